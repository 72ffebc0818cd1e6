"""The SDK's lean HTTP/1.1 client (libdsec/_wire.py) against small servers on 127.0.0.1 that
answer by hand, so each test decides how the server frames its answer and when it hangs up."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from libdsec import DSecClient, LimitOutOfRange, ServerUnavailable
from libdsec._wire import WireClient, WireError


class Server:
    """Reads requests (headers, then Content-Length bytes) and answers each with ``answer``."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.connections = 0

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *fields = head.decode().split("\r\n")
                headers = {k.lower(): v.strip() for k, _, v in (f.partition(":") for f in fields if f)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.requests.append((line, headers, body))
                if not await self.answer(writer, line, body):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _unused_port() -> int:
    """A port on 127.0.0.1 nobody listens on (bound a moment, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _json(writer: asyncio.StreamWriter, status: int, body: object) -> None:
    data = json.dumps(body).encode()
    writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n".encode()
                 + data)


async def test_keeps_the_connection_and_sends_body_query_and_token() -> None:
    async def answer(writer, line, body):
        _json(writer, 200, {"line": line, "body": body.decode()})
        return True

    async with Server(answer) as srv:
        wire = WireClient(f"http://127.0.0.1:{srv.port}", {"authorization": "Bearer t0k"}, 4)
        for i in range(3):
            got = await wire.request("POST", "/v1/x", params={"path": "/a b"}, body=f"{i}".encode(),
                                     content_type="application/json", timeout=5)
            assert got.status_code == 200
            assert got.json() == {"line": "POST /v1/x?path=%2Fa+b HTTP/1.1", "body": str(i)}
        await wire.aclose()
    assert srv.connections == 1  # one keep-alive connection for all three
    _, headers, _ = srv.requests[0]
    assert headers["authorization"] == "Bearer t0k"
    assert headers["content-type"] == "application/json"
    assert headers["host"] == f"127.0.0.1:{srv.port}"


async def test_a_burst_leaves_at_most_max_idle_open_and_expired_ones_are_closed(monkeypatch) -> None:
    async def answer(writer, line, body):
        await asyncio.sleep(0.05)  # the burst's requests overlap: each needs a connection
        _json(writer, 200, {})
        return True

    async with Server(answer) as srv:
        wire = WireClient(f"http://127.0.0.1:{srv.port}", {}, 64, max_idle=4)
        await asyncio.gather(*(wire.request("GET", "/x", timeout=5) for _ in range(20)))
        assert srv.connections == 20 and len(wire._idle) == 4  # the other 16 were closed
        await wire.request("GET", "/x", timeout=5)
        assert srv.connections == 20  # one of the kept ones was used
        wire._idle_expiry_s = 0.0  # now all of them have expired
        await wire.request("GET", "/x", timeout=5)
        assert srv.connections == 21 and len(wire._idle) == 1  # the expired ones closed, the new one kept
        await wire.aclose()


async def test_reads_a_chunked_answer_and_an_error_status() -> None:
    async def answer(writer, line, body):
        if "/fail" in line:
            _json(writer, 404, {"error": "not_found"})
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        return True

    async with Server(answer) as srv:
        wire = WireClient(f"http://127.0.0.1:{srv.port}", {}, 4)
        got = await wire.request("GET", "/chunked", timeout=5)
        assert (got.status_code, got.content) == (200, b"hello world")
        got = await wire.request("GET", "/fail", timeout=5)
        assert (got.status_code, got.json()) == (404, {"error": "not_found"})
        await wire.aclose()
    assert srv.connections == 1


async def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async def answer(writer, line, body):  # answers once, then hangs up (a keep-alive expiry)
        _json(writer, 200, {"ok": True})
        await writer.drain()
        return False

    async with Server(answer) as srv:
        wire = WireClient(f"http://127.0.0.1:{srv.port}", {}, 4)
        for _ in range(3):
            assert (await wire.request("GET", "/", timeout=5)).json() == {"ok": True}
        await wire.aclose()
    assert srv.connections == 3
    assert len(srv.requests) == 3  # each request reached the server once


async def test_a_server_that_breaks_off_mid_answer_is_an_error() -> None:
    async def answer(writer, line, body):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        return False

    async with Server(answer) as srv:
        wire = WireClient(f"http://127.0.0.1:{srv.port}", {}, 4)
        with pytest.raises(WireError, match="broke off"):
            await wire.request("GET", "/", timeout=5)
        await wire.aclose()
    assert len(srv.requests) == 1  # not sent again: the server had begun to answer


async def test_timeout_and_refused_connection_are_errors() -> None:
    async def answer(writer, line, body):
        await asyncio.sleep(10)
        return False

    async with Server(answer) as srv:
        wire = WireClient(f"http://127.0.0.1:{srv.port}", {}, 4)
        with pytest.raises(WireError, match="within 0.2s"):
            await wire.request("GET", "/slow", timeout=0.2)
        await wire.aclose()
    wire = WireClient(f"http://127.0.0.1:{_unused_port()}", {}, 4)
    with pytest.raises(WireError, match="cannot connect"):
        await wire.request("GET", "/", timeout=5)


async def test_the_sdk_maps_wire_failures_and_errors() -> None:
    async def answer(writer, line, body):
        _json(writer, 400, {"error": {"code": "limit_out_of_range", "message": "memory_limit_mb out of range"}})
        return True

    async with Server(answer) as srv:
        async with DSecClient(f"http://127.0.0.1:{srv.port}", token="t") as client:
            with pytest.raises(LimitOutOfRange, match="memory_limit_mb"):
                await client.list_images()
    async with DSecClient(f"http://127.0.0.1:{_unused_port()}", token="t") as client:
        with pytest.raises(ServerUnavailable, match="cannot reach DSec"):
            await client.list_images()


def test_only_plain_http() -> None:
    with pytest.raises(ValueError, match="plain http"):
        WireClient("https://127.0.0.1:1", {}, 1)


async def test_a_chunked_answer_and_one_that_closes_are_read_whole() -> None:
    """The answer's framing is the parser's business: chunks are joined, and an answer that
    says ``connection: close`` leaves its connection out of the idle ones."""
    async def answer(writer, line, body):
        if line.startswith("GET /chunked"):
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
            return True
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        return False

    async with Server(answer) as srv:
        wire = WireClient(f"http://127.0.0.1:{srv.port}", {}, 4)
        assert (await wire.request("GET", "/chunked", timeout=5)).content == b"abcde"
        assert (await wire.request("GET", "/close", timeout=5)).content == b"ok"
        assert (await wire.request("GET", "/close", timeout=5)).content == b"ok"
        await wire.aclose()
    assert srv.connections == 2  # the chunked answer's connection was kept; each close one was not


async def test_nothing_the_caller_passes_can_end_a_line_of_the_head() -> None:
    with pytest.raises(ValueError, match="header"):
        WireClient("http://127.0.0.1:1", {"authorization": "Bearer x\r\nx-evil: 1"}, 4)
    wire = WireClient("http://127.0.0.1:1", {}, 4)
    # What is no visible ASCII in a path is percent-encoded (UTF-8), as httpx does it.
    for path, target in (("/v1/sandboxes/a b", "/v1/sandboxes/a%20b"), ("/v1/x\r\nx-evil: 1", "/v1/x%0D%0Ax-evil:%201"),
                         ("/v1/ü", "/v1/%C3%BC")):
        head = wire._request_bytes("GET", path, None, None, None).split(b"\r\n")
        assert head[0] == f"GET {target} HTTP/1.1".encode() and not any(line.startswith(b"x-evil") for line in head)
    with pytest.raises(WireError, match="cannot send the header"):
        await wire.request("GET", "/v1/x", timeout=1, headers={"x-key": "a\r\nx-evil: 1"})
    await wire.aclose()


async def test_a_stream_is_read_as_it_arrives_and_its_connection_kept_once_read_to_its_end() -> None:
    go_on = asyncio.Event()

    async def answer(writer, line, body):
        if "/fail" in line:
            _json(writer, 409, {"error": "busy"})
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nline1\n\r\n")
        await writer.drain()
        await go_on.wait()  # the first piece is in the caller's hands before the rest is sent
        if "/broken" in line:
            return False
        writer.write(b"6\r\nline2\n\r\n0\r\n\r\n")
        return True

    async with Server(answer) as srv:
        wire = WireClient(f"http://127.0.0.1:{srv.port}", {}, 4)
        async with wire.stream("POST", "/batch", body=b"{}", content_type="application/json", timeout=5) as answer_:
            assert answer_.status_code == 200
            pieces = []
            async for chunk in answer_.chunks():
                pieces.append(chunk)
                go_on.set()
        assert pieces == [b"line1\n", b"line2\n"] and len(wire._idle) == 1
        async with wire.stream("POST", "/fail", body=b"{}", timeout=5) as answer_:
            assert (answer_.status_code, await answer_.read()) == (409, b'{"error": "busy"}')
        go_on.clear()
        with pytest.raises(WireError, match="broke off"):
            async with wire.stream("POST", "/broken", body=b"{}", timeout=5) as answer_:
                async for chunk in answer_.chunks():
                    go_on.set()
        go_on.clear()
        async with wire.stream("POST", "/batch", body=b"{}", timeout=5) as answer_:
            pass  # left before its end: its connection is closed, not kept
        assert len(wire._idle) == 0
        go_on.set()
        await wire.aclose()
    assert srv.connections == 2  # the first one served /batch, /fail and /broken


async def test_an_exchange_leaves_no_garbage_cycle() -> None:
    """Each answer's parser called back into its reading, a reference cycle an exchange that only
    the collector's full passes freed: a client making thousands of calls then stalled for
    hundreds of ms at a time. Answers read whole and streamed leave nothing for the collector."""
    import gc

    async def answer(writer, line, body):
        _json(writer, 200, {"ok": True})
        return True

    async with Server(answer) as srv:
        wire = WireClient(f"http://127.0.0.1:{srv.port}", {}, 4)
        await wire.request("GET", "/warm", timeout=5)  # first-use allocations out of the way
        gc.collect()
        gc.disable()
        try:
            for _ in range(50):
                assert (await wire.request("GET", "/v1/x", timeout=5)).status_code == 200
                async with wire.stream("GET", "/v1/s", timeout=5) as stream:
                    assert json.loads(await stream.read()) == {"ok": True}
            found = gc.collect()
        finally:
            gc.enable()
        await wire.aclose()
    assert found < 10, f"{found} objects in reference cycles after 100 exchanges"


def test_a_sandbox_handle_is_no_reference_cycle() -> None:
    import gc
    from datetime import datetime, timezone

    from libdsec import Sandbox
    from libdsec.protocol import SandboxInfo, SandboxStatus

    now = datetime.now(timezone.utc)
    info = SandboxInfo(id="x", kind="container", node="n", image="i", status=SandboxStatus.running, created_at=now,
                       last_active_at=now, memory_limit_mb=64, cpu_cores_limit=1.0, ttl_running_stop=60.0,
                       init_user="root", workdir="/")
    client = DSecClient("http://127.0.0.1:1", token="t")
    gc.collect()
    gc.disable()
    try:
        for _ in range(100):
            sandbox = Sandbox(client, info)
            assert sandbox.files is not sandbox.files  # made on each use, not kept
        del sandbox
        found = gc.collect()
    finally:
        gc.enable()
    assert found == 0, f"{found} objects in reference cycles after 100 sandbox handles"
