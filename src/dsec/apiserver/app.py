"""The public API's app. Each handler only parses: it turns a request into one typed call on the
edge that the sandbox id names, and errors come back as ``{"error": {"code", "message"}}``.

The calls that are a request and its answer are the public table's (``libdsec.api_ops``), served
by ``table.TableRoutes`` in front of FastAPI (those more than one node call by ``calls.ApiCalls``);
the routes here are the others: the batch create's stream, the port proxy, and (``routes_observe.py``)
the metrics and the dashboard.

The apiserver keeps no sandbox state: sandbox ids name their node, and the node list comes from
the cluster (one embedded edge here).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager

from fastapi import Depends, FastAPI, Path, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from libdsec import DSecError, InvalidRequest, SandboxLost
from libdsec.protocol import JOB_HEADER, KEY_HEADER
from libdsec.protocol import (
    BatchEvent,
    CreateBatchRequest,
    ErrorResponse,
    SandboxInfo,
)

from .auth import Authenticator, Caller
from .calls import current
from .cluster import Cluster
from .lean import CatchUnexpected, LeanRoutes, error_headers
from .routes_observe import add_observe_routes
from .table import TableRoutes, add_schema_routes
from .portlane import PortLane
from .ports import DEFAULT_DOMAIN, PortProxy, PortRoutes
from .streams import StreamKeys, StreamRoutes
from .websocket import relay as websocket_relay

log = logging.getLogger("dsec.apiserver")

_JOB, _KEY = JOB_HEADER.encode(), KEY_HEADER.encode()

_ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
           409: {"model": ErrorResponse}, 422: {"model": ErrorResponse}, 429: {"model": ErrorResponse},
           503: {"model": ErrorResponse}}


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body", "query"))
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "malformed request: " + "; ".join(parts)


_NO_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                 if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})

# Batch creations under way, referenced until done (see the batch route).
_BATCHES: set[asyncio.Task] = set()


class _Proxied(Response):
    """A response that is a port's answer, streamed (``PortProxy.serve``)."""

    def __init__(self, serve) -> None:
        super().__init__()
        self._serve = serve

    async def __call__(self, scope, receive, send) -> None:
        await self._serve(scope, receive, send)


# Routes of another API added to the app (``dsec.app``: the compatibility layers): called with the
# app, the cluster and the authenticator, in order, after DSec's own; each returns the routes it
# added that the lean lane serves (``LeanRoutes``' plain routes), or None. One that adds its
# routes later (at its own first request) appends them to ``app.state.plain_routes``.
RouteAdder = Callable[[FastAPI, Cluster, Authenticator], "list | None"]


