"""The node seam's operations, each declared once: the table ``NodeServer``'s routes
(``dsec.edge.server``) and ``RemoteEdge``'s methods (``dsec.edge.remote``) are made from.

One ``Operation`` (``libdsec.ops``) per method of ``EdgeAPI`` but ``close``; its path is under
``/node/v1``. Every public call of ``libdsec.api_ops`` a node serves is also a node call, on the
same path with the same models (``public_twin``; ``NODE_FORMS`` where the node's form differs):
only the calls nodes alone take are written here. The order is the server's match order: the
hottest first (a create, a stop, the watcher's info, a get, a command). ``tests/unit/test_node_ops.py`` checks
that the table, ``EdgeAPI``, ``Edge`` and ``RemoteEdge`` name the same operations, and that each
has its route.

Adding a public sandbox call touches nothing here (its ``PUBLIC_OPS`` entry is its node entry
too); a call only nodes take: its models (``dsec.edge.protocol``), an entry here, and the method
on ``EdgeAPI`` and ``Edge``. The route and the ``RemoteEdge`` method follow from the entry.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

from libdsec.api_ops import PUBLIC_OPS, PUBLIC_OPS_BY_NAME
from libdsec.ops import Operation as Op
from libdsec.protocol import MAX_WATCH_WAIT_S
from libdsec.protocol import (
    BatchEvent,
    ExecEvent,
    NodeInfo,
    NodeStats,
    SandboxInfo,
    SandboxList,
    Snapshot,
    SnapshotList,
    StartProcessRequest,
)

from .api import EdgeAPI
from .protocol import (
    GetXattrsRequest,
    SetXattrsRequest,
    XattrsList,
    ImageRemoveRequest,
    LayerGCRequest,
    LayerGCResult,
    LayerUse,
    NodeBatchRequest,
    NodeBuildRequest,
    NodeCreateRequest,
    NodeStopRequest,
    SnapshotRemoveRequest,
)

PREFIX = "/node/v1"
SB = "/sandboxes/{sandbox_id}"

def public_twin(op: Op, **changes) -> Op:
    """A public call (``libdsec.api_ops``) as its node serves it: the same path, models, shapes
    and timeout, under ``/node/v1``. The node checks the sandbox's lifecycle in the edge's method
    itself and keeps no job log, so the apiserver's two rules are not the node's."""
    return replace(op, lifecycle=None, journal=None, **changes)


# A public call whose node form differs: a node's stop carries why (the apiserver's is a DELETE
# with no body), and a node waits for a watch's events at most MAX_WATCH_WAIT_S (the public
# call's bound is the request's own wait).
NODE_FORMS: dict[str, Op] = {
    "stop": Op("stop", "POST", SB + "/stop", NodeStopRequest, spread=True, answer=SandboxInfo),
    "watch_events": public_twin(PUBLIC_OPS_BY_NAME["watch_events"], timeout=MAX_WATCH_WAIT_S),
    # The node starts the stream; the apiserver makes its page's key (``Cluster.desktop_stream``).
    "desktop_stream": Op("desktop_stream", "POST", SB + "/desktop/stream", timeout="long"),
}

NODE_OPS: tuple[Op, ...] = (
    # -- the hot ones first --------------------------------------------------------------------
    Op("create", "POST", "/sandboxes", NodeCreateRequest, answer=SandboxInfo),
    NODE_FORMS["stop"],
    Op("node_info", "GET", "/info", answer=NodeInfo),
    # -- every public sandbox and image call, in the public table's order ---------------------
    *(NODE_FORMS.get(op.name) or public_twin(op) for op in PUBLIC_OPS
      if op.name != "stop" and op.served == "node"),
    # -- the node's own calls --------------------------------------------------------------------
    Op("create_batch", "POST", "/sandboxes:batch", NodeBatchRequest, answer=BatchEvent, answers="lines"),
    Op("commit_batch", "POST", "/batches/{batch:key}:commit"),
    Op("list", "GET", "/sandboxes", answer=SandboxList, unwrap="sandboxes"),
    Op("start_process_stream", "POST", SB + "/processes:stream", StartProcessRequest, answer=ExecEvent,
       answers="lines", timeout=24 * 3600.0),
    Op("connect_port", "POST", SB + "/ports/{port:port}:connect", answers="upgrade"),
    Op("get_xattrs", "POST", SB + "/xattrs:get", GetXattrsRequest, spread=True, answer=XattrsList, unwrap="values"),
    Op("set_xattrs", "POST", SB + "/xattrs:set", SetXattrsRequest, spread=True),
    Op("node_stats", "GET", "/stats", answer=NodeStats),
    Op("layer_use", "GET", "/layer_use", answer=LayerUse),
    Op("remove_image", "POST", "/images/{name:name}:remove", ImageRemoveRequest, spread=True),
    Op("gc_layers", "POST", "/images:gc", LayerGCRequest, spread=True, answer=LayerGCResult, unwrap="removed",
       timeout="long"),
    Op("build_image", "POST", "/images:build", NodeBuildRequest, spread=True, answer=ExecEvent, answers="lines",
       timeout="own"),
    # -- snapshots (kept in the layer store; the apiserver's catalogue routes call these) --------
    Op("list_snapshots", "GET", "/snapshots", answer=SnapshotList, unwrap="snapshots"),
    Op("get_snapshot", "GET", "/snapshots/{ref:name}", answer=Snapshot),
    Op("remove_snapshot", "POST", "/snapshots/{ref:name}:remove", SnapshotRemoveRequest, spread=True,
       answer=Snapshot),
)

NODE_OPS_BY_NAME: dict[str, Op] = {op.name: op for op in NODE_OPS}


def arguments(op: Op) -> tuple[str, ...]:
    """The arguments of ``op``'s method on ``EdgeAPI``, in order (``self`` left out)."""
    return tuple(p for p in inspect.signature(getattr(EdgeAPI, op.name)).parameters if p != "self")


def spread_fields(op: Op) -> tuple[str, ...]:
    """The fields of a spread request that are arguments of its method. Others (a
    ``PtyStreamRequest``'s ``timeout``) only bound the caller's wait."""
    if not op.spread or op.request is None:
        return ()
    names = arguments(op)
    return tuple(f for f in op.request.model_fields if f in names)
