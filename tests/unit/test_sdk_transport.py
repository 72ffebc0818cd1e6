"""The SDK against httpx.MockTransport: headers, error mapping, batch streaming, and a server
that is not there."""

from __future__ import annotations

import json

import httpx
import pytest

import libdsec
from dsec.local import free_port
from libdsec import DSecClient, SyncDSecClient
from libdsec.protocol import MAX_SANDBOX_BATCH
from sdk_answers import ARGS, INFO


def _client(handler, token: str | None = "t0k3n", **options) -> DSecClient:
    return DSecClient("http://dsec.test", token=token, transport=httpx.MockTransport(handler), **options)


async def test_token_header_and_request_body():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=INFO)

    async with _client(handler) as client:
        sandbox = await client.run_container(ARGS)
    assert sandbox.id == INFO["id"] and sandbox.status is libdsec.SandboxStatus.running
    (request,) = seen
    assert request.headers["authorization"] == "Bearer t0k3n"
    assert request.method == "POST" and request.url.path == "/v1/sandboxes"
    assert request.headers["content-type"] == "application/json"
    assert json.loads(request.content)["memory_limit_mb"] == 64


async def test_no_token_sends_no_header(monkeypatch, tmp_path):
    monkeypatch.delenv("DSEC_TOKEN", raising=False)
    monkeypatch.setenv("DSEC_STATE_DIR", str(tmp_path))  # no token file there
    assert libdsec.default_token() is None
    seen = []

    def handler(request):
        seen.append(request)
        return httpx.Response(401, json=libdsec.Unauthenticated("missing token").to_wire())

    async with _client(handler, token=None) as client:
        with pytest.raises(libdsec.Unauthenticated, match="missing token"):
            await client.list_sandboxes()
    assert "authorization" not in seen[0].headers


def test_default_token_sources(monkeypatch, tmp_path):
    (tmp_path / "token").write_text("from-file\n")
    monkeypatch.setenv("DSEC_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("DSEC_TOKEN", raising=False)
    assert libdsec.default_token() == "from-file"
    monkeypatch.setenv("DSEC_TOKEN", "from-env")
    assert libdsec.default_token() == "from-env"


@pytest.mark.parametrize("cls", [
    libdsec.InvalidRequest, libdsec.LimitOutOfRange, libdsec.Unauthenticated, libdsec.ImageNotFound,
    libdsec.SandboxNotFound, libdsec.SandboxStateError, libdsec.SandboxFileNotFound,
    libdsec.CommandTimeout, libdsec.CapacityExceeded, libdsec.BackendError, libdsec.ServerError,
], ids=lambda c: c.__name__)
async def test_error_bodies_map_to_their_class(cls):
    def handler(request):
        return httpx.Response(cls.status, json=cls(f"it went wrong: {cls.code}").to_wire())

    async with _client(handler) as client:
        sandbox = libdsec.Sandbox(client, libdsec.SandboxInfo.model_validate(INFO))
        for call in (client.get_sandbox("n0-0123456789abcdef"), sandbox.run_shell("true"),
                     sandbox.read_file("/x"), sandbox.write_file("/x", b"y")):
            with pytest.raises(cls, match=f"it went wrong: {cls.code}") as info:
                await call
            assert type(info.value) is cls


async def test_non_json_error_is_a_server_error():
    def handler(request):
        return httpx.Response(502, text="<html>bad gateway</html>")

    async with _client(handler) as client:
        with pytest.raises(libdsec.ServerError, match="HTTP 502"):
            await client.list_sandboxes()


async def test_connection_refused_is_server_unavailable():
    port = free_port()  # nothing listens there
    async with DSecClient(f"http://127.0.0.1:{port}", token="x") as client:
        with pytest.raises(libdsec.ServerUnavailable, match=str(port)) as info:
            await client.list_sandboxes()
        assert isinstance(info.value, ConnectionError)
        with pytest.raises(libdsec.ServerUnavailable):
            await client.run_containers(ARGS, count=2)


async def test_transport_errors_are_server_unavailable():
    def handler(request):
        raise httpx.ReadError("connection reset", request=request)

    async with _client(handler, retry_backoff_s=0.001) as client:  # (retried first, as a broken connection is)
        with pytest.raises(libdsec.ServerUnavailable, match="connection reset"):
            await client.list_sandboxes()


async def test_client_not_open_and_double_close():
    client = _client(lambda r: httpx.Response(200, json={"sandboxes": []}))
    with pytest.raises(libdsec.InvalidRequest, match="not open"):
        await client.list_sandboxes()
    await client.open()
    assert await client.list_sandboxes() == []
    await client.close()
    await client.close()  # a second close does nothing


def _batch_handler(lines: list[dict], status: int = 200):
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/sandboxes:batch"
        body = "".join(json.dumps(x) + "\n" for x in lines)
        return httpx.Response(status, content=body.encode(), headers={"content-type": "application/x-ndjson"})
    return handler


async def test_batch_progress_and_order():
    ids = [f"n0-{i:016x}" for i in range(3)]
    events = [{"event": "created", "index": i, "sandbox": {**INFO, "id": ids[i]}} for i in (2, 0, 1)]
    progress = []
    async with _client(_batch_handler([*events, {"event": "done"}])) as client:
        made = await client.run_containers(ARGS, count=3, progress=lambda d, n: progress.append((d, n)))
    assert [s.id for s in made] == ids  # in index order, whatever order they came up in
    assert progress == [(1, 3), (2, 3), (3, 3)]


async def test_batch_error_event_raises_its_class():
    events = [{"event": "created", "index": 0, "sandbox": INFO},
              {"event": "error", "error": {"code": "capacity_exceeded", "message": "node n0 is full"}}]
    async with _client(_batch_handler(events)) as client:
        with pytest.raises(libdsec.CapacityExceeded, match="node n0 is full"):
            await client.run_containers(ARGS, count=2)


async def test_batch_cut_short_is_an_error():
    events = [{"event": "created", "index": 0, "sandbox": INFO}]
    async with _client(_batch_handler(events)) as client:
        with pytest.raises(libdsec.ServerError, match="1 of 2"):
            await client.run_containers(ARGS, count=2)


async def test_batch_error_status_before_streaming():
    body = libdsec.ImageNotFound("unknown image 'nope'").to_wire()
    async with _client(_batch_handler([body], status=404)) as client:
        with pytest.raises(libdsec.ImageNotFound, match="nope"):
            await client.run_containers(ARGS, count=2)


@pytest.mark.parametrize("count", [0, -1, MAX_SANDBOX_BATCH + 1, 10**9])
async def test_batch_count_out_of_range_is_refused_before_sending(count):
    sent = []
    async with _client(lambda r: sent.append(r) or httpx.Response(500)) as client:
        with pytest.raises(libdsec.LimitOutOfRange, match="count") as info:
            await client.run_containers(ARGS, count=count)
    assert str(count) in str(info.value) and not sent


def test_sync_twin_maps_errors_the_same_way():
    def handler(request):
        if request.url.path == "/v1/sandboxes":
            return httpx.Response(200, json=INFO)
        return httpx.Response(409, json=libdsec.SandboxStateError("sandbox is stopped").to_wire())

    with SyncDSecClient("http://dsec.test", token="t", transport=httpx.MockTransport(handler)) as client:
        sandbox = client.run_container(ARGS)
        assert sandbox.id == INFO["id"]
        with pytest.raises(libdsec.SandboxStateError, match="stopped"):
            sandbox.run_shell("true")
        with pytest.raises(libdsec.SandboxStateError):
            sandbox.read_file("/etc/passwd")
    client.close()  # a second close does nothing
