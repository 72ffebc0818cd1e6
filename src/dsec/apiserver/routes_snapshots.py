"""HTTP routes for the snapshot catalogue: list, get and remove (``client.list_snapshots()``,
``get_snapshot``, ``remove_snapshot``). Snapshots are taken on a sandbox (the public table's
``snapshot``) and kept in the layer store, which every node reads, so any node answers for
them; removing a full one goes to the node that holds its memory. A token sees its own
project's snapshots; the root token sees every one.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI, Path

from libdsec import SnapshotConflict, SnapshotNotFound
from libdsec.protocol import Snapshot, SandboxStatus, SnapshotList

from ..edge.api import EdgeAPI
from .auth import Caller
from .cluster import Cluster

# A snapshot's id or name (``libdsec.protocol.SNAPSHOT_ID`` / ``SNAPSHOT_NAME``).
_REF = Path(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9._-]*$")
# The states in which a sandbox holds the snapshot it was started from.
_HOLDING = frozenset({SandboxStatus.creating, SandboxStatus.running, SandboxStatus.paused, SandboxStatus.stopping})


def add_snapshot_routes(app: FastAPI, cluster: Cluster, authenticated, errors: dict) -> None:
    async def visible(ref: str, caller: Caller) -> Snapshot:
        snap = await cluster.any_edge().get_snapshot(ref)
        if not caller.sees(cluster.projects, snap.project):
            raise SnapshotNotFound(f"no snapshot {ref!r} (neither an id nor a name of one kept in the layer store)")
        return snap

    @app.get("/v1/snapshots", responses=errors)
    async def list_snapshots(caller: Caller = Depends(authenticated)) -> SnapshotList:
        found = await cluster.any_edge().list_snapshots()
        return SnapshotList(snapshots=[s for s in found if caller.sees(cluster.projects, s.project)])

    @app.get("/v1/snapshots/{ref}", responses=errors)
    async def get_snapshot(ref: str = _REF, caller: Caller = Depends(authenticated)) -> Snapshot:
        return await visible(ref, caller)

    @app.delete("/v1/snapshots/{ref}", responses=errors)
    async def remove_snapshot(ref: str = _REF, caller: Caller = Depends(authenticated)) -> Snapshot:
        """Refused (409, naming them) while sandboxes started from it run, on any node."""
        snap = await visible(ref, caller)
        users = [info.id for info in await cluster.list_sandboxes()
                 if info.snapshot == snap.id and info.status in _HOLDING]
        return await _holder(cluster, snap).remove_snapshot(snap.id, users)


def _holder(cluster: Cluster, snap: Snapshot) -> EdgeAPI:
    """The node to remove ``snap`` on: a full snapshot's (its memory is there), else any."""
    if snap.mode != "full":
        return cluster.any_edge()
    edge = cluster.edges.get(snap.node)
    if edge is None:
        raise SnapshotConflict(f"snapshot {snap.id}'s memory is on node {snap.node}, which is not in the cluster "
                               "now; remove the snapshot when the node is back")
    return edge
