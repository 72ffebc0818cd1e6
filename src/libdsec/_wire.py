"""A lean HTTP/1.1 client for the SDK's own requests to an apiserver over plain ``http://``.

httpx spends about 1.3 ms of CPU on a request here, three to four times what the server
spends answering it: its connection pool polls every idle connection and rescans every queued
request each time one is sent or done, and each request passes through URL merging, cookie
extraction and an auth flow the SDK does not use. The SDK's requests all have one shape (a
method, a path with an optional query, a JSON or bytes body, one bearer token, an answer read
whole), so they go through this client instead: idle keep-alive connections on a stack, each
message framed by h11 (the HTTP/1.1 library under httpx). Streamed answers (the NDJSON of a
batch create), ``https://`` endpoints and custom httpx transports stay on httpx.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

import h11

# Close connections idle this long: well below any server's keep-alive (uvicorn's default is
# 5 s; `dsec serve` keeps them 75 s), so a request never leaves on a connection being closed.
IDLE_EXPIRY_S = 4.0
_READ_SIZE = 65536


class WireError(Exception):
    """The server could not be reached, or broke off the exchange."""


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
    __slots__ = ("reader", "writer", "http", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.http = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0

    def usable(self, now: float) -> bool:
        return (now - self.idle_since < IDLE_EXPIRY_S and not self.reader.at_eof()
                and not self.writer.is_closing())

    def close(self) -> None:
        self.writer.close()


class WireClient:
    """Requests to one ``http://host:port`` with at most ``max_connections`` open at once."""

    def __init__(self, endpoint: str, headers: dict[str, str], max_connections: int) -> None:
        url = urlsplit(endpoint)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"not a plain http endpoint: {endpoint!r}")
        self._host = url.hostname
        self._port = url.port or 80
        self._prefix = url.path.rstrip("/")
        netloc = url.netloc.rsplit("@", 1)[-1]
        self._headers = [("host", netloc), ("user-agent", "libdsec"),
                         *((k.lower(), v) for k, v in headers.items())]
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: bytes | None = None,
        content_type: str | None = None,
        timeout: float,
    ) -> Answer:
        if self._closed:
            raise WireError("client is closed")
        target = self._prefix + path + (f"?{urlencode(params)}" if params else "")
        headers = list(self._headers)
        if body is not None:
            headers.append(("content-type", content_type or "application/octet-stream"))
            headers.append(("content-length", str(len(body))))
        request = h11.Request(method=method, target=target, headers=headers)
        async with self._slots:
            try:
                async with asyncio.timeout(timeout):
                    return await self._exchange(request, body)
            except TimeoutError:
                raise WireError(f"no answer to {method} {path} within {timeout:g}s") from None

    async def _exchange(self, request: h11.Request, body: bytes | None) -> Answer:
        conn = self._take()
        if conn is not None:
            try:
                return await self._send(conn, request, body)
            except _NoAnswer:
                # The server closed the idle connection as the request left: it never read it.
                pass
        try:
            reader, writer = await asyncio.open_connection(self._host, self._port)
        except OSError as exc:
            raise WireError(f"cannot connect to {self._host}:{self._port}: {exc}") from exc
        try:
            return await self._send(_Connection(reader, writer), request, body)
        except _NoAnswer as exc:
            raise WireError(str(exc)) from None

    def _take(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.usable(now):
                return conn
            conn.close()
        return None

    async def _send(self, conn: _Connection, request: h11.Request, body: bytes | None) -> Answer:
        http = conn.http
        answered = False
        try:
            data = http.send(request)
            if body:
                data += http.send(h11.Data(data=body))
            conn.writer.write(data + http.send(h11.EndOfMessage()))
            status = 0
            parts: list[bytes] = []
            while True:
                event = http.next_event()
                if event is h11.NEED_DATA:
                    chunk = await conn.reader.read(_READ_SIZE)
                    if chunk:
                        answered = True
                    http.receive_data(chunk)
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    parts.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise _NoAnswer("the server closed the connection without answering")
        except (OSError, h11.ProtocolError) as exc:
            conn.close()
            if not answered:
                raise _NoAnswer(f"the server closed the connection: {exc!r}") from exc
            raise WireError(f"the server broke off its answer: {exc!r}") from exc
        except BaseException:  # cancelled or timed out mid-exchange: the connection is spent
            conn.close()
            raise
        if http.our_state is h11.DONE and http.their_state is h11.DONE and not self._closed:
            http.start_next_cycle()
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
        return Answer(status, b"".join(parts))

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        for conn in idle:
            try:
                await conn.writer.wait_closed()
            except OSError:
                pass


class _NoAnswer(WireError):
    """Nothing of an answer arrived: the request may be sent again on a new connection."""
