"""The port lane (``dsec.apiserver.portlane``) over real sockets: uvicorn with the lane's
protocol, an Edge over the fake backend (whose sandboxes' ports are the node's loopback), and
the benchmark's standard-library server as the server "inside". Raw sockets on the client side,
to see each byte of keep-alive, pipelining and the answers' framing."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import random
import subprocess
import sys

import pytest
import uvicorn

from dsec.apiserver.app import Cluster
from dsec.apiserver.portlane import lane_protocol
from dsec.app import create_app
from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from dsec.local import free_port
from dsec_bench.ports import APP_SERVER
from libdsec import DSecClient, DSecContainerRunArgs

TOKEN = "lane-token"


@pytest.fixture(scope="module")
def inside():
    """The server "inside" (its port: the fake sandbox's port)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", APP_SERVER, str(port)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        yield port
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
async def api(tmp_path, store):
    """(apiserver port, SDK client) of a real apiserver served by uvicorn with the lane."""
    edge = Edge(EdgeConfig(node_dir=tmp_path / "n0", node="n0", pool_min=0, pool_max=0), FakeBackend(), store)
    await edge.start()
    app = create_app(Cluster([edge], rng=random.Random(0)), TOKEN, domain="localhost")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off",
                                           http=lane_protocol(app.state.port_lane)))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        async with DSecClient(f"http://127.0.0.1:{port}", token=TOKEN) as client:
            yield port, client
    finally:
        server.should_exit = True
        await task
        app.state.port_lane.close()
        await edge.close()


async def _sandbox(client: DSecClient):
    return await client.run_container(DSecContainerRunArgs(container_image="tiny", memory_limit_mb=64))


