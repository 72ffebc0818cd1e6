"""The public table's operations the apiserver serves itself (``served="apiserver"`` in
``libdsec.api_ops``): those with more to them than one call on one node — a catalogue filtered by
what the caller may see, a call on every node, the nodes' list, the cluster's figures.

``ApiCalls`` has a method of each such operation's name. The table handler
(``table.TableRoutes``) calls it with the checked caller first, then the path parameters, the
query and the request, by position, as the table gives them; the answer is its model, a list of
models (``answers="list"``) or a small JSON object.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from libdsec import DSecError, InvalidRequest, SnapshotConflict, SnapshotNotFound, Unauthenticated
from libdsec._pausing import SandboxGroupRequest, SandboxGroupResult
from libdsec._projects import ProjectCreateRequest, ProjectInfo, ProjectList, ProjectQuota, ProjectToken, TokenRequest
from libdsec.protocol import (
    BuildImageRequest,
    ClusterStats,
    DSecContainerRunArgs,
    DSecFullVMRunArgs,
    DSecMicroVMRunArgs,
    ExecEvent,
    JobList,
    JobLog,
    NodeInfo,
    ProjectUsage,
    SandboxInfo,
    SandboxList,
    SandboxStatus,
    Snapshot,
    SnapshotList,
)

from ..edge.api import EdgeAPI
from .auth import Caller
from .cluster import Cluster
from .jobs import Jobs
from .pausing import SandboxGroups
from .projects import quota_of
from .quota import RESOURCES, Amount
from .routes_observe import ROOT_ONLY

# The states in which a sandbox holds the snapshot it was started from.
_HOLDING = frozenset({SandboxStatus.creating, SandboxStatus.running, SandboxStatus.paused, SandboxStatus.stopping})


class ApiCalls:
    """The apiserver's own operations over ``cluster`` (see the module)."""

    def __init__(self, cluster: Cluster, jobs: Jobs) -> None:
        self.cluster = cluster
        self.jobs = jobs
        self.groups = SandboxGroups(cluster, jobs)

    # -- creates: with an idempotency key or a job (x-dsec-job), through the job's log (Jobs.create)

    async def create_sandbox(self, caller: Caller, args: DSecContainerRunArgs) -> SandboxInfo:
        """With an ``idempotency-key`` header, a key used before in the project (or the job)
        returns the sandbox made then; ``x-dsec-job`` records the create in that job's log."""
        if caller.job is None and caller.key is None:
            return await self.cluster.create(args, caller.project)
        return await self._create(args, "container", caller)

    async def list_sandboxes(self, caller: Caller) -> SandboxList:
        return SandboxList(sandboxes=[info for info in await self.cluster.list_sandboxes()
                                      if caller.sees(self.cluster.projects, info.project)])

    async def create_microvm(self, caller: Caller, args: DSecMicroVMRunArgs) -> SandboxInfo:
        return await self._create(args, "microvm", caller)

    async def create_fullvm(self, caller: Caller, args: DSecFullVMRunArgs) -> SandboxInfo:
        return await self._create(args, "fullvm", caller)

    async def _create(self, args: DSecContainerRunArgs, kind: str, caller: Caller) -> SandboxInfo:
        return await self.jobs.create(caller, kind, args, lambda: self.cluster.create(args, caller.project, kind=kind),
                                      lambda info: current(self.cluster, info))

    # -- images and nodes ----------------------------------------------------------------------

    async def remove_image(self, caller: Caller, name: str) -> dict:
        images, _ = await self.cluster.layer_use()
        await self.cluster.any_edge().remove_image(name, images)
        return {"removed": name}

    async def gc_layers(self, caller: Caller) -> dict:
        _, layers = await self.cluster.layer_use()
        return {"removed": await self.cluster.any_edge().gc_layers(layers)}

    def build_image(self, caller: Caller, request: BuildImageRequest) -> AsyncIterator[ExecEvent]:
        """An image from a Dockerfile, its log as NDJSON ``ExecEvent`` lines (``dsec.edge.build``)."""
        return self.cluster.any_edge().build_image(request, caller.project)

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

    # -- projects, quotas and tokens -------------------------------------------------------------
    # The project store keeps the records and checks the quota tree; the rule here is who may
    # touch what. A token may read its own project and those below it, create projects below
    # its own, mint tokens for any of those, and set quotas or remove projects strictly below
    # its own (a project cannot raise its own quota). The root token may do all of it.

    async def list_projects(self, caller: Caller) -> ProjectList:
        tree = self.cluster.projects.tree()
        return ProjectList(projects=await self._describe(sorted(tree.subtree(caller.project), key=tree.path)))

    async def get_project(self, caller: Caller, name: str) -> ProjectInfo:
        caller.check_sees(self.cluster.projects, name)
        return (await self._describe([name]))[0]

    async def create_project(self, caller: Caller, request: ProjectCreateRequest) -> ProjectInfo:
        parent = request.parent or caller.project
        caller.check_sees(self.cluster.projects, parent)
        await self.cluster.projects.create(request.name, parent, request.quota)
        return (await self._describe([request.name]))[0]

    async def set_quota(self, caller: Caller, name: str, request: ProjectQuota) -> ProjectInfo:
        self._strictly_below(caller, name, "set the quota of")
        await self.cluster.projects.set_quota(name, request)
        return (await self._describe([name]))[0]

    async def remove_project(self, caller: Caller, name: str) -> dict:
        self._strictly_below(caller, name, "remove")
        held = (await self.cluster.usage()).get(name, Amount())
        if any(held.get(r) for r in RESOURCES):
            raise InvalidRequest(f"project {name!r} still has {int(held.sandboxes)} sandboxes: stop them first")
        await self.cluster.projects.remove(name)
        return {"removed": name}

    async def new_token(self, caller: Caller, name: str, request: TokenRequest | None) -> ProjectToken:
        caller.check_sees(self.cluster.projects, name)
        e2b = request is not None and request.form == "e2b"
        return ProjectToken(project=name, token=await self.cluster.projects.new_token(name, e2b=e2b))

    def _strictly_below(self, caller: Caller, name: str, action: str) -> None:
        caller.check_sees(self.cluster.projects, name)
        if name == caller.project and not caller.is_root:
            raise InvalidRequest(f"cannot {action} project {name!r} with its own token: ask a token of its parent")

    async def _describe(self, names: list[str]) -> list[ProjectInfo]:
        tree = self.cluster.projects.tree()
        usage = await self.cluster.usage()
        out = []
        for name in names:
            project = tree.projects[name]
            subtree = Amount()
            for p in tree.subtree(name):
                subtree = subtree + usage.get(p, Amount())
            out.append(ProjectInfo(
                name=name, parent=project.parent, path=tree.path(name), quota=quota_of(project),
                handed_out=_usage(tree.handed_out(name)), usage=_usage(usage.get(name, Amount())),
                subtree_usage=_usage(subtree), children=list(tree.children.get(name, ())),
            ))
        return out

    def _holder(self, snap: Snapshot) -> EdgeAPI:
        """The node to remove ``snap`` on: a full snapshot's (its memory is there), else any."""
        if snap.mode != "full":
            return self.cluster.any_edge()
        edge = self.cluster.edges.get(snap.node)
        if edge is None:
            raise SnapshotConflict(f"snapshot {snap.id}'s memory is on node {snap.node}, which is not in the cluster "
                                   "now; remove the snapshot when the node is back")
        return edge


def _usage(amount: Amount) -> ProjectUsage:
    return ProjectUsage(sandboxes=int(amount.sandboxes), cpu_cores=round(amount.cpu_cores, 6),
                        memory_mb=int(amount.memory_mb))


async def current(cluster: Cluster, info: SandboxInfo) -> SandboxInfo:
    """A sandbox made before, as its node says it is now (or as it was, once gone): what a key
    used again answers."""
    try:
        return await cluster.edge_for(info.id).get(info.id)
    except DSecError:
        return info.model_copy(update={"status": SandboxStatus.stopped})
