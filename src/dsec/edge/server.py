"""A node's own HTTP endpoint: the node seam (``EdgeAPI``) served to apiservers elsewhere.

One route per seam operation under ``/node/v1``, made from its entry in the table of
``dsec.edge.ops`` (one generic call: path parameters, query and body parsed by their types and
the operation's model, then the edge's method by its name; the answer written by its shape).
Bodies and answers are the models of ``libdsec.protocol`` and ``dsec.edge.protocol``; errors
are ``{"error": {"code", "message"}}`` with the error tree's codes and statuses
(``dsec.edge.remote.RemoteEdge`` maps them back). Every request carries the
cluster's node token (``authorization: Bearer …``), which only apiservers hold.

No framework and no ASGI server: the routes are a fixed table the apiserver alone calls, and
every request of a create passes through here, so it does only what the seam needs — an
asyncio protocol parses HTTP/1.1 with httptools (the parser under uvicorn), matches the route,
parses the body with the operation's model, calls the edge and writes the answer in one
piece. Under uvicorn the HTTP layer cost a node more CPU than a create on the fake backend
(and it wrote each answer's head and body apart: a system call each, and a wake-up of the
reader each). A batch create is answered as an NDJSON stream of ``BatchEvent`` lines, as the
apiserver answers its own clients, the lines that are ready together in one chunk; a caller
that goes away mid-stream closes the edge's batch, which then undoes itself (all or none).

``NodeServer(edge, token, host, port)`` serves one edge on its own listening socket in the
running loop (the simulated nodes of ``dsec bench cluster`` are many edges in a few processes).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import socket
import time
from collections import deque
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from urllib.parse import parse_qs

import httptools
import pydantic

from libdsec import DSecError, InvalidRequest
from libdsec.ops import PARAM_TYPES, Operation as Op, path_regex
from libdsec.protocol import BatchEvent

from .api import EdgeAPI
from .files import file_mode
from .ops import NODE_OPS, PREFIX, spread_fields
from .protocol import NodeBatchRequest, NodeCreateRequest
from .stream import TERMINAL

log = logging.getLogger("dsec.edge.server")

_OK = b'{"ok":true}'
PORT_UPGRADE = "dsec-port"
_PORT_CHUNK = 256 << 10

# Edge method arguments made from a request, by the request's parts. A function per operation,
# made here once; a request costs it what its own parsing costs.
Call = Callable[[EdgeAPI, dict, bytes, object], object]


def _parse(model: type[pydantic.BaseModel], body: bytes) -> pydantic.BaseModel:
    try:
        return model.model_validate_json(body or b"{}")
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise InvalidRequest(f"malformed {model.__name__}: {where}: {first.get('msg')}") from None


def _required(name: str, value: str | None) -> str:
    if not value:
        raise InvalidRequest(f"missing query parameter {name!r}")
    return value


_QUERY_TYPES: dict[str, Callable[[str, str | None], object]] = {
    "str": _required,
    "int": lambda name, value: int(_required(name, value)),
    "mode": lambda name, value: file_mode("0o644" if value is None else value),
    "opt": lambda name, value: value or None,
}


def _caller(op: Op) -> Call:
    """The call of ``op``'s method for one request: (edge, path parameters, query, body) to
    what the method returns (an awaitable, or an async iterator for a stream)."""
    name, model, arg = op.name, op.request, op.request_arg
    converted = tuple((n, PARAM_TYPES[kind][1]) for n, kind in op.params if PARAM_TYPES[kind][1] is not str)
    queries = tuple((n, _QUERY_TYPES[kind]) for n, kind in op.query_params)
    fields = spread_fields(op)
    raw = op.body_shape in ("bytes", "stream")

    def call(edge: EdgeAPI, kw: dict, query: bytes, body) -> object:
        for n, convert in converted:
            kw[n] = convert(kw[n])
        if queries:
            values = {k: v[-1] for k, v in parse_qs(query.decode("latin-1")).items()} if query else {}
            for n, convert in queries:
                kw[n] = convert(n, values.get(n))
        if model is not None:
            request = _parse(model, body)
            if fields:
                for f in fields:
                    kw[f] = getattr(request, f)
            else:
                kw[arg] = request
        elif raw:
            kw[arg] = body
        return getattr(edge, name)(**kw)
    return call


def _run_args(req: NodeCreateRequest):
    try:
        return req.run_args()
    except (pydantic.ValidationError, ValueError) as exc:
        raise InvalidRequest(f"malformed run args for a {req.kind.value}: {exc}") from None


def _create(edge: EdgeAPI, kw: dict, query: bytes, body) -> object:
    req = _parse(NodeCreateRequest, body)
    return edge.create(_run_args(req), req.kind, req.project)


@dataclass(frozen=True, slots=True)
class _Route:
    op: Op
    call: Call
    answer: str  # the EdgeApp method that writes its answer


def _route(op: Op) -> _Route:
    answer = {"lines": "_lines", "chunks": "_chunks", "upgrade": "_port"}.get(op.answers, "_one")
    if op.name == "create_batch":
        answer = "_batch"
    return _Route(op, _create if op.name == "create" else _caller(op), answer)


# The routes, in the table's order (the hot ones first): those without parameters by their
# path, the others tried in turn. Upgrades are matched apart (only an upgrade request may take
# one); so are the routes whose request body is handed on as it arrives (a tar, a file of any
# size), as soon as the request's head is read.
_PLAIN: dict[tuple[str, str], _Route] = {}
_MATCHED: dict[str, list[tuple[re.Pattern[str], _Route]]] = {}
_UPGRADES: list[tuple[re.Pattern[str], _Route]] = []
_STREAMED_BODIES: dict[str, list[re.Pattern[str]]] = {}
for _op in NODE_OPS:
    _pattern = path_regex(_op.path, PREFIX)
    if _op.answers == "upgrade":
        _UPGRADES.append((_pattern, _route(_op)))
    elif not _op.params:
        _PLAIN[(_op.method, PREFIX + _op.path)] = _route(_op)
    else:
        _MATCHED.setdefault(_op.method, []).append((_pattern, _route(_op)))
    if _op.body_shape == "stream":
        _STREAMED_BODIES.setdefault(_op.method, []).append(_pattern)
del _op, _pattern


def _match(method: str, path: str) -> tuple[_Route, dict[str, str]] | None:
    if (route := _PLAIN.get((method, path))) is not None:
        return route, {}
    for pattern, route in _MATCHED.get(method, ()):
        if (m := pattern.match(path)) is not None:
            return route, m.groupdict()
    return None


def _error_answer(exc: BaseException) -> tuple[int, bytes]:
    if isinstance(exc, DSecError):
        return exc.status, json.dumps(exc.to_wire()).encode()
    log.exception("unexpected error in a node call", exc_info=exc)
    body = {"error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}}
    return 500, json.dumps(body).encode()


_REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found", 409: b"Conflict",
            410: b"Gone", 413: b"Payload Too Large", 422: b"Unprocessable Entity", 429: b"Too Many Requests",
            500: b"Internal Server Error", 502: b"Bad Gateway", 503: b"Service Unavailable"}
# Connections with no request for this long are closed (the apiserver's own pools let theirs go
# after a few seconds; this is for callers that never come back).
IDLE_TIMEOUT_S = 75.0
SHUTDOWN_GRACE_S = 5.0


def _head(status: int, content_type: bytes, length: int | None, keep_alive: bool) -> bytes:
    reason = _REASONS.get(status, b"Unknown")
    framing = b"transfer-encoding: chunked" if length is None else b"content-length: %d" % length
    return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\n%s\r\n%s\r\n"
            % (status, reason, content_type, framing, b"" if keep_alive else b"connection: close\r\n"))


@dataclass(slots=True)
class _Request:
    method: str
    path: str
    query: bytes
    authorization: bytes
    body: bytes
    keep_alive: bool
    stream: _BodyStream | None = None
    upgrade: bool = False


_BODY_HIGH, _BODY_LOW = 1 << 20, 1 << 18
_DROP_REST_S = 5.0


class _BodyStream:
    """A request body as it arrives: chunks kept here up to ~1 MiB, past which the connection
    stops reading (TCP's flow control carries the pace to the caller) until the consumer
    caught up. Iterated once; a caller gone mid-body fails it."""

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.chunks: deque[bytes] = deque()
        self.held = 0
        self.complete = False
        self.failed: BaseException | None = None
        self.paused = False
        self.dropping = False
        self._more = asyncio.Event()

    async def drop_rest(self, timeout: float) -> None:
        """Drop what is left of the body as it arrives, until its end or ``timeout``."""
        self.dropping = True
        self.chunks.clear()
        self.held = 0
        if self.paused and self.conn.transport is not None:
            self.paused = False
            self.conn.transport.resume_reading()
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.complete and self.failed is None:
            self._more.clear()
            try:
                async with asyncio.timeout_at(deadline):
                    await self._more.wait()
            except TimeoutError:
                return

    def feed(self, data: bytes) -> None:
        if self.dropping:
            return
        self.chunks.append(bytes(data))
        self.held += len(data)
        self._more.set()
        if self.held > _BODY_HIGH and not self.paused and self.conn.transport is not None:
            self.paused = True
            self.conn.transport.pause_reading()

    def end(self, failure: BaseException | None = None) -> None:
        self.complete = failure is None
        self.failed = failure
        self._more.set()

    async def __aiter__(self):
        while True:
            if self.chunks:
                chunk = self.chunks.popleft()
                self.held -= len(chunk)
                if self.paused and self.held < _BODY_LOW and self.conn.transport is not None:
                    self.paused = False
                    self.conn.transport.resume_reading()
                yield chunk
                continue
            if self.failed is not None:
                raise InvalidRequest(f"the request's body broke off: {self.failed}")
            if self.complete:
                return
            self._more.clear()
            await self._more.wait()


class _Connection(asyncio.Protocol):
    """One caller's connection: requests parsed by httptools, answered one after another (as
    HTTP/1.1 wants), each answer written in one piece (a batch's lines as they come, those
    ready together in one piece)."""

    def __init__(self, server: NodeServer) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.requests: deque[_Request] = deque()
        self.task: asyncio.Task | None = None
        self.idle_since = time.monotonic()
        self.gone = asyncio.Event()  # the caller went away
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._url = b""
        self._authorization = b""
        self._body: list[bytes] = []
        self._stream: _BodyStream | None = None  # the body of the request being read, if streamed
        self._upgrade = False
        self.raw: asyncio.StreamReader | None = None  # after an upgrade: the caller's bytes

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)

    def connection_lost(self, exc) -> None:
        if self.raw is not None:
            self.raw.feed_eof()
        if self._stream is not None:
            self._stream.end(exc or ConnectionError("the caller closed the connection"))
            self._stream = None
        self.server.connections.discard(self)
        self.gone.set()
        self._can_write.set()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def data_received(self, data: bytes) -> None:
        if self.raw is not None:
            self.raw.feed_data(data)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            if not (self.requests and self.requests[-1].upgrade):
                self._fail(400, "upgrades are not served")
                return
            # The bytes after the head are the raw stream's (dsec-port: the caller's side of a
            # port's connection); TCP's flow control paces the caller (the reader pauses us).
            self.raw = asyncio.StreamReader(limit=_PORT_CHUNK)
            self.raw.set_transport(self.transport)
            if rest := data[exc.args[0]:]:
                self.raw.feed_data(rest)
        except httptools.HttpParserError as exc:
            self._fail(400, f"malformed HTTP request: {exc}")

    def eof_received(self) -> bool:
        if self.raw is not None:
            self.raw.feed_eof()
            return True  # half-closed: the answer's side goes on
        return False

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._authorization, self._body, self._upgrade = b"", b"", [], False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"authorization":
            self._authorization = value

    def on_headers_complete(self) -> None:
        url = httptools.parse_url(self._url)
        method, path = self.parser.get_method().decode("latin-1"), url.path.decode("latin-1")
        self._upgrade = self.parser.should_upgrade()
        if any(p.match(path) for p in _STREAMED_BODIES.get(method, ())):
            self._stream = _BodyStream(self)
            self._enqueue(_Request(method=method, path=path, query=url.query or b"", authorization=self._authorization,
                                   body=b"", keep_alive=self.parser.should_keep_alive(), stream=self._stream))

    def on_body(self, body: bytes) -> None:
        if self._stream is not None:
            self._stream.feed(body)
        else:
            self._body.append(body)

    def _enqueue(self, request: _Request) -> None:
        self.requests.append(request)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._serve())

    def on_message_complete(self) -> None:
        if self._stream is not None:
            self._stream.end()
            self._stream = None
            return
        url = httptools.parse_url(self._url)
        self._enqueue(_Request(
            method=self.parser.get_method().decode("latin-1"), path=url.path.decode("latin-1"),
            query=url.query or b"", authorization=self._authorization, body=b"".join(self._body),
            keep_alive=self.parser.should_keep_alive() and not self._upgrade, upgrade=self._upgrade))

    # -- answering ---------------------------------------------------------------------------

    def _fail(self, status: int, message: str) -> None:
        if self.transport is not None and not self.transport.is_closing():
            body = json.dumps({"error": {"code": "invalid_request", "message": message}}).encode()
            self.transport.write(_head(status, b"application/json", len(body), False) + body)
            self.transport.close()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def drain(self) -> None:
        if not self._can_write.is_set():
            await self._can_write.wait()

    async def _serve(self) -> None:
        try:
            while self.requests and not self.gone.is_set():
                request = self.requests.popleft()
                await self.server.app.answer(request, self)
                if request.stream is not None and not request.stream.complete:
                    # Answered before its body was all read (an error): the rest is read and
                    # dropped for a while, so the caller, still sending, gets to read the answer.
                    await request.stream.drop_rest(_DROP_REST_S)
                    if self.transport is not None:
                        self.transport.close()
                    return
                if not request.keep_alive:
                    if self.transport is not None:
                        self.transport.close()
                    return
                self.idle_since = time.monotonic()
        except Exception:  # noqa: BLE001 - a bug here must not leave the caller hanging
            log.exception("a node connection failed")
            if self.transport is not None:
                self.transport.close()
        finally:
            self.task = None


class EdgeApp:
    """Answers the seam's requests for one edge, to callers holding ``token``."""

    def __init__(self, edge: EdgeAPI, token: str) -> None:
        self.edge = edge
        self._auth = f"Bearer {token}".encode()

    async def answer(self, request: _Request, conn: _Connection) -> None:
        keep = request.keep_alive
        if not hmac.compare_digest(request.authorization, self._auth):
            body = b'{"error":{"code":"unauthenticated","message":"wrong or missing node token"}}'
            conn.write(_head(401, b"application/json", len(body), keep) + body)
            return
        method, path = request.method, request.path
        if request.upgrade:
            await self._port(request, conn)
            return
        if (found := _match(method, path)) is None:
            body = json.dumps({"error": {"code": "invalid_request", "message": f"no node route {method} {path}"}}).encode()
            conn.write(_head(404, b"application/json", len(body), keep) + body)
            return
        route, params = found
        await getattr(self, route.answer)(route, params, request, conn)

    async def _one(self, route: _Route, params: dict, request: _Request, conn: _Connection) -> None:
        """An answer in one piece: the answer model's JSON (``{"ok":true}`` for none), or bytes."""
        keep = request.keep_alive
        content_type = b"application/json"
        try:
            result = await route.call(self.edge, params, request.query,
                                      request.stream if request.stream is not None else request.body)
        except Exception as exc:  # noqa: BLE001 - every error becomes its wire answer
            status, body = _error_answer(exc)
        else:
            status = 200
            if result is None:
                body = _OK
            elif isinstance(result, bytes):
                body, content_type = result, b"application/octet-stream"
            elif route.op.unwrap is not None:
                body = route.op.answer(**{route.op.unwrap: result}).model_dump_json().encode()
            else:
                body = result.model_dump_json().encode()
        if request.stream is not None and not request.stream.complete:
            keep = request.keep_alive = False  # (the rest of its body is not read: the connection ends)
        conn.write(_head(status, content_type, len(body), keep) + body)

    async def _port(self, request: _Request, conn: _Connection) -> None:
        """``POST …/ports/PORT:connect`` with ``upgrade: dsec-port``: 101, then the connection
        carries the raw bytes of a connection to that port inside the sandbox, both ways, each
        side's end of sending passed on (a half-close), until both ended or either broke."""
        try:
            for pattern, route in _UPGRADES:
                if request.method == route.op.method and (m := pattern.match(request.path)) is not None:
                    break
            else:
                raise InvalidRequest(f"no node route to upgrade: {request.method} {request.path}")
            reader, writer = await route.call(self.edge, m.groupdict(), request.query, request.body)
        except Exception as exc:  # noqa: BLE001 - every error becomes its wire answer
            status, body = _error_answer(exc)
            conn.write(_head(status, b"application/json", len(body), False) + body)
            return
        conn.write(b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: %s\r\n\r\n"
                   % PORT_UPGRADE.encode())
        await relay_port(conn, reader, writer)

    async def _batch(self, route: _Route, params: dict, request: _Request, conn: _Connection) -> None:
        """A batch create: NDJSON ``BatchEvent`` lines, those ready together in one chunk; a
        caller that goes away mid-stream closes the edge's batch, which undoes itself."""
        keep = request.keep_alive
        try:
            req = _parse(NodeBatchRequest, request.body)
            args = _run_args(req)
            events = self.edge.create_batch(args, req.count, req.kind, req.project, req.batch)
            first = await anext(events)
        except StopAsyncIteration:
            body = BatchEvent(event="done").model_dump_json().encode() + b"\n"
            conn.write(_head(200, _NDJSON, len(body), keep) + body)
            return
        except Exception as exc:  # noqa: BLE001 - the batch's first error is a plain answer
            status, body = _error_answer(exc)
            conn.write(_head(status, b"application/json", len(body), keep) + body)
            return
        # Lines are gathered and written once the batch waits for its next sandbox: the ones
        # that came up together leave in one chunk (a write each cost the node as much CPU as
        # starting the sandbox on the fake backend).
        lines: list[bytes] = []
        loop = asyncio.get_running_loop()
        flushing = False

        def flush() -> None:
            nonlocal flushing
            flushing = False
            if lines:
                data = b"".join(lines)
                lines.clear()
                conn.write(b"%x\r\n%s\r\n" % (len(data), data))

        def line(event: BatchEvent) -> None:
            nonlocal flushing
            lines.append(event.model_dump_json().encode() + b"\n")
            if not flushing:
                flushing = True
                loop.call_soon(flush)

        conn.write(_head(200, _NDJSON, None, keep))
        made: list[str] = []
        async with aclosing(events):
            try:
                index, info = first
                made.append(info.id)
                line(BatchEvent(event="created", index=index, sandbox=info))
                async for index, info in events:
                    if conn.gone.is_set():
                        log.warning("a batch's caller went away: undoing it")
                        return
                    made.append(info.id)
                    line(BatchEvent(event="created", index=index, sandbox=info))
                    await conn.drain()
                end = BatchEvent(event="done")
            except DSecError as exc:
                end = BatchEvent(event="error", error=exc.to_wire()["error"])
        if conn.gone.is_set():  # complete, but the caller may not have learnt every id
            log.warning("a batch's caller went away at its end: stopping its %d sandboxes", len(made))
            await asyncio.gather(*(self.edge.stop(sid, "batch abandoned by its caller") for sid in made),
                                 return_exceptions=True)
            return
        line(end)
        flush()
        conn.write(b"0\r\n\r\n")


    async def _lines(self, route: _Route, params: dict, request: _Request, conn: _Connection) -> None:
        """A streamed command: NDJSON ``ExecEvent`` lines, each written once the last drained
        (the caller's pace is the command's); a caller that goes away kills the command."""
        keep = request.keep_alive
        try:
            events = route.call(self.edge, params, request.query, request.body)
            first = await anext(events)
        except Exception as exc:  # noqa: BLE001 - an error before the start is a plain answer
            status, body = _error_answer(exc)
            conn.write(_head(status, b"application/json", len(body), keep) + body)
            return
        conn.write(_head(200, _NDJSON, None, keep))
        gone = asyncio.ensure_future(conn.gone.wait())
        async with aclosing(events):
            try:
                event = first
                while True:
                    data = event.model_dump_json().encode() + b"\n"
                    conn.write(b"%x\r\n%s\r\n" % (len(data), data))
                    if event.event in TERMINAL:
                        break
                    await conn.drain()
                    step = asyncio.ensure_future(anext(events))
                    await asyncio.wait([step, gone], return_when=asyncio.FIRST_COMPLETED)
                    if not step.done():
                        step.cancel()
                        await asyncio.gather(step, return_exceptions=True)
                        return  # the caller went away: the command is killed
                    try:
                        event = step.result()
                    except StopAsyncIteration:
                        break
            finally:
                gone.cancel()
        conn.write(b"0\r\n\r\n")


    async def _chunks(self, route: _Route, params: dict, request: _Request, conn: _Connection) -> None:
        """Bytes (a tar), each chunk written once the last drained; an error after the start
        breaks the connection off without the last chunk (the caller sees an incomplete
        answer), a caller that goes away ends the command."""
        keep = request.keep_alive
        try:
            chunks = route.call(self.edge, params, request.query, request.body)
            first = await anext(chunks)
        except StopAsyncIteration:
            first = b""
        except Exception as exc:  # noqa: BLE001 - an error before the start is a plain answer
            status, body = _error_answer(exc)
            conn.write(_head(status, b"application/json", len(body), keep) + body)
            return
        conn.write(_head(200, b"application/x-tar", None, keep))
        gone = asyncio.ensure_future(conn.gone.wait())
        async with aclosing(chunks):
            try:
                data = first
                while True:
                    if data:
                        conn.write(b"%x\r\n%s\r\n" % (len(data), data))
                    await conn.drain()
                    step = asyncio.ensure_future(anext(chunks))
                    await asyncio.wait([step, gone], return_when=asyncio.FIRST_COMPLETED)
                    if not step.done():
                        step.cancel()
                        await asyncio.gather(step, return_exceptions=True)
                        return
                    try:
                        data = step.result()
                    except StopAsyncIteration:
                        break
                    except Exception:  # noqa: BLE001 - broken off: no end of the answer
                        log.warning("a tree download broke off", exc_info=True)
                        if conn.transport is not None:
                            conn.transport.close()
                        return
            finally:
                gone.cancel()
        conn.write(b"0\r\n\r\n")


