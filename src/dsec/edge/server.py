"""A node's own HTTP endpoint: the node seam (``EdgeAPI``) served to apiservers elsewhere.

One route per seam operation under ``/node/v1``, bodies and answers the models of
``libdsec.protocol``, errors as ``{"error": {"code", "message"}}`` with the error tree's codes
and statuses (``dsec.edge.remote.RemoteEdge`` maps them back). Every request carries the
cluster's node token (``authorization: Bearer …``), which only apiservers hold.

A plain ASGI app, no framework: the routes are a fixed table the apiserver alone calls, and
every request of a create passes through here, so it does only what the seam needs — match,
parse the body with the operation's model, call the edge, write the answer. A batch create is
answered as an NDJSON stream of ``BatchEvent`` lines, as the apiserver answers its own clients;
a caller that goes away mid-stream closes the edge's batch, which then undoes itself (all or
none).

``serve(edges, host, port, token)`` runs one listening socket per edge in this process's loop
(the simulated nodes of ``dsec bench cluster`` are many edges in a few processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import socket
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from urllib.parse import parse_qs

import pydantic
import uvicorn

from libdsec import DSecError, InvalidRequest
from libdsec.protocol import (
    BatchEvent,
    DSecFnCallArgs,
    ExecRequest,
    FnCallBatchRequest,
    FnCallBatchResult,
    ImageList,
    ImageRemoveRequest,
    LayerGCRequest,
    LayerGCResult,
    NetworkRulesRequest,
    NodeBatchRequest,
    NodeCreateRequest,
    NodeStopRequest,
    PackDiffRequest,
    SandboxList,
    SecurityEventList,
)

from .api import EdgeAPI

log = logging.getLogger("dsec.edge.server")

PREFIX = "/node/v1"
_JSON = [(b"content-type", b"application/json")]
_OK = b'{"ok":true}'

Handler = Callable[["_Call"], Awaitable[object]]


@dataclass(slots=True)
class _Call:
    edge: EdgeAPI
    params: dict[str, str]  # from the path
    query: dict[str, str]
    body: bytes

    def parse(self, model: type[pydantic.BaseModel]) -> pydantic.BaseModel:
        try:
            return model.model_validate_json(self.body or b"{}")
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "body"
            raise InvalidRequest(f"malformed {model.__name__}: {where}: {first.get('msg')}") from None

    def arg(self, name: str) -> str:
        value = self.query.get(name)
        if not value:
            raise InvalidRequest(f"missing query parameter {name!r}")
        return value


def _routes() -> list[tuple[str, re.Pattern[str], Handler]]:
    sid = r"(?P<sid>[^/]+)"

    async def info(c: _Call):
        return await c.edge.node_info()

    async def layer_use(c: _Call):
        return await c.edge.layer_use()

    async def images(c: _Call):
        return ImageList(images=await c.edge.list_images())

    async def inspect_image(c: _Call):
        return await c.edge.inspect_image(c.params["ref"])

    async def remove_image(c: _Call):
        await c.edge.remove_image(c.params["ref"], frozenset(c.parse(ImageRemoveRequest).in_use))
        return None

    async def gc(c: _Call):
        return LayerGCResult(removed=await c.edge.gc_layers(frozenset(c.parse(LayerGCRequest).in_use)))

    async def create(c: _Call):
        req = c.parse(NodeCreateRequest)
        return await c.edge.create(_run_args(req), req.kind.value, req.project)

    async def listing(c: _Call):
        return SandboxList(sandboxes=await c.edge.list())

    async def get(c: _Call):
        return await c.edge.get(c.params["sid"])

    async def stop(c: _Call):
        return await c.edge.stop(c.params["sid"], c.parse(NodeStopRequest).reason)

    async def pause(c: _Call):
        return await c.edge.pause(c.params["sid"])

    async def resume(c: _Call):
        return await c.edge.resume(c.params["sid"])

    async def snapshot(c: _Call):
        return await c.edge.snapshot(c.params["sid"])

    async def pack_diff(c: _Call):
        req = c.parse(PackDiffRequest)
        return await c.edge.pack_diff(c.params["sid"], req.name, req.role)

    async def exec_(c: _Call):
        return await c.edge.exec(c.params["sid"], c.parse(ExecRequest))

    async def read_file(c: _Call):
        return await c.edge.read_file(c.params["sid"], c.arg("path"))

    async def write_file(c: _Call):
        try:
            mode = int(c.query.get("mode", "0o644"), 0)
        except ValueError:
            raise InvalidRequest(f"invalid file mode {c.query.get('mode')!r}: use octal like 0o644") from None
        await c.edge.write_file(c.params["sid"], c.arg("path"), c.body, mode)
        return None

    async def events(c: _Call):
        return SecurityEventList(events=await c.edge.security_events(c.params["sid"]))

    async def rules(c: _Call):
        await c.edge.set_network_rules(c.params["sid"], c.parse(NetworkRulesRequest).network_rules)
        return None

    async def fncall(c: _Call):
        return await c.edge.fncall(c.parse(DSecFnCallArgs))

    async def fncall_batch(c: _Call):
        return FnCallBatchResult(results=await c.edge.fncall_many(c.parse(FnCallBatchRequest).calls))

    table = [
        ("GET", "/info", info), ("GET", "/layer_use", layer_use),
        ("GET", "/images", images), ("POST", "/images:gc", gc),
        ("GET", r"/images/(?P<ref>[^/]+)", inspect_image), ("POST", r"/images/(?P<ref>[^/:]+):remove", remove_image),
        ("POST", "/sandboxes", create), ("GET", "/sandboxes", listing),
        ("GET", f"/sandboxes/{sid}", get), ("POST", f"/sandboxes/{sid}/stop", stop),
        ("POST", f"/sandboxes/{sid}/pause", pause), ("POST", f"/sandboxes/{sid}/resume", resume),
        ("POST", f"/sandboxes/{sid}/snapshot", snapshot), ("POST", f"/sandboxes/{sid}/pack_diff", pack_diff),
        ("POST", f"/sandboxes/{sid}/exec", exec_),
        ("GET", f"/sandboxes/{sid}/files", read_file), ("PUT", f"/sandboxes/{sid}/files", write_file),
        ("GET", f"/sandboxes/{sid}/security_events", events), ("PUT", f"/sandboxes/{sid}/network_rules", rules),
        ("POST", "/fncall", fncall), ("POST", "/fncall:batch", fncall_batch),
    ]
    return [(method, re.compile(re.escape(PREFIX) + path.replace(":", r"\:") + r"\Z"), fn) for method, path, fn in table]


_ROUTES = _routes()
_BATCH = PREFIX + "/sandboxes:batch"


def _run_args(req: NodeCreateRequest):
    try:
        return req.run_args()
    except (pydantic.ValidationError, ValueError) as exc:
        raise InvalidRequest(f"malformed run args for a {req.kind.value}: {exc}") from None


def _error_answer(exc: BaseException) -> tuple[int, bytes]:
    if isinstance(exc, DSecError):
        return exc.status, json.dumps(exc.to_wire()).encode()
    log.exception("unexpected error in a node call", exc_info=exc)
    body = {"error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}}
    return 500, json.dumps(body).encode()


class EdgeApp:
    """The ASGI app serving one edge's seam to callers holding ``token``."""

    def __init__(self, edge: EdgeAPI, token: str) -> None:
        self.edge = edge
        self._auth = f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
            if message["type"] == "http.disconnect":
                return
        headers = dict(scope["headers"])
        if not hmac.compare_digest(headers.get(b"authorization", b""), self._auth):
            await _answer(send, 401, b'{"error":{"code":"unauthenticated","message":"wrong or missing node token"}}')
            return
        method, path = scope["method"], scope["path"]
        if method == "POST" and path == _BATCH:
            await self._batch(bytes(body), receive, send)
            return
        query = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}
        for route_method, pattern, handler in _ROUTES:
            m = pattern.match(path)
            if m and route_method == method:
                try:
                    result = await handler(_Call(self.edge, m.groupdict(), query, bytes(body)))
                except Exception as exc:  # noqa: BLE001 - every error becomes its wire answer
                    await _answer(send, *_error_answer(exc))
                    return
                if result is None:
                    await _answer(send, 200, _OK)
                elif isinstance(result, bytes):
                    await _answer(send, 200, result, b"application/octet-stream")
                else:
                    await _answer(send, 200, result.model_dump_json().encode())
                return
        await _answer(send, 404, json.dumps({"error": {"code": "invalid_request",
                                                       "message": f"no node route {method} {path}"}}).encode())

    async def _batch(self, body: bytes, receive, send) -> None:
        try:
            req = _Call(self.edge, {}, {}, body).parse(NodeBatchRequest)
            args = _run_args(req)
            events = self.edge.create_batch(args, req.count, req.kind.value, req.project)
            first = await anext(events)
        except StopAsyncIteration:
            await _answer(send, 200, BatchEvent(event="done").model_dump_json().encode() + b"\n")
            return
        except Exception as exc:  # noqa: BLE001 - the batch's first error is a plain answer
            await _answer(send, *_error_answer(exc))
            return
        # The server drops what is sent after the caller went away: the disconnect is watched
        # for, and the batch given up (it undoes itself: all or none) at the next sandbox.
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/x-ndjson")]})
            async with aclosing(events):
                try:
                    index, info = first
                    made = [info.id]
                    await _chunk(send, BatchEvent(event="created", index=index, sandbox=info))
                    async for index, info in events:
                        if gone.is_set():
                            log.warning("a batch's caller went away: undoing it")
                            return
                        made.append(info.id)
                        await _chunk(send, BatchEvent(event="created", index=index, sandbox=info))
                    end = BatchEvent(event="done")
                except DSecError as exc:
                    end = BatchEvent(event="error", error=exc.to_wire()["error"])
            if gone.is_set():  # complete, but the caller may not have learnt every id
                log.warning("a batch's caller went away at its end: stopping its %d sandboxes", len(made))
                await asyncio.gather(*(self.edge.stop(sid, "batch abandoned by its caller") for sid in made),
                                     return_exceptions=True)
                return
            await _chunk(send, end)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()


async def _chunk(send, event: BatchEvent) -> None:
    await send({"type": "http.response.body", "body": event.model_dump_json().encode() + b"\n", "more_body": True})


async def _answer(send, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class NodeServer:
    """One edge's endpoint, served in the running loop. ``await start()`` binds and returns its
    URL; ``await close()`` stops serving (a second call does nothing; the edge is not closed)."""

    def __init__(self, edge: EdgeAPI, token: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.edge, self.token, self.host, self.port = edge, token, host, port
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self.url = ""

    async def start(self) -> str:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(1024)
        sock.setblocking(False)
        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(EdgeApp(self.edge, self.token), lifespan="off", log_level="warning",
                                access_log=False, proxy_headers=False, timeout_keep_alive=75,
                                timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._server.capture_signals = contextlib.nullcontext  # the process's owner handles signals
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name=f"dsec-node-{self.edge.node}")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the node server stopped at start")
            await asyncio.sleep(0.005)
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        return self.url

    async def close(self) -> None:
        if self._server is None or self._task is None:
            return
        server, task, self._server, self._task = self._server, self._task, None, None
        server.should_exit = True
        await asyncio.gather(task, return_exceptions=True)
