"""HTTP to a port inside a sandbox: ``sandbox.port_url(PORT)`` and ``PORT-SANDBOXID.DOMAIN``.

The node connects to 127.0.0.1:PORT inside the sandbox itself (``EdgeAPI.connect_port``: a
socket made in the sandbox's network namespace, a VM's through its agent; across the node seam
an upgraded connection of its own), so nothing of the image is needed; the edge closes those
connections when the sandbox ends. Two ways over that byte stream, with the same promises
(bodies streamed both ways, connections to ports kept alive, WebSocket upgrades, the caller's
credentials and the hop-by-hop headers never passed on, the same access rules, E2B's errors on
host names):

- ``dsec serve``: the port lane (``dsec.apiserver.portlane``), uvicorn's HTTP protocol taking
  the client's connection between requests: heads checked and re-written, bodies and answers
  relayed byte for byte on a port connection paired with the client's.
- Anywhere else (another ASGI server, a request of a job, one the lane does not take):
  ``PortRoutes`` here, in front of every route. The request is re-framed: the head passed on
  without its hop-by-hop headers and the caller's credentials, the body as it comes (chunked
  when the caller sent it so), the answer parsed with httptools and sent as ASGI messages as
  the server inside writes it; connections to a port are pooled per sandbox and port (idle ones
  let go after a few seconds). A WebSocket is relayed message for message
  (``dsec.apiserver.websocket``).

Host names (``HostNames``, an ASGI middleware in front of every route): a request whose Host is
``PORT-SANDBOXID.DOMAIN`` (DOMAIN: ``dsec serve --domain``) goes to that port of that sandbox,
HTTP or WebSocket, whatever its path, as E2B's proxy does (``sandbox.get_host(port)``). Access
is port_url's: a token that sees the sandbox, taken from ``Authorization: Bearer``, HTTP Basic
(the token as the password: what a browser sends for ``http://user:TOKEN@host/``),
``X-API-Key`` or ``e2b-traffic-access-token``; no header carrying it is passed on. Errors there are
E2B-shaped (``{"code", "message"}``), a missing token answers 401 with a Basic challenge.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httptools
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from libdsec import DSecError, InvalidRequest, PortUnreachable, Unauthenticated

from .cluster import Cluster
from .lean import error_headers
from .websocket import relay as websocket_relay

log = logging.getLogger("dsec.apiserver.ports")

_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te", b"trailer",
                         b"upgrade", b"proxy-authorization", b"proxy-authenticate",
                         b"expect"})  # (the ASGI server answers a client's 100-continue itself)
_NO_BODY = frozenset({204, 304})
_CHUNK = 256 << 10
KEEPALIVE_S = 5.0
MAX_IDLE = 256  # connections to ports kept between requests, all sandboxes together
# On one machine ``*.localhost`` is loopback already (RFC 6761; glibc's resolver, curl, browsers).
DEFAULT_DOMAIN = "localhost"


class _ClientGone(Exception):
    pass


class _Broken(Exception):
    """The answer broke off after its head went to the client."""


@dataclass(slots=True, eq=False)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0
    reused: bool = False

    def usable(self, now: float) -> bool:
        return (not self.reader.at_eof() and self.reader.exception() is None and not self.writer.is_closing()
                and now - self.idle_since < KEEPALIVE_S)


class _Answer:
    """httptools' callbacks for one answer."""

    __slots__ = ("parser", "headers", "head_done", "body", "done", "status", "keep_alive")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = self.done = self.keep_alive = False
        self.body: list[bytes] = []
        self.status = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        # (asked here: once the answer is complete, the parser has reset for the next one)
        self.head_done = True
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(bytes(body))

    def on_message_complete(self) -> None:
        self.done = True


