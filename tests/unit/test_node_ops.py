"""The node seam's operation table (``dsec.edge.ops``): ``EdgeAPI``, the in-process ``Edge`` and
``RemoteEdge`` name the same operations, every entry has its route on the node's endpoint, and
a ``RemoteEdge`` call reaches the edge's method of the same name, with its arguments and the
timeout it always had."""

from __future__ import annotations

import asyncio
import inspect
import json

import pytest

from dsec.edge import remote as remote_module
from dsec.edge.api import EdgeAPI
from dsec.edge.edge import Edge
from dsec.edge.ops import NODE_OPS, NODE_OPS_BY_NAME, PREFIX, arguments
from dsec.edge.remote import LONG_CALL_TIMEOUT_S, SLACK_S, RemoteEdge
from dsec.edge.server import EdgeApp, NodeServer, _Request
from libdsec import SandboxStateError
from libdsec.ops import Operation, format_path, path_regex
from libdsec.protocol import MAX_WATCH_WAIT_S, DesktopInput, DesktopLaunchRequest, OpenWatchRequest
from libdsec.protocol import (
    BuildImageRequest,
    DSecContainerRunArgs,
    DSecFnCallArgs,
    ExecRequest,
    OpenPtyRequest,
    OpenSessionRequest,
    ProcessStreamRequest,
    StartProcessRequest,
)

TOKEN = "node-secret"
SANDBOX = "n0-0123456789abcdef"
# Not operations: the node's name, and the end of this side of it.
NOT_OPERATIONS = {"node", "close"}


def seam_methods() -> set[str]:
    return {name for name, value in vars(EdgeAPI).items() if not name.startswith("_") and callable(value)}


def test_the_table_edge_api_edge_and_remote_edge_name_the_same_operations():
    names = [op.name for op in NODE_OPS]
    assert len(names) == len(set(names)), "an operation declared twice"
    assert set(names) == seam_methods() - NOT_OPERATIONS
    for name in names:
        want = list(inspect.signature(getattr(EdgeAPI, name)).parameters)
        for cls in (Edge, RemoteEdge):
            # The server calls the edge's method by keyword: the names must be EdgeAPI's.
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls.__name__, name)
    routes = {(op.method, path_regex(op.path).pattern) for op in NODE_OPS}
    assert len(routes) == len(NODE_OPS), "two operations share a route"


def test_path_templates():
    op = Operation("get_process", "GET", "/sandboxes/{sandbox_id}/processes/{pid:int}")
    assert op.params == (("sandbox_id", "str"), ("pid", "int"))
    assert format_path(op.path, sandbox_id=SANDBOX, pid=7) == f"/sandboxes/{SANDBOX}/processes/7"
    m = path_regex(op.path, PREFIX).match(f"{PREFIX}/sandboxes/{SANDBOX}/processes/7")
    assert m is not None and m.groupdict() == {"sandbox_id": SANDBOX, "pid": "7"}
    assert path_regex(op.path, PREFIX).match(f"{PREFIX}/sandboxes/{SANDBOX}/processes/x") is None
    assert path_regex("/images/{name:name}:remove").match("/images/a:b:remove") is None
    with pytest.raises(ValueError, match="unknown path parameter type"):
        path_regex("/a/{b:float}")


class Reached(SandboxStateError):
    pass


