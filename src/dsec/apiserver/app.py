"""HTTP routes. Each handler only parses: it turns a request into one typed call on the edge that
the sandbox id names, and errors come back as ``{"error": {"code", "message"}}``.

The apiserver keeps no sandbox state: sandbox ids name their node, and the node list comes from
the cluster (one embedded edge here).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager

from fastapi import Depends, FastAPI, Path, Query, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from libdsec import DSecError, InvalidRequest, SandboxLost
from libdsec.protocol import JOB_HEADER, KEY_HEADER, NetworkRulesRequest, SecurityEventList, TTLRequest
from libdsec.protocol import (
    BatchEvent,
    BuildImageRequest,
    CreateBatchRequest,
    DSecContainerRunArgs,
    DSecFullVMRunArgs,
    DSecMicroVMRunArgs,
    ErrorResponse,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    FileList,
    FileRemoveRequest,
    FileRenameRequest,
    ImageInfo,
    ImageList,
    MakeDirRequest,
    NodeInfo,
    CleanCopyRequest,
    CleanCopyResult,
    PackDiffRequest,
    PackDiffResult,
    OpenPtyRequest,
    OpenSessionRequest,
    OpenWatchRequest,
    PauseResult,
    ProcessInfo,
    ProcessList,
    ProcessSignalRequest,
    ProcessStdinRequest,
    ProcessStreamRequest,
    ProcessWaitRequest,
    SandboxInfo,
    SandboxList,
    SandboxStatus,
    PtyInfo,
    PtyInputRequest,
    PtyResizeRequest,
    PtyStreamRequest,
    SessionInfo,
    SnapshotInfo,
    StartProcessRequest,
    TreeDownloadRequest,
    WatchEvents,
    WatchEventsRequest,
    WatchInfo,
)

from ..edge.files import file_mode as parse_file_mode
from .auth import Authenticator, Caller
from .cluster import Cluster
from .lean import CatchUnexpected, LeanRoutes, error_headers
from .jobs import file_request, unrecorded_call
from .routes_fncall import add_fncall_routes
from .routes_jobs import add_job_routes
from .routes_observe import add_observe_routes
from .routes_projects import add_project_routes
from .ports import DEFAULT_DOMAIN, PortProxy, PortRoutes
from .websocket import relay as websocket_relay

log = logging.getLogger("dsec.apiserver")

_JOB, _KEY = JOB_HEADER.encode(), KEY_HEADER.encode()

_ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
           409: {"model": ErrorResponse}, 422: {"model": ErrorResponse}, 429: {"model": ErrorResponse},
           503: {"model": ErrorResponse}}


# Served by the same endpoints without FastAPI's per-request layers (see lean.py).
LEAN_ROUTES = frozenset({"create_sandbox", "get_sandbox", "stop_sandbox", "exec_command"})


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


async def _streaming(events: AsyncIterator[ExecEvent]) -> StreamingResponse:
    try:  # errors before the start are a plain error answer
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    return StreamingResponse(_ndjson(first, events), media_type="application/x-ndjson")


async def _body_chunks(request: Request) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        if chunk:
            yield chunk


async def _first_chunk(chunks: AsyncIterator[bytes]) -> bytes:
    try:  # errors before the start are a plain error answer
        return await anext(chunks)
    except StopAsyncIteration:
        return b""
    except BaseException:
        await chunks.aclose()
        raise


async def _bytes_after(first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    async with aclosing(chunks):
        if first:
            yield first
        async for chunk in chunks:
            yield chunk


async def _ndjson(first: ExecEvent, events: AsyncIterator[ExecEvent]) -> AsyncIterator[str]:
    """One line an event, each sent once the last left (Starlette awaits the transport's
    drain); a client that goes away cancels this, which closes ``events``: the command dies."""
    async with aclosing(events):
        yield first.model_dump_json() + "\n"
        async for event in events:
            yield event.model_dump_json() + "\n"


class _Proxied(Response):
    """A response that is a port's answer, streamed (``PortProxy.serve``)."""

    def __init__(self, serve) -> None:
        super().__init__()
        self._serve = serve

    async def __call__(self, scope, receive, send) -> None:
        await self._serve(scope, receive, send)