class PortProxy:
    """HTTP requests to ports inside sandboxes, each an ASGI exchange re-framed onto a
    connection from ``connect_port``: the head re-written, bodies streamed both ways as they
    come, the answer parsed with httptools (the parser under uvicorn). Connections are kept for
    the next request to the same port for ``KEEPALIVE_S`` when both ends allow it. ``aclose``
    closes the kept ones (a second call does nothing)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.idle: dict[tuple[str, int], list[_Conn]] = {}
        self.idle_count = 0
        self._sweeper: asyncio.Task | None = None

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        for conns in self.idle.values():
            for conn in conns:
                conn.writer.close()
        self.idle.clear()
        self.idle_count = 0

    async def _sweep(self) -> None:
        """Close kept connections once idle past ``KEEPALIVE_S`` (each holds its sandbox's
        network namespace, or a connection to its node)."""
        while True:
            await asyncio.sleep(KEEPALIVE_S)
            now = time.monotonic()
            for key in list(self.idle):
                kept = [c for c in self.idle[key] if c.usable(now) or c.writer.close()]
                self.idle_count -= len(self.idle[key]) - len(kept)
                if kept:
                    self.idle[key] = kept
                else:
                    del self.idle[key]

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        conns = self.idle.get(key)
        now = time.monotonic()
        while conns:
            conn = conns.pop()
            self.idle_count -= 1
            if conn.usable(now):
                conn.reused = True
                return conn
            conn.writer.close()
        return None

    def _keep(self, key: tuple[str, int], conn: _Conn) -> None:
        if self.idle_count >= MAX_IDLE:
            conn.writer.close()
            return
        conn.idle_since = time.monotonic()
        self.idle.setdefault(key, []).append(conn)
        self.idle_count += 1
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="dsec-port-idle-sweep")

    async def serve(self, scope, receive, send, sandbox_id: str, port: int, target: bytes, host: bytes,
                    drop: frozenset[bytes] = frozenset({b"authorization"})) -> None:
        """Answer the ASGI HTTP request with what ``port`` inside ``sandbox_id`` answers it;
        ``host`` is the Host the server inside sees, ``drop`` the caller's headers not passed on.
        A ``DSecError`` is raised only before anything was sent."""
        if not 1 <= port <= 65535:
            raise InvalidRequest(f"port {port} is outside 1-65535")
        method = scope["method"].encode()
        lines = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method, target, host)]
        chunked, has_body = False, False
        for name, value in scope["headers"]:
            if name == b"upgrade":
                raise InvalidRequest("an upgrade that is not a WebSocket handshake cannot go to a sandbox's port")
            if name == b"transfer-encoding":
                chunked = chunked or b"chunked" in value.lower()
            elif name == b"content-length":
                has_body = has_body or value.strip() != b"0"
                lines.append(b"content-length: %s\r\n" % value)
            elif name not in _HOP_BY_HOP and name != b"host" and name not in drop:
                lines.append(b"%s: %s\r\n" % (name, value))
        if chunked:
            lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(b"\r\n")
        head = b"".join(lines)
        key = (sandbox_id, port)
        body_sent = not (chunked or has_body)
        while True:
            conn = self._take(key)
            if conn is None:
                conn = _Conn(*await self.cluster.edge_for(sandbox_id).connect_port(sandbox_id, port))
            try:
                conn.writer.write(head)
                if not body_sent:
                    await _send_body(receive, conn.writer, chunked)
                    body_sent = True
                await self._answer(scope, receive, send, conn, key, method == b"HEAD", port)
                return
            except _Stale:
                conn.writer.close()
                continue  # a kept connection the server had closed: once more on a new one
            except _ClientGone:
                conn.writer.close()
                return
            except BaseException:
                conn.writer.close()
                raise

    async def _answer(self, scope, receive, send, conn: _Conn, key: tuple[str, int], head_only: bool,
                      port: int) -> None:
        answer = _Answer()
        parser = answer.parser
        started = False
        gone: asyncio.Future | None = None
        try:
            while True:
                if started and gone is None:  # a long answer: watch for the client going away meanwhile
                    gone = asyncio.ensure_future(_disconnected(receive))
                data = await (_read(conn, started) if gone is None else _read_or_gone(conn, gone))
                if not data:
                    if not started:
                        if conn.reused:
                            raise _Stale
                        raise PortUnreachable(f"port {port} in the sandbox closed the connection without an answer")
                    if answer.head_done and not answer.done and not _framed(answer.headers):
                        answer.done = True  # a body that ends with the connection
                        await _flush(send, answer, more=False)
                        conn.writer.close()
                        return
                    raise _Broken("the connection ended in the middle of the answer")
                try:
                    parser.feed_data(data)
                except httptools.HttpParserError as exc:
                    if started:
                        raise _Broken(f"what followed the head is not HTTP: {exc}") from None
                    raise PortUnreachable(f"port {port} in the sandbox did not answer HTTP: {data[:80]!r}") from None
                if answer.head_done and not started:
                    status = answer.status
                    if head_only or status in _NO_BODY:
                        answer.done = True
                    await send({"type": "http.response.start", "status": status,
                                "headers": [(k, v) for k, v in answer.headers if k not in _HOP_BY_HOP]})
                    started = True
                if started:
                    await _flush(send, answer, more=not answer.done)
                if answer.done:
                    if answer.keep_alive:
                        self._keep(key, conn)
                    else:
                        conn.writer.close()
                    return
        except _Broken as exc:
            log.info("port %d of %s broke off an answer: %s", port, key[0], exc)
            conn.writer.close()  # (the client's connection is cut: no end of the answer is sent)
            raise _ClientGone from None
        finally:
            if gone is not None:
                gone.cancel()


class _Stale(Exception):
    pass


def _framed(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k == b"content-length" or (k == b"transfer-encoding" and b"chunked" in v.lower()) for k, v in headers)


async def _flush(send, answer: _Answer, more: bool) -> None:
    body = b"".join(answer.body) if len(answer.body) != 1 else answer.body[0]
    answer.body.clear()
    if body or not more:
        await send({"type": "http.response.body", "body": body, "more_body": more})


async def _read(conn: _Conn, started: bool) -> bytes:
    try:
        return await conn.reader.read(_CHUNK)
    except OSError as exc:
        if started:
            raise _Broken(str(exc)) from None
        if conn.reused:
            raise _Stale from None
        raise PortUnreachable(f"the connection to the port broke: {exc}") from None


async def _read_or_gone(conn: _Conn, gone: asyncio.Future) -> bytes:
    read = asyncio.ensure_future(_read(conn, True))
    await asyncio.wait((read, gone), return_when=asyncio.FIRST_COMPLETED)
    if not read.done():
        read.cancel()
        raise _ClientGone
    return read.result()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_body(receive, writer: asyncio.StreamWriter, chunked: bool) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        body = message.get("body", b"")
        if body:
            writer.write(b"%x\r\n%s\r\n" % (len(body), body) if chunked else body)
        if not message.get("more_body"):
            break
        try:
            await writer.drain()
        except OSError as exc:
            raise PortUnreachable(f"the port stopped taking the request's body: {exc}") from None
    if chunked:
        writer.write(b"0\r\n\r\n")


# -- host names -------------------------------------------------------------------------------

_LABEL = re.compile(r"([0-9]{1,5})-([a-z0-9][a-z0-9-]{0,62})\Z")
_CREDENTIALS = (b"e2b-traffic-access-token", b"x-api-key")

Check = Callable[[dict[bytes, bytes], dict], Awaitable[object]]


def split_host(host: str, domain: str) -> tuple[int, str] | None:
    """(port, sandbox id) of ``PORT-SANDBOXID.DOMAIN[:port]``, else None."""
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.lower().rstrip(".")
    suffix = "." + domain.lower()
    if not domain or not name.endswith(suffix):
        return None
    m = _LABEL.match(name[:-len(suffix)])
    return None if m is None else (int(m.group(1)), m.group(2))


def _token(headers: dict[bytes, bytes]) -> tuple[str, bytes] | None:
    """The caller's token and the header it came in."""
    scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    if scheme.lower() == "bearer" and given.strip():
        return given.strip(), b"authorization"
    if scheme.lower() == "basic":
        with contextlib.suppress(ValueError):
            password = base64.b64decode(given.strip(), validate=True).decode().partition(":")[2]
            if password:
                return password, b"authorization"
    for name in _CREDENTIALS:
        if headers.get(name):
            return headers[name].decode("latin-1").strip(), name
    return None


