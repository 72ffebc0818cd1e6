"""One request path in the SDK: the same calls through each transport (``transport="wire"``,
the lean client, and ``transport="httpx"``) against one real apiserver on 127.0.0.1 (uvicorn, an
Edge over the fake backend) give the same answers and the same errors; a server that hangs up
is retried the same number of times by both; a choice that cannot work is refused when the
client is made."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from typing import Any

import httpx
import pytest
import uvicorn

import libdsec
from dsec.apiserver.app import Cluster
from dsec.app import create_app
from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from dsec.local import free_port
from libdsec import DSecClient, DSecContainerRunArgs, SyncDSecClient
from libdsec._transport import HttpxTransport
from libdsec._wire import WireClient

TOKEN = "one-path-token"
TRANSPORTS = ("wire", "httpx")
# What differs from one sandbox to the next, whichever transport made it.
VOLATILE = {"id", "created_at", "last_active_at", "started_at", "ended_at", "create_s"}


def _args(**kw: Any) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(**{"container_image": "tiny", "memory_limit_mb": 64, **kw})


@pytest.fixture
async def endpoint(tmp_path, store):
    """A real apiserver over one real edge (fake backend), served by uvicorn on a free port."""
    edge = Edge(EdgeConfig(node_dir=tmp_path / "n0", node="n0", pool_min=0, pool_max=0), FakeBackend(), store)
    await edge.start()
    app = create_app(Cluster([edge], rng=random.Random(0)), TOKEN)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        assert server.started, "the apiserver did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.to_thread(thread.join, 10)
        await edge.close()


def _info(info: libdsec.SandboxInfo) -> dict:
    return info.model_dump(mode="json", exclude=VOLATILE)


def _error(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)


async def _calls(client: DSecClient) -> list[Any]:
    """Every kind of call (a request read whole, a stream, an error answer of each), what each
    gave in an order both transports follow; sandbox ids replaced by their place."""
    seen: list[Any] = []
    ids: dict[str, str] = {}

    def said(value: Any) -> None:
        text = repr(value)
        for sid, name in ids.items():
            text = text.replace(sid, name)
        seen.append(text)

    async def attempt(call) -> None:
        try:
            said(await call())
        except libdsec.DSecError as exc:
            said(_error(exc))

    sandbox = await client.run_container(_args())
    ids[sandbox.id] = "<first>"
    said(_info(sandbox.info))
    said(_info((await client.get_sandbox(sandbox.id)).info))
    result = await sandbox.run_shell("echo hi; echo oops >&2")
    said((result.exit_code, result.stdout, result.stderr))
    said([(e.event, e.data) for e in [event async for event in sandbox.stream_shell("echo streamed")]])
    await sandbox.write_file("/tmp/f", b"\x00bytes\xff")
    said(await sandbox.read_file("/tmp/f"))
    said(sorted(_info(i)["status"] for i in await client.list_sandboxes()))
    batch = await client.run_containers(_args(), count=3)
    for i, made in enumerate(batch):
        ids[made.id] = f"<batch {i}>"
    said([_info(s.info) for s in batch])
    said([n.model_dump(mode="json", include={"node"}) for n in await client.node_info()])
    # Error answers: each is the same exception with the same message through both.
    await attempt(lambda: client.get_sandbox("n0-00000000deadbeef"))
    await attempt(lambda: client.get_sandbox("not an id"))
    await attempt(lambda: sandbox.read_file("/no/such/file"))
    await attempt(lambda: client.run_container(_args(container_image="no-such-image")))
    await attempt(lambda: client.run_containers(_args(container_image="no-such-image"), count=2))
    await attempt(lambda: client.run_containers(_args(memory_limit_mb=10**9), count=2))
    await sandbox.stop()
    await attempt(lambda: sandbox.run_shell("echo after"))
    for made in batch:
        await made.stop()
    said(sorted(_info(i)["status"] for i in await client.list_sandboxes()))
    return seen


async def test_both_transports_give_the_same_answers_and_errors(endpoint):
    answers = {}
    for transport in TRANSPORTS:
        async with DSecClient(endpoint, token=TOKEN, transport=transport) as client:
            kind = type(client._transport)
            answers[transport] = await _calls(client)
        assert kind is {"wire": WireClient, "httpx": HttpxTransport}[transport]
    assert answers["wire"] == answers["httpx"]
    errors = [a for a in answers["wire"] if a.startswith("('")]
    assert len(errors) == 7, errors  # every error case above was an error, on both
    assert any("SandboxNotFound" in e for e in errors) and any("SandboxStateError" in e for e in errors)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_wrong_token_is_the_same_error(endpoint, transport):
    async with DSecClient(endpoint, token="wrong", transport=transport) as client:
        with pytest.raises(libdsec.Unauthenticated) as refused:
            await client.list_sandboxes()
        with pytest.raises(libdsec.Unauthenticated):
            await client.run_containers(_args(), count=2)  # a stream's error answer too
    assert "token" in str(refused.value)


def test_the_sync_twin_over_both_transports(endpoint):
    outputs = []
    for transport in TRANSPORTS:
        with SyncDSecClient(endpoint, token=TOKEN, transport=transport) as client:
            with client.run_container(_args()) as sandbox:
                outputs.append(sandbox.run_shell("echo twin").stdout)
            with pytest.raises(libdsec.SandboxNotFound):
                client.get_sandbox("n0-00000000deadbeef")
    assert outputs == ["twin\n", "twin\n"]


class _LoopbackServer:
    """A hand-written server on 127.0.0.1 (``async with`` gives its endpoint); ``_serve`` is
    each connection's."""

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One request read whole (its body by Content-Length); its head is returned."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)
    return head


