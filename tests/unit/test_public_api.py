"""The SDK's public surface: the curated ``__all__``, the error tree on the wire, the wire
models, and that libdsec stands alone (no server code pulled in)."""

from __future__ import annotations

import subprocess
import sys

import pydantic
import pytest

import libdsec
from libdsec import _errors, protocol as _models
from libdsec._errors import ERROR_CODES, error_from_wire

from dsec.edge import protocol as _node

PUBLIC = {
    "BackendError", "CapacityExceeded", "CommandTimeout", "DSecClient", "DSecContainerRunArgs",
    "DSecError", "ExecEvent", "ExecResult", "ImageInfo", "ImageNotFound", "InvalidRequest", "LimitOutOfRange",
    "PackDiffResult", "Sandbox", "SandboxFileNotFound", "SandboxInfo", "SandboxNotFound", "SandboxStateError",
    "SandboxStatus", "ServerError", "ServerUnavailable", "SyncDSecClient", "SyncSandbox",
    "Unauthenticated", "default_token",
}
PUBLIC |= {"DSecFullVMRunArgs", "DSecMicroVMRunArgs", "SnapshotInfo"}  # VM sandboxes
PUBLIC |= {"SecurityEvent"}  # security events
PUBLIC |= {"PauseResult", "ProjectInfo", "ProjectNotFound", "ProjectQuota", "QuotaExceeded"}  # resources, projects
PUBLIC |= {"DSecFnCallArgs", "FnCallResult"}  # fncall
PUBLIC |= {"SandboxLost", "StoreUnavailable"}  # cluster, a shared layer store
PUBLIC |= {"JobNotFound", "KeyReused", "ReplayDiverged", "ReplayIncomplete"}  # idempotency keys, job logs
PUBLIC |= {"Overloaded"}  # overload
PUBLIC |= {"SandboxGroupResult", "SandboxOutcome"}  # pausing a job, a project or many ids at once
PUBLIC |= {"Process", "ProcessInfo", "ProcessNotFound", "Session", "SessionClosed", "SyncProcess", "SyncSession", "FileEntry", "PortUnreachable"}  # inside a sandbox
PUBLIC |= {"Pty", "SyncPty"}  # a terminal in a sandbox
PUBLIC |= {"BuildResult", "ImageBuildFailed"}  # images built from Dockerfiles
PUBLIC |= {"DirWatch", "FsEvent", "SyncDirWatch"}  # directory watches
PUBLIC |= {"Desktop", "DesktopAccessibilityTree", "DesktopInfo", "DesktopSpec", "DesktopUnavailable", "DesktopWindow", "SyncDesktop"}  # desktops
PUBLIC |= {"Snapshot", "SnapshotConflict", "SnapshotNotFound"}  # named snapshots

# Every error class, its wire code, HTTP status and the built-in it also is.
ERRORS = [
    (libdsec.InvalidRequest, "invalid_request", 422, ValueError),
    (libdsec.LimitOutOfRange, "limit_out_of_range", 422, ValueError),
    (libdsec.Unauthenticated, "unauthenticated", 401, PermissionError),
    (libdsec.ImageNotFound, "image_not_found", 404, LookupError),
    (libdsec.SandboxNotFound, "sandbox_not_found", 404, LookupError),
    (libdsec.SnapshotNotFound, "snapshot_not_found", 404, LookupError),
    (libdsec.SnapshotConflict, "snapshot_conflict", 409, libdsec.DSecError),
    (libdsec.SandboxStateError, "sandbox_state", 409, RuntimeError),
    (libdsec.SandboxLost, "sandbox_lost", 410, ConnectionError),
    (libdsec.SandboxFileNotFound, "file_not_found", 404, FileNotFoundError),
    (libdsec.ProcessNotFound, "process_not_found", 404, LookupError),
    (libdsec.SessionClosed, "session_closed", 409, RuntimeError),
    (libdsec.PortUnreachable, "port_unreachable", 502, ConnectionError),
    (libdsec.CommandTimeout, "command_timeout", 408, TimeoutError),
    (libdsec.DesktopUnavailable, "desktop_unavailable", 409, libdsec.DSecError),
    (libdsec.CapacityExceeded, "capacity_exceeded", 503, libdsec.DSecError),
    (libdsec.QuotaExceeded, "quota_exceeded", 429, libdsec.DSecError),
    (libdsec.Overloaded, "overloaded", 429, libdsec.DSecError),
    (libdsec.ProjectNotFound, "project_not_found", 404, LookupError),
    (libdsec.KeyReused, "key_reused", 409, ValueError),
    (libdsec.ImageBuildFailed, "image_build_failed", 422, ValueError),
    (libdsec.JobNotFound, "job_not_found", 404, LookupError),
    (libdsec.ReplayDiverged, "replay_diverged", 409, libdsec.DSecError),
    (libdsec.ReplayIncomplete, "replay_incomplete", 409, libdsec.ReplayDiverged),
    (libdsec.BackendError, "backend_error", 500, libdsec.DSecError),
    (libdsec.StoreUnavailable, "store_unavailable", 503, libdsec.BackendError),
    (libdsec.ServerUnavailable, "server_unavailable", 503, ConnectionError),
    (libdsec.ServerError, "internal", 500, libdsec.DSecError),
]