def e2b_error(exc: DSecError) -> tuple[dict, dict[str, str]]:
    """A host name's error as E2B's proxy gives it: the body, and the headers it adds (a Basic
    challenge for a missing token)."""
    headers = {"www-authenticate": 'Basic realm="dsec sandbox ports"'} if isinstance(exc, Unauthenticated) else {}
    return {"code": exc.status, "message": str(exc)}, headers


def _e2b_error(exc: DSecError) -> JSONResponse:
    body, headers = e2b_error(exc)
    return JSONResponse(body, status_code=exc.status, headers=headers or None)


_PORT_PATH = re.compile(rb"/v1/sandboxes/([^/]+)/ports/([^/]*)/")


class PortRoutes:
    """ASGI middleware, in front of every route: ``PORT-SANDBOXID.DOMAIN`` to that port (see
    the module docstring); and port_url's HTTP requests, served here as their route would
    serve them (the same check, DSec's error bodies) without the framework's layers, which
    cost more than the proxying itself (a request of a job, ``x-dsec-job``, goes to the route,
    which logs it). Everything else goes on to ``app``."""

    def __init__(self, app, domain: str, proxy: PortProxy, check: Check, job_header: bytes) -> None:
        self.app, self.domain, self.proxy, self.check = app, domain.strip(".").lower(), proxy, check
        self.job_header = job_header

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "http" or kind == "websocket":
            if self.domain:
                for name, value in scope["headers"]:
                    if name == b"host":
                        target = split_host(value.decode("latin-1"), self.domain)
                        if target is not None:
                            await self._serve(scope, receive, send, value, *target)
                            return
                        break
            if kind == "http" and scope["path"].startswith("/v1/sandboxes/"):
                m = _PORT_PATH.match(scope.get("raw_path") or scope["path"].encode())
                if m is not None and all(name != self.job_header for name, _ in scope["headers"]):
                    await self._port_url(scope, receive, send, m)
                    return
        await self.app(scope, receive, send)

    async def _port_url(self, scope, receive, send, m: re.Match) -> None:
        sandbox_id, port = m.group(1).decode("latin-1"), m.group(2).decode("latin-1")
        path = (scope.get("raw_path") or scope["path"].encode())[m.end() - 1:]
        target = path + (b"?" + scope["query_string"] if scope.get("query_string") else b"")
        try:
            if not port.isdigit() or not 1 <= int(port) <= 65535:
                raise InvalidRequest(f"port {port} is outside 1-65535")
            await self.check(dict(scope["headers"]), {"sandbox_id": sandbox_id})
            await self.proxy.serve(scope, receive, send, sandbox_id, int(port), target, b"127.0.0.1:%s" % m.group(2))
        except DSecError as exc:
            await JSONResponse(exc.to_wire(), status_code=exc.status, headers=error_headers(exc))(scope, receive, send)

    async def _serve(self, scope, receive, send, host: bytes, port: int, sandbox_id: str) -> None:
        headers = dict(scope["headers"])
        path = scope.get("raw_path") or scope["path"].encode()
        target = path.decode("latin-1") + (f"?{scope['query_string'].decode('latin-1')}"
                                           if scope.get("query_string") else "")
        try:
            given = _token(headers)
            if given is None:
                raise Unauthenticated(f"a token is needed for port {port} of sandbox {sandbox_id}: "
                                      "Authorization: Bearer, Basic (the token as password), X-API-Key or "
                                      "e2b-traffic-access-token")
            token, header = given
            if not 1 <= port <= 65535:
                raise InvalidRequest(f"port {port} is outside 1-65535")
            await self.check({b"authorization": b"Bearer " + token.encode("latin-1")}, {"sandbox_id": sandbox_id})
            edge = self.proxy.cluster.edge_for(sandbox_id)
        except DSecError as exc:
            if scope["type"] == "websocket":
                await WebSocket(scope, receive, send).send_denial_response(_e2b_error(exc))
            else:
                await _e2b_error(exc)(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await websocket_relay(WebSocket(scope, receive, send), edge, sandbox_id, port, target,
                                  host=host.decode("latin-1"), deny=_e2b_error)
            return
        try:
            carried = token.encode("latin-1")
            await self.proxy.serve(scope, receive, send, sandbox_id, port, target.encode("latin-1"), host,
                                   drop=frozenset({header, *(name for name in (b"authorization", *_CREDENTIALS)
                                                             if carried in headers.get(name, b"\0"))}))
        except DSecError as exc:
            await _e2b_error(exc)(scope, receive, send)