_NDJSON = b"application/x-ndjson"


async def relay_port(conn: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The caller's raw bytes (``conn.raw``) to the port and the port's to the caller, until
    both sides ended sending, either broke, or the caller went away; then both are closed."""
    async def to_port() -> None:
        while data := await conn.raw.read(_PORT_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    async def to_caller() -> None:
        while data := await reader.read(_PORT_CHUNK):
            conn.write(data)
            await conn.drain()
        if conn.transport is not None and not conn.transport.is_closing() and conn.transport.can_write_eof():
            conn.transport.write_eof()

    tasks = [asyncio.ensure_future(to_port()), asyncio.ensure_future(to_caller())]
    gone = asyncio.ensure_future(conn.gone.wait())
    try:
        pending = set(tasks)
        while pending and not gone.done():
            done, pending = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(gone)
            if any(t.exception() is not None for t in done if t is not gone):
                break
    finally:
        for task in (*tasks, gone):
            task.cancel()
        await asyncio.gather(*tasks, gone, return_exceptions=True)
        writer.close()
        if conn.transport is not None:
            conn.transport.close()


class NodeServer:
    """One edge's endpoint, served in the running loop. ``await start()`` binds and returns its
    URL; ``await close()`` stops serving — requests under way get a few seconds to finish —
    (a second call does nothing; the edge is not closed)."""

    def __init__(self, edge: EdgeAPI, token: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.edge, self.token, self.host, self.port = edge, token, host, port
        self.app = EdgeApp(edge, token)
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task | None = None
        self.url = ""

    async def start(self) -> str:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(1024)
        sock.setblocking(False)
        host, port = sock.getsockname()[:2]
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=sock)
        self._sweeper = loop.create_task(self._sweep(), name=f"dsec-node-{self.edge.node}-idle")
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        return self.url

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(IDLE_TIMEOUT_S / 4)
            now = time.monotonic()
            for conn in list(self.connections):
                if conn.task is None and not conn.requests and now - conn.idle_since > IDLE_TIMEOUT_S:
                    if conn.transport is not None:
                        conn.transport.close()

    async def close(self) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        if self._sweeper is not None:
            self._sweeper.cancel()
        server.close()
        busy = [c.task for c in self.connections if c.task is not None]
        for conn in list(self.connections):
            if conn.task is None and conn.transport is not None:
                conn.transport.close()
        if busy:
            await asyncio.wait(busy, timeout=SHUTDOWN_GRACE_S)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        await server.wait_closed()
