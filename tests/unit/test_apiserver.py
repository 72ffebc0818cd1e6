"""The apiserver alone, over a fake edge (control plane only): the OpenAPI document, auth,
request parsing, error mapping, and that an unexpected error does not break the connection."""

from __future__ import annotations

import asyncio
import json
import threading
import warnings
from datetime import datetime, timezone

import httpx
import pytest
import uvicorn

import libdsec
from dsec.apiserver.app import Cluster
from dsec.app import create_app
from dsec.local import free_port
from libdsec.protocol import ExecRequest, ExecResult, NodeInfo, SandboxInfo, SandboxStatus

TOKEN = "s3cret"
SID = "n0-0123456789abcdef"
BOOM = "n0-00000000000b0000"  # the fake edge fails on this one with an unexpected error


class FakeEdge:
    """In-memory stand-in for an edge: enough to drive every route."""

    node = "n0"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def _info(self, sandbox_id: str = SID, status: SandboxStatus = SandboxStatus.running) -> SandboxInfo:
        now = datetime.now(timezone.utc)
        return SandboxInfo(id=sandbox_id, node=self.node, image="busybox", status=status, created_at=now,
                           last_active_at=now, memory_limit_mb=64, cpu_cores_limit=1, ttl_running_stop=60,
                           init_user="root", workdir="/")

    def _check(self, sandbox_id: str) -> None:
        if sandbox_id == BOOM:
            raise RuntimeError("the fake edge broke")
        if sandbox_id != SID:
            raise libdsec.SandboxNotFound(f"no sandbox {sandbox_id} on node n0")

    async def create(self, args, kind="container", project="root"):
        self.calls.append(("create", args))
        if args.container_image != "busybox":
            raise libdsec.ImageNotFound(f"unknown image {args.container_image!r}")
        return self._info()

    async def create_batch(self, args, count, kind="container", project="root", batch=None):
        if args.container_image != "busybox":
            raise libdsec.ImageNotFound(f"unknown image {args.container_image!r}")
        for i in range(count):
            if i == 2 and args.memory_limit_mb == 999:
                raise libdsec.CapacityExceeded("node n0 is full")
            yield i, self._info(f"n0-{i:016x}")

    async def commit_batch(self, batch):
        pass

    async def get(self, sandbox_id):
        self._check(sandbox_id)
        return self._info(sandbox_id)

    async def list(self):
        return [self._info()]

    async def exec(self, sandbox_id, request: ExecRequest):
        self._check(sandbox_id)
        self.calls.append(("exec", request))
        return ExecResult(exit_code=0, stdout=request.command, stderr="", duration_s=0.0)

    async def read_file(self, sandbox_id, path):
        self._check(sandbox_id)
        if path == "/missing":
            raise libdsec.SandboxFileNotFound(f"no such file in sandbox: {path}")
        return b"data:" + path.encode()

    async def write_file(self, sandbox_id, path, data, mode):
        self._check(sandbox_id)
        self.calls.append(("write", path, data, mode))

    async def stop(self, sandbox_id, reason="stopped by request"):
        self._check(sandbox_id)
        return self._info(sandbox_id, SandboxStatus.stopped)

    async def node_info(self):
        return NodeInfo(node="n0", cgroup_version="v1", runtime="fake", sandboxes=1, memory_total_mb=1, cpu_cores=1)


class FakeStore:
    def image_names(self):
        return []


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge()


@pytest.fixture
def app(edge):
    return create_app(Cluster([edge]), TOKEN)


