"""A lean HTTP/1.1 client for the SDK's own requests to an apiserver over plain ``http://``.

httpx spends several times the CPU on a request that the server spends answering it: its connection
pool polls every idle connection and rescans every queued request each time one is sent or done,
and each request passes through URL merging, cookie extraction and an auth flow the SDK does not
use. The SDK's requests all have one shape (a method, a path with an optional query, a JSON or
bytes body, one bearer token, an answer read whole), so they go through this client instead: idle
keep-alive connections on a stack, each request's head written out directly (its header values
checked first, its path percent-encoded as httpx would where it is not visible ASCII), each answer
read by httptools (the C HTTP parser under uvicorn). h11, which
framed both before, took a sizeable share of what a warm create costs the client in all; httptools
a small part of that (docs/BENCHMARKS.md, "Lifecycle", has the client's CPU a lifecycle). A batch
create's NDJSON answer is read as it arrives (``stream``): httpx's line iterator and its stream
machinery cost the client more than parsing each line. It is the SDK's ``transport="wire"``
(``_transport.py``, where httpx is the other); ``https://`` goes through httpx. (The apiserver
reaches its nodes through this client too: ``dsec.edge.remote``.)
"""

from __future__ import annotations

import asyncio
import json
import re
import select
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import httptools

# Close connections idle this long: well below any server's keep-alive (uvicorn's default is
# 5 s; `dsec serve` keeps them 75 s), so a request never leaves on a connection being closed.
IDLE_EXPIRY_S = 4.0
_READ_SIZE = 65536
# What a request target and a header value may hold: visible ASCII (and, in a value, spaces
# and tabs), so that nothing the caller passes can end a line of the request's head.
_TARGET = re.compile(r"[!-~]+")
_VALUE = re.compile(r"[\t -~]*")
_VISIBLE = "".join(map(chr, range(0x21, 0x7F)))


class WireError(Exception):
    """The server could not be reached, broke off the exchange, or did not answer in time."""


class CannotConnect(WireError):
    """No connection could be made: the request never left."""


class ConnectionBroken(WireError):
    """The connection closed or broke before the whole answer came: the request may have
    reached the server."""


@dataclass(slots=True)
class Answer:
    status_code: int
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class _Connection:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def fresh(self, now: float, expiry_s: float) -> bool:
        return now - self.idle_since < expiry_s

    def usable(self, now: float, expiry_s: float) -> bool:
        return self.fresh(now, expiry_s) and not self.reader.at_eof() and not self.writer.is_closing()

    def peer_closed(self) -> bool:
        """Whether the kernel holds something to read on this idle connection (the server's
        end of it, which the event loop may not have seen yet): one poll(2)."""
        poller = select.poll()
        poller.register(self.writer.get_extra_info("socket").fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        self.writer.close()


class _Reading:
    """What httptools hands over of one answer."""

    __slots__ = ("parser", "parts", "complete", "keep_alive")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.parts: list[bytes] = []
        self.complete = False
        self.keep_alive = False

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)

    def on_message_complete(self) -> None:
        # Asked here: once the message is done the parser starts on the next one.
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True


class _StreamReading(_Reading):
    __slots__ = ("head_done",)

    def __init__(self) -> None:
        super().__init__()
        self.head_done = False

    def on_headers_complete(self) -> None:
        self.head_done = True


class Stream:
    """An answer read as it arrives (``WireClient.stream``): its status once the head is in,
    then its body in the pieces it arrives in, each read bounded by the stream's timeout."""

    def __init__(self, conn: _Connection, reading: _StreamReading, timeout: float) -> None:
        self._conn, self._reading, self._timeout = conn, reading, timeout
        self.status_code = reading.parser.get_status_code()

    async def chunks(self) -> AsyncIterator[bytes]:
        reading = self._reading
        while True:
            if reading.parts:
                data = b"".join(reading.parts)
                reading.parts.clear()
                yield data
            if reading.complete:
                return
            try:
                async with asyncio.timeout(self._timeout):
                    chunk = await self._conn.reader.read(_READ_SIZE)
            except TimeoutError:
                raise WireError(f"the server sent nothing for {self._timeout:g}s") from None
            except OSError as exc:
                raise ConnectionBroken(f"the server broke off its answer: {exc!r}") from exc
            if not chunk:
                raise ConnectionBroken("the server broke off its answer: it closed the connection")
            try:
                reading.parser.feed_data(chunk)
            except httptools.HttpParserError as exc:
                raise WireError(f"the server broke off its answer: {exc!r}") from exc

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])