def test_all_is_the_checked_list():
    assert set(libdsec.__all__) == PUBLIC
    assert len(libdsec.__all__) == len(PUBLIC), "duplicates in __all__"
    assert libdsec.__all__ == sorted(libdsec.__all__)
    for name in libdsec.__all__:
        assert getattr(libdsec, name) is not None


def test_every_error_class_is_on_the_wire_list():
    classes = {
        obj for obj in vars(_errors).values()
        if isinstance(obj, type) and issubclass(obj, libdsec.DSecError) and obj is not libdsec.DSecError
    }
    assert classes == {cls for cls, *_ in ERRORS}
    assert set(ERROR_CODES.values()) == classes
    assert len({cls.code for cls in classes}) == len(classes), "two classes share a wire code"


@pytest.mark.parametrize(("cls", "code", "status", "builtin"), ERRORS, ids=[c.__name__ for c, *_ in ERRORS])
def test_error_round_trips_the_wire(cls, code, status, builtin):
    assert (cls.code, cls.status) == (code, status)
    assert issubclass(cls, libdsec.DSecError) and issubclass(cls, builtin)
    err = cls(f"something about {code}")
    body = err.to_wire()
    extra = {"retry_after": 1.0} if cls is libdsec.Overloaded else {}
    assert body == {"error": {"code": code, "message": f"something about {code}", **extra}}
    back = error_from_wire(body, status)
    assert type(back) is cls
    assert back.message == err.message and str(back) == err.message


def test_overloaded_carries_its_retry_after_across_the_wire():
    back = error_from_wire(libdsec.Overloaded("busy", retry_after=0.25).to_wire(), 429)
    assert isinstance(back, libdsec.Overloaded) and back.retry_after == 0.25
    assert error_from_wire({"error": {"code": "overloaded", "message": "m", "retry_after": "soon"}}, 429).retry_after == 1.0


def test_error_from_wire_with_unknown_or_garbled_bodies():
    unknown = error_from_wire({"error": {"code": "no_such_code", "message": "m"}}, 418)
    assert type(unknown) is libdsec.ServerError and unknown.message == "m"
    for body in ("<html>bad gateway</html>", None, {"detail": "x"}, {"error": "flat string"}, [1, 2]):
        err = error_from_wire(body, 502)
        assert type(err) is libdsec.ServerError
        assert "HTTP 502" in err.message
    assert len(error_from_wire("x" * 10_000, 500).message) <= 500


WIRE_MODELS = [
    cls for cls in vars(_models).values()
    if isinstance(cls, type) and issubclass(cls, _models._Model) and not cls.__name__.startswith("_")
] + [  # the node seam's own models (dsec.edge.protocol)
    cls for cls in vars(_node).values()
    if isinstance(cls, type) and issubclass(cls, _node._Model) and not cls.__name__.startswith("_")
]