class RecordingEdge:
    """Every method raises ``SandboxStateError("reached NAME")`` and records its arguments."""

    node = "n0"

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str):
        if name not in seam_methods():
            raise AttributeError(name)

        def method(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            raise SandboxStateError(f"reached {name}")
        return method


QUERY_VALUES = {"str": "/a", "mode": "0o600", "opt": "x"}
PATH_VALUES = {"str": SANDBOX, "int": "7", "port": "8080", "key": "b1", "name": "busybox"}
BODIES = {
    "create": {"args": {"container_image": "busybox"}},
    "create_batch": {"args": {"container_image": "busybox"}, "count": 2},
    "exec": {"command": "true"}, "exec_stream": {"command": "true"}, "session_exec": {"command": "true"},
    "session_exec_stream": {"command": "true"}, "start_process": {"command": "true"},
    "start_process_stream": {"command": "true"}, "signal_process": {"signal": 2}, "process_stdin": {"data": "x"},
    "resize_pty": {"cols": 80, "rows": 24}, "pty_input": {"data": "A2Fi"}, "remove_path": {"path": "/a"},
    "make_dir": {"path": "/a"}, "rename_path": {"src": "/a", "dst": "/b"}, "download_tree": {"path": "/a"},
    "set_network_rules": {"network_rules": {"pypi": True}}, "set_ttl": {"ttl_running_stop": 60},
    "fncall": {"code": "print(1)"}, "fncall_many": {"calls": [{"code": "print(1)"}]},
    "build_image": {"build": {"name": "task", "dockerfile": "FROM python\n"}}, "clean_copy": {"keep": ["/a"]},
    "open_watch": {"path": "/a"}, "get_xattrs": {"paths": ["/a"], "prefix": "user.x."},
    "set_xattrs": {"path": "/a", "prefix": "user.x.", "values": {"k": "v"}},
    "desktop_input": {"action": "click", "x": 1, "y": 2}, "desktop_focus": {"window": 7},
}


class Conn:
    """What the app writes, for one request."""

    def __init__(self) -> None:
        self.out = b""
        self.gone = asyncio.Event()
        self.transport = None

    def write(self, data: bytes) -> None:
        self.out += data

    async def drain(self) -> None:
        pass

    def answer(self) -> tuple[int, dict]:
        head, _, body = self.out.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(body)


async def ask(app: EdgeApp, method: str, path: str, query: bytes = b"", body: bytes = b"", upgrade: bool = False):
    conn = Conn()
    await app.answer(_Request(method=method, path=path, query=query, authorization=f"Bearer {TOKEN}".encode(),
                              body=body, keep_alive=True, upgrade=upgrade), conn)
    return conn.answer()


@pytest.mark.parametrize("op", NODE_OPS, ids=[op.name for op in NODE_OPS])
async def test_every_operation_has_its_route(op):
    edge = RecordingEdge()
    app = EdgeApp(edge, TOKEN)
    path = PREFIX + format_path(op.path, **{n: PATH_VALUES[kind] for n, kind in op.params})
    query = b"&".join(f"{n}={QUERY_VALUES[kind]}".encode() for n, kind in op.query_params)
    body = json.dumps(BODIES.get(op.name, {})).encode() if op.request is not None else b"data"
    status, answer = await ask(app, op.method, path, query, body, upgrade=op.answers == "upgrade")
    assert (status, answer["error"]) == (409, {"code": "sandbox_state", "message": f"reached {op.name}"})
    [(name, args, kwargs)] = edge.calls
    assert name == op.name
    if op.name not in ("create", "create_batch"):  # (those two are called by position)
        assert set(kwargs) == set(arguments(op)) and not args
        for n, kind in op.params:
            assert kwargs[n] == (int(PATH_VALUES[kind]) if kind in ("int", "port") else PATH_VALUES[kind])


async def test_an_unknown_route_is_a_404_naming_it():
    app = EdgeApp(RecordingEdge(), TOKEN)
    status, answer = await ask(app, "GET", PREFIX + "/nope")
    assert status == 404
    assert answer["error"] == {"code": "invalid_request", "message": f"no node route GET {PREFIX}/nope"}
    status, answer = await ask(app, "DELETE", PREFIX + f"/sandboxes/{SANDBOX}")
    assert status == 404 and answer["error"]["message"] == f"no node route DELETE {PREFIX}/sandboxes/{SANDBOX}"
    status, answer = await ask(app, "POST", PREFIX + f"/sandboxes/{SANDBOX}/exec", body=b'{"command": 5}')
    assert status == 422 and answer["error"]["message"].startswith("malformed ExecRequest: command:")


def remote_arguments(op: Operation) -> dict:
    values = {
        "sandbox_id": SANDBOX, "reason": "r", "name": "busybox", "role": "snapshot", "keep": ["/a"], "pid": 7,
        "signal": 2, "data": "x" if op.name == "process_stdin" else b"x", "close": False, "timeout": 3.0, "session": 3, "pty": 2, "cols": 80, "rows": 24,
        "encoding": "utf-8", "port": 8080, "path": "/a", "recursive": True, "src": "/a", "dst": "/b",
        "mode": "filesystem" if op.name in ("snapshot", "pause") else 0o600, "users": [SANDBOX],
        "network_rules": {"pypi": True}, "ttl_running_stop": 60.0, "ref": "busybox", "in_use": frozenset({"x"}),
        "build": BuildImageRequest(name="task", dockerfile="FROM python\n", timeout=100), "project": "root",
        "args": DSecFnCallArgs(code="print(1)", timeout=4) if op.name == "fncall"
        else DSecContainerRunArgs(container_image="busybox"),
        "calls": [DSecFnCallArgs(code="print(1)", timeout=9)], "batch": "b1", "count": 2, "kind": "container",
        "request": {ExecRequest: ExecRequest(command="true", timeout=5), StartProcessRequest: StartProcessRequest(
            command="true"), ProcessStreamRequest: ProcessStreamRequest(timeout=6), OpenPtyRequest: OpenPtyRequest(),
            OpenSessionRequest: OpenSessionRequest(),
            OpenWatchRequest: OpenWatchRequest(path="/a", recursive=True),
            DesktopInput: DesktopInput(action="press", keys="ctrl+s"),
            DesktopLaunchRequest: DesktopLaunchRequest(app="mousepad")}.get(op.request),
        "watch": 4, "wait": 2.5, "paths": ["/a", "/b"], "prefix": "user.x.", "values": {"k": "v"},
        "format": "raw", "window": 7, "max_chars": 5000,
        "all_or_none": False,
        "limit": "5", "after": "task-1",
    }
    return {n: values[n] for n in arguments(op)}


async def test_remote_edge_reaches_each_operation_with_its_arguments():
    edge = RecordingEdge()
    server = NodeServer(edge, TOKEN)
    remote = RemoteEdge("n0", await server.start(), TOKEN)
    try:
        for op in NODE_OPS:
            kwargs = remote_arguments(op)
            with pytest.raises(SandboxStateError, match=f"reached {op.name}"):
                result = getattr(remote, op.name)(**kwargs)
                if inspect.isawaitable(result):
                    await result
                else:
                    async for _ in result:
                        pass
            name, args, got = edge.calls.pop()
            assert name == op.name
            if op.name in ("create", "create_batch"):
                continue
            for n, value in kwargs.items():
                if n == "data" and op.body_shape == "stream":
                    continue  # (handed on as it arrives: dsec.edge.server._BodyStream)
                assert got[n] == value, (op.name, n)
    finally:
        await remote.close()
        await server.close()


# Each call's bound on its wait, as RemoteEdge always had it (None: the client's call timeout).
TIMEOUTS = {
    "pause": LONG_CALL_TIMEOUT_S, "resume": LONG_CALL_TIMEOUT_S, "snapshot": LONG_CALL_TIMEOUT_S,
    "pack_diff": LONG_CALL_TIMEOUT_S, "clean_copy": LONG_CALL_TIMEOUT_S, "fork": LONG_CALL_TIMEOUT_S,
    "process_stdin": LONG_CALL_TIMEOUT_S,
    "pty_input": LONG_CALL_TIMEOUT_S, "close_pty": LONG_CALL_TIMEOUT_S, "remove_path": LONG_CALL_TIMEOUT_S,
    "upload_tree": LONG_CALL_TIMEOUT_S, "gc_layers": LONG_CALL_TIMEOUT_S, "write_file_stream": 3600.0,
    "desktop_stream": LONG_CALL_TIMEOUT_S,
    "exec": 5 + SLACK_S, "session_exec": 5 + SLACK_S, "wait_process": 3 + SLACK_S, "fncall": 4 + SLACK_S,
    "fncall_many": LONG_CALL_TIMEOUT_S + 9,
    "exec_stream": 5 + SLACK_S, "session_exec_stream": 5 + SLACK_S, "stream_process": 6 + SLACK_S,
    "start_process_stream": 24 * 3600.0 + SLACK_S, "pty_stream": 7 * 24 * 3600.0 + SLACK_S,
    "download_tree": 3600.0 + SLACK_S, "build_image": 100 + SLACK_S,
    "download_tree_tar": 3600.0 + SLACK_S, "read_file_stream": 3600.0 + SLACK_S,
    "watch_events": MAX_WATCH_WAIT_S + SLACK_S,
}


async def test_remote_edge_keeps_each_calls_timeout(monkeypatch):
    seen: dict[str, float | None] = {}
    current = {"name": ""}

    async def call(self, method, path, *, timeout=None, **kw):
        seen[current["name"]] = timeout
        raise Reached("x")

    async def lines(self, model, path, request, timeout):
        seen[current["name"]] = timeout
        raise Reached("x")
        yield

    async def raw(self, route, params, timeout, what):
        seen[current["name"]] = timeout
        raise Reached("x")
        yield

    monkeypatch.setattr(RemoteEdge, "_call", call)
    monkeypatch.setattr(RemoteEdge, "_lines", lines)
    monkeypatch.setattr(RemoteEdge, "_raw", raw)
    remote = RemoteEdge("n0", "http://127.0.0.1:9", TOKEN)
    for op in NODE_OPS:
        if op.name in ("create_batch", "connect_port"):
            continue
        current["name"] = op.name
        with pytest.raises(Reached):
            result = getattr(remote, op.name)(**remote_arguments(op))
            if inspect.isawaitable(result):
                await result
            else:
                async for _ in result:
                    pass
        assert seen[op.name] == TIMEOUTS.get(op.name), op.name
    await remote.close()
    assert remote_module.BATCH_IDLE_S == 120.0 and NODE_OPS_BY_NAME["create_batch"].answers == "lines"


def test_every_public_call_is_a_node_call_on_the_same_path_with_the_same_models():
    from libdsec.api_ops import PUBLIC_OPS

    from dsec.edge.ops import NODE_FORMS

    for op in PUBLIC_OPS:
        if op.served != "node":  # (the apiserver's own: test_api_ops)
            continue
        node = NODE_OPS_BY_NAME[op.name]
        if op.name in NODE_FORMS:
            assert node is NODE_FORMS[op.name]
            continue
        assert (node.method, node.path, node.request, node.answer, node.answers, node.body, node.query,
                node.spread, node.timeout) == (op.method, op.path, op.request, op.answer, op.answers, op.body,
                                               op.query, op.spread, op.timeout), op.name
        assert node.lifecycle is None and node.journal is None, op.name  # the edge's method checks its own