# Routes of another API added to the app (``dsec.app``: the compatibility layers): called with the
# app, the cluster and the authenticator, in order, after DSec's own; each returns the routes it
# added that the lean lane serves (``LeanRoutes``' plain routes), or None.
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

    app = FastAPI(title="DSec", version="0.1.0", lifespan=lifespan_with_ports,
                  description="Sandboxes for agent training: containers from shared EROFS layers.",
                  # No OpenTelemetry (the platform's metrics are its own): FastAPI would otherwise
                  # ask the global providers whether to trace, on every request.
                  **_NO_TELEMETRY)

    authenticator = Authenticator(token, cluster.projects)
    jobs = cluster.jobs

    async def check(headers: dict[bytes, bytes], path_params: dict, route: str = "") -> Caller:
        """The calling project (and its job and key, if the request names them); a sandbox it
        may not see answers ``SandboxNotFound``, one whose node is lost ``SandboxLost``, and
        its stop (the route ``stop_sandbox``) is then owed to the node, to be made if the
        sandbox is the caller's (``Cluster.keep_stop``)."""
        job, key = headers.get(_JOB), headers.get(_KEY)
        caller = authenticator.caller(headers.get(b"authorization", b"").decode("latin-1"),
                                      None if job is None else job.decode("latin-1"),
                                      None if key is None else key.decode("latin-1"))
        if "sandbox_id" in path_params and not caller.is_root:
            try:
                await cluster.edge_for_caller(path_params["sandbox_id"], caller)
            except SandboxLost as lost:
                if route == "stop_sandbox":
                    await cluster.keep_stop(path_params["sandbox_id"], lost, caller=caller)
                raise
        return caller

    async def authenticated(request: Request) -> Caller:
        return await check(dict(request.headers.raw), request.path_params, request.scope["route"].name)

    async def authenticated_and_logged(request: Request) -> Caller:
        """``authenticated``; a call of a job that its log does not record with its result is
        logged as made, before it runs (``jobs.UNRECORDED``)."""
        caller = await authenticated(request)
        if caller.job is not None:
            unrecorded = unrecorded_call(request.method, request.url.path)
            if unrecorded is not None:
                await jobs.mark(caller, *unrecorded)
        return caller

    async def now(info: SandboxInfo) -> SandboxInfo:
        """A sandbox made before, as its node says it is now (or as it was, once gone)."""
        try:
            return await cluster.edge_for(info.id).get(info.id)
        except DSecError:
            return info.model_copy(update={"status": SandboxStatus.stopped})

    @app.exception_handler(DSecError)
    async def _dsec_error(request: Request, exc: DSecError) -> JSONResponse:
        return JSONResponse(exc.to_wire(), status_code=exc.status, headers=error_headers(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(InvalidRequest(_validation_message(exc)).to_wire(), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "invalid_request" if exc.status_code < 500 else "internal"
        return JSONResponse({"error": {"code": code, "message": f"{exc.detail}: {request.method} {request.url.path}"}},
                            status_code=exc.status_code)

    # Not an exception handler: Starlette re-raises after those, and uvicorn then closes the
    # keep-alive connection, so the client's next call on it fails.
    app.add_middleware(CatchUnexpected)
    # Outermost of ours: the hottest routes skip FastAPI's own layers (see lean.py).
    plain_routes: list = []  # the E2B API's, added below
    app.add_middleware(LeanRoutes, app_ref=app, names=LEAN_ROUTES, check=check, dependency=authenticated,
                       plain_routes=plain_routes)
    # Outermost: a sandbox's host name is served whatever its path (E2B's proxy does the same),
    # and port_url's requests skip the framework (ports.PortRoutes).
    app.add_middleware(PortRoutes, domain=domain, proxy=ports, check=check, job_header=_JOB)

    auth = [Depends(authenticated_and_logged)]

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict:
        return {"ok": True}

    @app.post("/v1/sandboxes", responses=_ERRORS)
    async def create_sandbox(args: DSecContainerRunArgs, caller: Caller = Depends(authenticated)) -> SandboxInfo:
        """With an ``idempotency-key`` header, a key used before in the project (or the job)
        returns the sandbox made then; ``x-dsec-job`` records the create in that job's log."""
        if caller.job is None and caller.key is None:
            return await cluster.create(args, caller.project)
        return await create_kind(args, "container", caller)

    async def create_kind(args: DSecContainerRunArgs, kind: str, caller: Caller) -> SandboxInfo:
        return await jobs.create(caller, kind, args, lambda: cluster.create(args, caller.project, kind=kind), now)

    @app.post("/v1/microvms", responses=_ERRORS)
    async def create_microvm(args: DSecMicroVMRunArgs, caller: Caller = Depends(authenticated)) -> SandboxInfo:
        return await create_kind(args, "microvm", caller)

    @app.post("/v1/vms", responses=_ERRORS)
    async def create_fullvm(args: DSecFullVMRunArgs, caller: Caller = Depends(authenticated)) -> SandboxInfo:
        return await create_kind(args, "fullvm", caller)

    @app.post("/v1/sandboxes/{sandbox_id}/snapshot", dependencies=auth, responses=_ERRORS)
    async def snapshot(sandbox_id: str) -> SnapshotInfo:
        return await cluster.edge_for(sandbox_id).snapshot(sandbox_id)

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

    @app.get("/v1/sandboxes")
    async def list_sandboxes(caller: Caller = Depends(authenticated)) -> SandboxList:
        found = [info for info in await cluster.list_sandboxes() if caller.sees(cluster.projects, info.project)]
        return SandboxList(sandboxes=found)

    @app.get("/v1/sandboxes/{sandbox_id}", dependencies=[Depends(authenticated)], responses=_ERRORS)  # (lean)
    async def get_sandbox(sandbox_id: str) -> SandboxInfo:
        return await cluster.edge_for(sandbox_id).get(sandbox_id)

    @app.delete("/v1/sandboxes/{sandbox_id}", responses=_ERRORS)
    async def stop_sandbox(sandbox_id: str, caller: Caller = Depends(authenticated)) -> SandboxInfo:
        if caller.job is None:
            return await cluster.stop(sandbox_id)
        return await jobs.recorded(caller, "stop", sandbox_id, {}, lambda: cluster.stop(sandbox_id))

    @app.post("/v1/sandboxes/{sandbox_id}/pause", responses=_ERRORS)
    async def pause_sandbox(sandbox_id: str, caller: Caller = Depends(authenticated)) -> PauseResult:
        return await jobs.recorded(caller, "pause", sandbox_id, {}, lambda: cluster.edge_for(sandbox_id).pause(sandbox_id))

    @app.post("/v1/sandboxes/{sandbox_id}/resume", responses=_ERRORS)
    async def resume_sandbox(sandbox_id: str, caller: Caller = Depends(authenticated)) -> SandboxInfo:
        return await jobs.recorded(caller, "resume", sandbox_id, {}, lambda: cluster.edge_for(sandbox_id).resume(sandbox_id))

    @app.post("/v1/sandboxes/{sandbox_id}/exec", responses=_ERRORS)
    async def exec_command(sandbox_id: str, request: ExecRequest, caller: Caller = Depends(authenticated)) -> ExecResult:
        if caller.job is None:
            return await cluster.exec(sandbox_id, request)
        return await jobs.recorded(caller, "exec", sandbox_id, request.model_dump(mode="json"),
                                   lambda: cluster.exec(sandbox_id, request))

    @app.post("/v1/sandboxes/{sandbox_id}/exec:stream", dependencies=auth, responses=_ERRORS,
              response_model=ExecEvent)
    async def exec_stream(sandbox_id: str, request: ExecRequest) -> StreamingResponse:
        """The command's ``ExecEvent``s as NDJSON lines, as it writes (``dsec.edge.stream``)."""
        return await _streaming(cluster.edge_for(sandbox_id).exec_stream(sandbox_id, request))

    # -- background processes ---------------------------------------------------------------

    @app.post("/v1/sandboxes/{sandbox_id}/processes", dependencies=auth, responses=_ERRORS)
    async def start_process(sandbox_id: str, request: StartProcessRequest) -> ProcessInfo:
        return await cluster.edge_for(sandbox_id).start_process(sandbox_id, request)

    @app.get("/v1/sandboxes/{sandbox_id}/processes", dependencies=auth, responses=_ERRORS)
    async def list_processes(sandbox_id: str) -> ProcessList:
        return ProcessList(processes=await cluster.edge_for(sandbox_id).list_processes(sandbox_id))

    @app.get("/v1/sandboxes/{sandbox_id}/processes/{pid}", dependencies=auth, responses=_ERRORS)
    async def get_process(sandbox_id: str, pid: int = Path(ge=1, le=999_999_999)) -> ProcessInfo:
        return await cluster.edge_for(sandbox_id).get_process(sandbox_id, pid)

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{pid}/signal", dependencies=auth, responses=_ERRORS)
    async def signal_process(sandbox_id: str, request: ProcessSignalRequest, pid: int = Path(ge=1, le=999_999_999)) -> dict:
        await cluster.edge_for(sandbox_id).signal_process(sandbox_id, pid, request.signal)
        return {"ok": True}

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{pid}/stdin", dependencies=auth, responses=_ERRORS)
    async def process_stdin(sandbox_id: str, request: ProcessStdinRequest, pid: int = Path(ge=1, le=999_999_999)) -> dict:
        await cluster.edge_for(sandbox_id).process_stdin(sandbox_id, pid, request.data, request.close)
        return {"ok": True}

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{pid}/wait", dependencies=auth, responses=_ERRORS)
    async def wait_process(sandbox_id: str, request: ProcessWaitRequest, pid: int = Path(ge=1, le=999_999_999)) -> ProcessInfo:
        return await cluster.edge_for(sandbox_id).wait_process(sandbox_id, pid, request.timeout)

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{pid}/stream", dependencies=auth, responses=_ERRORS,
              response_model=ExecEvent)
    async def stream_process(sandbox_id: str, request: ProcessStreamRequest, pid: int = Path(ge=1, le=999_999_999)) -> StreamingResponse:
        """The process's output from the offsets given, as NDJSON ``ExecEvent`` lines, to its end."""
        return await _streaming(cluster.edge_for(sandbox_id).stream_process(sandbox_id, pid, request))

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

    # -- PTYs (held by the sandbox's node: dsec.edge.pty) ------------------------------------

    pty_id = Path(ge=1, le=999_999_999)

    @app.post("/v1/sandboxes/{sandbox_id}/ptys", dependencies=auth, responses=_ERRORS)
    async def open_pty(sandbox_id: str, request: OpenPtyRequest) -> PtyInfo:
        return await cluster.edge_for(sandbox_id).open_pty(sandbox_id, request)

    @app.post("/v1/sandboxes/{sandbox_id}/ptys/{pty}/input", dependencies=auth, responses=_ERRORS)
    async def pty_input(sandbox_id: str, request: PtyInputRequest, pty: int = pty_id) -> dict:
        await cluster.edge_for(sandbox_id).pty_input(sandbox_id, pty, request.data)
        return {"ok": True}

    @app.post("/v1/sandboxes/{sandbox_id}/ptys/{pty}/resize", dependencies=auth, responses=_ERRORS)
    async def resize_pty(sandbox_id: str, request: PtyResizeRequest, pty: int = pty_id) -> dict:
        await cluster.edge_for(sandbox_id).resize_pty(sandbox_id, pty, request.cols, request.rows)
        return {"ok": True}

    @app.post("/v1/sandboxes/{sandbox_id}/ptys/{pty}/stream", dependencies=auth, responses=_ERRORS,
              response_model=ExecEvent)
    async def pty_stream(sandbox_id: str, request: PtyStreamRequest, pty: int = pty_id) -> StreamingResponse:
        return await _streaming(cluster.edge_for(sandbox_id).pty_stream(sandbox_id, pty, request.encoding))

    @app.post("/v1/sandboxes/{sandbox_id}/ptys/{pty}/close", dependencies=auth, responses=_ERRORS)
    async def close_pty(sandbox_id: str, pty: int = pty_id) -> dict:
        await cluster.edge_for(sandbox_id).close_pty(sandbox_id, pty)
        return {"ok": True}

    # -- directory watches (held by the sandbox's node: dsec.edge.watches) ---------------------

    watch_id = Path(ge=1, le=999_999_999)

    @app.post("/v1/sandboxes/{sandbox_id}/watches", dependencies=auth, responses=_ERRORS)
    async def open_watch(sandbox_id: str, request: OpenWatchRequest) -> WatchInfo:
        return await cluster.edge_for(sandbox_id).open_watch(sandbox_id, request)

    @app.post("/v1/sandboxes/{sandbox_id}/watches/{watch}/events", dependencies=auth, responses=_ERRORS)
    async def watch_events(sandbox_id: str, request: WatchEventsRequest, watch: int = watch_id) -> WatchEvents:
        """The changes since the last call; ``wait``: seconds to wait for a first one."""
        return await cluster.edge_for(sandbox_id).watch_events(sandbox_id, watch, request.wait)

    @app.post("/v1/sandboxes/{sandbox_id}/watches/{watch}/close", dependencies=auth, responses=_ERRORS)
    async def close_watch(sandbox_id: str, watch: int = watch_id) -> dict:
        await cluster.edge_for(sandbox_id).close_watch(sandbox_id, watch)
        return {"ok": True}

    # -- sessions ---------------------------------------------------------------------------

    @app.post("/v1/sandboxes/{sandbox_id}/sessions", dependencies=auth, responses=_ERRORS)
    async def open_session(sandbox_id: str, request: OpenSessionRequest) -> SessionInfo:
        return await cluster.edge_for(sandbox_id).open_session(sandbox_id, request)

    @app.post("/v1/sandboxes/{sandbox_id}/sessions/{session}/exec", dependencies=auth, responses=_ERRORS)
    async def session_exec(sandbox_id: str, request: ExecRequest, session: int = Path(ge=1, le=999_999_999)) -> ExecResult:
        return await cluster.edge_for(sandbox_id).session_exec(sandbox_id, session, request)

    @app.post("/v1/sandboxes/{sandbox_id}/sessions/{session}/exec:stream", dependencies=auth, responses=_ERRORS,
              response_model=ExecEvent)
    async def session_exec_stream(sandbox_id: str, request: ExecRequest, session: int = Path(ge=1, le=999_999_999)) -> StreamingResponse:
        return await _streaming(cluster.edge_for(sandbox_id).session_exec_stream(sandbox_id, session, request))

    @app.post("/v1/sandboxes/{sandbox_id}/sessions/{session}/interrupt", dependencies=auth, responses=_ERRORS)
    async def interrupt_session(sandbox_id: str, session: int = Path(ge=1, le=999_999_999)) -> dict:
        await cluster.edge_for(sandbox_id).interrupt_session(sandbox_id, session)
        return {"ok": True}

    @app.post("/v1/sandboxes/{sandbox_id}/sessions/{session}/close", dependencies=auth, responses=_ERRORS)
    async def close_session(sandbox_id: str, session: int = Path(ge=1, le=999_999_999)) -> dict:
        await cluster.edge_for(sandbox_id).close_session(sandbox_id, session)
        return {"ok": True}

    # -- file trees -------------------------------------------------------------------------

    @app.get("/v1/sandboxes/{sandbox_id}/fs/list", dependencies=auth, responses=_ERRORS)
    async def list_dir(sandbox_id: str, path: str = Query(min_length=1)) -> FileList:
        return FileList(entries=await cluster.edge_for(sandbox_id).list_dir(sandbox_id, path))

    @app.get("/v1/sandboxes/{sandbox_id}/fs/stat", dependencies=auth, responses=_ERRORS)
    async def stat_path(sandbox_id: str, path: str = Query(min_length=1)) -> FileEntry:
        return await cluster.edge_for(sandbox_id).stat_path(sandbox_id, path)

    @app.post("/v1/sandboxes/{sandbox_id}/fs/remove", dependencies=auth, responses=_ERRORS)
    async def remove_path(sandbox_id: str, request: FileRemoveRequest) -> dict:
        await cluster.edge_for(sandbox_id).remove_path(sandbox_id, request.path, request.recursive)
        return {"ok": True}

    @app.post("/v1/sandboxes/{sandbox_id}/fs/mkdir", dependencies=auth, responses=_ERRORS)
    async def make_dir(sandbox_id: str, request: MakeDirRequest) -> dict:
        await cluster.edge_for(sandbox_id).make_dir(sandbox_id, request.path)
        return {"ok": True}

    @app.post("/v1/sandboxes/{sandbox_id}/fs/rename", dependencies=auth, responses=_ERRORS)
    async def rename_path(sandbox_id: str, request: FileRenameRequest) -> dict:
        await cluster.edge_for(sandbox_id).rename_path(sandbox_id, request.src, request.dst)
        return {"ok": True}

    @app.put("/v1/sandboxes/{sandbox_id}/fs/tree", dependencies=auth, responses=_ERRORS)
    async def upload_tree(request: Request, sandbox_id: str, path: str = Query(min_length=1)) -> dict:
        """The body is an uncompressed tar, streamed (chunked) or whole: passed on to the
        sandbox's ``tar x`` as it comes, each member checked first."""
        edge = cluster.edge_for(sandbox_id)
        await edge.upload_tree(sandbox_id, path, _body_chunks(request))
        return {"ok": True}

    @app.get("/v1/sandboxes/{sandbox_id}/fs/tree", dependencies=auth, responses=_ERRORS)
    async def download_tree_tar(sandbox_id: str, path: str = Query(min_length=1)) -> StreamingResponse:
        """The tree as an uncompressed tar (``application/x-tar``), streamed as ``tar c`` writes
        it; a failure after the start breaks the answer off (no final chunk)."""
        chunks = cluster.edge_for(sandbox_id).download_tree_tar(sandbox_id, path)
        first = await _first_chunk(chunks)
        return StreamingResponse(_bytes_after(first, chunks), media_type="application/x-tar")

    @app.post("/v1/sandboxes/{sandbox_id}/fs/tree:download", dependencies=auth, responses=_ERRORS,
              response_model=ExecEvent)
    async def download_tree(sandbox_id: str, request: TreeDownloadRequest) -> StreamingResponse:
        """The tree as a tar, base64 text in NDJSON ``ExecEvent`` stdout lines, then ``exit``."""
        return await _streaming(cluster.edge_for(sandbox_id).download_tree(sandbox_id, request.path))

    @app.get("/v1/sandboxes/{sandbox_id}/files:stream", dependencies=auth, responses=_ERRORS)
    async def read_file_stream(sandbox_id: str, path: str = Query(min_length=1)) -> StreamingResponse:
        """The file's bytes streamed (``application/octet-stream``), of any size; a failure
        after the start breaks the answer off."""
        chunks = cluster.edge_for(sandbox_id).read_file_stream(sandbox_id, path)
        first = await _first_chunk(chunks)
        return StreamingResponse(_bytes_after(first, chunks), media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/files:stream", dependencies=auth, responses=_ERRORS)
    async def write_file_stream(request: Request, sandbox_id: str, path: str = Query(min_length=1),
                                mode: str = Query("0o644")) -> dict:
        """The body (streamed, or whole) written to the file as it comes, of any size."""
        file_mode = parse_file_mode(mode)
        await cluster.edge_for(sandbox_id).write_file_stream(sandbox_id, path, _body_chunks(request), file_mode)
        return {"ok": True}

    @app.get("/v1/sandboxes/{sandbox_id}/files", responses=_ERRORS)
    async def read_file(sandbox_id: str, path: str = Query(min_length=1), caller: Caller = Depends(authenticated)) -> Response:
        data = await jobs.recorded_read(caller, sandbox_id, path, lambda: cluster.edge_for(sandbox_id).read_file(sandbox_id, path))
        return Response(content=data, media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/files", responses=_ERRORS)
    async def write_file(request: Request, sandbox_id: str, path: str = Query(min_length=1),
                         mode: str = Query("0o644"), caller: Caller = Depends(authenticated)) -> dict:
        file_mode = parse_file_mode(mode)
        edge, data = cluster.edge_for(sandbox_id), await request.body()

        async def write() -> dict:
            await edge.write_file(sandbox_id, path, data, file_mode)
            return {"ok": True}

        request_entry = file_request(path, file_mode, data) if caller.job is not None else {}
        return await jobs.recorded(caller, "write_file", sandbox_id, request_entry, write)

    @app.get("/v1/sandboxes/{sandbox_id}/security_events", dependencies=auth, responses=_ERRORS)
    async def security_events(sandbox_id: str) -> SecurityEventList:
        return SecurityEventList(events=await cluster.edge_for(sandbox_id).security_events(sandbox_id))

    @app.put("/v1/sandboxes/{sandbox_id}/network_rules", responses=_ERRORS)
    async def set_network_rules(sandbox_id: str, request: NetworkRulesRequest, caller: Caller = Depends(authenticated)) -> dict:
        async def set_rules() -> dict:
            await cluster.edge_for(sandbox_id).set_network_rules(sandbox_id, request.network_rules)
            return {"ok": True}

        return await jobs.recorded(caller, "set_network_rules", sandbox_id, request.model_dump(mode="json"), set_rules)

    @app.put("/v1/sandboxes/{sandbox_id}/ttl", responses=_ERRORS)
    async def set_ttl(sandbox_id: str, request: TTLRequest, caller: Caller = Depends(authenticated)) -> SandboxInfo:
        return await jobs.recorded(caller, "set_ttl", sandbox_id, request.model_dump(mode="json"),
                                   lambda: cluster.edge_for(sandbox_id).set_ttl(sandbox_id, request.ttl_running_stop))

    @app.post("/v1/sandboxes/{sandbox_id}/pack_diff", responses=_ERRORS)
    async def pack_diff(sandbox_id: str, request: PackDiffRequest, caller: Caller = Depends(authenticated)) -> PackDiffResult:
        return await jobs.recorded(caller, "pack_diff", sandbox_id, request.model_dump(mode="json"),
                                   lambda: cluster.edge_for(sandbox_id).pack_diff(sandbox_id, request.name, request.role))

    @app.post("/v1/sandboxes/{sandbox_id}/clean_copy", responses=_ERRORS)
    async def clean_copy(sandbox_id: str, request: CleanCopyRequest, caller: Caller = Depends(authenticated)) -> CleanCopyResult:
        return await jobs.recorded(caller, "clean_copy", sandbox_id, request.model_dump(mode="json"),
                                   lambda: cluster.clean_copy(sandbox_id, request.keep))

    @app.get("/v1/images", dependencies=auth)
    async def list_images() -> ImageList:
        return ImageList(images=await cluster.any_edge().list_images())

    @app.get("/v1/images/{ref}", dependencies=auth, responses=_ERRORS)
    async def inspect_image(ref: str) -> ImageInfo:
        return await cluster.any_edge().inspect_image(ref)

    @app.delete("/v1/images/{name}", dependencies=auth, responses=_ERRORS)
    async def remove_image(name: str) -> dict:
        images, _ = await cluster.layer_use()
        await cluster.any_edge().remove_image(name, images)
        return {"removed": name}

    @app.post("/v1/images:build", responses=_ERRORS, response_model=ExecEvent)
    async def build_image(request: BuildImageRequest, caller: Caller = Depends(authenticated)) -> StreamingResponse:
        """An image from a Dockerfile, its log as NDJSON ``ExecEvent`` lines (``dsec.edge.build``)."""
        return await _streaming(cluster.any_edge().build_image(request, caller.project))

    @app.post("/v1/images:gc", dependencies=auth)
    async def gc_layers() -> dict:
        _, layers = await cluster.layer_use()
        return {"removed": await cluster.any_edge().gc_layers(layers)}

    @app.get("/v1/nodes", dependencies=auth)
    async def nodes(all: bool = False) -> list[NodeInfo]:
        """The nodes serving; with ``all=true``, also those lost or whose edge did not start."""
        return await cluster.node_infos() + (cluster.unready_infos() if all else [])

    add_project_routes(app, cluster, authenticated, _ERRORS)
    add_job_routes(app, jobs, authenticated, _ERRORS)
    add_fncall_routes(app, cluster, authenticated, _ERRORS)
    add_observe_routes(app, cluster, authenticator, _ERRORS)
    for add in extensions:
        plain_routes.extend(add(app, cluster, authenticator) or ())
    return app
