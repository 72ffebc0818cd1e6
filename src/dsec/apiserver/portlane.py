"""The port lane: HTTP and WebSocket to a port inside a sandbox relayed on the client's own
connection, without the ASGI server's re-framing (``dsec.apiserver.ports`` has what the path
promises; this is how ``dsec serve`` keeps it fast).

``lane_protocol(lane)`` is the apiserver's HTTP protocol for uvicorn: uvicorn's own (httptools)
with one thing added. When a connection is between requests and a whole request head has come
that is a port's (``/v1/sandboxes/ID/ports/PORT/…`` without ``x-dsec-job``, or a Host
``PORT-SANDBOXID.DOMAIN``), the connection becomes the lane's: each request head is checked and
re-written (the caller's credentials and the hop-by-hop headers taken out, ``Host`` the one the
server inside is to see) and written to a connection from ``EdgeAPI.connect_port``, the client
connection's own for as long as it asks for the same port; bodies go on byte for byte as they
come, and the answers come back byte for byte as the server inside writes them, read only for
where each ends (HTTP/1.1's own framing: Content-Length, chunked, or the end of the connection;
none after HEAD, 204 and 304). Its framing is the server's: the client's connection is paired
with the server's, so an answer that ends the server's connection ends the client's. A
WebSocket handshake goes on as it is, and once the server answers 101 the two connections are
one byte stream until either ends. A request that is not a port's, once the answers before it
have gone, hands the connection back to uvicorn.

Every request is checked: its token (revoked: refused at once), then, when it is not the one
checked last for that sandbox on this connection, whether it sees the sandbox. A head of the same
bytes as the connection's last one is that same request: what ``classify`` made of it is kept
(so is an answer head's framing), the checks are not. A sandbox that ends takes the connection
to its port with it; the next request is checked anew (and so answered ``sandbox_not_found``).
Errors are DSec's (port_url) or E2B's (host names) as in ``ports``, after the answers before
them; one to a request with a body closes the connection (its body is not read). Kept
connections to ports (a client gone, or asking another port next) wait ``KEEPALIVE_S`` for the
next client connection to the same port.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from libdsec import DSecError, InvalidRequest, PortUnreachable, Unauthenticated

from .auth import Authenticator
from .cluster import Cluster
from .lean import error_headers
from .ports import _CREDENTIALS, KEEPALIVE_S, MAX_IDLE, _token, e2b_error, split_host

log = logging.getLogger("dsec.apiserver.portlane")

MAX_HEAD = 64 << 10
_PORT_PATH = re.compile(rb"/v1/sandboxes/([^/?#]+)/ports/([^/?#]*)(/[^ ]*)\Z")
_TOKEN_CHARS = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
# A request line, then header fields (RFC 9112 5: a token, a colon, a value with no CR, LF or NUL;
# no folded lines), each field's name and value (its spaces around taken off).
_REQUEST_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+) ([^ \r\n\0]+) (HTTP/1\.[01])\r\n")
_HEAD = re.compile(_REQUEST_LINE.pattern + rb"(?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[^\r\n\0]*\r\n)*")
# The headers the lane reads (of a head checked by _HEAD: each line CRLF-led, no CR or LF in a value).
_CARRIERS = (b"authorization", *_CREDENTIALS)
_READ = (b"host", *_CARRIERS, b"content-length",
         b"transfer-encoding", b"connection", b"upgrade", b"sec-websocket-key")
# What the lane reads of an answer's head.
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})[^\r\n]*")
_ANSWER_FIELD = re.compile(rb"\r\n(content-length|transfer-encoding|connection)[ \t]*:[ \t]*([^\r\n]*)", re.I)
_CHUNK_SIZE = re.compile(rb"[0-9a-fA-F]{1,15}")
# Not passed on (RFC 9110 7.6.1; and the ones a proxy answers itself). ``connection`` is
# written anew; ``upgrade`` only for a WebSocket handshake.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade",
                         b"proxy-authorization", b"proxy-authenticate", b"host"})


class _Bad(Exception):
    """A request (or answer) that is not HTTP/1.1 the lane can frame."""


class _BadHandshake(InvalidRequest):
    """A WebSocket handshake that is none (400, as a WebSocket server answers it)."""

    status = 400


# -- framing ------------------------------------------------------------------------------------

class _Body:
    """Where a body ends in the bytes of a connection: ``take(data, i)`` is how far into
    ``data`` (from ``i``) it goes and whether it ended there."""

    __slots__ = ("left", "chunked", "line", "trailer")

    def __init__(self, length: int, chunked: bool) -> None:
        self.left, self.chunked, self.line, self.trailer = length, chunked, b"", False

    def take(self, data: bytes, i: int) -> tuple[int, bool]:
        if not self.chunked:
            n = min(self.left, len(data) - i)
            self.left -= n
            return i + n, self.left == 0
        while True:
            if self.left:  # a chunk's data and its CRLF
                n = min(self.left, len(data) - i)
                i += n
                self.left -= n
                if self.left:
                    return i, False
            j = data.find(b"\n", i)
            if j < 0:
                self.line += data[i:]
                if len(self.line) > 8192:
                    raise _Bad("a chunk's size line is too long")
                return len(data), False
            line, self.line, i = self.line + data[i:j], b"", j + 1
            if self.trailer:
                if not line.strip():
                    return i, True
                continue
            size = line.split(b";", 1)[0].strip()
            if not _CHUNK_SIZE.fullmatch(size):
                raise _Bad(f"a chunk's size is not hex: {size[:20]!r}")
            n = int(size, 16)
            if n == 0:
                self.trailer = True
            else:
                self.left = n + 2


class _Request:
    """A request head the lane serves (``classify``)."""

    __slots__ = ("method", "version", "target", "sandbox_id", "port", "host", "rest", "drop", "token",
                 "token_header", "host_name", "body", "upgrade", "close", "error", "wire")

    def __init__(self) -> None:
        self.method = b""
        self.body: _Body | None = None
        self.upgrade = self.close = False
        self.error: DSecError | None = None
        self.token: str | None = None
        self.token_header = b""
        self.wire: bytes | None = None  # head(), once made

    def head(self) -> bytes:
        """The head the server inside gets: the caller's header lines but those dropped, in
        their order, after its request line and Host."""
        if self.wire is None:
            self.wire = self._head()
        return self.wire

    def _head(self) -> bytes:
        rest = _dropping(self.drop).sub(b"", self.rest)  # ("\r\nname: value…\r\n", lines dropped)
        if self.upgrade:
            end = b"connection: upgrade\r\nupgrade: websocket\r\n\r\n"
        elif self.close:
            end = b"connection: close\r\n\r\n"
        elif self.version == b"HTTP/1.0":
            end = b"connection: keep-alive\r\n\r\n"
        else:
            end = b"\r\n"
        return b"%s %s %s\r\nhost: %s%s%s" % (self.method, self.target, self.version, self.host, rest, end)


_DROPPING: dict[frozenset[bytes], re.Pattern] = {}


def _dropping(extra: frozenset[bytes]) -> re.Pattern:
    """The lines of the hop-by-hop headers and of ``extra`` (CRLF first: lines are CRLF-led
    in a request's ``rest``), one pattern a set of names (few: the credentials)."""
    pattern = _DROPPING.get(extra)
    if pattern is None:
        if len(_DROPPING) > 64:
            _DROPPING.clear()
        names = b"|".join(re.escape(n) for n in sorted(_HOP_BY_HOP | extra))
        pattern = _DROPPING[extra] = re.compile(rb"\r\n(?:" + names + rb"):[^\r\n]*", re.I)
    return pattern


# -- the lane -----------------------------------------------------------------------------------

class PortLane:
    """What every lane connection shares: how to check a caller, the domain of host names, and
    the connections to ports kept between client connections."""

    def __init__(self, cluster: Cluster, authenticator: Authenticator, domain: str, job_header: bytes) -> None:
        self.cluster, self.authenticator = cluster, authenticator
        self.domain = domain.strip(".").lower()
        self._domain_b = self.domain.encode()
        self.job_header = job_header
        names = b"|".join(re.escape(n) for n in (*_READ, job_header))
        self._read = re.compile(rb"\r\n(" + names + rb"):[ \t]*([^\r\n]*?)[ \t]*(?=\r\n)", re.I)
        self.idle: dict[tuple[str, int], list[_Upstream]] = {}
        self.idle_count = 0

    def maybe(self, head: bytes) -> bool:
        """Whether ``head`` may be a port's (cheap; ``classify`` decides)."""
        first = head[:head.find(b"\r\n")]
        return b"/ports/" in first or (bool(self._domain_b) and self._domain_b in head.lower())

    def classify(self, head: bytes) -> _Request | None:
        """The port request ``head`` is, None when it is none (uvicorn's then); ``_Bad`` for a
        head that is not HTTP/1.x. Two passes of C: the head checked whole, then the few
        headers the lane reads taken out of it."""
        head += b"\r\n"
        m = _HEAD.fullmatch(head)
        if m is None:
            line = head[:head.find(b"\r\n")]
            if _REQUEST_LINE.match(head) is None:
                raise _Bad(f"not an HTTP/1.x request line: {line[:80]!r}")
            raise _Bad("a header line that is not a name, a colon and a value (or a lone CR, LF or NUL)")
        req = _Request()
        req.method, target, req.version = m.groups()
        req.rest = head[m.end(3):]
        values: dict[bytes, bytes] = {}
        for name, value in self._read.findall(head):
            name = name.lower()
            if name in values:
                if name == b"content-length" and value != values[name]:
                    raise _Bad("two different Content-Length headers")
                if name == b"host":
                    raise _Bad("two Host headers")
                values[name] = values[name] + b", " + value
            else:
                values[name] = value
        if self.job_header in values:
            return None  # (a job's request: the route logs it)
        host = values.get(b"host", b"")
        where = (split_host(host.decode("latin-1"), self.domain)
                 if self._domain_b and self._domain_b in host.lower() else None)
        if where is not None:
            req.host_name = True
            req.port, req.sandbox_id = where
            req.target, req.host = target, host
            given = _token(values)
            if given is not None:
                req.token, req.token_header = given
            else:
                req.error = Unauthenticated(
                    f"a token is needed for port {req.port} of sandbox {req.sandbox_id}: Authorization: Bearer, "
                    "Basic (the token as password), X-API-Key or e2b-traffic-access-token")
        else:
            m = _PORT_PATH.match(target) if target.startswith(b"/v1/sandboxes/") else None
            if m is None:
                return None
            req.host_name = False
            req.sandbox_id = m.group(1).decode("latin-1")
            port = m.group(2)
            req.port = int(port) if port.isdigit() and len(port) <= 5 else 0
            if not 1 <= req.port <= 65535:
                req.error = InvalidRequest(f"port {port.decode('latin-1')} is outside 1-65535")
            req.target, req.host = m.group(3), b"127.0.0.1:" + port
            scheme, _, given = values.get(b"authorization", b"").decode("latin-1").partition(" ")
            req.token = given.strip() if scheme.lower() == "bearer" and given.strip() else None
            req.token_header = b"authorization"
            if req.token is None:
                req.error = Unauthenticated("missing or invalid API token (Authorization: Bearer <token>)")
        if not 1 <= req.port <= 65535 and req.error is None:
            req.error = InvalidRequest(f"port {req.port} is outside 1-65535")
        # The framing of the body (RFC 9112 6): chunked as the only coding, or a length.
        te, length = values.get(b"transfer-encoding"), values.get(b"content-length")
        if te is not None:
            if te.lower() != b"chunked" or length is not None:
                raise _Bad("a Transfer-Encoding other than chunked alone, or with a Content-Length")
            req.body = _Body(0, True)
        elif length is not None:
            if not length.isdigit() or len(length) > 18:
                raise _Bad(f"a Content-Length that is not a length: {length[:20]!r}")
            if int(length):
                req.body = _Body(int(length), False)
        drop = {req.token_header}
        connection = values.get(b"connection")
        if connection:
            tokens = {t.strip().lower() for t in connection.split(b",")}
            upgrade = values.get(b"upgrade")
            if upgrade is not None and b"upgrade" in tokens:
                if upgrade.lower() != b"websocket":
                    req.error = req.error or InvalidRequest(
                        "an upgrade that is not a WebSocket handshake cannot go to a sandbox's port")
                elif req.method != b"GET" or b"sec-websocket-key" not in values or req.version != b"HTTP/1.1":
                    req.error = req.error or _BadHandshake(
                        "not a WebSocket handshake: a GET of HTTP/1.1 with Sec-WebSocket-Key is one")
                req.upgrade = True
            req.close = b"close" in tokens or (req.version == b"HTTP/1.0" and b"keep-alive" not in tokens)
            # (what Connection names is this hop's alone; the body's framing stays)
            drop.update(t for t in tokens - {b"content-length", b"transfer-encoding", b""} if _TOKEN_CHARS.match(t))
        else:
            req.close = req.version == b"HTTP/1.0"
        if req.token:  # (and any other header that carries the token: never passed on)
            token = req.token.encode("latin-1")
            for name in _CARRIERS:
                value = values.get(name)
                if value is not None and token in value:
                    drop.add(name)
        req.drop = frozenset(drop)
        return req

    # connections to ports, kept between client connections

    def take(self, key: tuple[str, int]) -> _Upstream | None:
        kept = self.idle.get(key)
        while kept:
            up = kept.pop()
            self.idle_count -= 1
            if up.timer is not None:
                up.timer.cancel()
                up.timer = None
            if not up.closed:
                if not kept:
                    del self.idle[key]
                up.reused = True
                return up
        self.idle.pop(key, None)
        return None

    def keep(self, key: tuple[str, int], up: _Upstream) -> None:
        if self.idle_count >= MAX_IDLE or up.closed:
            up.close()
            return
        up.relay = None
        up.timer = asyncio.get_running_loop().call_later(KEEPALIVE_S, self._expire, key, up)
        self.idle.setdefault(key, []).append(up)
        self.idle_count += 1

    def _expire(self, key: tuple[str, int], up: _Upstream) -> None:
        kept = self.idle.get(key)
        if kept is not None and up in kept:
            kept.remove(up)
            self.idle_count -= 1
            if not kept:
                del self.idle[key]
        up.timer = None
        up.close()

    def close(self) -> None:
        for kept in self.idle.values():
            for up in kept:
                if up.timer is not None:
                    up.timer.cancel()
                up.close()
        self.idle.clear()
        self.idle_count = 0


class _Upstream(asyncio.Protocol):
    """A connection to a port (the transport ``connect_port`` made, taken over from its
    streams): what it reads goes to the relay of the client connection it serves."""

    def __init__(self, transport: asyncio.Transport, writer: asyncio.StreamWriter) -> None:
        self.transport, self.writer = transport, writer  # (the writer holds a VM's tunnel)
        self.relay: _Relay | None = None
        self.closed = False
        self.reused = False
        self.timer: asyncio.TimerHandle | None = None
        self.pending: tuple[bytes, bool] | None = None  # what the streams had read, and whether they had ended

    def data_received(self, data: bytes) -> None:
        if self.relay is not None:
            self.relay.answer_data(data)
        else:  # (a kept connection the server speaks on: no use for it)
            self.close()

    def eof_received(self) -> bool:
        self.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.close()

    def pause_writing(self) -> None:
        if self.relay is not None:
            self.relay.pause(b"port")

    def resume_writing(self) -> None:
        if self.relay is not None:
            self.relay.resume(b"port")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.transport.close()
        relay, self.relay = self.relay, None
        if relay is not None:
            relay.upstream_ended(self)


async def _connect(lane: PortLane, sandbox_id: str, port: int) -> _Upstream:
    reader, writer = await lane.cluster.edge_for(sandbox_id).connect_port(sandbox_id, port)
    transport = writer.transport
    up = _Upstream(transport, writer)
    # What the streams read already (a node's answer may bring the first bytes): StreamReader
    # has no way to take it but its buffer.
    left = bytes(reader._buffer)
    ended = reader._eof
    transport.set_protocol(up)
    up.pending = (left, ended)
    return up


def _framing(head: bytes) -> tuple[int, bool, bytes | None, bool | None]:
    """What an answer's head says of its framing: (status, whether it ends the connection,
    its Content-Length as written, whether it is chunked)."""
    m = _STATUS_LINE.match(head)
    if m is None:
        raise _Bad(f"not a status line: {head[:40]!r}")
    length = chunked = None
    close = m.group(1) == b"0"
    for name, value in _ANSWER_FIELD.findall(head):
        name = name.lower()
        if name == b"content-length":
            length = value.strip()
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        else:
            tokens = value.lower()
            if b"close" in tokens:
                close = True
            elif b"keep-alive" in tokens:
                close = False
    return int(m.group(2)), close, length, chunked


def _answer(req: _Request, exc: DSecError, close: bool) -> bytes:
    """The error answer to ``req``: E2B's shape on a host name, DSec's on port_url."""
    headers = error_headers(exc)
    if req.host_name:
        body, extra = e2b_error(exc)
        headers.update(extra)
    else:
        body = exc.to_wire()
    data = json.dumps(body, separators=(",", ":")).encode()
    reason = b"Error"
    lines = [b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
             % (exc.status, reason, len(data))]
    lines += [b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in headers.items()]
    if close:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    # (an answer to HEAD has its length but no body: the client reads none)
    return b"".join(lines) + (b"" if req.method == b"HEAD" else data)


class _Relay:
    """One client connection while it is the lane's (module docstring)."""

    def __init__(self, proto: _LaneProtocol, lane: PortLane) -> None:
        self.proto, self.lane = proto, lane
        self.client = proto.transport
        self.buf = b""
        self.body: _Body | None = None  # the body of the request being passed on
        self.up: _Upstream | None = None
        self.up_key: tuple[str, int] | None = None
        # (token, sandbox, the token's project) last seen to see the sandbox
        self.checked: tuple[str | None, str, str] | None = None
        self.inflight: list[bytes] = []  # the methods of requests the answers of which have not ended
        self.retry: bytes | None = None  # the head of the one request in flight, when it may be sent again
        self.answered = False  # bytes of the current answer went to the client
        self.ahead = b""  # an answer's head not yet whole
        self.abody: _Body | None = None
        self.until_close = False
        self.tunnel = False
        self.after_close = False  # the answer under way ends the connection
        self.busy: asyncio.Task | None = None
        self.paused: set[bytes] = set()
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None  # the client's keep-alive: checked when it is due
        self.idle_since = 0.0
        self.host_name = False  # the last request came by host name (errors then E2B's)
        # The last head classified and what it is (a request with no body, no upgrade and no
        # error): a head of the same bytes is the same request (classify reads nothing else),
        # as a client asking the same again sends it. Its caller is checked all the same (_fits).
        self.last: tuple[bytes, _Request] | None = None
        self.last_answer: tuple[bytes, tuple] | None = None  # the same for an answer's head (_framing)

    # client → port

    def client_data(self, data: bytes) -> None:
        if self.tunnel and self.up is not None:
            self.up.transport.write(data)
            return
        self.buf = self.buf + data if self.buf else data
        self.process()

    def process(self) -> None:
        """Pass on what the client sent, as far as it can go now."""
        try:
            self._process()
        except _Bad as exc:
            self.fail(InvalidRequest(f"malformed request: {exc}"))
        if not self.closed and not self.inflight and not self.buf and self.busy is None and not self.tunnel:
            # (one timer a connection, not one a request: at its time, it looks how long it was idle)
            self.idle_since = self.proto.loop.time()
            if self.timer is None:
                self.timer = self.proto.loop.call_later(self.proto.timeout_keep_alive, self._idle)
        if len(self.buf) > MAX_HEAD:
            self.pause(b"buf")  # (until it has gone on)
        elif b"buf" in self.paused:
            self.resume(b"buf")

    def _process(self) -> None:
        while self.buf and not self.closed and self.busy is None:
            if self.body is not None:
                end, done = self.body.take(self.buf, 0)
                if self.up is not None:
                    self.up.transport.write(self.buf if end == len(self.buf) else self.buf[:end])
                self.buf = self.buf[end:]
                if done:
                    self.body = None
                continue
            if self.tunnel:
                if self.up is not None:
                    self.up.transport.write(self.buf)
                self.buf = b""
                return
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    raise _Bad("the request head is larger than 64 KiB")
                return
            head = self.buf[:end]
            last = self.last
            if last is not None and last[0] == head:
                req = last[1]
            else:
                req = self.lane.classify(head)
                self.last = ((head, req) if req is not None and req.error is None and req.body is None
                             and not req.upgrade else None)
            if req is None or req.error is not None or not self._fits(req):
                if self.inflight or self.after_close:
                    self.pause(b"wait")
                    return  # (after the answers before it)
                if req is None:
                    self.hand_back()
                    return
                if req.error is not None:
                    self.buf = self.buf[end + 4:]
                    self.refuse(req, req.error)
                    continue
                self.buf = self.buf[end + 4:]
                self.busy = self.proto.loop.create_task(self._open(req))
                self.pause(b"wait")
                return
            self.buf = self.buf[end + 4:]
            self.send(req)

    def _idle(self) -> None:
        self.timer = None
        if self.closed or self.inflight or self.buf or self.busy is not None or self.tunnel:
            return  # (armed again once idle)
        left = self.idle_since + self.proto.timeout_keep_alive - self.proto.loop.time()
        if left > 0.01:
            self.timer = self.proto.loop.call_later(left, self._idle)
        else:
            self.close()

    def _fits(self, req: _Request) -> bool:
        """Whether ``req`` goes on the port connection there is, its caller checked (the
        token each time: a revoked one is refused at once)."""
        checked = self.checked
        if (checked is None or checked[0] != req.token or checked[1] != req.sandbox_id
                or self.lane.authenticator.project_of(req.token) != checked[2]):
            return False  # (checked whole: _open)
        return (self.up is not None and not self.up.closed and self.up_key == (req.sandbox_id, req.port)
                and not self.after_close)

    def send(self, req: _Request) -> None:
        """Write ``req``'s head to the port, with as much of its body as has come (one write:
        the server inside reads them in one wake-up, as it does from a client that writes
        them together). ``self.buf`` is what follows the head; ``_Bad`` for a body that is
        not chunked as it says (before anything is written)."""
        head = req.head()
        body = req.body
        self.retry = head if not self.inflight and body is None and not req.upgrade else None
        if body is not None and self.buf:
            end, done = body.take(self.buf, 0)
            head, self.buf = head + self.buf[:end], self.buf[end:]
            if done:
                body = None
        self.host_name = req.host_name
        self.up.transport.write(head)
        self.inflight.append(req.method)
        self.body = body
        if req.close:
            self.after_close = True
        if req.upgrade:
            self.tunnel = True  # (whatever follows is the WebSocket's: held until the 101 if not yet here)

    async def _open(self, req: _Request) -> None:
        """Check the caller against the sandbox, take a connection to the port, send ``req``."""
        try:
            try:
                caller = self.lane.authenticator.caller("Bearer " + req.token)
                await self.lane.cluster.edge_for_caller(req.sandbox_id, caller)
                key = (req.sandbox_id, req.port)
                if self.up is not None and (self.up_key != key or self.up.closed):
                    self._let_go()
                if self.up is None:
                    up = self.lane.take(key) or await _connect(self.lane, req.sandbox_id, req.port)
                    if self.closed:
                        self.lane.keep(key, up)
                        return
                    self._attach(up, key)
                if self.up is None:  # (it ended as it came)
                    raise PortUnreachable(f"port {req.port} in the sandbox closed the connection at once")
                self.checked = (req.token, req.sandbox_id, caller.project)
            except DSecError as exc:
                if not self.closed:
                    self.refuse(req, exc)
                return
            except Exception as exc:  # noqa: BLE001 - the client is answered, the server goes on
                log.exception("port %s of %s: could not connect", req.port, req.sandbox_id)
                if not self.closed:
                    self.refuse(req, PortUnreachable(f"could not reach port {req.port}: {type(exc).__name__}: {exc}"))
                return
            if not self.closed:
                try:
                    self.send(req)
                except _Bad as exc:
                    self.fail(InvalidRequest(f"malformed request: {exc}"))
        finally:
            self.busy = None
            if not self.closed:
                self.resume(b"wait")
                self.process()

    def _attach(self, up: _Upstream, key: tuple[str, int]) -> None:
        self.up, self.up_key = up, key
        up.relay = self
        pending = getattr(up, "pending", None)
        if pending is not None:
            up.pending = None
            left, ended = pending
            if left:
                self.proto.loop.call_soon(self._late, up, left, ended)
            elif ended:
                up.close()

    def _late(self, up: _Upstream, data: bytes, ended: bool) -> None:
        if up.relay is self:
            up.data_received(data)
            if ended:
                up.close()

    def _let_go(self) -> None:
        """Keep the port connection for another client, if it is between answers."""
        up, self.up, self.checked = self.up, None, None
        if up is None:
            return
        up.relay = None
        if (up.closed or self.inflight or self.tunnel or self.after_close or self.body is not None or self.ahead
                or self.abody is not None or self.until_close):
            up.close()
        else:
            self.lane.keep(self.up_key, up)

    def refuse(self, req: _Request, exc: DSecError) -> None:
        close = req.body is not None or req.upgrade or req.close
        self.client.write(_answer(req, exc, close))
        if close:
            self.close()

    def fail(self, exc: DSecError) -> None:
        """Answer ``exc`` (unless an answer is half sent) and close the connection."""
        if not self.answered:
            req = _Request()
            req.host_name = self.host_name
            self.client.write(_answer(req, exc, True))
        self.close()

    def hand_back(self) -> None:
        """Give the connection back to uvicorn with what came of the next request."""
        buf, self.buf = self.buf, b""
        self._let_go()
        self.closed = True
        self.paused.clear()
        self.proto.end_relay(buf)

    # port → client

    def answer_data(self, data: bytes) -> None:
        if self.tunnel and not self.inflight:
            self.client.write(data)
            return
        try:
            self._answer_data(data)
        except _Bad as exc:
            log.info("port %s of %s answered what is not HTTP/1.x: %s", self.up_key[1], self.up_key[0], exc)
            self.fail(PortUnreachable(f"port {self.up_key[1]} in the sandbox did not answer HTTP: {exc}"))

    def _answer_data(self, data: bytes) -> None:
        i, n = 0, len(data)
        start = 0
        while i < n:
            if self.abody is not None:
                i, done = self.abody.take(data, i)
                if done:
                    self.abody = None
                    self._answer_done()
                continue
            if self.until_close:
                i = n
                break
            if not self.inflight:
                raise _Bad("bytes with no request to answer")
            # an answer's head
            if self.ahead:
                data = self.ahead + data[i:]
                start = i = 0
                n = len(data)
                self.ahead = b""
            end = data.find(b"\r\n\r\n", i)
            if end < 0:
                if not data.startswith(b"HTTP/"[:n - i], i):
                    raise _Bad(f"{data[i:i + 40]!r}")
                self.ahead = data[i:]
                if len(self.ahead) > MAX_HEAD:
                    raise _Bad("an answer head larger than 64 KiB")
                if i > start:
                    self.client.write(data[start:i])
                return
            self._answer_head(data[i:end])
            i = end + 4
            if self.tunnel and not self.inflight:  # a 101: the rest is the WebSocket's
                i = n
                break
        if start < n:
            self.client.write(data if start == 0 else data[start:])

    def _answer_head(self, head: bytes) -> None:
        last = self.last_answer
        if last is not None and last[0] == head:
            status, close, length, chunked = last[1]
        else:
            framing = _framing(head)
            self.last_answer = (head, framing)
            status, close, length, chunked = framing
        self.answered = True
        self.retry = None
        method = self.inflight[0]
        if status < 200:
            if status == 101:
                if not self.tunnel:
                    raise _Bad("a 101 to a request that was no upgrade")
                self.inflight.pop(0)
            return  # (an interim answer: the final one follows)
        if self.tunnel:  # a handshake refused: the connection cannot go on as HTTP
            self.tunnel = False
            self.after_close = True
        if close:
            self.after_close = True
        if method == b"HEAD" or status in (204, 304):
            self._answer_done()
        elif chunked:
            self.abody = _Body(0, True)
        elif length is not None:
            if not length.isdigit():
                raise _Bad(f"a Content-Length that is not a length: {length[:20]!r}")
            if int(length):
                self.abody = _Body(int(length), False)
            else:
                self._answer_done()
        else:
            self.until_close = True
            self.after_close = True

    def _answer_done(self) -> None:
        self.inflight.pop(0)
        self.answered = False
        if self.up is not None:
            self.up.reused = True  # (the port may close it when it will: a request then goes again)
        if self.after_close and not self.inflight:
            self.proto.loop.call_soon(self.close)  # (once what is written of the answer is)
            return
        if not self.inflight and (self.buf or b"wait" in self.paused):
            self.resume(b"wait")
            self.proto.loop.call_soon(self.process)

    def upstream_ended(self, up: _Upstream) -> None:
        if up is not self.up or self.closed:
            return
        self.up, self.checked = None, None
        if self.tunnel and not self.inflight or self.until_close:
            self.close()
            return
        if not self.inflight and self.body is None:
            return  # between answers: the next request is checked anew
        if self.retry is not None and up.reused and not self.answered:  # a kept connection the port had closed
            self._again(self.retry)
            return
        if self.answered:
            log.info("port %s of %s broke off an answer", self.up_key[1], self.up_key[0])
            self.close()
            return
        self.fail(PortUnreachable(f"port {self.up_key[1]} in the sandbox closed the connection without an answer"))

    def _again(self, head: bytes) -> None:
        key = self.up_key

        async def again() -> None:
            try:
                up = await _connect(self.lane, *key)
            except DSecError as exc:
                self.fail(exc)
                return
            finally:
                self.busy = None
            if self.closed:
                up.close()
                return
            self._attach(up, key)
            up.transport.write(head)
            self.resume(b"wait")
            self.process()

        self.busy = self.proto.loop.create_task(again())
        self.pause(b"wait")

    # flow control and the end

    def pause(self, why: bytes) -> None:
        if not self.paused and not self.closed:
            self.client.pause_reading()
        self.paused.add(why)

    def resume(self, why: bytes) -> None:
        if why in self.paused:
            self.paused.discard(why)
            if not self.paused and not self.closed:
                self.client.resume_reading()

    def client_paused(self) -> None:
        if self.up is not None:
            self.up.transport.pause_reading()

    def client_resumed(self) -> None:
        if self.up is not None and not self.up.closed:
            self.up.transport.resume_reading()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        if self.busy is not None:
            self.busy.cancel()
        self._let_go()  # (kept for the next client, if between answers)
        self.client.close()


class _LaneProtocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol, its connections handed to the lane between requests when a
    port's request comes (module docstring)."""

    lane: PortLane

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.relay: _Relay | None = None
        self._mid = False  # uvicorn's parser is inside a request
        self._held = b""  # a head not yet whole, while between requests

    def on_message_begin(self) -> None:
        self._mid = True
        super().on_message_begin()

    def on_message_complete(self) -> None:
        self._mid = False
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        if self.relay is not None:
            self.relay.client_data(data)
            return
        if self._mid or self.pipeline or not (self.cycle is None or self.cycle.response_complete):
            super().data_received(data)
            return
        if self._held:
            data, self._held = self._held + data, b""
        end = data.find(b"\r\n\r\n")
        if end < 0:
            if len(data) < MAX_HEAD and self.parser is not None:
                self._held = data  # (which lane is not known before the head is whole)
                return
        elif self.lane.maybe(data[:end]):
            try:
                req = self.lane.classify(data[:end])
            except _Bad:
                req = None  # (uvicorn answers it)
            if req is not None:
                self._unset_keepalive_if_required()
                self.relay = _Relay(self, self.lane)
                self.relay.client_data(data)
                return
        super().data_received(data)

    def end_relay(self, rest: bytes) -> None:
        self.relay = None
        if rest and not self.transport.is_closing():
            self.transport.resume_reading()
            self.data_received(rest)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        if self.relay is not None and (self.relay.inflight or self.relay.tunnel):
            if self.relay.up is not None and self.relay.up.transport.can_write_eof():
                self.relay.up.transport.write_eof()
            return True  # (the answers still go back)
        return super().eof_received()

    def pause_writing(self) -> None:
        if self.relay is not None:
            self.relay.client_paused()
        else:
            super().pause_writing()

    def resume_writing(self) -> None:
        if self.relay is not None:
            self.relay.client_resumed()
        else:
            super().resume_writing()

    def shutdown(self) -> None:
        if self.relay is not None:
            self.relay.close()
        else:
            super().shutdown()


def lane_protocol(lane: PortLane) -> type[HttpToolsProtocol]:
    """uvicorn's ``http=`` for an apiserver whose port requests take ``lane``."""
    return type("PortLaneProtocol", (_LaneProtocol,), {"lane": lane})
