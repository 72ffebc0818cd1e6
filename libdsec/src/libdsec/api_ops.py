"""The public API's operations, each declared once: the table the apiserver's routes
(``dsec.apiserver.table``), its OpenAPI document and the SDK's paths are made from.

One ``Operation`` (``libdsec.ops``) per call under ``/v1`` that only parses and makes one call:
on the node seam, where its name is the ``EdgeAPI`` method it becomes (on the sandbox's node, or
any node for the image calls), or (``served="apiserver"``) on the apiserver's own ``ApiCalls``
(``dsec.apiserver.calls``), a method of the same name given the caller. The order is the apiserver's
match order: the hottest first (a get, a command, a stop). Beyond ``libdsec.ops``' fields:

- ``lifecycle``: the action of the sandbox's lifecycle table the node checks the call against
  (``dsec.edge.lifecycle.Action``'s name), None for a call that reads or is checked otherwise;
- ``journal``: how a call made for a job (``x-dsec-job``) is kept in its log — ``recorded``
  (after it ran, with its request and answer: the request's model, the file written's digest
  and bytes, or nothing), ``read`` (a file read, with what it read), ``made`` (before it runs,
  with no result: replay cannot answer it), or None (not logged: it changes nothing).

The calls that are more than a request and its answer (the batch create's stream, the port
proxy) keep routes of their own in ``dsec.apiserver``. ``tests/unit/test_api_ops.py`` checks that this table, the apiserver's
routes, the SDK and the node seam name the same operations.

Adding an operation: its models (``libdsec.protocol``), an entry here, the edge's method (and
its line on ``EdgeAPI``, the node seam's typed interface), and the SDK's method with its sync
twin; the route, its OpenAPI entry, the job log's rule, the node's entry (``dsec.edge.ops``
makes it from this one), its route and ``RemoteEdge``'s method follow.
"""

from __future__ import annotations

from ._pausing import SandboxGroupRequest, SandboxGroupResult
from ._projects import ProjectCreateRequest, ProjectInfo, ProjectList, ProjectQuota, ProjectToken, TokenRequest
from .ops import Operation as Op, path_format
from .protocol import (
    BuildImageRequest,
    CleanCopyRequest,
    ClusterStats,
    CleanCopyResult,
    DesktopAccessibilityRequest,
    DesktopAccessibilityTree,
    DesktopFocusRequest,
    DesktopInfo,
    DesktopInput,
    DesktopLaunchRequest,
    DesktopStream,
    DesktopStreamRequest,
    DesktopWindowList,
    DSecContainerRunArgs,
    DSecFnCallArgs,
    DSecFullVMRunArgs,
    DSecMicroVMRunArgs,
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
    JobList,
    JobLog,
    MakeDirRequest,
    NodeInfo,
    NetworkRulesRequest,
    OpenPtyRequest,
    OpenSessionRequest,
    OpenWatchRequest,
    PackDiffRequest,
    PackDiffResult,
    PauseRequest,
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
    Snapshot,
    SnapshotList,
    SnapshotRequest,
    StartProcessRequest,
    TreeDownloadRequest,
    TTLRequest,
    WatchEvents,
    WatchEventsRequest,
    WatchInfo,
)

PREFIX = "/v1"
SB = "/sandboxes/{sandbox_id}"
REC, MADE, API = "recorded", "made", "apiserver"

