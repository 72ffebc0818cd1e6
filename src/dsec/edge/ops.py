"""The node seam's operations, each declared once: the table ``NodeServer``'s routes
(``dsec.edge.server``) and ``RemoteEdge``'s methods (``dsec.edge.remote``) are made from.

One ``Operation`` (``libdsec.ops``) per method of ``EdgeAPI`` but ``close``; its path is under
``/node/v1``. The order is the server's match order: the hottest first (a create, a stop, the
watcher's info, a get, a command). ``tests/unit/test_node_ops.py`` checks that the table,
``EdgeAPI``, ``Edge`` and ``RemoteEdge`` name the same operations, and that each has its route.

Adding an operation: its models (the SDK's, or ``dsec.edge.protocol`` for one only nodes
take), an entry here, and the method on ``EdgeAPI`` and ``Edge``; the route and the
``RemoteEdge`` method follow from the entry.
"""

from __future__ import annotations

import inspect

from libdsec.ops import Operation as Op
from libdsec.protocol import MAX_WATCH_WAIT_S, OpenWatchRequest, WatchEvents, WatchEventsRequest, WatchInfo
from libdsec.protocol import (
    BatchEvent,
    CleanCopyRequest,
    CleanCopyResult,
    DSecFnCallArgs,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    FileList,
    FileRemoveRequest,
    FileRenameRequest,
    FnCallBatchRequest,
    FnCallBatchResult,
    FnCallResult,
    ForkRequest,
    ForkResult,
    ImageInfo,
    ImageList,
    MakeDirRequest,
    NetworkRulesRequest,
    NodeInfo,
    NodeStats,
    OpenPtyRequest,
    OpenSessionRequest,
    PackDiffRequest,
    PackDiffResult,
    PauseResult,
    ProcessInfo,
    ProcessList,
    ProcessSignalRequest,
    ProcessStdinRequest,
    ProcessStreamRequest,
    ProcessWaitRequest,
    PtyInfo,
    PtyInputRequest,
    PtyResizeRequest,
    PtyStreamRequest,
    SandboxInfo,
    SandboxList,
    SecurityEventList,
    SessionInfo,
    SnapshotInfo,
    StartProcessRequest,
    TreeDownloadRequest,
    TTLRequest,
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
)

PREFIX = "/node/v1"
SB = "/sandboxes/{sandbox_id}"