def create_app(cluster: Cluster, token: str, lifespan=None, extensions: Sequence[RouteAdder] = (),
               domain: str = DEFAULT_DOMAIN) -> FastAPI:
    """DSec's own API over ``cluster``; ``extensions`` add other APIs' routes after it. A
    request whose Host is ``PORT-SANDBOXID.<domain>`` goes to that port (``ports.HostNames``);
    an empty ``domain`` turns host names off."""
    ports = PortProxy(cluster)

    @asynccontextmanager
    async def lifespan_with_ports(app):
        try:
            if lifespan is None:
                yield
            else:
                async with lifespan(app) as state:
                    yield state
        finally:
            await ports.aclose()
            lane.close()

    app = FastAPI(title="DSec", version="0.1.0", lifespan=lifespan_with_ports,
                  description="Sandboxes for agent training: containers from shared EROFS layers.",
                  # No OpenTelemetry (the platform's metrics are its own): FastAPI would otherwise
                  # ask the global providers whether to trace, on every request.
                  **_NO_TELEMETRY)

    authenticator = Authenticator(token, cluster.projects)
    # ``dsec serve`` relays port requests on the client's own connection (portlane.py); the
    # middleware below serves them where the lane does not (another server, a job's request).
    lane = app.state.port_lane = PortLane(cluster, authenticator, domain, _JOB)
    jobs = cluster.jobs

    async def check(headers: dict[bytes, bytes], path_params: dict, route: str = "") -> Caller:
        """The calling project (and its job and key, if the request names them); a sandbox it
        may not see answers ``SandboxNotFound``, one whose node is lost ``SandboxLost``, and
        its stop (the operation ``stop``) is then owed to the node, to be made if the
        sandbox is the caller's (``Cluster.keep_stop``)."""
        job, key = headers.get(_JOB), headers.get(_KEY)
        caller = authenticator.caller(headers.get(b"authorization", b"").decode("latin-1"),
                                      None if job is None else job.decode("latin-1"),
                                      None if key is None else key.decode("latin-1"))
        if "sandbox_id" in path_params and not caller.is_root:
            try:
                await cluster.edge_for_caller(path_params["sandbox_id"], caller)
            except SandboxLost as lost:
                if route == "stop":
                    await cluster.keep_stop(path_params["sandbox_id"], lost, caller=caller)
                raise
        return caller

    async def authenticated(request: Request) -> Caller:
        return await check(dict(request.headers.raw), request.path_params, request.scope["route"].name)

    def now(info: SandboxInfo) -> Awaitable[SandboxInfo]:
        return current(cluster, info)

    @app.exception_handler(DSecError)
    async def _dsec_error(request: Request, exc: DSecError) -> JSONResponse:
        return JSONResponse(exc.to_wire(), status_code=exc.status, headers=error_headers(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(InvalidRequest(_validation_message(exc)).to_wire(), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "invalid_request" if exc.status_code < 500 else "internal"
        detail = "Not Found: no such operation" if exc.status_code == 404 else exc.detail
        return JSONResponse({"error": {"code": code, "message": f"{detail}: {request.method} {request.url.path}"}},
                            status_code=exc.status_code)

    # Not an exception handler: Starlette re-raises after those, and uvicorn then closes the
    # keep-alive connection, so the client's next call on it fails.
    app.add_middleware(CatchUnexpected)
    # The E2B API's routes skip FastAPI's own layers (see lean.py).
    plain_routes: list = []  # the E2B API's, added below (or by it, at its first request)
    app.state.plain_routes = plain_routes
    app.add_middleware(LeanRoutes, plain_routes=plain_routes)
    # The operations of the public table, FastAPI's layers skipped (table.py).
    app.add_middleware(TableRoutes, cluster=cluster, check=check, jobs=jobs)
    # Outermost: a sandbox's host name is served whatever its path (E2B's proxy does the same),
    # and port_url's requests skip the framework (ports.PortRoutes).
    app.add_middleware(PortRoutes, domain=domain, proxy=ports, check=check, job_header=_JOB)
    # A desktop's live view (noVNC) to a browser, by the key its page's path carries (streams.py).
    cluster.stream_keys = StreamKeys(token)
    app.add_middleware(StreamRoutes, keys=cluster.stream_keys, proxy=ports)

    auth = [Depends(authenticated)]

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict:
        return {"ok": True}

    @app.post("/v1/sandboxes:batch", dependencies=auth, responses=_ERRORS)
    async def create_batch(batch: CreateBatchRequest, request: Request,
                           caller: Caller = Depends(authenticated)) -> StreamingResponse:
        events = jobs.create_batch(caller, "container", batch.args, batch.count,
                                   lambda: cluster.create_batch(batch.args, batch.count, caller.project), now)
        # The first sandbox is awaited here, so a bad request gets a plain error status.
        try:
            first = await anext(events)
        except BaseException:
            await events.aclose()
            raise

        # The batch runs in a task of its own, not in the response's: when the client goes away,
        # Starlette cancels the response under a cancel scope that would also cancel every await
        # of the batch's clean-up (so sandboxes it had made were left running), and a response
        # cancelled before it starts would never close the batch at all. A client that goes
        # away before the stream's end never learns the ids: what the batch made is stopped.
        out: asyncio.Queue[BatchEvent] = asyncio.Queue()
        made: list[str] = []
        state = {"complete": False, "delivered": False, "undone": False}

        async def pump() -> None:
            async with aclosing(events):
                try:
                    index, info = first
                    made.append(info.id)
                    out.put_nowait(BatchEvent(event="created", index=index, sandbox=info))
                    async for index, info in events:
                        made.append(info.id)
                        out.put_nowait(BatchEvent(event="created", index=index, sandbox=info))
                    state["complete"] = True
                    out.put_nowait(BatchEvent(event="done"))
                except DSecError as exc:
                    out.put_nowait(BatchEvent(event="error", error=exc.to_wire()["error"]))

        async def undo() -> None:
            batch_task.cancel()  # an unfinished batch undoes itself (all or none)
            await asyncio.gather(batch_task, return_exceptions=True)
            if state["complete"]:
                await cluster.stop_ids(made, "batch abandoned by its client")
                await jobs.undo_batch(caller)

        def give_up() -> None:
            if not state["delivered"] and not state["undone"]:
                state["undone"] = True
                task = asyncio.create_task(undo())
                _BATCHES.add(task)
                task.add_done_callback(_BATCHES.discard)

        batch_task = asyncio.create_task(pump())
        _BATCHES.add(batch_task)
        batch_task.add_done_callback(_BATCHES.discard)

        async def lines() -> AsyncIterator[str]:
            # The events that are ready together leave in one chunk (one write to the socket,
            # where a write a line cost the apiserver as much as the rest of a sandbox's way).
            try:
                while True:
                    ready = [await out.get()]
                    while not out.empty() and ready[-1].event == "created":
                        ready.append(out.get_nowait())
                    yield "".join(event.model_dump_json() + "\n" for event in ready)
                    if ready[-1].event != "created":
                        # (a client gone before the response started takes nothing from it)
                        state["delivered"] = not await request.is_disconnected()
                        return
            finally:
                give_up()

        async def abandoned() -> None:  # (runs also when the response never started)
            give_up()

        return StreamingResponse(lines(), media_type="application/x-ndjson", background=BackgroundTask(abandoned))

    add_schema_routes(app, _ERRORS)  # (served by TableRoutes)

    # -- ports: HTTP and WebSocket to a port inside, for the caller's token only (ports.py) ----

    async def port_proxy(request: Request, sandbox_id: str, path: str, port: int = Path(ge=1, le=65535)) -> Response:
        """The answer of port ``port`` inside the sandbox to this request (``sandbox.port_url``),
        streamed both ways."""
        # (Served by ports.PortRoutes in front of the framework, unless the request is a job's.)
        target = ("/" + path + (f"?{request.url.query}" if request.url.query else "")).encode("latin-1")
        return _Proxied(lambda scope, receive, send: ports.serve(scope, receive, send, sandbox_id, port, target,
                                                                 f"127.0.0.1:{port}".encode()))

    # One route a method, each with its operation id (one route of several methods gives them all one).
    for method in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
        app.add_api_route("/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}", port_proxy, methods=[method],
                          dependencies=auth, responses=_ERRORS, name=f"port_proxy_{method.lower()}")

    @app.websocket("/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}")
    async def port_websocket(websocket: WebSocket, sandbox_id: str, port: str, path: str) -> None:
        """A WebSocket to port ``port`` inside the sandbox, message for message (``dsec.apiserver.websocket``)."""
        try:
            if not port.isdigit() or not 1 <= int(port) <= 65535:
                raise InvalidRequest(f"port {port} is outside 1-65535")
            await check(dict(websocket.headers.raw), websocket.path_params)
            edge = cluster.edge_for(sandbox_id)
        except DSecError as exc:
            await websocket.send_denial_response(JSONResponse(exc.to_wire(), status_code=exc.status))
            return
        target = "/" + path + (f"?{websocket.url.query}" if websocket.url.query else "")
        await websocket_relay(websocket, edge, sandbox_id, int(port), target)

    add_observe_routes(app, cluster, authenticator, _ERRORS)
    for add in extensions:
        plain_routes.extend(add(app, cluster, authenticator) or ())
    return app
