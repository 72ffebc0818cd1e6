"""``RemoteEdge``: a node in another process or on another machine, behind its own endpoint
(``dsec.edge.server``), as an ``EdgeAPI``.

Its methods are made from the node's operation table (``dsec.edge.ops``) when this module is
imported: one per operation, its path, body, answer and timeout taken from the entry. Written
here by hand are those that do more than one call: a create (its body serialised once: the
hottest call), a batch create's stream, a port's connection, a clean copy (checked by the node
alone), a build and a fncall batch (their timeouts). A body the entry streams (``body="stream"``)
goes whole when it is bytes, and as it comes (``_put_stream``) when it is an iterator.

Answers come back as the seam's models and errors as the error tree (the wire codes). A node
that cannot be reached — refused, reset, no answer in time, or an answer that is not the node
protocol — raises ``NodeUnreachable`` naming the node: a ``SandboxLost`` to whoever called on a
sandbox, and for a create the sign to place it elsewhere. Nothing here waits without a bound:
each call has a timeout (a command's own timeout plus slack, for exec and fncall).

Requests go through the SDK's lean HTTP client (``libdsec._wire``): one keep-alive pool per
node, a batch create's NDJSON stream read as it arrives on one of its connections.

Lifecycle: usable once made; ``await close()`` closes its connections (a second call does
nothing); a call after it raises ``NodeUnreachable``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import TypeVar
from urllib.parse import quote, urlencode, urlsplit

import httpx
import pydantic

from libdsec import DSecError
from libdsec._errors import error_from_wire
from libdsec._wire import Answer, WireClient, WireError
from libdsec.ops import Operation as Op, path_format
from libdsec.protocol import (
    BatchEvent,
    BuildImageRequest,
    CleanCopyRequest,
    CleanCopyResult,
    DSecContainerRunArgs,
    DSecFnCallArgs,
    ExecEvent,
    FnCallBatchRequest,
    FnCallBatchResult,
    FnCallResult,
    SandboxInfo,
    SandboxKind,
)

from .api import EdgeAPI, NodeUnreachable
from .ops import NODE_OPS, PREFIX, arguments, spread_fields
from .protocol import NodeBatchRequest, NodeBuildRequest
from .server import PORT_UPGRADE

PORT_READ_LIMIT = 256 << 10

# Bounds on a call's wait. A node's own work (a create, a stop) takes well under these; long
# ones (packing a layer, saving a VM's memory) get the long bound; commands their own timeout
# plus the slack.
CALL_TIMEOUT_S = 30.0
LONG_CALL_TIMEOUT_S = 600.0
SLACK_S = 30.0
# A batch stream may pause between sandboxes while the node starts them; not longer than this.
BATCH_IDLE_S = 120.0
MAX_CONNECTIONS = 256
# Connections kept open to a node between calls: one apiserver's pools to 160 nodes hold at
# most 160 × this many file descriptors, whatever bursts opened.
MAX_IDLE_CONNECTIONS = 32
# How long an idle connection to a node is kept: well below the node endpoint's own keep-alive
# (75 s), and long enough that the spare connections a node's busiest moments opened are still
# there for the next one (at 4 s, one single create in five opened a connection, paying the
# connect and accept on both ends).
IDLE_EXPIRY_S = 30.0

M = TypeVar("M", bound=pydantic.BaseModel)

# Batch streams being read, referenced until done (see RemoteEdge.create_batch).
_BATCHES: set[asyncio.Task] = set()


def _status_and_length(head: bytes) -> tuple[int, int]:
    """The status and content-length of an answer's head (``ValueError`` if it is none)."""
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return status, length