@pytest.fixture
async def http(app):
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://api",
                                 headers={"authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def test_openapi_document_has_the_sandbox_routes(app):
    doc = app.openapi()
    paths = doc["paths"]
    expected = {
        "/v1/sandboxes": {"get", "post"},
        "/v1/sandboxes:batch": {"post"},
        "/v1/sandboxes/{sandbox_id}": {"get", "delete"},
        "/v1/sandboxes/{sandbox_id}/exec": {"post"},
        "/v1/sandboxes/{sandbox_id}/files": {"get", "put"},
        "/v1/images": {"get"},
        "/v1/nodes": {"get"},
    }
    for path, methods in expected.items():
        assert path in paths, f"{path} missing from the OpenAPI document"
        assert methods <= set(paths[path]), f"{path}: {set(paths[path])}"
    schemas = doc["components"]["schemas"]
    for name in ("DSecContainerRunArgs", "CreateBatchRequest", "ExecRequest", "ExecResult", "SandboxInfo",
                 "ErrorResponse"):
        assert name in schemas
    # The request models are the SDK's own: unknown fields are refused in the schema too.
    assert schemas["DSecContainerRunArgs"].get("additionalProperties") is False
    assert "memory_limit_mb" in schemas["DSecContainerRunArgs"]["properties"]
    json.dumps(doc)


def test_every_operation_has_an_id_of_its_own(edge):
    """OpenAPI wants operation ids unique; a route with several methods gives them all one (FastAPI
    warned on every start: the port proxy's seven methods shared its id)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        doc = create_app(Cluster([edge]), TOKEN).openapi()
    assert not [w for w in said if "Operation ID" in str(w.message)], [str(w.message) for w in said]
    ids = [op["operationId"] for path in doc["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    port = doc["paths"]["/v1/sandboxes/{sandbox_id}/ports/{port}/{path}"]
    assert set(port) == {"get", "head", "post", "put", "patch", "delete", "options"}


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {TOKEN}"},
                                     {"authorization": TOKEN}, {"authorization": "Bearer "}])
async def test_unauthenticated(app, edge, headers):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api", headers=headers) as c:
        for method, path in (("GET", "/v1/sandboxes"), ("POST", "/v1/sandboxes"), ("GET", f"/v1/sandboxes/{SID}"),
                             ("DELETE", f"/v1/sandboxes/{SID}"), ("POST", f"/v1/sandboxes/{SID}/exec")):
            r = await c.request(method, path, json={"container_image": "busybox"})
            assert r.status_code == 401, (method, path)
            assert r.json()["error"]["code"] == "unauthenticated"
            assert "token" in r.json()["error"]["message"]
        assert (await c.get("/healthz")).status_code == 200
    assert edge.calls == []


@pytest.mark.parametrize(("body", "names"), [
    (b"{not json", "json"),
    (b"", "body"),
    (b"[]", "body"),
    (json.dumps({"container_image": "busybox", "memory_limit_mb": "lots"}).encode(), "memory_limit_mb"),
    (json.dumps({"container_image": 7}).encode(), "container_image"),
    (json.dumps({"container_image": "busybox", "memroy_limit_mb": 64}).encode(), "memroy_limit_mb"),
    (json.dumps({"memory_limit_mb": 64}).encode(), "container_image"),
    (json.dumps({"container_image": "busybox", "workdir": "tmp"}).encode(), "workdir"),
])
async def test_malformed_create_is_422_invalid_request(http, edge, body, names):
    r = await http.post("/v1/sandboxes", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "invalid_request"
    assert names in err["message"].lower()
    assert edge.calls == []


@pytest.mark.parametrize(("path", "body", "names"), [
    (f"/v1/sandboxes/{SID}/exec", {"command": ["ls"]}, "command"),
    (f"/v1/sandboxes/{SID}/exec", {"command": "ls", "timeout": -1}, "timeout"),
    (f"/v1/sandboxes/{SID}/exec", {"command": "ls", "tiemout": 1}, "tiemout"),
    ("/v1/sandboxes:batch", {"args": {"container_image": "busybox"}, "count": 0}, "count"),
    ("/v1/sandboxes:batch", {"args": {"container_image": "busybox"}, "count": 10**6}, "count"),
    ("/v1/sandboxes:batch", {"args": {"container_image": "busybox"}}, "count"),
])
async def test_malformed_calls_are_422(http, edge, path, body, names):
    r = await http.post(path, json=body)
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "invalid_request"
    assert names in r.json()["error"]["message"]
    assert edge.calls == []


@pytest.mark.parametrize("sandbox_id", ["xyz", "n0-0123", "n0-0123456789ABCDEF", "N0-0123456789abcdef",
                                        "n0-0123456789abcdeg", "n0_0123456789abcdef", "-0123456789abcdef",
                                        "n0-0123456789abcdef0", "a" * 40 + "-0123456789abcdef"])
async def test_malformed_sandbox_id(http, sandbox_id):
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/files?path=/x")):
        r = await http.request(method, f"/v1/sandboxes/{sandbox_id}{path}")
        assert r.status_code == 422, (method, path)
        assert r.json()["error"]["code"] == "invalid_request"
        assert "malformed sandbox id" in r.json()["error"]["message"]


async def test_unknown_sandbox_and_unknown_node(http):
    r = await http.get("/v1/sandboxes/n0-fedcba9876543210")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "sandbox_not_found")
    r = await http.get("/v1/sandboxes/n7-0123456789abcdef")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "sandbox_not_found")
    assert "'n7'" in r.json()["error"]["message"]


async def test_routes_hand_typed_calls_to_the_edge(http, edge):
    r = await http.post(f"/v1/sandboxes/{SID}/exec", json={"command": "echo hi", "env": {"A": "1"}, "timeout": 5})
    assert r.status_code == 200 and r.json()["stdout"] == "echo hi"
    kind, request = edge.calls[-1]
    assert kind == "exec" and isinstance(request, ExecRequest) and request.env == {"A": "1"}
    r = await http.put(f"/v1/sandboxes/{SID}/files", params={"path": "/a", "mode": "0o600"}, content=b"xyz")
    assert r.status_code == 200 and edge.calls[-1] == ("write", "/a", b"xyz", 0o600)
    r = await http.put(f"/v1/sandboxes/{SID}/files", params={"path": "/a", "mode": "rwx"}, content=b"xyz")
    assert r.status_code == 422 and "mode" in r.json()["error"]["message"]
    r = await http.get(f"/v1/sandboxes/{SID}/files", params={"path": "/etc/x"})
    assert r.content == b"data:/etc/x"
    r = await http.get(f"/v1/sandboxes/{SID}/files", params={"path": "/missing"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "file_not_found")
    r = await http.get(f"/v1/sandboxes/{SID}/files")
    assert r.status_code == 422 and "path" in r.json()["error"]["message"]


async def test_unknown_route_is_a_wire_error(http):
    r = await http.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "invalid_request"
    r = await http.patch("/v1/sandboxes")
    assert r.status_code == 405 and r.json()["error"]["code"] == "invalid_request"


async def test_batch_streams_and_reports_errors(http):
    ok = await http.post("/v1/sandboxes:batch", json={"args": {"container_image": "busybox"}, "count": 3})
    events = [json.loads(line) for line in ok.text.splitlines()]
    assert [e["event"] for e in events] == ["created"] * 3 + ["done"]
    bad = await http.post("/v1/sandboxes:batch", json={"args": {"container_image": "nope"}, "count": 3})
    assert (bad.status_code, bad.json()["error"]["code"]) == (404, "image_not_found")
    late = await http.post("/v1/sandboxes:batch",
                           json={"args": {"container_image": "busybox", "memory_limit_mb": 999}, "count": 5})
    events = [json.loads(line) for line in late.text.splitlines()]
    assert [e["event"] for e in events] == ["created", "created", "error"]
    assert events[-1]["error"]["code"] == "capacity_exceeded"


async def test_sdk_over_the_app(app):
    """The real SDK over the app in-process: errors come back as their classes."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with libdsec.DSecClient("http://api", token=TOKEN, transport=transport) as client:
        with pytest.raises(libdsec.ImageNotFound, match="nope"):
            await client.run_container(libdsec.DSecContainerRunArgs(container_image="nope"))
        with pytest.raises(libdsec.InvalidRequest, match="malformed sandbox id"):
            await client.get_sandbox("bad")
        sandbox = await client.get_sandbox(SID)
        assert (await sandbox.run_shell("true")).exit_code == 0
        with pytest.raises(libdsec.ServerError, match="the fake edge broke"):
            await client.get_sandbox(BOOM)
    async with libdsec.DSecClient("http://api", token="wrong", transport=transport) as client:
        with pytest.raises(libdsec.Unauthenticated):
            await client.list_sandboxes()


async def test_unexpected_error_keeps_the_connection_usable(app):
    """Over a real socket: a 500 must not cut the keep-alive connection the SDK reuses (else the
    SDK's next call on it fails with ServerUnavailable)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for sandbox_id, status in ((BOOM, b" 500 "), (SID, b" 200 "), (BOOM, b" 500 "), (SID, b" 200 ")):
                writer.write(f"GET /v1/sandboxes/{sandbox_id} HTTP/1.1\r\nhost: api\r\n"
                             f"authorization: Bearer {TOKEN}\r\n\r\n".encode())
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert status in head.split(b"\r\n")[0], head
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                body = json.loads(await reader.readexactly(length))
                if status == b" 500 ":
                    assert body["error"] == {"code": "internal", "message": "RuntimeError: the fake edge broke"}
                await asyncio.sleep(0.05)  # let the server close the connection, if it does
        finally:
            writer.close()
        async with libdsec.DSecClient(f"http://127.0.0.1:{port}", token=TOKEN) as client:
            with pytest.raises(libdsec.ServerError, match="RuntimeError: the fake edge broke"):
                await client.get_sandbox(BOOM)
            assert (await client.get_sandbox(SID)).id == SID
    finally:
        server.should_exit = True
        thread.join(10)


def _info(sandbox_id: str = SID, status: SandboxStatus = SandboxStatus.running) -> dict:
    body = FakeEdge()._info(sandbox_id, status).model_dump(mode="json")
    return {k: v for k, v in body.items() if not k.endswith("_at")}


def _error(status: int, message: str, code: str = "invalid_request") -> tuple:
    return status, {"error": {"code": code, "message": message}}


_MALFORMED_ID = "malformed sandbox id {!r}: expected <node>-<16 hex digits>"
_NOT_FOUND = _error(404, "no sandbox n0-fedcba9876543210 on node n0", "sandbox_not_found")
# The table's operations (create, get, exec, stop the hottest) as FastAPI's own routes answered
# them (its answers taken at 39084e2, when each had a route of its own, over the same fake edge;
# the creates' at f2a68f3, where the lean lane and FastAPI answered them alike).
_TABLE_CASES = [
    ("POST", "/v1/sandboxes", {"container_image": "busybox"}, (200, _info())),
    ("POST", "/v1/sandboxes?via=query", {"container_image": "busybox"}, (200, _info())),
    ("POST", "/v1/sandboxes", {"container_image": "nope"}, _error(404, "unknown image 'nope'", "image_not_found")),
    ("POST", "/v1/sandboxes", {"container_image": "busybox", "memory_limit_mb": "lots"},
     _error(422, "malformed request: memory_limit_mb: Input should be a valid integer, unable to parse string as an "
                 "integer")),
    ("POST", "/v1/sandboxes", {"container_image": "busybox", "memroy_limit_mb": 64},
     _error(422, "malformed request: memroy_limit_mb: Extra inputs are not permitted")),
    ("POST", "/v1/sandboxes", {"memory_limit_mb": 64},
     _error(422, "malformed request: body: Value error, container_image is required (or snapshot, to start from one)")),
    ("POST", "/v1/sandboxes", None, _error(422, "malformed request: body: Field required")),
    ("POST", "/v1/microvms", {"container_image": "busybox", "vcpus": "x"},
     _error(422, "malformed request: vcpus: Extra inputs are not permitted")),
    ("POST", "/v1/vms", {"container_image": "nope"}, _error(404, "unknown image 'nope'", "image_not_found")),
    ("GET", f"/v1/sandboxes/{SID}", None, (200, _info())),
    ("GET", "/v1/sandboxes/n0-fedcba9876543210", None, _NOT_FOUND),
    ("GET", "/v1/sandboxes/n0-0123", None, _error(422, _MALFORMED_ID.format("n0-0123"))),
    ("GET", f"/v1/sandboxes/{BOOM}", None, _error(500, "RuntimeError: the fake edge broke", "internal")),
    ("POST", f"/v1/sandboxes/{SID}/exec", {"command": "echo hi", "env": {"A": "1"}, "timeout": 5},
     (200, {"exit_code": 0, "stdout": "echo hi", "stderr": "", "duration_s": 0.0, "stdout_truncated": False,
            "stderr_truncated": False, "stdout_bytes": 0, "stderr_bytes": 0})),
    ("POST", f"/v1/sandboxes/{SID}/exec", {"command": ["ls"]},
     _error(422, "malformed request: command: Input should be a valid string")),
    ("POST", "/v1/sandboxes/n0-fedcba9876543210/exec", {"command": "ls"}, _NOT_FOUND),
    ("DELETE", f"/v1/sandboxes/{SID}", None, (200, _info(status=SandboxStatus.stopped))),
    ("DELETE", "/v1/sandboxes/xyz", None, _error(422, _MALFORMED_ID.format("xyz"))),
    ("GET", f"/v1/sandboxes/{SID}/processes/0", None,
     _error(422, "malformed request: path.pid: Input should be greater than or equal to 1")),
    ("GET", f"/v1/sandboxes/{SID}/processes/abc", None,
     _error(422, "malformed request: path.pid: Input should be a valid integer, unable to parse string as an integer")),
    ("POST", f"/v1/sandboxes/{SID}/processes/0/signal", {"signal": "x"},
     _error(422, "malformed request: path.pid: Input should be greater than or equal to 1; signal: Input should be a "
                 "valid integer, unable to parse string as an integer")),
    ("GET", f"/v1/sandboxes/{SID}/fs/list?path=", None,
     _error(422, "malformed request: path: String should have at least 1 character")),
    ("GET", f"/v1/sandboxes/{SID}/fs/list", None, _error(422, "malformed request: path: Field required")),
    ("POST", f"/v1/sandboxes/{SID}/ptys/1/resize", None, _error(422, "malformed request: body: Field required")),
    ("POST", f"/v1/sandboxes/{SID}/sessions", None, _error(422, "malformed request: body: Field required")),
]


async def test_the_table_routes_answer_as_fastapi_did(http, monkeypatch):
    """The public table's operations are served by one handler in front of FastAPI
    (apiserver/table.py), errors and all as FastAPI's routes for them answered; a wrong method
    is still FastAPI's 405."""
    from dsec.apiserver.table import TableRoutes

    served = []
    serve = TableRoutes._serve

    async def counting(self, route, *args):
        served.append(route.op.name)
        return await serve(self, route, *args)

    monkeypatch.setattr(TableRoutes, "_serve", counting)
    for method, path, body, answer in _TABLE_CASES:
        r = await http.request(method, path, json=body)
        assert served and served.pop(), (method, path)
        assert _comparable(r) == answer, (method, path)
    for path in (f"/v1/sandboxes/{SID}/exec", "/v1/sandboxes"):
        r = await http.post(path, content=b"{not json", headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_request")
        assert r.json()["error"]["message"].startswith("malformed request")
    r = await http.post(f"/v1/sandboxes/{SID}/fs/mkdir", content=b"abc", headers={"content-type": "text/plain"})
    assert _comparable(r) == _error(422, "malformed request: body: Input should be a valid dictionary or object to "
                                         "extract fields from")
    served.clear()
    r = await http.get(f"/v1/sandboxes/{SID}/exec")
    assert not served and _comparable(r) == _error(405, f"Method Not Allowed: GET /v1/sandboxes/{SID}/exec")


def _comparable(r: httpx.Response) -> tuple:
    body = r.json()
    if r.status_code == 200:
        body = {k: v for k, v in body.items() if not k.endswith("_at")}  # the fake edge stamps "now"
    return r.status_code, body


def _untimed(r: httpx.Response) -> tuple:
    """Status and body, less E2B's times (the fake edge stamps "now")."""
    body = r.json() if r.content else None
    for item in body if isinstance(body, list) else [body]:
        if isinstance(item, dict):
            for k in [k for k in item if k.endswith("At")]:
                del item[k]
    return r.status_code, body


async def test_the_e2b_routes_are_called_as_fastapis_router_would_call_them(edge, http, monkeypatch):
    """The E2B API's plain routes and envd's mount skip FastAPI's layers (lean.py's plain
    lane), query strings and all; the catch-all after them is FastAPI's. Each answers as through
    FastAPI (an app without the plain lane), errors included; an unexpected error is a 500
    ``internal``."""
    from dsec.apiserver import lean

    framework = create_app(Cluster([edge]), TOKEN)
    for middleware in framework.user_middleware:
        if middleware.cls is lean.LeanRoutes:
            middleware.kwargs["plain_routes"] = ()

    served = []
    plain = lean._plain

    def recording(route):
        found = plain(route)
        if found is None:
            return None
        endpoint = found.endpoint

        async def called(*args, **kwargs):
            served.append(route.path)
            return await endpoint(*args, **kwargs)

        return lean._Plain(found.regex, called, found.mount)

    monkeypatch.setattr(lean, "_plain", recording)
    key = {"x-api-key": TOKEN}
    cases = [
        ("POST", "/e2b/sandboxes", {"templateID": "busybox", "timeout": 60}, key, "/e2b/sandboxes"),
        ("POST", "/e2b/sandboxes", {"templateID": "nope"}, key, "/e2b/sandboxes"),
        ("POST", "/e2b/sandboxes", {"templateID": "busybox"}, {"x-api-key": "wrong"}, "/e2b/sandboxes"),
        ("GET", "/e2b/sandboxes?state=running,paused&limit=5", None, key, "/e2b/sandboxes"),
        ("GET", f"/e2b/sandboxes/{SID}", None, key, "/e2b/sandboxes/{sandbox_id}"),
        ("DELETE", "/e2b/sandboxes/n0-fedcba9876543210", None, key, "/e2b/sandboxes/{sandbox_id}"),
        ("GET", "/e2b/envd/health", None, {}, "/e2b/envd"),
        ("GET", "/e2b/not-an-e2b-route", None, key, None),  # the catch-all: FastAPI's
    ]
    router = httpx.AsyncClient(transport=httpx.ASGITransport(app=framework), base_url="http://api")
    async with router:
        for method, path, body, headers, route in cases:
            answer = await http.request(method, path, json=body, headers=headers)
            assert served == ([route] if route else []), (method, path, served)
            served.clear()
            direct = await router.request(method, path, json=body, headers=headers)
            assert _untimed(answer) == _untimed(direct), (method, path)
    assert answer.status_code == 404 and "not part of DSec's E2B API" in answer.json()["message"]
    broke = await http.request("DELETE", f"/e2b/sandboxes/{BOOM}", headers=key)
    assert broke.status_code == 500 and broke.json()["error"]["code"] == "internal"
    assert "the fake edge broke" in broke.json()["error"]["message"]
