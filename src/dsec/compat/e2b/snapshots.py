"""E2B's snapshots on DSec's named snapshots (``dsec.edge.snapshots``), under ``/e2b``.

- ``POST /sandboxes/{id}/snapshots`` (``create_snapshot``): ``memory`` true is a ``full``
  snapshot, false a ``filesystem`` one, unset DSec's default for the kind (an E2B sandbox is a
  container: ``filesystem``; ``full`` there is a 400 naming the kind). ``name`` is the
  snapshot's name; one that is taken is a 409 naming it (E2B would add a build to that
  template instead);
- ``GET /snapshots`` (``list_snapshots``): the caller's, by ``sandboxID`` and ``name``, paged as
  E2B pages (``limit``, ``nextToken``, the ``x-next-token`` header);
- ``DELETE /templates/{id}`` (``delete_snapshot``): a snapshot's id or name removes it (a 409
  naming the sandboxes started from it while they run); a template that is an image is not
  removed here (501, as before);
- ``POST /sandboxes`` with a snapshot's id (or name, where no image has it) as ``templateID``
  starts from it (``start_of``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from libdsec import ImageNotFound, InvalidRequest, SnapshotNotFound
from libdsec.protocol import SNAPSHOT_ID, SNAPSHOT_NAME, SandboxStatus, Snapshot

from ...apiserver.cluster import Cluster
from . import _models as m
from ._errors import error_body

# The states in which a sandbox holds the snapshot it was started from.
_HOLDING = frozenset({SandboxStatus.creating, SandboxStatus.running, SandboxStatus.paused, SandboxStatus.stopping})


def info_of(snap: Snapshot) -> m.SnapshotInfo:
    return m.SnapshotInfo(snapshot_id=snap.id, names=[snap.name] if snap.name else [])


async def start_of(cluster: Cluster, template: str) -> Snapshot | None:
    """The snapshot a create's ``templateID`` names: its id, or its name where no image has
    that name (an image of the name wins); None for a template that is no snapshot."""
    if not (SNAPSHOT_ID.match(template) or SNAPSHOT_NAME.match(template)):
        return None
    edge = cluster.any_edge()
    if not SNAPSHOT_ID.match(template):
        try:
            await edge.inspect_image(template)
            return None
        except ImageNotFound:
            pass
    try:
        return await edge.get_snapshot(template)
    except SnapshotNotFound:
        return None


def add_snapshot_routes(router: APIRouter, cluster: Cluster, caller_of, visible, answers) -> None:
    async def own(request: Request, ref: str) -> Snapshot:
        caller = caller_of(request)
        snap = await cluster.any_edge().get_snapshot(ref)
        if not caller.sees(cluster.projects, snap.project):
            raise SnapshotNotFound(f"snapshot '{ref}' not found")
        return snap

    @router.post("/sandboxes/{sandbox_id}/snapshots")
    @answers
    async def create_snapshot(request: Request, sandbox_id: str) -> JSONResponse:
        body = m.parse(m.SnapshotRequest, await m.read_json(request))
        await visible(request, sandbox_id)
        mode = None if body.memory is None else "full" if body.memory else "filesystem"
        snap = await cluster.edge_for(sandbox_id).snapshot(sandbox_id, mode, body.name)
        return JSONResponse(info_of(snap).model_dump(mode="json"), status_code=201)

    @router.get("/snapshots")
    @answers
    async def list_snapshots(request: Request) -> JSONResponse:
        caller = caller_of(request)
        query = request.query_params
        try:
            limit = int(query.get("limit") or 0) or None
            offset = int(query.get("nextToken") or 0)
        except ValueError as exc:
            raise InvalidRequest(f"malformed query: {exc}") from None
        found = [s for s in await cluster.any_edge().list_snapshots()
                 if caller.sees(cluster.projects, s.project)
                 and query.get("sandboxID") in (None, "", s.sandbox_id)
                 and query.get("name") in (None, "", s.name)]
        found.sort(key=lambda s: s.created_at, reverse=True)
        page = found[offset:offset + limit] if limit else found[offset:]
        headers = {"x-next-token": str(offset + len(page))} if limit and offset + len(page) < len(found) else {}
        return JSONResponse([info_of(s).model_dump(mode="json") for s in page], headers=headers)

    @router.delete("/templates/{template_id}")
    @answers
    async def delete_template(request: Request, template_id: str) -> Response:
        caller_of(request)  # a bad key is told so first
        if not (SNAPSHOT_ID.match(template_id) or SNAPSHOT_NAME.match(template_id)):
            return error_body(404, f"template '{template_id}' not found")
        try:
            snap = await own(request, template_id)
        except SnapshotNotFound:
            try:
                await cluster.any_edge().inspect_image(template_id)
            except ImageNotFound:
                return error_body(404, f"template '{template_id}' not found")
            return error_body(501, f"DELETE /templates/{template_id}: removing a template that is an image is not "
                                   "part of DSec's E2B API (docs/COMPAT.md); `dsec image rm` removes it")
        users = [info.id for info in await cluster.list_sandboxes()
                 if info.snapshot == snap.id and info.status in _HOLDING]
        edge = cluster.edges.get(snap.node) if snap.mode == "full" else cluster.any_edge()
        if edge is None:
            return error_body(409, f"snapshot {snap.id}'s memory is on node {snap.node}, which is not in the "
                                   "cluster now")
        await edge.remove_snapshot(snap.id, users)
        return Response(status_code=204)