class RemoteEdge:
    """The node ``node`` at ``url`` (``http://host:port``), called with the node ``token``."""

    def __init__(self, node: str, url: str, token: str, *, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.node = node
        self.url = url.rstrip("/")
        self.call_timeout_s = call_timeout_s
        headers = {"authorization": f"Bearer {token}"}
        self._wire = WireClient(self.url, headers, MAX_CONNECTIONS, MAX_IDLE_CONNECTIONS, idle_expiry_s=IDLE_EXPIRY_S)
        self._headers = headers
        self._streaming: httpx.AsyncClient | None = None  # (streamed request bodies: _put_stream)
        self._closed = False

    def __repr__(self) -> str:
        return f"RemoteEdge({self.node!r}, {self.url!r})"

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._wire.aclose()
        if self._streaming is not None:
            await self._streaming.aclose()

    # -- transport ---------------------------------------------------------------------------

    def _unreachable(self, what: str) -> NodeUnreachable:
        return NodeUnreachable(f"node {self.node} ({self.url}) {what}")

    async def _call(self, method: str, path: str, *, model: pydantic.BaseModel | None = None,
                    body: bytes | None = None, params: dict[str, str] | None = None,
                    timeout: float | None = None, content_type: str = "application/octet-stream") -> Answer:
        if self._closed:
            raise self._unreachable("is closed on this side")
        if model is not None:
            body, content_type = model.model_dump_json().encode(), "application/json"
        try:
            answer = await self._wire.request(method, PREFIX + path, params=params, body=body,
                                              content_type=content_type, timeout=timeout or self.call_timeout_s)
        except WireError as exc:
            raise self._unreachable(f"did not answer {method} {path}: {exc}") from None
        if answer.status_code >= 400:
            raise self._error(answer.status_code, answer.content)
        return answer

    def _error(self, status: int, content: bytes) -> DSecError:
        try:
            body = json.loads(content)
        except (ValueError, UnicodeDecodeError):
            body = None
        if not (isinstance(body, dict) and isinstance(body.get("error"), dict) and "code" in body["error"]):
            return self._unreachable(f"answered what is not the node protocol: HTTP {status} {content[:200]!r}")
        return error_from_wire(body, status)

    def _parse(self, model: type[pydantic.BaseModel], answer: Answer):
        try:
            return model.model_validate_json(answer.content)
        except pydantic.ValidationError as exc:
            raise self._unreachable(f"answered what is not a {model.__name__}: {exc.errors()[0].get('msg')}") from None

    # -- written by hand (the others are made from the table, below) -----------------------

    async def create(self, args: DSecContainerRunArgs, kind: SandboxKind = SandboxKind.container,
                     project: str = "root") -> SandboxInfo:
        # A NodeCreateRequest's JSON, with the run args serialised once (not dumped to a dict,
        # validated into the request and dumped again): the hottest call of the seam.
        body = b'{"kind":%s,"project":%s,"args":%s}' % (
            json.dumps(kind).encode(), json.dumps(project).encode(), args.model_dump_json().encode())
        return self._parse(SandboxInfo, await self._call("POST", "/sandboxes", body=body, content_type="application/json"))

    async def create_batch(
        self, args: DSecContainerRunArgs, count: int, kind: SandboxKind = SandboxKind.container,
        project: str = "root", batch: str | None = None,
    ) -> AsyncIterator[tuple[int, SandboxInfo]]:
        """Yields (index, info) as the node streams them; all or none. The stream is read by a
        task of its own: when this is closed early, or fails, the task reads the stream to its
        end and stops every sandbox it names (the node undoes itself only once it sees the
        request gone, and may have sent the rest already)."""
        if self._closed:
            raise self._unreachable("is closed on this side")
        request = NodeBatchRequest(kind=kind, project=project, args=args.model_dump(mode="json"), count=count,
                                   batch=batch)
        queue: asyncio.Queue[tuple[int, SandboxInfo] | BaseException | None] = asyncio.Queue()
        state = {"abandoned": False}
        reader = asyncio.create_task(self._read_batch(request, queue, state))
        _BATCHES.add(reader)
        reader.add_done_callback(_BATCHES.discard)
        complete = False
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
            complete = True
        finally:
            if not complete:
                state["abandoned"] = True
                if reader.done():  # it read to the end already: what it made is undone here
                    undo = asyncio.create_task(self._stop_all(state["made"]))
                    _BATCHES.add(undo)
                    undo.add_done_callback(_BATCHES.discard)

    async def _stop_all(self, made: list[str]) -> None:
        await asyncio.gather(*(self.stop(sid, "batch create failed") for sid in made), return_exceptions=True)
        made.clear()

    async def _read_batch(self, request: NodeBatchRequest, queue: asyncio.Queue, state: dict) -> None:
        made: list[str] = state.setdefault("made", [])
        ok = False
        try:
            async with aclosing(self._lines(BatchEvent, "/sandboxes:batch", request, BATCH_IDLE_S)) as events:
                async for event in events:
                    if event.event == "created" and event.sandbox is not None and event.index is not None:
                        made.append(event.sandbox.id)
                        if not state["abandoned"]:
                            queue.put_nowait((event.index, event.sandbox))
                    elif event.event == "error":
                        made.clear()  # the node undid its batch itself
                        raise error_from_wire({"error": event.error}, 500)
                    elif event.event == "done":
                        if len(made) != request.count:
                            raise self._unreachable(f"ended a batch of {request.count} after {len(made)}")
                        queue.put_nowait(None)
                        ok = True
                        return
            raise self._unreachable(f"broke off a batch of {request.count} after {len(made)} sandboxes")
        except WireError as exc:
            queue.put_nowait(self._unreachable(f"did not answer a batch of {request.count} (after {len(made)}): {exc}"))
        except DSecError as exc:
            queue.put_nowait(exc)
        finally:
            if made and (state["abandoned"] or not ok):
                await self._stop_all(made)

    async def clean_copy(self, sandbox_id: str, keep: list[str]) -> CleanCopyResult:
        # Checked by the node (its errors are the ones the seam promises).
        return self._parse(CleanCopyResult, await self._call(
            "POST", f"/sandboxes/{sandbox_id}/clean_copy", model=CleanCopyRequest.model_construct(keep=keep),
            timeout=LONG_CALL_TIMEOUT_S))

    def build_image(self, build: BuildImageRequest, project: str = "root") -> AsyncIterator[ExecEvent]:
        return self._events("/images:build", NodeBuildRequest(project=project, build=build), build.timeout + SLACK_S)

    async def fncall_many(self, calls: list[DSecFnCallArgs]) -> list[FnCallResult]:
        longest = max((c.timeout for c in calls), default=0.0)
        answer = await self._call("POST", "/fncall:batch", model=FnCallBatchRequest(calls=calls),
                                  timeout=LONG_CALL_TIMEOUT_S + longest)
        return self._parse(FnCallBatchResult, answer).results

    async def connect_port(self, sandbox_id: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection of its own to the node, upgraded (``upgrade: dsec-port``) to the raw
        byte stream of the port's connection on the node (``dsec.edge.server``)."""
        if self._closed:
            raise self._unreachable("is closed on this side")
        url = urlsplit(self.url)
        path = f"{PREFIX}/sandboxes/{quote(sandbox_id, safe='')}/ports/{int(port)}:connect"
        head = (f"POST {path} HTTP/1.1\r\nhost: {url.netloc}\r\nauthorization: {self._headers['authorization']}\r\n"
                f"connection: upgrade\r\nupgrade: {PORT_UPGRADE}\r\ncontent-length: 0\r\n\r\n").encode("latin-1")
        writer = None
        try:
            async with asyncio.timeout(self.call_timeout_s):
                reader, writer = await asyncio.open_connection(url.hostname, url.port or 80, limit=PORT_READ_LIMIT)
                writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                writer.write(head)
                answer = await reader.readuntil(b"\r\n\r\n")
                status, length = _status_and_length(answer)
                if status == 101:
                    return reader, writer
                content = await reader.readexactly(length) if length else b""
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            if writer is not None:
                writer.close()
            raise self._unreachable(f"did not connect to port {port} of {sandbox_id}: {exc!r}") from None
        except BaseException:
            if writer is not None:
                writer.close()
            raise
        writer.close()
        raise self._error(status, content)

    async def _put_stream(self, route: str, params: dict[str, str], chunks: AsyncIterator[bytes]) -> None:
        """PUT a body streamed (chunked) as ``chunks`` come: the node hands it on as it arrives
        and reads no further than its consumer (TCP's flow control is the pace). httpx, not
        the wire client (which sends a body whole), on a client of its own made on first use."""
        if self._closed:
            raise self._unreachable("is closed on this side")
        if self._streaming is None:
            self._streaming = httpx.AsyncClient(base_url=self.url, headers=self._headers,
                                                timeout=httpx.Timeout(3600.0 + SLACK_S, connect=10.0))
        try:
            response = await self._streaming.put(PREFIX + route, params=params, content=chunks,
                                                 headers={"content-type": "application/octet-stream"})
        except httpx.TransportError as exc:
            raise self._unreachable(f"broke off a streamed PUT {route}: {exc!r}") from None
        if response.status_code >= 400:
            raise self._error(response.status_code, response.content)

    async def _raw(self, route: str, params: dict[str, str], timeout: float, what: str) -> AsyncIterator[bytes]:
        """The answer's bytes as they come; ``timeout``: the longest silence between two pieces."""
        if self._closed:
            raise self._unreachable("is closed on this side")
        target = f"{PREFIX}{route}?{urlencode(params)}"
        try:
            async with self._wire.stream("GET", target, timeout=timeout) as response:
                if response.status_code >= 400:
                    raise self._error(response.status_code, await response.read())
                async for chunk in response.chunks():
                    yield chunk
        except WireError as exc:
            raise self._unreachable(f"broke off {what}: {exc}") from None

    async def _events(self, path: str, request: pydantic.BaseModel, timeout: float) -> AsyncIterator[ExecEvent]:
        """The node's NDJSON lines as events, read as the consumer asks for them (so TCP's flow
        control carries its pace to the node). Between two lines the node may be silent for
        ``timeout`` (as long as the command is: its timeout plus the slack)."""
        if self._closed:
            raise self._unreachable("is closed on this side")
        try:
            async with aclosing(self._lines(ExecEvent, path, request, timeout)) as events:
                async for event in events:
                    yield event
                    if event.event in ("exit", "error"):
                        return
        except WireError as exc:
            raise self._unreachable(f"broke off a streamed command: {exc}") from None
        raise self._unreachable("ended a streamed command without its exit")

    async def _lines(self, model: type[M], path: str, request: pydantic.BaseModel, timeout: float) -> AsyncIterator[M]:
        """POST ``request`` and read the node's NDJSON answer as ``model``s, one a line, as the
        consumer asks for them; an error status is the node's typed error. ``timeout``: the
        longest silence between two lines."""
        async with self._wire.stream("POST", PREFIX + path, body=request.model_dump_json().encode(),
                                     content_type="application/json", timeout=timeout) as response:
            if response.status_code >= 400:
                raise self._error(response.status_code, await response.read())
            rest = b""
            async for chunk in response.chunks():
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    try:
                        item = model.model_validate_json(line)
                    except pydantic.ValidationError:
                        raise self._unreachable(f"sent a line that is not a {model.__name__}: {line[:200]!r}") from None
                    yield item


_QUERY_FORMATS: dict[str, Callable[[object], str]] = {"str": str, "int": str, "mode": oct, "opt": str}


def _method(op: Op) -> Callable:
    """``RemoteEdge``'s method for ``op``: its arguments bound as ``EdgeAPI``'s, the request
    made as the entry says, the answer read by its shape. Everything but the call's own values
    is worked out here, once."""
    signature = inspect.signature(getattr(EdgeAPI, op.name))
    names = arguments(op)
    defaults = {n: p.default for n, p in signature.parameters.items() if p.default is not p.empty}
    path, verb, model, arg = path_format(op.path), op.method, op.request, op.request_arg
    answer_model, unwrap, as_bytes = op.answer, op.unwrap, op.answers == "bytes"
    queries = tuple((n, _QUERY_FORMATS[kind]) for n, kind in op.query_params)
    fields = spread_fields(op) if op.spread else None
    raw, streamed = op.body_shape in ("bytes", "stream"), op.body_shape == "stream"
    own = op.timeout == "own"
    # "call": the client's own bound (None); seconds: plus the slack, but for a body streamed
    # (its seconds bound the whole upload: ``libdsec.ops``).
    fixed = {"call": None, "long": LONG_CALL_TIMEOUT_S, "own": None}.get(op.timeout) if isinstance(op.timeout, str) \
        else op.timeout + (0.0 if streamed else SLACK_S)

    def bind(args: tuple, kwargs: dict) -> dict:
        if not kwargs and len(args) == len(names):
            return dict(zip(names, args))
        values = {**defaults, **dict(zip(names, args)), **kwargs}
        if len(args) > len(names) or len(values) != len(names):
            raise TypeError(f"{op.name}() takes ({', '.join(names)}), not {args!r} {kwargs!r}")
        return values

    def request_of(values: dict) -> pydantic.BaseModel | None:
        if model is None:
            return None
        return model(**{f: values[f] for f in fields}) if fields is not None else values[arg]

    def timeout_of(request) -> float | None:
        return max(request.timeout, 0) + SLACK_S if own else fixed

    if op.answers == "lines":
        def method(self, *args, **kwargs):
            values = bind(args, kwargs)
            request = request_of(values)
            return self._events(path.format_map(values), request, timeout_of(request))
    elif op.answers == "chunks":
        def method(self, *args, **kwargs):
            values = bind(args, kwargs)
            return self._raw(path.format_map(values), {n: f(values[n]) for n, f in queries}, timeout_of(None),
                             op.name)
    else:
        async def method(self, *args, **kwargs):
            values = bind(args, kwargs)
            request = request_of(values)
            params = {n: f(values[n]) for n, f in queries if values[n] is not None} if queries else None
            body = values[arg] if raw else None
            if streamed and not isinstance(body, (bytes, bytearray, memoryview)):
                return await self._put_stream(path.format_map(values), params or {}, body)
            answer = await self._call(verb, path.format_map(values), model=request,
                                      body=None if body is None else bytes(body), params=params,
                                      timeout=timeout_of(request))
            if as_bytes:
                return answer.content
            if answer_model is None:
                return None
            result = self._parse(answer_model, answer)
            return getattr(result, unwrap) if unwrap is not None else result
    method.__name__, method.__qualname__ = op.name, f"RemoteEdge.{op.name}"
    method.__signature__ = signature
    method.__doc__ = getattr(EdgeAPI, op.name).__doc__
    return method


for _op in NODE_OPS:  # the operations not written by hand above
    if _op.name not in vars(RemoteEdge):
        setattr(RemoteEdge, _op.name, _method(_op))
del _op