class WireClient:
    """Requests to one ``http://host:port`` with at most ``max_connections`` in flight at once,
    and at most ``max_idle`` (default ``max_connections``) kept open between them.

    ``check_idle``: before an idle connection is used again, ask the kernel whether the server
    closed it (one poll(2) a request). Then a request sent on it that gets no answer was read
    by a server that went away, so it may have reached it, and the failure says so
    (``ConnectionBroken``, not ``CannotConnect``): for a client that would send it to another
    server."""

    def __init__(self, endpoint: str, headers: dict[str, str], max_connections: int,
                 max_idle: int | None = None, *, check_idle: bool = False,
                 idle_expiry_s: float = IDLE_EXPIRY_S) -> None:
        url = urlsplit(endpoint)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"not a plain http endpoint: {endpoint!r}")
        self._host = url.hostname
        self._port = url.port or 80
        self._prefix = url.path.rstrip("/")
        netloc = url.netloc.rsplit("@", 1)[-1]
        lines = [("host", netloc), ("user-agent", "libdsec"), *((k.lower(), v) for k, v in headers.items())]
        for name, value in lines:
            if not _TARGET.fullmatch(name) or ":" in name or not _VALUE.fullmatch(value):
                raise ValueError(f"cannot send the header {name!r}: {value!r} (visible ASCII only)")
        self._head = "".join(f"{name}: {value}\r\n" for name, value in lines)
        # Most recently used last; a burst's extra connections sink to the front, expire there
        # and are closed (else an apiserver's pool to each of 160 nodes kept every connection
        # its busiest moment opened: 256 stops in flight to one node at a time ran it out of
        # file descriptors).
        self._idle: deque[_Connection] = deque()
        self._max_idle = max_connections if max_idle is None else max_idle
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False
        self._check_idle = check_idle
        self._idle_expiry_s = idle_expiry_s

    def _request_bytes(self, method: str, path: str, params: dict[str, str] | None, body: bytes | None,
                       content_type: str | None, headers: dict[str, str] | None = None) -> bytes:
        if self._closed:
            raise WireError("client is closed")
        target = self._prefix + path + (f"?{urlencode(params)}" if params else "")
        if not _TARGET.fullmatch(target):
            # Spaces, controls and non-ASCII are percent-encoded (UTF-8), as httpx does: the
            # server sees the same path through either transport.
            target = self._prefix + quote(path, safe=_VISIBLE) + (f"?{urlencode(params)}" if params else "")
        head = f"{method} {target} HTTP/1.1\r\n{self._head}"
        for name, value in (headers or {}).items():
            if not _TARGET.fullmatch(name) or ":" in name or not _VALUE.fullmatch(value):
                raise WireError(f"cannot send the header {name!r}: {value!r} (visible ASCII only)")
            head += f"{name}: {value}\r\n"
        if body is not None:
            head += f"content-type: {content_type or 'application/octet-stream'}\r\ncontent-length: {len(body)}\r\n"
        return (head + "\r\n").encode() + (body or b"")

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: bytes | None = None,
        content_type: str | None = None,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        request = self._request_bytes(method, path, params, body, content_type, headers)
        async with self._slots:
            try:
                async with asyncio.timeout(timeout):
                    return await self._exchange(request)
            except TimeoutError:
                raise WireError(f"no answer to {method} {path} within {timeout:g}s") from None

    async def _exchange(self, request: bytes) -> Answer:
        conn = self._take()
        sent = False
        if conn is not None:
            try:
                return await self._send(conn, request)
            except _NoAnswer:
                # The server closed the idle connection as the request left: it never read it
                # (with check_idle, one closed before was not taken: this one went away after).
                sent = self._check_idle
        try:
            reader, writer = await asyncio.open_connection(self._host, self._port)
        except OSError as exc:
            failure = ConnectionBroken if sent else CannotConnect
            raise failure(f"cannot connect to {self._host}:{self._port}: {exc}") from exc
        try:
            return await self._send(_Connection(reader, writer), request)
        except _NoAnswer as exc:
            raise ConnectionBroken(str(exc)) from None

    @asynccontextmanager
    async def stream(self, method: str, path: str, *, body: bytes | None = None, content_type: str | None = None,
                     timeout: float, headers: dict[str, str] | None = None) -> AsyncIterator[Stream]:
        """The answer to one request, read as it arrives (an NDJSON stream): ``async with
        client.stream(…) as answer``, then ``answer.status_code`` and ``answer.chunks()``.
        ``timeout`` bounds the wait for the head and for each piece after it. A stream left
        before its end closes its connection."""
        request = self._request_bytes(method, path, None, body, content_type, headers)
        async with self._slots:
            try:
                async with asyncio.timeout(timeout):
                    conn, reading = await self._open_stream(request)
            except TimeoutError:
                raise WireError(f"no answer to {method} {path} within {timeout:g}s") from None
            try:
                yield Stream(conn, reading, timeout)
            finally:
                if reading.complete and reading.keep_alive and not self._closed and len(self._idle) < self._max_idle:
                    conn.idle_since = time.monotonic()
                    self._idle.append(conn)
                else:
                    conn.close()
                reading.parser = None  # a stream left before its end too: no cycle for the collector

    async def _open_stream(self, request: bytes) -> tuple[_Connection, _StreamReading]:
        conn = self._take()
        if conn is not None:
            try:
                return conn, await self._send_head(conn, request)
            except _NoAnswer:
                pass  # closed as the request left (see _exchange)
        try:
            reader, writer = await asyncio.open_connection(self._host, self._port)
        except OSError as exc:
            raise CannotConnect(f"cannot connect to {self._host}:{self._port}: {exc}") from exc
        conn = _Connection(reader, writer)
        try:
            return conn, await self._send_head(conn, request)
        except _NoAnswer as exc:
            raise ConnectionBroken(str(exc)) from None

    async def _send_head(self, conn: _Connection, request: bytes) -> _StreamReading:
        """Send ``request`` and read until the answer's head is in (and whatever came with it)."""
        reading = _StreamReading()
        await _write_and_read(conn, request, reading, head_only=True)
        return reading

    def _take(self) -> _Connection | None:
        now = time.monotonic()
        idle = self._idle
        expiry = self._idle_expiry_s
        while idle and not idle[0].fresh(now, expiry):
            idle.popleft().close()
        while idle:
            conn = idle.pop()
            if conn.usable(now, expiry) and not (self._check_idle and conn.peer_closed()):
                return conn
            conn.close()
        return None

    async def _send(self, conn: _Connection, request: bytes) -> Answer:
        reading = _Reading()
        parser = reading.parser
        await _write_and_read(conn, request, reading, head_only=False)
        if reading.keep_alive and not self._closed and len(self._idle) < self._max_idle:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
        status = parser.get_status_code()
        reading.parser = None  # the parser calls back into ``reading``: no cycle left for the collector
        return Answer(status, b"".join(reading.parts))

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, deque()
        for conn in idle:
            conn.close()
        for conn in idle:
            try:
                await conn.writer.wait_closed()
            except OSError:
                pass


