"""``RemoteEdge``: a node in another process or on another machine, behind its own endpoint
(``dsec.edge.server``), as an ``EdgeAPI``.

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
import json
import socket
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TypeVar
from urllib.parse import quote, urlencode, urlsplit

import httpx
import pydantic

from libdsec import DSecError
from libdsec._errors import error_from_wire
from libdsec._wire import Answer, WireClient, WireError
from libdsec.protocol import (
    BatchEvent,
    BuildImageRequest,
    NodeBuildRequest,
    DSecContainerRunArgs,
    DSecFnCallArgs,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    FileList,
    FileRemoveRequest,
    FileRenameRequest,
    FnCallBatchRequest,
    FnCallBatchResult,
    FnCallResult,
    ImageInfo,
    ImageList,
    ImageRemoveRequest,
    LayerGCRequest,
    LayerGCResult,
    LayerUse,
    MakeDirRequest,
    NetworkRulesRequest,
    TTLRequest,
    NodeBatchRequest,
    NodeInfo,
    NodeStats,
    NodeStopRequest,
    CleanCopyRequest,
    CleanCopyResult,
    PackDiffRequest,
    PackDiffResult,
    OpenPtyRequest,
    OpenSessionRequest,
    PauseResult,
    ProcessInfo,
    ProcessList,
    ProcessSignalRequest,
    ProcessStdinRequest,
    ProcessStreamRequest,
    ProcessWaitRequest,
    SandboxInfo,
    SandboxList,
    SecurityEvent,
    SecurityEventList,
    PtyInfo,
    PtyInputRequest,
    PtyResizeRequest,
    PtyStreamRequest,
    SessionInfo,
    SnapshotInfo,
    StartProcessRequest,
    TreeDownloadRequest,
)

from .api import NodeUnreachable
from .server import PORT_UPGRADE, PREFIX

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

    async def _get(self, answer_model, path: str, **kw):
        return self._parse(answer_model, await self._call("GET", path, **kw))

    async def _post(self, answer_model, path: str, **kw):
        return self._parse(answer_model, await self._call("POST", path, **kw))

    # -- sandboxes ---------------------------------------------------------------------------

    async def create(self, args: DSecContainerRunArgs, kind: str = "container", project: str = "root") -> SandboxInfo:
        # A NodeCreateRequest's JSON, with the run args serialised once (not dumped to a dict,
        # validated into the request and dumped again): the hottest call of the seam.
        body = b'{"kind":%s,"project":%s,"args":%s}' % (
            json.dumps(kind).encode(), json.dumps(project).encode(), args.model_dump_json().encode())
        return await self._post(SandboxInfo, "/sandboxes", body=body, content_type="application/json")

    async def create_batch(
        self, args: DSecContainerRunArgs, count: int, kind: str = "container", project: str = "root",
        batch: str | None = None,
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

    async def commit_batch(self, batch: str) -> None:
        await self._call("POST", f"/batches/{batch}:commit")

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

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self._get(SandboxInfo, f"/sandboxes/{sandbox_id}")

    async def list(self) -> list[SandboxInfo]:
        return (await self._get(SandboxList, "/sandboxes")).sandboxes

    async def stop(self, sandbox_id: str, reason: str = "stopped by request") -> SandboxInfo:
        return await self._post(SandboxInfo, f"/sandboxes/{sandbox_id}/stop", model=NodeStopRequest(reason=reason))

    async def pause(self, sandbox_id: str) -> PauseResult:
        return await self._post(PauseResult, f"/sandboxes/{sandbox_id}/pause", timeout=LONG_CALL_TIMEOUT_S)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return await self._post(SandboxInfo, f"/sandboxes/{sandbox_id}/resume", timeout=LONG_CALL_TIMEOUT_S)

    async def snapshot(self, sandbox_id: str) -> SnapshotInfo:
        return await self._post(SnapshotInfo, f"/sandboxes/{sandbox_id}/snapshot", timeout=LONG_CALL_TIMEOUT_S)

    async def pack_diff(self, sandbox_id: str, name: str | None = None, role: str = "snapshot") -> PackDiffResult:
        return await self._post(PackDiffResult, f"/sandboxes/{sandbox_id}/pack_diff",
                                model=PackDiffRequest(name=name, role=role), timeout=LONG_CALL_TIMEOUT_S)

    async def clean_copy(self, sandbox_id: str, keep: list[str]) -> CleanCopyResult:
        # Checked by the node (its errors are the ones the seam promises).
        return await self._post(CleanCopyResult, f"/sandboxes/{sandbox_id}/clean_copy",
                                model=CleanCopyRequest.model_construct(keep=keep), timeout=LONG_CALL_TIMEOUT_S)

    # -- inside a sandbox --------------------------------------------------------------------

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        return await self._post(ExecResult, f"/sandboxes/{sandbox_id}/exec", model=request,
                                timeout=request.timeout + SLACK_S)

    def exec_stream(self, sandbox_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        return self._events(f"/sandboxes/{sandbox_id}/exec:stream", request, request.timeout)

    def stream_process(self, sandbox_id: str, pid: int, request: ProcessStreamRequest) -> AsyncIterator[ExecEvent]:
        return self._events(f"/sandboxes/{sandbox_id}/processes/{pid}/stream", request, request.timeout)

    def start_process_stream(self, sandbox_id: str, request: StartProcessRequest) -> AsyncIterator[ExecEvent]:
        return self._events(f"/sandboxes/{sandbox_id}/processes:stream", request, 24 * 3600.0)

    async def start_process(self, sandbox_id: str, request: StartProcessRequest) -> ProcessInfo:
        return await self._post(ProcessInfo, f"/sandboxes/{sandbox_id}/processes", model=request)

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        return (await self._get(ProcessList, f"/sandboxes/{sandbox_id}/processes")).processes

    async def get_process(self, sandbox_id: str, pid: int) -> ProcessInfo:
        return await self._get(ProcessInfo, f"/sandboxes/{sandbox_id}/processes/{pid}")

    async def signal_process(self, sandbox_id: str, pid: int, signal: int) -> None:
        await self._call("POST", f"/sandboxes/{sandbox_id}/processes/{pid}/signal",
                         model=ProcessSignalRequest(signal=signal))

    async def process_stdin(self, sandbox_id: str, pid: int, data: str, close: bool) -> None:
        await self._call("POST", f"/sandboxes/{sandbox_id}/processes/{pid}/stdin",
                         model=ProcessStdinRequest(data=data, close=close), timeout=LONG_CALL_TIMEOUT_S)

    async def wait_process(self, sandbox_id: str, pid: int, timeout: float) -> ProcessInfo:
        return await self._post(ProcessInfo, f"/sandboxes/{sandbox_id}/processes/{pid}/wait",
                                model=ProcessWaitRequest(timeout=timeout), timeout=timeout + SLACK_S)

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

    async def open_pty(self, sandbox_id: str, request: OpenPtyRequest) -> PtyInfo:
        return await self._post(PtyInfo, f"/sandboxes/{sandbox_id}/ptys", model=request)

    async def pty_input(self, sandbox_id: str, pty: int, data: bytes) -> None:
        await self._call("POST", f"/sandboxes/{sandbox_id}/ptys/{pty}/input", model=PtyInputRequest(data=data),
                         timeout=LONG_CALL_TIMEOUT_S)

    async def resize_pty(self, sandbox_id: str, pty: int, cols: int, rows: int) -> None:
        await self._call("POST", f"/sandboxes/{sandbox_id}/ptys/{pty}/resize", model=PtyResizeRequest(cols=cols, rows=rows))

    def pty_stream(self, sandbox_id: str, pty: int, encoding: str = "utf-8") -> AsyncIterator[ExecEvent]:
        request = PtyStreamRequest(encoding=encoding)
        return self._events(f"/sandboxes/{sandbox_id}/ptys/{pty}/stream", request, request.timeout)

    async def close_pty(self, sandbox_id: str, pty: int) -> None:
        await self._call("POST", f"/sandboxes/{sandbox_id}/ptys/{pty}/close", timeout=LONG_CALL_TIMEOUT_S)

    async def open_session(self, sandbox_id: str, request: OpenSessionRequest) -> SessionInfo:
        return await self._post(SessionInfo, f"/sandboxes/{sandbox_id}/sessions", model=request)

    async def session_exec(self, sandbox_id: str, session: int, request: ExecRequest) -> ExecResult:
        return await self._post(ExecResult, f"/sandboxes/{sandbox_id}/sessions/{session}/exec", model=request,
                                timeout=request.timeout + SLACK_S)

    def session_exec_stream(self, sandbox_id: str, session: int, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        return self._events(f"/sandboxes/{sandbox_id}/sessions/{session}/exec:stream", request, request.timeout)

    async def interrupt_session(self, sandbox_id: str, session: int) -> None:
        await self._call("POST", f"/sandboxes/{sandbox_id}/sessions/{session}/interrupt")

    async def close_session(self, sandbox_id: str, session: int) -> None:
        await self._call("POST", f"/sandboxes/{sandbox_id}/sessions/{session}/close")

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileEntry]:
        return (await self._get(FileList, f"/sandboxes/{sandbox_id}/fs/list", params={"path": path})).entries

    async def stat_path(self, sandbox_id: str, path: str) -> FileEntry:
        return await self._get(FileEntry, f"/sandboxes/{sandbox_id}/fs/stat", params={"path": path})

    async def remove_path(self, sandbox_id: str, path: str, recursive: bool) -> None:
        await self._call("POST", f"/sandboxes/{sandbox_id}/fs/remove", model=FileRemoveRequest(path=path, recursive=recursive),
                         timeout=LONG_CALL_TIMEOUT_S)

    async def make_dir(self, sandbox_id: str, path: str) -> None:
        await self._call("POST", f"/sandboxes/{sandbox_id}/fs/mkdir", model=MakeDirRequest(path=path))

    async def rename_path(self, sandbox_id: str, src: str, dst: str) -> None:
        await self._call("POST", f"/sandboxes/{sandbox_id}/fs/rename", model=FileRenameRequest(src=src, dst=dst))

    async def upload_tree(self, sandbox_id: str, path: str, data: bytes | AsyncIterator[bytes]) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            await self._put_stream(f"/sandboxes/{sandbox_id}/fs/tree", {"path": path}, data)
            return
        await self._call("PUT", f"/sandboxes/{sandbox_id}/fs/tree", body=bytes(data), params={"path": path},
                         timeout=LONG_CALL_TIMEOUT_S)

    def build_image(self, request: BuildImageRequest, project: str = "root") -> AsyncIterator[ExecEvent]:
        return self._events("/images:build", NodeBuildRequest(project=project, build=request), request.timeout)

    def download_tree(self, sandbox_id: str, path: str) -> AsyncIterator[ExecEvent]:
        return self._events(f"/sandboxes/{sandbox_id}/fs/tree:download", TreeDownloadRequest(path=path), 3600.0)

    async def download_tree_tar(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        async for chunk in self._raw(f"/sandboxes/{sandbox_id}/fs/tree", path, "a tree download"):
            yield chunk

    async def read_file_stream(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        async for chunk in self._raw(f"/sandboxes/{sandbox_id}/files:stream", path, "a file read"):
            yield chunk

    async def write_file_stream(self, sandbox_id: str, path: str, data: bytes | AsyncIterator[bytes], mode: int) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            await self._put_stream(f"/sandboxes/{sandbox_id}/files:stream", {"path": path, "mode": oct(mode)}, data)
            return
        await self._call("PUT", f"/sandboxes/{sandbox_id}/files:stream", body=bytes(data),
                         params={"path": path, "mode": oct(mode)}, timeout=3600.0)

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

    async def _raw(self, route: str, path: str, what: str) -> AsyncIterator[bytes]:
        if self._closed:
            raise self._unreachable("is closed on this side")
        target = f"{PREFIX}{route}?{urlencode({'path': path})}"
        try:
            async with self._wire.stream("GET", target, timeout=3600.0 + SLACK_S) as response:
                if response.status_code >= 400:
                    raise self._error(response.status_code, await response.read())
                async for chunk in response.chunks():
                    yield chunk
        except WireError as exc:
            raise self._unreachable(f"broke off {what}: {exc}") from None

    async def _events(self, path: str, request: pydantic.BaseModel, timeout: float) -> AsyncIterator[ExecEvent]:
        """The node's NDJSON lines as events, read as the consumer asks for them (so TCP's flow
        control carries its pace to the node). Between two lines the node may be silent for
        as long as the command is (its timeout plus the slack)."""
        if self._closed:
            raise self._unreachable("is closed on this side")
        try:
            async with aclosing(self._lines(ExecEvent, path, request, timeout + SLACK_S)) as events:
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

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return (await self._call("GET", f"/sandboxes/{sandbox_id}/files", params={"path": path})).content

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None:
        await self._call("PUT", f"/sandboxes/{sandbox_id}/files", body=data, params={"path": path, "mode": oct(mode)})

    async def security_events(self, sandbox_id: str) -> list[SecurityEvent]:
        return (await self._get(SecurityEventList, f"/sandboxes/{sandbox_id}/security_events")).events

    async def set_network_rules(self, sandbox_id: str, rules: dict) -> None:
        await self._call("PUT", f"/sandboxes/{sandbox_id}/network_rules", model=NetworkRulesRequest(network_rules=rules))

    async def set_ttl(self, sandbox_id: str, ttl_running_stop: float) -> SandboxInfo:
        return self._parse(SandboxInfo, await self._call("PUT", f"/sandboxes/{sandbox_id}/ttl",
                                                         model=TTLRequest(ttl_running_stop=ttl_running_stop)))

    # -- the node ----------------------------------------------------------------------------

    async def node_info(self) -> NodeInfo:
        return await self._get(NodeInfo, "/info")

    async def node_stats(self) -> NodeStats:
        return await self._get(NodeStats, "/stats")

    async def layer_use(self) -> LayerUse:
        return await self._get(LayerUse, "/layer_use")

    async def list_images(self) -> list[ImageInfo]:
        return (await self._get(ImageList, "/images")).images

    async def inspect_image(self, ref: str) -> ImageInfo:
        return await self._get(ImageInfo, f"/images/{ref}")

    async def remove_image(self, name: str, in_use: frozenset[str]) -> None:
        await self._call("POST", f"/images/{name}:remove", model=ImageRemoveRequest(in_use=sorted(in_use)))

    async def gc_layers(self, in_use: frozenset[str]) -> list[str]:
        result = await self._post(LayerGCResult, "/images:gc", model=LayerGCRequest(in_use=sorted(in_use)),
                                  timeout=LONG_CALL_TIMEOUT_S)
        return result.removed

    # -- stateless calls ---------------------------------------------------------------------

    async def fncall(self, args: DSecFnCallArgs) -> FnCallResult:
        return await self._post(FnCallResult, "/fncall", model=args, timeout=max(args.timeout, 0) + SLACK_S)

    async def fncall_many(self, calls: list[DSecFnCallArgs]) -> list[FnCallResult]:
        longest = max((c.timeout for c in calls), default=0.0)
        result = await self._post(FnCallBatchResult, "/fncall:batch", model=FnCallBatchRequest(calls=calls),
                                  timeout=LONG_CALL_TIMEOUT_S + longest)
        return result.results