def _minimal(cls: type[pydantic.BaseModel]) -> dict:
    """A valid instance's fields for each wire model."""
    info = {
        "id": "n0-0123456789abcdef", "node": "n0", "image": "busybox", "status": "running",
        "created_at": "2026-01-01T00:00:00Z", "last_active_at": "2026-01-01T00:00:00Z",
        "memory_limit_mb": 64, "cpu_cores_limit": 1.0, "ttl_running_stop": 60.0,
        "init_user": "root", "workdir": "/",
    }
    node = {"node": "n0", "cgroup_version": "v1", "runtime": "container", "sandboxes": 0, "memory_total_mb": 1,
            "cpu_cores": 1}
    return {
        _models.DSecContainerRunArgs: {"container_image": "busybox"},
        _models.CreateBatchRequest: {"args": {"container_image": "busybox"}, "count": 1},
        _models.SandboxInfo: info,
        _models.SandboxList: {"sandboxes": [info]},
        _models.OpenWatchRequest: {"path": "/w"},
        _models.WatchInfo: {"id": 1, "path": "/w", "recursive": False},
        _models.FsEvent: {"type": "create", "name": "a"},
        _models.WatchEventsRequest: {},
        _models.WatchEvents: {"events": [{"type": "write", "name": "a"}]},
        _models.BatchEvent: {"event": "done"},
        _models.ExecRequest: {"command": "true"},
        _models.JobEntry: {"seq": 1, "at": "2026-01-01T00:00:00Z", "op": "exec", "request": {"command": "true"}},
        _models.JobInfo: {"name": "run-1", "project": "root", "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z", "entries": 0},
        _models.JobList: {"jobs": []},
        _models.JobLog: {"job": {"name": "run-1", "project": "root", "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z", "entries": 0}, "entries": []},
        _models.ExecResult: {"exit_code": 0, "stdout": "", "stderr": "", "duration_s": 0.1},
        _models.ExecEvent: {"event": "stdout", "data": "x"},
        _models.StartProcessRequest: {"command": "sleep 1"},
        _models.ProcessInfo: {"pid": 7, "command": "sleep 1", "running": True},
        _models.ProcessList: {"processes": []},
        _models.ProcessStdinRequest: {"data": "x"},
        _models.ProcessSignalRequest: {"signal": 2},
        _models.ProcessWaitRequest: {},
        _models.ProcessStreamRequest: {},
        _models.OpenSessionRequest: {},
        _models.FileEntry: {"name": "a", "path": "/a", "type": "file", "size": 1, "mode": 420, "mtime": 0.0,
                            "uid": 0, "gid": 0},
        _models.FileList: {"entries": []},
        _models.FileRemoveRequest: {"path": "/a"},
        _models.FileRenameRequest: {"src": "/a", "dst": "/b"},
        _models.MakeDirRequest: {"path": "/a"},
        _models.TreeDownloadRequest: {"path": "/a"},
        _models.SessionInfo: {"id": 9},
        _models.ImageInfo: {"name": "busybox", "layers": ["sha256-00"], "size_bytes": 1},
        _models.ImageList: {"images": []},
        _models.PackDiffRequest: {"name": "snap"},
        _models.CleanCopyRequest: {"keep": ["/testbed"]},
        _models.CleanCopyResult: {"sandbox": info, "source": "n0-0123456789abcdef", "keep": ["/testbed"], "files": 1,
                                  "bytes": 1, "scrubbed": [], "tampered": [], "copy_s": 0.01},
        _models.ForkRequest: {"count": 2},
        _models.ForkChild: {"sandbox": info},
        _models.ForkResult: {"parent": "n0-0123456789abcdef", "kind": "filesystem", "children": [{"sandbox": info}],
                             "frozen_s": 0.1, "fork_s": 0.5},
        _models.PackDiffResult: {"image": "snap", "layer": "sha256-00", "layers": ["sha256-00"],
                                 "size_bytes": 1, "scrubbed": []},
        _models.NodeInfo: node,
        _models.ErrorBody: {"code": "internal", "message": "m"},
        _models.ErrorResponse: {"error": {"code": "internal", "message": "m"}},
        _models.DSecMicroVMRunArgs: {"container_image": "busybox", "snapshot": "s0123456789abcdef"},
        _models.DSecFullVMRunArgs: {"container_image": "busybox"},
        _models.SnapshotInfo: {"id": "s0123456789abcdef", "sandbox_id": "n0-0123456789abcdef", "kind": "microvm",
                               "node": "n0", "image": "busybox", "size_bytes": 1, "memory_mb": 256, "save_s": 0.1,
                               "created_at": "2026-01-01T00:00:00Z"},
        _models.PauseResult: {"sandbox": info, "pause_s": 0.1},
        _models.ProjectUsage: {"sandboxes": 1},
        _models.SecurityEvent: {"kind": "dns.refused", "detail": "d", "at": "2026-01-01T00:00:00Z"},
        _models.SecurityEventList: {"events": []},
        _models.NetworkRulesRequest: {"network_rules": {"pypi": True}},
        _models.TTLRequest: {"ttl_running_stop": 60},
        _models.DSecFnCallArgs: {"code": "print(1)"},
        _models.FnCallResult: {"exit_code": 0},
        _models.FnCallBatchRequest: {"calls": [{"code": "print(1)"}]},
        _models.FnCallBatchResult: {"results": [{"exit_code": 0}]},
        _node.NodeCreateRequest: {"args": {"container_image": "busybox"}},
        _node.NodeBatchRequest: {"args": {"container_image": "busybox"}, "count": 2},
        _node.NodeStopRequest: {},
        _node.GetXattrsRequest: {"paths": ["/a"], "prefix": "user.e2b."},
        _node.XattrsList: {"values": [{"k": "v"}]},
        _node.SetXattrsRequest: {"path": "/a", "prefix": "user.e2b.", "values": {}},
        _node.LayerUse: {},
        _node.ImageRemoveRequest: {},
        _node.LayerGCRequest: {},
        _node.SnapshotRemoveRequest: {"users": []},
        _models.SnapshotRequest: {"mode": "filesystem", "name": "base-ready"},
        _models.PauseRequest: {"mode": "filesystem"},
        _models.SnapshotList: {"snapshots": []},
        _node.LayerGCResult: {"removed": []},
        _models.LatencyHistogram: {},
        _models.SandboxCount: {"status": "running", "kind": "container", "project": "root", "count": 1},
        _models.NodeSecurityEvent: {"sandbox_id": "n0-0123456789abcdef",
                                    "event": {"kind": "dns.refused", "detail": "d", "at": "2026-01-01T00:00:00Z"}},
        _models.NodeStats: {"info": node, "started_at": "2026-01-01T00:00:00Z"},
        _models.ApiserverStats: {"started_at": "2026-01-01T00:00:00Z"},
        _models.OpenPtyRequest: {},
        _models.PtyInfo: {"id": 1, "cols": 80, "rows": 24},
        _models.PtyResizeRequest: {"cols": 80, "rows": 24},
        _models.PtyStreamRequest: {},
        _models.PtyInputRequest: {"data": "A2Fi"},
        _models.BuildImageRequest: {"name": "task", "dockerfile": "FROM python\n"},
        _models.BuildResult: {"image": "task", "cached": False, "key": "0" * 64},
        _node.NodeBuildRequest: {"build": {"name": "task", "dockerfile": "FROM python\n"}},
        _models.ClusterStats: {"at": "2026-01-01T00:00:00Z", "nodes": [],
                               "apiserver": {"started_at": "2026-01-01T00:00:00Z"}},
        _models.DesktopSpec: {},
        _models.DesktopInput: {"action": "click"},
        _models.DesktopInfo: {"width": 8, "height": 8, "dpi": 96, "display": ":0", "cursor_x": 0, "cursor_y": 0},
        _models.DesktopWindow: {"id": 1, "title": "t", "app": "a", "x": 0, "y": 0, "width": 8, "height": 8},
        _models.DesktopWindowList: {"windows": []},
        _models.DesktopFocusRequest: {"window": 1},
        _models.DesktopLaunchRequest: {},
        _models.DesktopStreamRequest: {},
        _models.DesktopAccessibilityRequest: {},
        _models.DesktopAccessibilityTree: {"tree": "", "count": 0, "truncated": False},
        _models.DesktopStream: {"path": "/p", "expires_at": 1.0},
    }[cls]