async def _write_and_read(conn: _Connection, request: bytes, reading: _Reading, head_only: bool) -> None:
    """Send ``request`` on ``conn`` and feed what comes back to ``reading`` until the answer is
    in whole (``head_only``: its head, ``_StreamReading``). Nothing back is ``_NoAnswer`` (it may
    go again on a new connection); a break after that is ``ConnectionBroken``, an answer that is
    no HTTP a ``WireError``. On any failure, a cancel or a timeout, the connection is closed."""
    answered = False
    try:
        conn.writer.write(request)
        while not (reading.head_done if head_only else reading.complete):  # type: ignore[attr-defined]
            chunk = await conn.reader.read(_READ_SIZE)
            if not chunk:
                if not answered:
                    raise _NoAnswer("the server closed the connection without answering")
                raise ConnectionBroken("the server broke off its answer: it closed the connection")
            answered = True
            reading.parser.feed_data(chunk)
    except (OSError, httptools.HttpParserError) as exc:
        conn.close()
        if not answered:
            raise _NoAnswer(f"the server closed the connection: {exc!r}") from exc
        failure = ConnectionBroken if isinstance(exc, OSError) else WireError
        raise failure(f"the server broke off its answer: {exc!r}") from exc
    except BaseException:  # cancelled or timed out mid-exchange, or closed: the connection is spent
        conn.close()
        raise


class _NoAnswer(ConnectionBroken):
    """Nothing of an answer arrived: the request may be sent again on a new connection."""