NODE_OPS: tuple[Op, ...] = (
    # -- the hot ones first --------------------------------------------------------------------
    Op("create", "POST", "/sandboxes", NodeCreateRequest, answer=SandboxInfo),
    Op("stop", "POST", SB + "/stop", NodeStopRequest, spread=True, answer=SandboxInfo),
    Op("node_info", "GET", "/info", answer=NodeInfo),
    Op("get", "GET", SB, answer=SandboxInfo),
    Op("exec", "POST", SB + "/exec", ExecRequest, answer=ExecResult, timeout="own"),
    # -- sandboxes -------------------------------------------------------------------------
    Op("create_batch", "POST", "/sandboxes:batch", NodeBatchRequest, answer=BatchEvent, answers="lines"),
    Op("commit_batch", "POST", "/batches/{batch:key}:commit"),
    Op("list", "GET", "/sandboxes", answer=SandboxList, unwrap="sandboxes"),
    Op("pause", "POST", SB + "/pause", answer=PauseResult, timeout="long"),
    Op("resume", "POST", SB + "/resume", answer=SandboxInfo, timeout="long"),
    Op("snapshot", "POST", SB + "/snapshot", answer=SnapshotInfo, timeout="long"),
    Op("pack_diff", "POST", SB + "/pack_diff", PackDiffRequest, spread=True, answer=PackDiffResult, timeout="long"),
    Op("clean_copy", "POST", SB + "/clean_copy", CleanCopyRequest, spread=True, answer=CleanCopyResult,
       timeout="long"),
    Op("fork", "POST", SB + "/fork", ForkRequest, spread=True, answer=ForkResult, timeout="long"),
    Op("security_events", "GET", SB + "/security_events", answer=SecurityEventList, unwrap="events"),
    Op("set_network_rules", "PUT", SB + "/network_rules", NetworkRulesRequest, spread=True),
    Op("set_ttl", "PUT", SB + "/ttl", TTLRequest, spread=True, answer=SandboxInfo),
    # -- commands, processes, sessions, PTYs, ports ------------------------------------------
    Op("exec_stream", "POST", SB + "/exec:stream", ExecRequest, answer=ExecEvent, answers="lines", timeout="own"),
    Op("start_process", "POST", SB + "/processes", StartProcessRequest, answer=ProcessInfo),
    Op("start_process_stream", "POST", SB + "/processes:stream", StartProcessRequest, answer=ExecEvent,
       answers="lines", timeout=24 * 3600.0),
    Op("list_processes", "GET", SB + "/processes", answer=ProcessList, unwrap="processes"),
    Op("get_process", "GET", SB + "/processes/{pid:int}", answer=ProcessInfo),
    Op("signal_process", "POST", SB + "/processes/{pid:int}/signal", ProcessSignalRequest, spread=True),
    Op("process_stdin", "POST", SB + "/processes/{pid:int}/stdin", ProcessStdinRequest, spread=True, timeout="long"),
    Op("wait_process", "POST", SB + "/processes/{pid:int}/wait", ProcessWaitRequest, spread=True,
       answer=ProcessInfo, timeout="own"),
    Op("stream_process", "POST", SB + "/processes/{pid:int}/stream", ProcessStreamRequest, answer=ExecEvent,
       answers="lines", timeout="own"),
    Op("open_session", "POST", SB + "/sessions", OpenSessionRequest, answer=SessionInfo),
    Op("session_exec", "POST", SB + "/sessions/{session:int}/exec", ExecRequest, answer=ExecResult, timeout="own"),
    Op("session_exec_stream", "POST", SB + "/sessions/{session:int}/exec:stream", ExecRequest, answer=ExecEvent,
       answers="lines", timeout="own"),
    Op("interrupt_session", "POST", SB + "/sessions/{session:int}/interrupt"),
    Op("close_session", "POST", SB + "/sessions/{session:int}/close"),
    Op("open_pty", "POST", SB + "/ptys", OpenPtyRequest, answer=PtyInfo),
    Op("pty_input", "POST", SB + "/ptys/{pty:int}/input", PtyInputRequest, spread=True, timeout="long"),
    Op("resize_pty", "POST", SB + "/ptys/{pty:int}/resize", PtyResizeRequest, spread=True),
    Op("pty_stream", "POST", SB + "/ptys/{pty:int}/stream", PtyStreamRequest, spread=True, answer=ExecEvent,
       answers="lines", timeout="own"),
    Op("close_pty", "POST", SB + "/ptys/{pty:int}/close", timeout="long"),
    Op("connect_port", "POST", SB + "/ports/{port:port}:connect", answers="upgrade"),
    Op("open_watch", "POST", SB + "/watches", OpenWatchRequest, answer=WatchInfo),
    Op("watch_events", "POST", SB + "/watches/{watch:int}/events", WatchEventsRequest, spread=True,
       answer=WatchEvents, timeout=MAX_WATCH_WAIT_S),
    Op("close_watch", "POST", SB + "/watches/{watch:int}/close"),
    Op("get_xattrs", "POST", SB + "/xattrs:get", GetXattrsRequest, spread=True, answer=XattrsList, unwrap="values"),
    Op("set_xattrs", "POST", SB + "/xattrs:set", SetXattrsRequest, spread=True),
    # -- files -------------------------------------------------------------------------------
    Op("read_file", "GET", SB + "/files", query=("path",), answers="bytes"),
    Op("write_file", "PUT", SB + "/files", request_arg="data", body="bytes", query=("path", "mode:mode")),
    Op("read_file_stream", "GET", SB + "/files:stream", query=("path",), answers="chunks", timeout=3600.0),
    Op("write_file_stream", "PUT", SB + "/files:stream", request_arg="data", body="stream",
       query=("path", "mode:mode"), timeout=3600.0),
    Op("list_dir", "GET", SB + "/fs/list", query=("path",), answer=FileList, unwrap="entries"),
    Op("stat_path", "GET", SB + "/fs/stat", query=("path",), answer=FileEntry),
    Op("remove_path", "POST", SB + "/fs/remove", FileRemoveRequest, spread=True, timeout="long"),
    Op("make_dir", "POST", SB + "/fs/mkdir", MakeDirRequest, spread=True),
    Op("rename_path", "POST", SB + "/fs/rename", FileRenameRequest, spread=True),
    Op("upload_tree", "PUT", SB + "/fs/tree", request_arg="data", body="stream", query=("path",), timeout="long"),
    Op("download_tree_tar", "GET", SB + "/fs/tree", query=("path",), answers="chunks", timeout=3600.0),
    Op("download_tree", "POST", SB + "/fs/tree:download", TreeDownloadRequest, spread=True, answer=ExecEvent,
       answers="lines", timeout=3600.0),
    # -- the node and its images ---------------------------------------------------------------
    Op("node_stats", "GET", "/stats", answer=NodeStats),
    Op("layer_use", "GET", "/layer_use", answer=LayerUse),
    Op("list_images", "GET", "/images", answer=ImageList, unwrap="images"),
    Op("inspect_image", "GET", "/images/{ref}", answer=ImageInfo),
    Op("remove_image", "POST", "/images/{name:name}:remove", ImageRemoveRequest, spread=True),
    Op("gc_layers", "POST", "/images:gc", LayerGCRequest, spread=True, answer=LayerGCResult, unwrap="removed",
       timeout="long"),
    Op("build_image", "POST", "/images:build", NodeBuildRequest, spread=True, answer=ExecEvent, answers="lines",
       timeout="own"),
    # -- stateless calls -------------------------------------------------------------------------
    Op("fncall", "POST", "/fncall", DSecFnCallArgs, request_arg="args", answer=FnCallResult, timeout="own"),
    Op("fncall_many", "POST", "/fncall:batch", FnCallBatchRequest, spread=True, answer=FnCallBatchResult,
       unwrap="results", timeout="long"),
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