@pytest.mark.parametrize("cls", WIRE_MODELS, ids=[c.__name__ for c in WIRE_MODELS])
def test_wire_models_forbid_unknown_fields(cls):
    data = _minimal(cls)
    cls.model_validate(data)
    with pytest.raises(pydantic.ValidationError, match="extra_forbidden|Extra inputs"):
        cls.model_validate({**data, "memroy_limit_mb": 64})


def test_run_args_validation():
    args = libdsec.DSecContainerRunArgs
    for bad in ({"container_image": ""}, {"container_image": "x" * 257},
                {"container_image": "busybox", "workdir": "relative"},
                {"container_image": "busybox", "env": {"A=B": "x"}},
                {"container_image": "busybox", "env": {"A": "nul\0"}},
                {"container_image": "busybox", "cpu_cores_limit": float("nan")},
                {"container_image": "busybox", "ttl_running_stop": float("inf")},
                {"container_image": "busybox", "memory_limit_mb": "lots"}):
        with pytest.raises(pydantic.ValidationError):
            args.model_validate(bad)
    for bad_timeout in (0, -1, float("nan"), 86401):
        with pytest.raises(pydantic.ValidationError, match="timeout"):
            _models.ExecRequest(command="true", timeout=bad_timeout)
    with pytest.raises(pydantic.ValidationError):
        _models.ExecRequest(command="")
    with pytest.raises(pydantic.ValidationError):
        _models.ExecRequest(command="true", max_output_bytes=_models.MAX_OUTPUT_BYTES_LIMIT + 1)


def test_libdsec_imports_no_server_code():
    # (httpx itself may pull in rich and click for its command line; that is not ours.)
    code = (
        "import sys, libdsec\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('dsec', 'fastapi', 'starlette', 'uvicorn', 'typer'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"libdsec pulled in: {out.stdout.strip()}"