class HangUp(_LoopbackServer):
    """Reads each request and closes the connection without an answer; counts them."""

    def __init__(self) -> None:
        self.requests = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _read_request(reader)
            self.requests += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_server_that_hangs_up_is_retried_alike(transport):
    hang_up = HangUp()
    async with hang_up as endpoint:
        async with DSecClient(endpoint, token=TOKEN, transport=transport, retries=2, retry_backoff_s=0.01) as client:
            with pytest.raises(libdsec.ServerUnavailable, match="cannot reach DSec"):
                await client.list_sandboxes()  # a read: safe to send again, 1 + 2 retries
            reads = hang_up.requests
            with pytest.raises(libdsec.ServerUnavailable):
                await client.run_container(_args())  # a create without a key: sent once
            with pytest.raises(libdsec.ServerUnavailable):
                await client.run_containers(_args(), count=2, key="batch-1")  # keyed: sent again
    assert (reads, hang_up.requests) == (3, 3 + 1 + 3)


class Busy(_LoopbackServer):
    """Answers ``refusals`` requests with 429 ``overloaded`` (a short ``retry_after``), then
    each with ``[]``; streams as one NDJSON error line."""

    def __init__(self, refusals: int) -> None:
        self.refusals, self.requests = refusals, []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await _read_request(reader)
                self.requests.append(head.split(b" ")[1].decode())
                if len(self.requests) <= self.refusals:
                    status, body = "429 Too Many Requests", libdsec.Overloaded("busy here", retry_after=0.01).to_wire()
                else:
                    status, body = "200 OK", []
                data = json.dumps(body).encode()
                writer.write(f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
                             f"content-length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_overloaded_answer_is_retried_alike(transport):
    busy = Busy(refusals=2)
    async with busy as endpoint:
        async with DSecClient(endpoint, token=TOKEN, transport=transport, retries=2, retry_backoff_s=0.01) as client:
            assert await client.node_info() == []  # two refusals, then the answer
    assert busy.requests == ["/v1/nodes"] * 3
    busy = Busy(refusals=10)
    async with busy as endpoint:
        async with DSecClient(endpoint, token=TOKEN, transport=transport, retries=2, retry_backoff_s=0.01) as client:
            with pytest.raises(libdsec.Overloaded, match="busy here"):
                await client.node_info()
            with pytest.raises(libdsec.Overloaded, match="busy here"):
                await client.run_containers(_args(), count=2)  # a create without a key: sent once
            with pytest.raises(libdsec.Overloaded, match="busy here"):
                await client.run_containers(_args(), count=2, key="b-1")  # keyed: a stream retried the same
    assert busy.requests == ["/v1/nodes"] * 3 + ["/v1/sandboxes:batch"] * 4


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_nobody_listening_is_server_unavailable(transport):
    async with DSecClient(f"http://127.0.0.1:{free_port()}", token=TOKEN, transport=transport) as client:
        with pytest.raises(libdsec.ServerUnavailable, match="cannot reach DSec at http://127.0.0.1"):
            await client.list_sandboxes()
        with pytest.raises(libdsec.ServerUnavailable, match="cannot reach DSec at http://127.0.0.1"):
            await client.run_containers(_args(), count=2)


def test_a_transport_that_cannot_serve_is_refused_when_made():
    with pytest.raises(libdsec.InvalidRequest, match="transport='httpx'"):
        DSecClient("https://dsec.example:8765", token=TOKEN, transport="wire")
    with pytest.raises(libdsec.InvalidRequest, match="plain http://"):
        DSecClient("http://a:1,https://b:2", token=TOKEN, transport="wire")
    with pytest.raises(libdsec.InvalidRequest, match="not 'wire', 'httpx'"):
        DSecClient("http://a:1", token=TOKEN, transport="h2")
    with pytest.raises(libdsec.InvalidRequest, match="not 'wire', 'httpx'"):
        DSecClient("http://a:1", token=TOKEN, transport=object())


async def test_the_default_is_the_lean_client_for_http_and_httpx_for_https():
    client = DSecClient("http://127.0.0.1:1,https://127.0.0.1:2", token=TOKEN)
    await client.open()
    try:
        kinds = {endpoint: type(t) for endpoint, t in client._transports.items()}
    finally:
        await client.close()
        await client.close()  # a second close does nothing
    assert kinds == {"http://127.0.0.1:1": WireClient, "https://127.0.0.1:2": HttpxTransport}
    async with DSecClient("http://api", transport=httpx.MockTransport(lambda r: httpx.Response(200, json=[]))) as mock:
        assert isinstance(mock._transport, HttpxTransport) and await mock.node_info() == []