PUBLIC_OPS: tuple[Op, ...] = (
    # -- the hot ones first --------------------------------------------------------------------
    Op("create_sandbox", "POST", "/sandboxes", DSecContainerRunArgs, request_arg="args", answer=SandboxInfo,
       served=API),
    Op("get", "GET", SB, answer=SandboxInfo),
    Op("exec", "POST", SB + "/exec", ExecRequest, answer=ExecResult, timeout="own", lifecycle="exec", journal=REC),
    Op("stop", "DELETE", SB, answer=SandboxInfo, lifecycle="stop", journal=REC),
    # -- stateless calls (FnCall: on a node that serves it, ``Cluster.fncall_edge``) ----------------
    Op("fncall", "POST", "/fncall", DSecFnCallArgs, request_arg="args", answer=FnCallResult, timeout="own"),
    Op("fncall_many", "POST", "/fncall:batch", FnCallBatchRequest, spread=True, answer=FnCallBatchResult,
       unwrap="results", timeout="long"),
    # -- a sandbox's state ---------------------------------------------------------------------
    Op("pause", "POST", SB + "/pause", PauseRequest, spread=True, body="optional", answer=PauseResult, timeout="long", lifecycle="pause", journal=REC),
    Op("resume", "POST", SB + "/resume", answer=SandboxInfo, timeout="long", lifecycle="resume", journal=REC),
    Op("snapshot", "POST", SB + "/snapshot", SnapshotRequest, spread=True, answer=Snapshot, timeout="long",
       lifecycle="snapshot", journal=MADE),
    Op("pack_diff", "POST", SB + "/pack_diff", PackDiffRequest, spread=True, answer=PackDiffResult, timeout="long",
       lifecycle="pack_diff", journal=REC),
    Op("clean_copy", "POST", SB + "/clean_copy", CleanCopyRequest, spread=True, answer=CleanCopyResult,
       timeout="long", lifecycle="clean_copy", journal=REC),
    Op("fork", "POST", SB + "/fork", ForkRequest, spread=True, answer=ForkResult, timeout="long", lifecycle="fork",
       journal=REC),
    Op("security_events", "GET", SB + "/security_events", answer=SecurityEventList, unwrap="events"),
    Op("set_network_rules", "PUT", SB + "/network_rules", NetworkRulesRequest, spread=True,
       lifecycle="set_network_rules", journal=REC),
    Op("set_ttl", "PUT", SB + "/ttl", TTLRequest, spread=True, answer=SandboxInfo, lifecycle="set_ttl", journal=REC),
    # -- commands, processes, sessions, PTYs, watches ------------------------------------------
    Op("exec_stream", "POST", SB + "/exec:stream", ExecRequest, answer=ExecEvent, answers="lines", timeout="own",
       lifecycle="exec", journal=MADE),
    Op("start_process", "POST", SB + "/processes", StartProcessRequest, answer=ProcessInfo, lifecycle="exec",
       journal=MADE),
    Op("list_processes", "GET", SB + "/processes", answer=ProcessList, unwrap="processes"),
    Op("get_process", "GET", SB + "/processes/{pid:int}", answer=ProcessInfo),
    Op("signal_process", "POST", SB + "/processes/{pid:int}/signal", ProcessSignalRequest, spread=True, journal=MADE),
    Op("process_stdin", "POST", SB + "/processes/{pid:int}/stdin", ProcessStdinRequest, spread=True, timeout="long",
       journal=MADE),
    Op("wait_process", "POST", SB + "/processes/{pid:int}/wait", ProcessWaitRequest, spread=True, answer=ProcessInfo,
       timeout="own"),
    Op("stream_process", "POST", SB + "/processes/{pid:int}/stream", ProcessStreamRequest, answer=ExecEvent,
       answers="lines", timeout="own"),
    Op("open_session", "POST", SB + "/sessions", OpenSessionRequest, answer=SessionInfo, lifecycle="exec",
       journal=MADE),
    Op("session_exec", "POST", SB + "/sessions/{session:int}/exec", ExecRequest, answer=ExecResult, timeout="own",
       lifecycle="exec", journal=MADE),
    Op("session_exec_stream", "POST", SB + "/sessions/{session:int}/exec:stream", ExecRequest, answer=ExecEvent,
       answers="lines", timeout="own", lifecycle="exec", journal=MADE),
    Op("interrupt_session", "POST", SB + "/sessions/{session:int}/interrupt", journal=MADE),
    Op("close_session", "POST", SB + "/sessions/{session:int}/close", journal=MADE),
    Op("open_pty", "POST", SB + "/ptys", OpenPtyRequest, answer=PtyInfo, lifecycle="exec", journal=MADE),
    Op("pty_input", "POST", SB + "/ptys/{pty:int}/input", PtyInputRequest, spread=True, timeout="long", journal=MADE),
    Op("resize_pty", "POST", SB + "/ptys/{pty:int}/resize", PtyResizeRequest, spread=True, journal=MADE),
    Op("pty_stream", "POST", SB + "/ptys/{pty:int}/stream", PtyStreamRequest, spread=True, answer=ExecEvent,
       answers="lines", timeout="own"),
    Op("close_pty", "POST", SB + "/ptys/{pty:int}/close", timeout="long", journal=MADE),
    Op("open_watch", "POST", SB + "/watches", OpenWatchRequest, answer=WatchInfo, lifecycle="read_file"),
    Op("watch_events", "POST", SB + "/watches/{watch:int}/events", WatchEventsRequest, spread=True,
       answer=WatchEvents, timeout="own"),
    Op("close_watch", "POST", SB + "/watches/{watch:int}/close"),
    # -- files ---------------------------------------------------------------------------------
    Op("read_file", "GET", SB + "/files", query=("path",), answers="bytes", lifecycle="read_file", journal="read"),
    Op("write_file", "PUT", SB + "/files", request_arg="data", body="bytes", query=("path", "mode:mode"),
       lifecycle="write_file", journal=REC),
    Op("read_file_stream", "GET", SB + "/files:stream", query=("path",), answers="chunks", timeout=3600.0,
       lifecycle="read_file"),
    Op("write_file_stream", "PUT", SB + "/files:stream", request_arg="data", body="stream",
       query=("path", "mode:mode"), timeout=3600.0, lifecycle="write_file", journal=MADE),
    Op("list_dir", "GET", SB + "/fs/list", query=("path",), answer=FileList, unwrap="entries", lifecycle="read_file"),
    Op("stat_path", "GET", SB + "/fs/stat", query=("path",), answer=FileEntry, lifecycle="read_file"),
    Op("remove_path", "POST", SB + "/fs/remove", FileRemoveRequest, spread=True, timeout="long",
       lifecycle="write_file", journal=MADE),
    Op("make_dir", "POST", SB + "/fs/mkdir", MakeDirRequest, spread=True, lifecycle="write_file", journal=MADE),
    Op("rename_path", "POST", SB + "/fs/rename", FileRenameRequest, spread=True, lifecycle="write_file",
       journal=MADE),
    Op("upload_tree", "PUT", SB + "/fs/tree", request_arg="data", body="stream", query=("path",), timeout="long",
       lifecycle="write_file", journal=MADE),
    Op("download_tree_tar", "GET", SB + "/fs/tree", query=("path",), answers="chunks", timeout=3600.0,
       lifecycle="read_file"),
    Op("download_tree", "POST", SB + "/fs/tree:download", TreeDownloadRequest, spread=True, answer=ExecEvent,
       answers="lines", timeout=3600.0, lifecycle="read_file"),
    # -- a sandbox's desktop -----------------------------------------------------------------------
    Op("desktop_screenshot", "GET", SB + "/desktop/screenshot", query=("format",), answers="bytes", lifecycle="exec"),
    Op("desktop_input", "POST", SB + "/desktop/input", DesktopInput, answer=DesktopInfo, lifecycle="exec"),
    Op("desktop_info", "GET", SB + "/desktop", answer=DesktopInfo, lifecycle="exec"),
    Op("desktop_windows", "GET", SB + "/desktop/windows", answer=DesktopWindowList, unwrap="windows",
       lifecycle="exec"),
    Op("desktop_focus", "POST", SB + "/desktop/focus", DesktopFocusRequest, spread=True, lifecycle="exec"),
    Op("desktop_launch", "POST", SB + "/desktop/launch", DesktopLaunchRequest, answer=ProcessInfo, lifecycle="exec",
       journal=MADE),
    Op("desktop_accessibility_tree", "POST", SB + "/desktop/accessibility_tree", DesktopAccessibilityRequest,
       spread=True, answer=DesktopAccessibilityTree, lifecycle="exec"),
    Op("desktop_stream", "POST", SB + "/desktop/stream", DesktopStreamRequest, spread=True, answer=DesktopStream,
       lifecycle="exec", journal=MADE),
    # -- images (any node's store) ---------------------------------------------------------------
    Op("list_images", "GET", "/images", query=("limit:opt", "after:opt", "prefix:opt", "role:opt"), answer=ImageList,
       unwrap="images"),
    Op("inspect_image", "GET", "/images/{ref}", answer=ImageInfo),
    # -- served by the apiserver itself (``dsec.apiserver.calls``): more than one node call -------
    Op("list_sandboxes", "GET", "/sandboxes", answer=SandboxList, served=API),
    Op("create_microvm", "POST", "/microvms", DSecMicroVMRunArgs, request_arg="args", answer=SandboxInfo,
       served=API),
    Op("create_fullvm", "POST", "/vms", DSecFullVMRunArgs, request_arg="args", answer=SandboxInfo, served=API),
    Op("remove_image", "DELETE", "/images/{name}", served=API),
    Op("gc_layers", "POST", "/images:gc", timeout="long", served=API),
    Op("build_image", "POST", "/images:build", BuildImageRequest, answer=ExecEvent, answers="lines", timeout="own",
       served=API),
    Op("nodes", "GET", "/nodes", query=("all:flag",), answer=NodeInfo, answers="list", served=API),
    Op("stats", "GET", "/stats", answer=ClusterStats, served=API),
    Op("list_snapshots", "GET", "/snapshots", answer=SnapshotList, served=API),
    Op("get_snapshot", "GET", "/snapshots/{ref:snapshot}", answer=Snapshot, served=API),
    Op("remove_snapshot", "DELETE", "/snapshots/{ref:snapshot}", answer=Snapshot, served=API),
    Op("list_jobs", "GET", "/jobs", answer=JobList, served=API),
    Op("show_job", "GET", "/jobs/{job:job}", query=("after:count",), answer=JobLog, served=API),
    Op("remove_job", "DELETE", "/jobs/{job:job}", served=API),
    Op("pause_sandboxes", "POST", "/sandboxes:pause", SandboxGroupRequest, answer=SandboxGroupResult,
       timeout="long", served=API),
    Op("resume_sandboxes", "POST", "/sandboxes:resume", SandboxGroupRequest, answer=SandboxGroupResult,
       timeout="long", served=API),
    Op("list_projects", "GET", "/projects", answer=ProjectList, served=API),
    Op("get_project", "GET", "/projects/{name}", answer=ProjectInfo, served=API),
    Op("create_project", "POST", "/projects", ProjectCreateRequest, answer=ProjectInfo, served=API),
    Op("set_quota", "PUT", "/projects/{name}/quota", ProjectQuota, answer=ProjectInfo, served=API),
    Op("remove_project", "DELETE", "/projects/{name}", served=API),
    Op("new_token", "POST", "/projects/{name}/tokens", TokenRequest, body="optional", answer=ProjectToken,
       served=API),
)

PUBLIC_OPS_BY_NAME: dict[str, Op] = {op.name: op for op in PUBLIC_OPS}
# Each operation's method and path as a format string, made once (a call formats it only).
_ROUTES: dict[str, tuple[str, str]] = {op.name: (op.method, PREFIX + path_format(op.path)) for op in PUBLIC_OPS}


def api_path(name: str, /, **arguments: object) -> str:
    """The path of operation ``name`` for these path arguments: ``api_path("exec", sandbox_id=…)``."""
    return _ROUTES[name][1].format_map(arguments)


def api_route(name: str, /, **arguments: object) -> tuple[str, str]:
    """(method, path) of operation ``name`` for these path arguments: ``_request(*api_route(…))``."""
    method, path = _ROUTES[name]
    return method, path.format_map(arguments)
