"""The public table's operations the apiserver serves itself (``served="apiserver"`` in
``libdsec.api_ops``): those with more to them than one call on one node — a catalogue filtered by
what the caller may see, a call on every node, the nodes' list, the cluster's figures.

``ApiCalls`` has a method of each such operation's name. The table handler
(``table.TableRoutes``) calls it with the checked caller first, then the path parameters, the
query and the request, by position, as the table gives them; the answer is its model, a list of
models (``answers="list"``) or a small JSON object.
"""

from __future__ import annotations

from libdsec import SnapshotConflict, SnapshotNotFound, Unauthenticated
from libdsec._pausing import SandboxGroupRequest, SandboxGroupResult
from libdsec.protocol import ClusterStats, JobList, JobLog, NodeInfo, SandboxStatus, Snapshot, SnapshotList

from ..edge.api import EdgeAPI
from .auth import Caller
from .cluster import Cluster
from .jobs import Jobs
from .pausing import SandboxGroups
from .routes_observe import ROOT_ONLY

# The states in which a sandbox holds the snapshot it was started from.
_HOLDING = frozenset({SandboxStatus.creating, SandboxStatus.running, SandboxStatus.paused, SandboxStatus.stopping})


class ApiCalls:
    """The apiserver's own operations over ``cluster`` (see the module)."""

    def __init__(self, cluster: Cluster, jobs: Jobs) -> None:
        self.cluster = cluster
        self.jobs = jobs
        self.groups = SandboxGroups(cluster, jobs)

    # -- images and nodes ----------------------------------------------------------------------

    async def remove_image(self, caller: Caller, name: str) -> dict:
        images, _ = await self.cluster.layer_use()
        await self.cluster.any_edge().remove_image(name, images)
        return {"removed": name}

    async def gc_layers(self, caller: Caller) -> dict:
        _, layers = await self.cluster.layer_use()
        return {"removed": await self.cluster.any_edge().gc_layers(layers)}

    async def nodes(self, caller: Caller, all: bool) -> list[NodeInfo]:  # noqa: A002 - the query's name
        """The nodes serving; with ``all=true``, also those lost or whose edge did not start."""
        return await self.cluster.node_infos() + (self.cluster.unready_infos() if all else [])

    async def stats(self, caller: Caller) -> ClusterStats:
        if not caller.is_root:
            raise Unauthenticated(ROOT_ONLY)
        return await self.cluster.stats()

    # -- the snapshot catalogue ----------------------------------------------------------------
    # Snapshots are kept in the layer store, which every node reads, so any node answers for
    # them; removing a full one goes to the node that holds its memory. A token sees its own
    # project's snapshots; the root token sees every one.

    async def list_snapshots(self, caller: Caller) -> SnapshotList:
        found = await self.cluster.any_edge().list_snapshots()
        return SnapshotList(snapshots=[s for s in found if caller.sees(self.cluster.projects, s.project)])

    async def get_snapshot(self, caller: Caller, ref: str) -> Snapshot:
        snap = await self.cluster.any_edge().get_snapshot(ref)
        if not caller.sees(self.cluster.projects, snap.project):
            raise SnapshotNotFound(f"no snapshot {ref!r} (neither an id nor a name of one kept in the layer store)")
        return snap

    async def remove_snapshot(self, caller: Caller, ref: str) -> Snapshot:
        """Refused (409, naming them) while sandboxes started from it run, on any node."""
        snap = await self.get_snapshot(caller, ref)
        users = [info.id for info in await self.cluster.list_sandboxes()
                 if info.snapshot == snap.id and info.status in _HOLDING]
        return await self._holder(snap).remove_snapshot(snap.id, users)

    # -- job logs (``dsec job ls | show | rm``): a token sees its own project's jobs, the root
    # token every job; the sandbox calls that name a job record into its log (``jobs``) ---------

    async def list_jobs(self, caller: Caller) -> JobList:
        return await self.jobs.list(caller)

    async def show_job(self, caller: Caller, job: str, after: int) -> JobLog:
        """The job and its log entries past ``after`` (a ``seq``), in order."""
        return await self.jobs.show(caller, job, after)

    async def remove_job(self, caller: Caller, job: str) -> dict:
        await self.jobs.remove(caller, job)
        return {"removed": job}

    # -- many sandboxes at once (``pausing``) ---------------------------------------------------

    async def pause_sandboxes(self, caller: Caller, request: SandboxGroupRequest) -> SandboxGroupResult:
        """Pause every running sandbox of a job, a project (and those below it) or a list of
        ids: one outcome per sandbox, and the memory they held before and after."""
        return await self.groups.run("pause", request, caller)

    async def resume_sandboxes(self, caller: Caller, request: SandboxGroupRequest) -> SandboxGroupResult:
        """Resume every paused sandbox of a job, a project or a list of ids."""
        return await self.groups.run("resume", request, caller)

    def _holder(self, snap: Snapshot) -> EdgeAPI:
        """The node to remove ``snap`` on: a full snapshot's (its memory is there), else any."""
        if snap.mode != "full":
            return self.cluster.any_edge()
        edge = self.cluster.edges.get(snap.node)
        if edge is None:
            raise SnapshotConflict(f"snapshot {snap.id}'s memory is on node {snap.node}, which is not in the cluster "
                                   "now; remove the snapshot when the node is back")
        return edge