class Conn:
    """One raw client connection; ``answer()`` reads one answer (Content-Length or chunked)."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    def send(self, *heads: str, body: bytes = b"") -> None:
        self.writer.write(b"".join(h.encode() for h in heads) + body)

    async def answer(self, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        if head_only:
            body = b""
        elif headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int((await self.reader.readline()).split(b";")[0], 16):
                body += await self.reader.readexactly(size)
                await self.reader.readexactly(2)
            await self.reader.readline()
        else:
            body = await self.reader.readexactly(int(headers.get("content-length", 0)))
        return status, headers, body

    async def ended(self) -> bool:
        return await asyncio.wait_for(self.reader.read(1), 10) == b""

    def close(self) -> None:
        self.writer.close()


def _get(path: str, host: str = "api", **headers: str) -> str:
    return f"GET {path} HTTP/1.1\r\nhost: {host}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"


async def test_keep_alive_strips_credentials_on_every_request(api, inside):
    """port_url and a host name, each over one kept connection: every request's credentials are
    taken out (not only the first's), the Host is the one the server is to see, and the
    requests share one connection to the port."""
    port, client = api
    sandbox = await _sandbox(client)
    basic = base64.b64encode(f"user:{TOKEN}".encode()).decode()
    conn = await Conn.open(port)
    try:
        ports_seen = set()
        for i in range(4):
            conn.send(_get(f"/v1/sandboxes/{sandbox.id}/ports/{inside}/headers", authorization=f"Bearer {TOKEN}",
                           x_other=f"v{i}".replace("_", "-")))
            status, _, body = await conn.answer()
            assert status == 200, body
            seen = body.decode().lower()
            assert TOKEN not in seen and "authorization" not in seen, seen
            assert f"host: 127.0.0.1:{inside}" in seen
            conn.send(_get(f"/v1/sandboxes/{sandbox.id}/ports/{inside}/conn", authorization=f"Bearer {TOKEN}"))
            ports_seen.add((await conn.answer())[2])
        assert len(ports_seen) == 1  # one connection to the port, kept
        # Then, on the same connection, an API call goes to the API (the lane hands it back) ...
        conn.send(_get(f"/v1/sandboxes/{sandbox.id}", authorization=f"Bearer {TOKEN}"))
        status, _, body = await conn.answer()
        assert status == 200 and json.loads(body)["id"] == sandbox.id
        # ... and a port's request after it to the port again.
        conn.send(_get(f"/v1/sandboxes/{sandbox.id}/ports/{inside}/", authorization=f"Bearer {TOKEN}"))
        assert b"hello from the sandbox" in (await conn.answer())[2]
    finally:
        conn.close()

    host = f"{inside}-{sandbox.id}.localhost:{port}"
    conn = await Conn.open(port)
    try:
        for header in ({"x-api-key": TOKEN}, {"authorization": f"Basic {basic}"},
                       {"e2b-traffic-access-token": TOKEN}, {"authorization": f"Bearer {TOKEN}"},
                       {"authorization": f"Bearer {TOKEN}", "x-api-key": TOKEN}):
            conn.send(_get("/headers", host=host, **header))
            status, _, body = await conn.answer()
            assert status == 200, body
            seen = body.decode().lower()
            assert TOKEN not in seen and basic.lower() not in seen, seen
            assert f"host: {host}" in seen
        # A request without a token on the same connection: E2B's 401, the connection kept.
        conn.send(_get("/headers", host=host))
        status, headers, body = await conn.answer()
        assert status == 401 and json.loads(body)["code"] == 401 and "basic" in headers["www-authenticate"].lower()
        conn.send(_get("/headers", host=host, authorization=f"Bearer {TOKEN}"))
        assert (await conn.answer())[0] == 200
    finally:
        conn.close()


async def test_pipelined_requests_and_bodies(api, inside):
    """Two requests in one write get their two answers in order; bodies (a length, chunked) go
    on whole; a HEAD's answer has no body; an answer streamed comes as it is written."""
    port, client = api
    sandbox = await _sandbox(client)
    base = f"/v1/sandboxes/{sandbox.id}/ports/{inside}"
    auth = f"authorization: Bearer {TOKEN}\r\n"
    conn = await Conn.open(port)
    try:
        data = b"x" * 100_000
        conn.send(f"GET {base}/conn HTTP/1.1\r\nhost: a\r\n{auth}\r\n"
                  f"POST {base}/sum HTTP/1.1\r\nhost: a\r\n{auth}content-length: {len(data)}\r\n\r\n", body=data)
        first, second = await conn.answer(), await conn.answer()
        assert first[0] == 200 and first[2].isdigit()
        assert second[2].decode() == f"{hashlib.sha256(data).hexdigest()} {len(data)}"
        chunked = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        conn.send(f"POST {base}/sum HTTP/1.1\r\nhost: a\r\n{auth}transfer-encoding: chunked\r\n\r\n", body=chunked)
        assert (await conn.answer())[2].decode() == f"{hashlib.sha256(b'hello world').hexdigest()} 11"
        conn.send(f"HEAD {base}/ HTTP/1.1\r\nhost: a\r\n{auth}\r\n", f"GET {base}/ts HTTP/1.1\r\nhost: a\r\n{auth}\r\n")
        status, headers, body = await conn.answer(head_only=True)
        assert status == 200 and int(headers["content-length"]) > 0
        status, _, body = await conn.answer()
        assert status == 200 and float(body)  # (the chunked /ts: a stamp)
        # Malformed framing is refused, and the connection closed.
        conn.send(f"POST {base}/sum HTTP/1.1\r\nhost: a\r\n{auth}transfer-encoding: gzip\r\n\r\n")
        status, _, body = await conn.answer()
        assert status == 422 and b"malformed request" in body
        assert await conn.ended()
    finally:
        conn.close()
    # A connection's first request (checked before it goes on) with its body in the same write:
    # the body goes on whole; a chunked body that is not is refused before any of it goes.
    for body, expected in ((chunked, (200, f"{hashlib.sha256(b'hello world').hexdigest()} 11".encode())),
                           (b"zz\r\nhello\r\n0\r\n\r\n", (422, b"a chunk's size is not hex"))):
        conn = await Conn.open(port)
        try:
            conn.send(f"POST {base}/sum HTTP/1.1\r\nhost: a\r\n{auth}transfer-encoding: chunked\r\n\r\n", body=body)
            status, _, answer = await conn.answer()
            assert status == expected[0] and expected[1] in answer, answer
        finally:
            conn.close()


async def test_a_sandbox_killed_between_requests_of_a_kept_connection(api, inside):
    """The kept connection's next request gets the sandbox's own error, clearly, and the
    server goes on serving; the same for a token that is wrong on the second request."""
    port, client = api
    sandbox = await _sandbox(client)
    other = await _sandbox(client)
    conn = await Conn.open(port)
    try:
        conn.send(_get(f"/v1/sandboxes/{sandbox.id}/ports/{inside}/conn", authorization=f"Bearer {TOKEN}"))
        assert (await conn.answer())[0] == 200
        conn.send(_get(f"/v1/sandboxes/{sandbox.id}/ports/{inside}/conn", authorization="Bearer wrong"))
        status, _, body = await conn.answer()
        assert status == 401 and json.loads(body)["error"]["code"] == "unauthenticated"
        await client.stop_sandbox(sandbox.id)
        conn.send(_get(f"/v1/sandboxes/{sandbox.id}/ports/{inside}/conn", authorization=f"Bearer {TOKEN}"))
        status, _, body = await conn.answer()
        assert status in (404, 409), body
        assert sandbox.id in json.loads(body)["error"]["message"]
        # The same connection, another sandbox: served.
        conn.send(_get(f"/v1/sandboxes/{other.id}/ports/{inside}/conn", authorization=f"Bearer {TOKEN}"))
        assert (await conn.answer())[0] == 200
        # By host name, the error is E2B's.
        await client.stop_sandbox(other.id)
        conn.send(_get("/conn", host=f"{inside}-{other.id}.localhost", authorization=f"Bearer {TOKEN}"))
        status, _, body = await conn.answer()
        assert status in (404, 409) and set(json.loads(body)) == {"code", "message"}
    finally:
        conn.close()


async def test_websocket_and_a_port_with_nothing(api, inside):
    """A WebSocket handshake goes through and the connection is then the WebSocket's; a port
    where nothing listens answers port_unreachable and the connection goes on."""
    from websockets.asyncio.client import connect

    port, client = api
    sandbox = await _sandbox(client)
    url = f"ws://127.0.0.1:{port}/v1/sandboxes/{sandbox.id}/ports/{inside}/ws"
    async with connect(url, additional_headers={"authorization": f"Bearer {TOKEN}"}) as ws:
        for i in range(3):
            await ws.send(f"m{i}")
            assert await ws.recv() == f"echo:m{i}"
        await ws.send(b"abc")
        assert await ws.recv() == b"cba"
    conn = await Conn.open(port)
    try:
        conn.send(_get(f"/v1/sandboxes/{sandbox.id}/ports/{free_port()}/", authorization=f"Bearer {TOKEN}"))
        status, _, body = await conn.answer()
        assert status == 502 and json.loads(body)["error"]["code"] == "port_unreachable"
        conn.send(_get(f"/v1/sandboxes/{sandbox.id}/ports/70000/", authorization=f"Bearer {TOKEN}"))
        status, _, body = await conn.answer()
        assert status == 422 and "70000" in json.loads(body)["error"]["message"]
        # An error answer to HEAD has its length and no body: the next answer is read whole.
        conn.send(f"HEAD /v1/sandboxes/xyz/ports/{inside}/ HTTP/1.1\r\nhost: api\r\nauthorization: Bearer {TOKEN}\r\n\r\n")
        status, headers, _ = await conn.answer(head_only=True)
        assert status == 422 and int(headers["content-length"]) > 0
        conn.send(_get(f"/v1/sandboxes/{sandbox.id}/ports/{inside}/", authorization=f"Bearer {TOKEN}"))
        assert (await conn.answer())[0] == 200
    finally:
        conn.close()
