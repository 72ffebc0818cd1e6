"""The async SDK: ``DSecClient`` opens a connection to an apiserver; ``Sandbox`` is one handle.

Lifecycle: ``DSecClient()`` → ``await open()`` (or ``async with``) → calls → ``await close()``;
a second ``close()`` does nothing. A ``Sandbox`` is a handle to a server-side sandbox; ``stop()``
ends it (a second ``stop()`` does nothing), and ``async with sandbox`` stops it on exit.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import base64
import os
import random
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from .api_ops import api_path, api_route
from ._errors import (
    DSecError,
    InvalidRequest,
    LimitOutOfRange,
    Overloaded,
    ReplayIncomplete,
    ServerError,
    SessionClosed,
    ServerUnavailable,
    error_from_wire,
)
from ._build import build_request
from ._desktop import Desktop
from ._files import SandboxFiles
from ._process import Process, Session, events_of, run_with_callbacks
from ._pausing import _GroupMethods
from ._projects import _ProjectMethods
from ._replay import Replay
from ._pty import Pty
from ._watch import DirWatch
from ._transport import Answer, Transport, check_choice, make_transport
from ._wire import CannotConnect, ConnectionBroken, WireError
from .protocol import OpenWatchRequest, WatchInfo
from .protocol import ClusterStats, NetworkRulesRequest, SecurityEvent, SecurityEventList, TTLRequest
from .protocol import DSecFnCallArgs, FnCallBatchRequest, FnCallBatchResult, FnCallResult
from .protocol import JOB_HEADER, KEY_HEADER, JobInfo, JobList, JobLog, check_job_name, check_key
from .protocol import (
    DEFAULT_COMMAND_TIMEOUT_S,
    MAX_SANDBOX_BATCH,
    BatchEvent,
    BuildResult,
    CleanCopyRequest,
    CleanCopyResult,
    ForkRequest,
    ForkResult,
    CreateBatchRequest,
    DSecContainerRunArgs,
    DSecFullVMRunArgs,
    DSecMicroVMRunArgs,
    ExecEvent,
    ExecRequest,
    ExecResult,
    ImageInfo,
    ImageList,
    NodeInfo,
    PackDiffRequest,
    PackDiffResult,
    OpenPtyRequest,
    OpenSessionRequest,
    PauseMode,
    PauseRequest,
    PauseResult,
    ProcessInfo,
    ProcessList,
    PtyInfo,
    SessionInfo,
    StartProcessRequest,
    SandboxInfo,
    SandboxList,
    SandboxStatus,
    Snapshot,
    SnapshotList,
    SnapshotMode,
    SnapshotRequest,
)

if TYPE_CHECKING:
    import httpx

DEFAULT_ENDPOINT = "http://127.0.0.1:8765"
DEFAULT_STATE_DIR = "/var/lib/dsec"
# Slack added to a command's own timeout for the HTTP round trip.
_HTTP_SLACK_S = 30.0
# Requests that may go to another endpoint after they may have reached a server: the
# idempotent methods (RFC 9110), reads and stop among them; never a create or an exec (POST).
_REPEATABLE = frozenset({"GET", "HEAD", "PUT", "DELETE"})
# The calls that make a sandbox: sent again only when they carry an idempotency key.
_CREATE_PATHS = frozenset({*(api_path(name) for name in ("create_sandbox", "create_microvm", "create_fullvm")),
                           "/v1/sandboxes:batch"})


def _is_create(method: str, path: str) -> bool:
    return method == "POST" and (path in _CREATE_PATHS or path.endswith(("/clean_copy", "/fork")))


def may_repeat(method: str, path: str, headers: dict[str, str] | None, refused: bool) -> bool:
    """Whether a call that failed may be sent again, to the same server. ``refused``: it was
    answered ``Overloaded``, which a node says before any of the call's work began; else its
    connection broke, and the call may have reached the server. A create is repeated only when
    it carries an idempotency key, in both cases: its ``Overloaded`` may come from the last of
    the nodes the apiserver tried, after one that broke off mid-create (and may have made it).
    Anything else refused is repeated; anything else broken only when idempotent (GET, PUT,
    DELETE: reads, writing a file, stop)."""
    if _is_create(method, path):
        return bool((headers or {}).get(KEY_HEADER))  # the idempotency key (``key=``)
    return refused or method in _REPEATABLE

ProgressCallback = Callable[[int, int], None]


def _path_segment(ref: str) -> str:
    """``ref`` as one path segment: a reference with a '/' (or nothing) is refused here, by name."""
    if not ref or "/" in ref or ref in (".", ".."):
        raise InvalidRequest(f"invalid snapshot reference {ref!r}: an id (s + 16 hex digits) or a name")
    return ref


def default_token() -> str | None:
    """DSEC_TOKEN, else the token file in the local state dir (DSEC_STATE_DIR)."""
    token = os.environ.get("DSEC_TOKEN")
    if token:
        return token
    path = Path(os.environ.get("DSEC_STATE_DIR", DEFAULT_STATE_DIR)) / "token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


OutputCallback = Callable[[str], Any]


def _exec_request(command: str, timeout: float, env: dict[str, str] | None, workdir: str | None, user: str | None,
                  stdin: str | None, max_output_bytes: int | None) -> ExecRequest:
    return ExecRequest(
        command=command, timeout=timeout, env=env or {}, workdir=workdir, user=user, stdin=stdin,
        **({"max_output_bytes": max_output_bytes} if max_output_bytes is not None else {}),
    )


class Sandbox:
    """A handle to one sandbox. Use ``async with`` or call ``stop()`` when done."""

    def __init__(self, client: DSecClient, info: SandboxInfo) -> None:
        self._client = client
        self.info = info
        # Set on a sandbox made by ``clean_copy``: what was carried into it.
        self.clean_copy_result: CleanCopyResult | None = None
        # Set on a child made by ``fork``: the fork (its kind, its parent, its siblings).
        self.fork_result: ForkResult | None = None

    @property
    def files(self) -> SandboxFiles:
        """The sandbox's files: list, stat, remove, make_dir, rename, upload_dir, download_dir.
        (Made on each use, not kept: a kept one would make every sandbox a reference cycle,
        left for the garbage collector's full passes to find.)"""
        return SandboxFiles(self)

    @property
    def desktop(self) -> Desktop:
        """The sandbox's screen, mouse and keyboard (a sandbox made with ``desktop=DesktopSpec(...)``)."""
        return Desktop(self)

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def status(self) -> SandboxStatus:
        return self.info.status

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.image} {self.info.status.value}>"

    async def run_shell(
        self,
        command: str,
        *,
        timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        stdin: str | None = None,
        max_output_bytes: int | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        """Run ``command`` with ``sh -c`` inside the sandbox; raises CommandTimeout past timeout.
        With ``on_stdout``/``on_stderr`` (plain or async callables) the output is streamed:
        each gets the text chunks as the command writes them, and the result still comes at
        the end (its output capped at ``max_output_bytes``; the callbacks see all of it)."""
        request = _exec_request(command, timeout, env, workdir, user, stdin, max_output_bytes)
        if on_stdout is not None or on_stderr is not None:
            return await run_with_callbacks(self._events(request), on_stdout, on_stderr)
        if self._client._replay is not None:
            answered, result = self._client._replay.call(self.id, "exec", request.model_dump(mode="json"))
            if answered:
                return ExecResult.model_validate(result)
        body = await self._client._request(
            *api_route("exec", sandbox_id=self.id),
            model=request,
            timeout=timeout + _HTTP_SLACK_S,
        )
        return ExecResult.model_validate(body)

    async def stream_shell(
        self,
        command: str,
        *,
        timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        stdin: str | None = None,
        max_output_bytes: int | None = None,
    ) -> AsyncIterator[ExecEvent]:
        """``async for event in sandbox.stream_shell(cmd)``: ``stdout``/``stderr`` events
        (``event.data``, text) as the command writes, then one ``exit`` (``event.result``, as
        ``run_shell`` returns it). Read slowly and the command slows down (nothing piles up
        in the server); leave the loop early and the command is killed. Errors (a timeout,
        the sandbox gone) are raised."""
        request = _exec_request(command, timeout, env, workdir, user, stdin, max_output_bytes)
        async for event in self._events(request):
            yield event

    def _events(self, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        route = api_route("exec_stream", sandbox_id=self.id)
        self._client._guard(*route)
        return events_of(self._client._stream(*route, request,
                                              request.timeout + _HTTP_SLACK_S, ExecEvent))

    # -- background processes ----------------------------------------------------------------

    async def start_shell(
        self,
        command: str,
        *,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
    ) -> Process:
        """Start ``command`` (``sh -c``) in the background and return at once: a ``Process``
        with its ``pid``. It outlives this call and this client (see ``Process``)."""
        request = StartProcessRequest(command=command, env=env or {}, workdir=workdir, user=user)
        body = await self._client._request(*api_route("start_process", sandbox_id=self.id), model=request)
        return Process(self, ProcessInfo.model_validate(body))

    async def list_processes(self) -> list[ProcessInfo]:
        """The background processes started in this sandbox, running or ended."""
        body = await self._client._request(*api_route("list_processes", sandbox_id=self.id))
        return ProcessList.model_validate(body).processes

    async def open_session(
        self,
        *,
        workdir: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        idle_timeout: float = 600.0,
        shell: str = "sh",
    ) -> Session:
        """A shell whose state persists between its commands (see ``Session``): ``async with
        await sandbox.open_session(workdir="/repo") as session: await session.run_shell(…)``.
        One no command reached for ``idle_timeout`` seconds ends (a client that vanished
        leaves nothing behind). ``shell``: ``"sh"`` or ``"bash"`` (without rc files)."""
        request = OpenSessionRequest(workdir=workdir, env=env or {}, user=user, idle_timeout=idle_timeout, shell=shell)
        body = await self._client._request(*api_route("open_session", sandbox_id=self.id), model=request, timeout=60)
        return Session(self, SessionInfo.model_validate(body))

    async def open_pty(
        self,
        *,
        cols: int = 80,
        rows: int = 24,
        command: str = "/bin/sh",
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        idle_timeout: float = 600.0,
    ) -> Pty:
        """``command`` (``sh -c``) on a new terminal of ``cols`` x ``rows`` (see ``Pty``):
        ``async with await sandbox.open_pty() as pty: await pty.write(b"ls\\n")``. ``TERM``
        is ``xterm-256color`` unless ``env`` or the image says otherwise. A PTY nobody reads
        or writes for ``idle_timeout`` seconds is closed."""
        try:
            request = OpenPtyRequest(cols=cols, rows=rows, command=command, env=env or {}, workdir=workdir, user=user,
                                     idle_timeout=idle_timeout)
        except ValidationError as exc:
            raise InvalidRequest("bad PTY: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                                         for e in exc.errors())) from None
        body = await self._client._request(*api_route("open_pty", sandbox_id=self.id), model=request, timeout=60)
        return Pty(self, PtyInfo.model_validate(body))

    async def watch_dir(self, path: str, *, recursive: bool = False) -> DirWatch:
        """Watch the directory ``path`` (and with ``recursive`` the tree below it) for changes,
        told by the node's inotify as they happen (see ``DirWatch``): ``async with await
        sandbox.watch_dir("/work") as watch: print(await watch.events(wait=5))``.
        ``SandboxFileNotFound`` if it is not there, ``InvalidRequest`` if it is not a directory
        (or the sandbox is a VM: containers only)."""
        request = OpenWatchRequest(path=path, recursive=recursive)
        body = await self._client._request(*api_route("open_watch", sandbox_id=self.id), model=request, timeout=60)
        return DirWatch(self, WatchInfo.model_validate(body))

    def port_url(self, port: int) -> str:
        """The URL, through the apiserver, of port ``port`` inside the sandbox: HTTP requests
        to it (with this client's token as ``authorization: Bearer …``) reach what listens there
        on 127.0.0.1; ``PortUnreachable`` (502) when nothing does. WebSocket too: the same URL
        as ``ws://`` (or ``wss://``), message for message, with the same ``authorization``."""
        if not 1 <= int(port) <= 65535:
            raise InvalidRequest(f"port {port} is outside 1-65535")
        return f"{self._client.endpoint}/v1/sandboxes/{self.id}/ports/{int(port)}/"

    async def connect_session(self, session_id: int) -> Session:
        """A handle on a session opened before (by any client, before an edge restart too).
        ``ProcessNotFound`` for an id that was never one; ``SessionClosed`` once it ended."""
        body = await self._client._request(*api_route("get_process", sandbox_id=self.id, pid=int(session_id)))
        info = ProcessInfo.model_validate(body)
        if not info.running:
            raise SessionClosed(f"session {session_id} has ended (exit code {info.exit_code}); open a new one")
        return Session(self, SessionInfo(id=info.pid))

    async def connect_process(self, pid: int) -> Process:
        """A handle on a background process started before (by any client); its ``stream()``
        gives what it writes from now on. ``ProcessNotFound`` for any other pid."""
        body = await self._client._request(*api_route("get_process", sandbox_id=self.id, pid=int(pid)))
        info = ProcessInfo.model_validate(body)
        return Process(self, info, stdout_offset=info.stdout_bytes, stderr_offset=info.stderr_bytes)

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        if isinstance(data, str):
            data = data.encode()
        if self._client._replay is not None:
            request = {"path": path, "mode": mode, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            if self._client._replay.call(self.id, "write_file", request)[0]:
                return
        await self._client._request(
            *api_route("write_file", sandbox_id=self.id),
            params={"path": path, "mode": oct(mode)},
            content=data,
        )

    async def read_file(self, path: str) -> bytes:
        if self._client._replay is not None:
            answered, result = self._client._replay.call(self.id, "read_file", {"path": path})
            if answered:
                if "data_b64" not in result:
                    raise ReplayIncomplete(f"job {self._client.job!r}: the log kept no bytes of the read of {path!r} "
                                           f"on sandbox {self.id} ({result.get('bytes')} bytes); it cannot answer it")
                return base64.b64decode(result["data_b64"])
        return await self._client._request(
            *api_route("read_file", sandbox_id=self.id), params={"path": path}, raw=True
        )

    async def pack_diff(self, name: str | None = None, *, role: str = "snapshot") -> PackDiffResult:
        """Turn the sandbox's changes into a new image (the sandbox is frozen meanwhile and
        keeps running after). Start new sandboxes from ``result.image`` to restore or branch."""
        request = PackDiffRequest(name=name, role=role)
        if self._client._replay is not None:
            answered, result = self._client._replay.call(self.id, "pack_diff", request.model_dump(mode="json"))
            if answered:
                return PackDiffResult.model_validate(result)
        body = await self._client._request(*api_route("pack_diff", sandbox_id=self.id), model=request, timeout=600)
        return PackDiffResult.model_validate(body)

    async def clean_copy(self, keep: Iterable[str]) -> Sandbox:
        """A new running sandbox for grading: the original image's layers with only this
        sandbox's changes beneath ``keep`` (e.g. ``["/testbed"]``), scrubbed as ``pack_diff``
        scrubs, links carried as links. Nothing the agent did elsewhere (a replaced ``/bin/sh``,
        ``/etc/ld.so.preload``, a ``sitecustomize.py``) reaches it; what it did beneath the kept
        paths does, so run the grader's own files from a place the agent could not write. This
        sandbox is frozen while its changes are read and keeps running; stop the copy when
        done (``async with``). ``copy.clean_copy_result`` says what was carried; system files the
        agent replaced or added are also a ``file.tampered`` security event of this sandbox."""
        try:
            request = CleanCopyRequest(keep=list(keep))
        except ValidationError as exc:
            raise InvalidRequest("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None
        answered, logged = (False, None) if self._client._replay is None else \
            self._client._replay.call(self.id, "clean_copy", request.model_dump(mode="json"))
        if answered:
            result = CleanCopyResult.model_validate(logged)
        else:
            body = await self._client._request(*api_route("clean_copy", sandbox_id=self.id), model=request,
                                               timeout=600)
            result = CleanCopyResult.model_validate(body)
        copy = Sandbox(self._client, result.sandbox)
        copy.clean_copy_result = result
        return copy

    async def fork(self, count: int = 1, *, all_or_none: bool = True,
                   ttl_running_stop: float | None = None) -> list[Sandbox] | list[Sandbox | DSecError]:
        """``count`` new running sandboxes branched from this one, which is frozen for as
        short a time as it takes and runs on untouched. Each child is someone new (its own id,
        host name, ``/etc/machine-id`` and address; a VM's random numbers reseeded) and has
        this sandbox's memory and processes where its kind forks memory (microVMs:
        ``child.fork_result.kind == "memory"``), else its files, with the image's command
        started afresh (``"filesystem"``: containers, full VMs; ``node_info().forks`` says
        which, by kind). All or none: a child that fails stops the others and raises its error;
        with ``all_or_none=False`` the list has one entry per child, a ``Sandbox`` or the
        ``DSecError`` that child met. ``ttl_running_stop``: the children's (default: this
        sandbox's). Children count against the project's quota; stop each when done."""
        try:
            request = ForkRequest(count=count, all_or_none=all_or_none, ttl_running_stop=ttl_running_stop)
        except ValidationError as exc:
            raise InvalidRequest("fork: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                                      for e in exc.errors())) from None
        answered, logged = (False, None) if self._client._replay is None else \
            self._client._replay.call(self.id, "fork", request.model_dump(mode="json"))
        if answered:
            result = ForkResult.model_validate(logged)
        else:
            result = ForkResult.model_validate(await self._client._request(
                *api_route("fork", sandbox_id=self.id), model=request, timeout=600))
        children: list = []
        for child in result.children:
            if child.sandbox is None:
                error = child.error.model_dump() if child.error is not None else {"code": "internal", "message": ""}
                children.append(error_from_wire({"error": error}, 500))
                continue
            made = Sandbox(self._client, child.sandbox)
            made.fork_result = result
            children.append(made)
        return children

    async def security_events(self) -> list[SecurityEvent]:
        """Denied actions the platform saw in this sandbox: blocked connections and DNS
        names, denied syscalls, limit hits, output caps (also after it stopped)."""
        body = await self._client._request(*api_route("security_events", sandbox_id=self.id))
        return SecurityEventList.model_validate(body).events

    async def set_network_rules(self, network_rules: dict[str, bool | list[str]]) -> None:
        """Replace the sandbox's network allowlist while it runs (e.g. between task stages)."""
        request = NetworkRulesRequest(network_rules=network_rules)
        if self._client._replay is not None and \
                self._client._replay.call(self.id, "set_network_rules", request.model_dump(mode="json"))[0]:
            return
        await self._client._request(*api_route("set_network_rules", sandbox_id=self.id), model=request)

    async def set_ttl(self, ttl_running_stop: float) -> SandboxInfo:
        """A new idle TTL (``ttl_running_stop``), counted from now; paused or running."""
        request = TTLRequest(ttl_running_stop=ttl_running_stop)
        answered, result = (False, None) if self._client._replay is None else \
            self._client._replay.call(self.id, "set_ttl", request.model_dump(mode="json"))
        self.info = SandboxInfo.model_validate(result if answered else await self._client._request(
            *api_route("set_ttl", sandbox_id=self.id), model=request))
        return self.info

    async def refresh(self) -> SandboxInfo:
        self.info = SandboxInfo.model_validate(
            await self._client._request(*api_route("get", sandbox_id=self.id))
        )
        return self.info

    async def pause(self, mode: PauseMode = "full") -> PauseResult:
        """``mode="full"``: freeze the sandbox and push its memory out (to swap); the result says
        how much memory it held before and after. Its next call (or ``resume()``) brings it back
        where it was. ``"filesystem"``: end its processes and keep its files only; ``resume()``
        starts it afresh over them (its image's init, a new boot id, no process of before; a
        call does not resume it: ``SandboxStateError``). Containers only (``InvalidRequest``)."""
        request = PauseRequest(mode=mode)
        answered, logged = (False, None) if self._client._replay is None else \
            self._client._replay.call(self.id, "pause", request.model_dump(mode="json"))
        result = PauseResult.model_validate(logged if answered else await self._client._request(
            *api_route("pause", sandbox_id=self.id), model=request))
        self.info = result.sandbox
        return result

    async def resume(self) -> SandboxInfo:
        """Thaw a paused sandbox (its memory comes back as it is touched)."""
        answered, logged = (False, None) if self._client._replay is None else \
            self._client._replay.call(self.id, "resume", {})
        self.info = SandboxInfo.model_validate(logged if answered else
                                               await self._client._request(*api_route("resume", sandbox_id=self.id)))
        return self.info

    async def snapshot(self, mode: SnapshotMode | None = None, *, name: str | None = None) -> Snapshot:
        """Keep this sandbox's state as a snapshot (it runs on). ``mode="full"``: memory,
        devices and files (microVMs: copies resume where it was); ``"filesystem"``: its files
        as an image layer (every kind: copies start afresh from them); unset, ``full`` where
        the kind can, else ``filesystem``. ``name``: unique among snapshots (a clash is
        ``SnapshotConflict``). Start sandboxes of the same kind from it with run args'
        ``snapshot=snap.id`` (or the name); it outlives this sandbox until
        ``client.remove_snapshot``."""
        try:
            request = SnapshotRequest(mode=mode, name=name)
        except ValidationError as exc:
            raise InvalidRequest("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None
        body = await self._client._request(*api_route("snapshot", sandbox_id=self.id), model=request, timeout=600)
        return Snapshot.model_validate(body)

    async def stop(self) -> None:
        """Stop and remove the sandbox. Stopping a stopped sandbox does nothing. ``SandboxLost``
        if its node is away: the stop is kept, and made when the node is back."""
        if self.info.status in (SandboxStatus.stopped,):
            return
        if self._client._replay is not None:
            answered, result = self._client._replay.call(self.id, "stop", {})
            if answered:
                self.info = SandboxInfo.model_validate(result)
                return
        body = await self._client._request(*api_route("stop", sandbox_id=self.id))
        self.info = SandboxInfo.model_validate(body)

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class DSecClient(_ProjectMethods, _GroupMethods):
    """Async client for a DSec apiserver.

    ``endpoint`` defaults to DSEC_ENDPOINT or http://127.0.0.1:8765; ``token`` to DSEC_TOKEN or
    the local state dir's token file.

    Several apiservers of one cluster: ``endpoint="http://a:8765,http://b:8765"``. Requests go
    to one (``self.endpoint``, the first to begin with); when it cannot be reached (connection
    refused, reset or closed, not an error answer) a request moves on to the next one, and the
    client stays there. A request that may already have reached the server (the connection
    broke after it was sent) moves on only when it is safe to repeat (GET, PUT, DELETE: reads,
    writing a file, stop); a create or an exec then fails with ``ServerUnavailable``.

    Overload and broken connections: a call answered ``Overloaded`` (429: the node was too busy
    to begin it) or whose connection was reset is sent again, up to ``retries`` times, after a
    backoff (``retry_backoff_s`` doubling each time, with jitter, at least the server's
    ``retry_after``, at most ``retry_max_wait_s``), when it is safe to repeat (``may_repeat``:
    never a create without an idempotency key, never a command whose connection broke). The
    last failure is raised. ``retries=0``: none is repeated.

    ``transport``: how requests reach an endpoint (``libdsec/_transport.py``). ``"wire"``, the
    lean HTTP/1.1 client, plain ``http://`` only (the default there: it costs the client a
    fraction of httpx's CPU a request); ``"httpx"`` (the default for ``https://``); or an httpx
    transport object such as ``httpx.ASGITransport(app)`` to serve an app in-process. Every
    transport answers through the same error mapping and the same retries and fail-over;
    ``transport="wire"`` with an ``https://`` endpoint is refused with ``InvalidRequest``.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 120.0,
        transport: str | httpx.AsyncBaseTransport | None = None,
        max_connections: int = 256,
        job: str | None = None,
        resume: bool = False,
        retries: int = 6,
        retry_backoff_s: float = 0.1,
        retry_max_wait_s: float = 10.0,
    ) -> None:
        if retries < 0 or retry_backoff_s < 0 or retry_max_wait_s < 0:
            raise InvalidRequest(f"retries={retries}, retry_backoff_s={retry_backoff_s} and "
                                 f"retry_max_wait_s={retry_max_wait_s} must not be negative")
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.retry_max_wait_s = retry_max_wait_s
        try:
            self.job = None if job is None else check_job_name(job)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if resume and job is None:
            raise InvalidRequest("resume=True needs the job to resume: DSecClient(job=..., resume=True)")
        self._resume = resume
        self._replay: Replay | None = None
        self.endpoints = _split_endpoints(endpoint or os.environ.get("DSEC_ENDPOINT") or DEFAULT_ENDPOINT)
        self.endpoint = self.endpoints[0]  # the one in use
        self._token = token
        self._timeout = timeout
        self._choice = check_choice(transport, self.endpoints)
        self._max_connections = max_connections
        self._transport: Transport | None = None  # the one of self.endpoint, once open
        self._transports: dict[str, Transport] = {}  # by endpoint
        self._headers: dict[str, str] = {}
        self._body_streams: dict[str, httpx.AsyncClient] = {}  # by endpoint, made at first use

    async def open(self) -> DSecClient:
        if self._transport is not None:
            return self
        token = self._token or default_token()
        headers = {"authorization": f"Bearer {token}"} if token else {}
        if self.job is not None:
            headers[JOB_HEADER] = self.job
        several = len(self.endpoints) > 1
        self._headers = headers
        self._transports = {endpoint: make_transport(self._choice, endpoint, headers, self._max_connections,
                                                     timeout=self._timeout, several=several)
                            for endpoint in self.endpoints}
        self._transport = self._transports[self.endpoint]
        if self._resume and self._replay is None:
            assert self.job is not None
            try:
                self._replay = Replay(await self.job_log(self.job))
            except BaseException:
                await self.close()
                raise
        return self

    async def close(self) -> None:
        transports, self._transports = self._transports, {}
        streams, self._body_streams = self._body_streams, {}
        self._transport = None
        await asyncio.gather(*(transport.aclose() for transport in transports.values()),
                             *(http.aclose() for http in streams.values()))

    async def __aenter__(self) -> DSecClient:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- sandboxes -------------------------------------------------------------------------

    async def run_container(self, args: DSecContainerRunArgs, *, key: str | None = None,
                            timeout: float | None = None) -> Sandbox:
        """Create one container sandbox and return once it is running.

        ``key``: an idempotency key of the caller's choosing (e.g. ``"episode-17"``). A create
        with a key used before in the project (or, with ``job=``, in the job) returns the sandbox
        made then, also after an apiserver restart, and makes none; with other arguments it
        raises ``KeyReused``. The same holds for ``run_microvm``, ``run_vm`` and ``run_containers``."""
        return await self._create(api_route("create_sandbox"), "container", args, key, timeout)

    async def run_microvm(self, args: DSecMicroVMRunArgs, *, key: str | None = None,
                          timeout: float | None = None) -> Sandbox:
        """Create one microVM (or restore one from ``args.snapshot``); returns once its guest
        agent answers. The handle is the same as a container's."""
        return await self._create(api_route("create_microvm"), "microvm", args, key, timeout)

    async def run_vm(self, args: DSecFullVMRunArgs, *, key: str | None = None, timeout: float | None = None) -> Sandbox:
        """Create one full VM booting the image's own init; same handle as a container's."""
        return await self._create(api_route("create_fullvm"), "fullvm", args, key, timeout)

    async def _create(self, route: tuple[str, str], kind: str, args: DSecContainerRunArgs, key: str | None,
                      timeout: float | None) -> Sandbox:
        headers = _key_headers(key)
        if self._replay is not None:
            logged = self._replay.create("create", {"kind": kind, "args": args.model_dump(mode="json")}, key)
            if logged is not None:
                return Sandbox(self, SandboxInfo.model_validate(logged))
        body = await self._request(*route, model=args, timeout=timeout, headers=headers)
        return Sandbox(self, SandboxInfo.model_validate(body))

    async def run_containers(
        self,
        args: DSecContainerRunArgs,
        *,
        count: int,
        key: str | None = None,
        timeout: float | None = None,
        progress: ProgressCallback | None = None,
    ) -> list[Sandbox]:
        """Create ``count`` sandboxes in one request; all of them, or none (then it raises).

        ``progress(done, count)`` is called as each one comes up. ``key``: as ``run_container``'s
        (a batch with a key used before returns the sandboxes made then).
        """
        if not 1 <= count <= MAX_SANDBOX_BATCH:
            raise LimitOutOfRange(f"count={count} is out of range: 1..{MAX_SANDBOX_BATCH} sandboxes per batch")
        headers = _key_headers(key)
        if self._replay is not None:
            logged = self._replay.create("create_batch", {"kind": "container", "args": args.model_dump(mode="json"),
                                                          "count": count}, key)
            if logged is not None:
                return [Sandbox(self, SandboxInfo.model_validate(info)) for info in logged]
        request = CreateBatchRequest(args=args, count=count)
        sandboxes: list[Sandbox | None] = [None] * count
        done = 0
        async for event in self._stream("POST", "/v1/sandboxes:batch", request, timeout, headers=headers):
            if event.event == "created" and event.sandbox is not None and event.index is not None:
                sandboxes[event.index] = Sandbox(self, event.sandbox)
                done += 1
                if progress is not None:
                    progress(done, count)
            elif event.event == "error":
                raise error_from_wire({"error": event.error}, 500)
        if any(s is None for s in sandboxes):
            raise ServerError(f"batch ended with {done} of {count} sandboxes created")
        return [s for s in sandboxes if s is not None]

    async def get_sandbox(self, sandbox_id: str) -> Sandbox:
        body = await self._request(*api_route("get", sandbox_id=sandbox_id))
        return Sandbox(self, SandboxInfo.model_validate(body))

    async def stop_sandbox(self, sandbox_id: str) -> SandboxInfo:
        """Stop the sandbox ``sandbox_id`` with no look-up first, by ``Sandbox.stop``'s rules: a
        stopped one stays as it is; ``SandboxLost`` when its node is away (the stop is kept, and
        made when the node is back)."""
        if self._replay is not None:
            answered, result = self._replay.call(sandbox_id, "stop", {})
            if answered:
                return SandboxInfo.model_validate(result)
        return SandboxInfo.model_validate(await self._request(*api_route("stop", sandbox_id=sandbox_id)))

    async def list_sandboxes(self) -> list[SandboxInfo]:
        return SandboxList.model_validate(await self._request(*api_route("list_sandboxes"))).sandboxes

    async def list_images(self, limit: int | None = None, after: str | None = None, prefix: str | None = None,
                          role: str | None = None) -> ImageList:
        """Images in name order: at most ``limit`` (None: all), after the name ``after``, whose
        names start with ``prefix``, whose top layer has ``role`` (base, workspace, toolkit,
        step, snapshot). A page of ``limit`` images may have a next one: ``after=`` its last
        image's name."""
        query = {k: str(v) for k, v in (("limit", limit), ("after", after), ("prefix", prefix), ("role", role))
                 if v is not None}
        return ImageList.model_validate(await self._request(*api_route("list_images"), params=query or None))

    async def inspect_image(self, ref: str) -> ImageInfo:
        """An image by name, or a composition such as ``python+repo-abc+harness``."""
        return ImageInfo.model_validate(await self._request(*api_route("inspect_image", ref=ref)))

    async def remove_image(self, name: str) -> None:
        await self._request(*api_route("remove_image", name=name))

    async def list_snapshots(self) -> list[Snapshot]:
        """The snapshots this client's project kept (every one, for the root token), oldest first."""
        return SnapshotList.model_validate(await self._request(*api_route("list_snapshots"))).snapshots

    async def get_snapshot(self, ref: str) -> Snapshot:
        """A snapshot by id or name (``SnapshotNotFound`` if there is none)."""
        return Snapshot.model_validate(await self._request(*api_route("get_snapshot", ref=_path_segment(ref))))

    async def remove_snapshot(self, ref: str) -> Snapshot:
        """Remove a snapshot (by id or name): its record, memory and image. ``SnapshotConflict``,
        naming them, while sandboxes started from it run."""
        return Snapshot.model_validate(await self._request(*api_route("remove_snapshot", ref=_path_segment(ref))))

    async def gc_images(self) -> list[str]:
        """Remove layers no image refers to and no sandbox holds; returns their digests."""
        return (await self._request(*api_route("gc_layers")))["removed"]

    async def build_image(
        self,
        name: str,
        dockerfile: str | os.PathLike | None = None,
        context: str | os.PathLike | None = None,
        *,
        dockerfile_text: str | None = None,
        build_args: dict[str, str] | None = None,
        no_cache: bool = False,
        on_log: Callable[[str], None] | None = None,
        memory_limit_mb: int = 2048,
        cpu_cores_limit: float = 1.0,
        timeout: float = 3600.0,
    ) -> BuildResult:
        """Build image ``name`` on the server from the Dockerfile at ``dockerfile`` (its context:
        its directory, or ``context``) or from ``dockerfile_text``. ``FROM`` names a DSec image,
        else a registry reference; RUN, COPY, ADD, ENV, ARG, WORKDIR, USER and SHELL are built
        by DSec itself (docs/INTEGRATIONS.md says what maps). The result is cached by content:
        a build of the same Dockerfile, args, copied files and base returns at once
        (``result.cached``), on any node of the store. ``on_log(line)`` gets the build's log as
        it runs. A step that fails raises ``ImageBuildFailed`` naming it, with the log's end."""
        request = await asyncio.to_thread(
            build_request, name, dockerfile, dockerfile_text, context, build_args=dict(build_args or {}),
            no_cache=no_cache, memory_limit_mb=memory_limit_mb, cpu_cores_limit=cpu_cores_limit, timeout=timeout)
        async for event in self._stream(*api_route("build_image"), request, timeout + 60, event_model=ExecEvent):
            if event.event == "stdout" and on_log is not None:
                on_log(event.data.removesuffix("\n"))
            elif event.event == "error":
                raise error_from_wire({"error": event.error or {}}, 500)
            elif event.event == "exit" and event.result is not None:
                return BuildResult.model_validate_json(event.result.stdout)
        raise ServerError("the build's answer ended without its result")

    async def node_info(self, include_unready: bool = False) -> list[NodeInfo]:
        """The nodes serving, with what they hold; with ``include_unready``, also a line for each
        node that is not (``state`` "lost" or "failed", and why in ``problem``)."""
        nodes = await self._request(*api_route("nodes"), params={"all": "true"} if include_unready else None)
        return [NodeInfo.model_validate(n) for n in nodes]

    async def stats(self) -> ClusterStats:
        """Every node's counters and holdings, and the apiserver's own (root token only): what
        ``/metrics``, the dashboard and ``dsec top`` show."""
        return ClusterStats.model_validate_json(await self._request(*api_route("stats"), raw=True))

    # -- job logs ----------------------------------------------------------------------------

    async def list_jobs(self) -> list[JobInfo]:
        """The jobs of this client's project (every job, for the root token)."""
        return JobList.model_validate(await self._request(*api_route("list_jobs"))).jobs

    async def job_log(self, job: str, *, after: int = 0) -> JobLog:
        """A job and its log entries (past ``after``, a ``seq``), in order; ``JobNotFound`` when
        there is none (or it is another project's)."""
        return JobLog.model_validate(await self._request(*api_route("show_job", job=_job_path(job)),
                                                         params={"after": str(after)} if after else None))

    async def remove_job(self, job: str) -> None:
        await self._request(*api_route("remove_job", job=_job_path(job)))

    @property
    def replayed(self) -> int:
        """Calls answered from the job's log so far (``resume=True``)."""
        return 0 if self._replay is None else self._replay.answered

    def _guard(self, method: str, path: str) -> None:
        """A resumed job: nothing goes to the server out of its log's order (``Replay.guard``)."""
        if self._replay is not None:
            self._replay.guard(method, path)

    # -- fncall ------------------------------------------------------------------------------

    async def fncall(self, args: DSecFnCallArgs, *, timeout: float | None = None) -> FnCallResult:
        """Run one stateless call in the warm pool (see ``DSecFnCallArgs``). A call that runs
        returns its result, whatever its exit code; one that cannot run raises."""
        raw = await self._request(*api_route("fncall"), model=args, raw=True,
                                  timeout=timeout if timeout is not None else args.timeout + _HTTP_SLACK_S)
        return FnCallResult.model_validate_json(raw)

    async def fncall_many(
        self, calls: Iterable[DSecFnCallArgs], *, timeout: float | None = None,
        per_request: int = 500, requests_in_flight: int = 4,
    ) -> list[FnCallResult]:
        """Run many calls, ``per_request`` to an HTTP request (a request costs more than a small
        call), answers in order. A call that cannot run has ``error`` set; the others are not
        affected. ``timeout`` bounds each request."""
        calls = list(calls)
        if not calls:
            return []
        chunks = [calls[i:i + per_request] for i in range(0, len(calls), max(1, per_request))]
        gate = asyncio.Semaphore(max(1, requests_in_flight))
        if timeout is None:
            timeout = max(self._timeout, max(c.timeout for c in calls) + _HTTP_SLACK_S)

        async def one(chunk: list[DSecFnCallArgs]) -> list[FnCallResult]:
            async with gate:
                raw = await self._request(*api_route("fncall_many"), model=FnCallBatchRequest(calls=chunk),
                                          raw=True, timeout=timeout)
            return FnCallBatchResult.model_validate_json(raw).results

        return [r for part in await asyncio.gather(*(one(c) for c in chunks)) for r in part]

    # -- transport -------------------------------------------------------------------------
    # One path for every request: the transport of the endpoint in use (``_transport.py``), one
    # error mapping (``_error_of``), one policy for sending again (``_again``).

    def _streaming_http(self) -> httpx.AsyncClient:
        """An httpx client for the calls whose bodies stream both ways (file trees and large
        files, ``_files.py``): the transports send and take whole bodies. Made at first use,
        for the endpoint in use, with the client's headers and httpx transport object if it
        was given one; closed with the client."""
        self._now()
        http = self._body_streams.get(self.endpoint)
        if http is None:
            import httpx

            from ._transport import _tls_context

            given = None if self._choice is None or isinstance(self._choice, str) else self._choice
            http = self._body_streams[self.endpoint] = httpx.AsyncClient(
                base_url=self.endpoint, headers=self._headers, timeout=self._timeout, transport=given,
                verify=_tls_context())
        return http

    def _now(self) -> tuple[str, Transport]:
        if self._transport is None:
            raise InvalidRequest("client is not open: call `await client.open()` first")
        return self.endpoint, self._transport

    async def _request(
        self,
        method: str,
        path: str,
        *,
        model: BaseModel | None = None,
        params: dict[str, str] | None = None,
        content: bytes | None = None,
        timeout: float | None = None,
        raw: bool = False,
        headers: dict[str, str] | None = None,
    ) -> Any:
        self._guard(method, path)
        body, content_type = content, "application/octet-stream"
        if model is not None:
            body, content_type = model.model_dump_json().encode(), "application/json"
        tried: list[str] = []
        attempt = 0
        while True:
            endpoint, transport = self.endpoint, self._transport  # (the hottest path: no call for it)
            if transport is None:
                raise InvalidRequest("client is not open: call `await client.open()` first")
            try:
                answer = await transport.request(method, path, params=params, body=body, content_type=content_type,
                                                 timeout=self._timeout if timeout is None else timeout,
                                                 headers=headers)
            except WireError as exc:
                attempt = await self._again(endpoint, method, path, headers, exc, tried, attempt)
                continue
            if answer.status_code < 400:
                return answer.content if raw else answer.json()
            error = _error_of(answer)
            attempt = await self._again(endpoint, method, path, headers, error, tried, attempt)

    async def _stream(
        self, method: str, path: str, model: BaseModel, timeout: float | None,
        event_model: type[BaseModel] = BatchEvent, headers: dict[str, str] | None = None,
    ) -> Any:
        """The NDJSON answer to one request, an event model each line. It is sent again (by
        ``_again``) only before its first event: after, the failure is raised."""
        body = model.model_dump_json().encode()
        tried: list[str] = []
        attempt = 0
        while True:
            endpoint, transport = self._now()
            yielded = False
            try:
                async with transport.stream(method, path, body=body, content_type="application/json",
                                            timeout=timeout if timeout is not None else self._timeout,
                                            headers=headers) as response:
                    if response.status_code >= 400:
                        error = _error_of(Answer(response.status_code, await response.read()))
                    else:
                        rest = b""
                        async for chunk in response.chunks():
                            *lines, rest = (rest + chunk).split(b"\n")
                            for line in lines:
                                if line.strip():
                                    yielded = True
                                    yield event_model.model_validate_json(line)
                        if rest.strip():
                            yield event_model.model_validate_json(rest)
                        return
            except WireError as exc:
                if yielded:
                    raise _unavailable(tried, endpoint, exc) from exc
                attempt = await self._again(endpoint, method, path, headers, exc, tried, attempt)
                continue
            attempt = await self._again(endpoint, method, path, headers, error, tried, attempt)

    async def _again(self, endpoint: str, method: str, path: str, headers: dict[str, str] | None,
                     failure: Exception, tried: list[str], attempt: int) -> int:
        """After ``failure`` (a ``WireError``, or the error an answer said): returns the attempt
        count to send the call again with, or raises. A call that never left (or may be
        repeated) moves on to the next endpoint (``_fail_over``); one whose connection broke
        or that was answered ``Overloaded`` is sent again after a backoff (``_backoff``, when
        ``may_repeat``); anything else is raised, a ``WireError`` as ``ServerUnavailable``."""
        if isinstance(failure, DSecError):
            if isinstance(failure, Overloaded) and await self._backoff(attempt, method, path, headers, failure):
                return attempt + 1
            raise failure
        assert isinstance(failure, WireError)
        if self._fail_over(endpoint, method, failure, tried):
            return attempt
        if isinstance(failure, ConnectionBroken) and await self._backoff(attempt, method, path, headers, None):
            tried.clear()
            return attempt + 1
        raise _unavailable(tried, endpoint, failure) from failure

    async def _backoff(self, attempt: int, method: str, path: str, headers: dict[str, str] | None,
                       refusal: Overloaded | None) -> bool:
        """Wait before sending the call again, if it may be (see ``may_repeat``) and has tries
        left; whether it is to be sent again."""
        if attempt >= self.retries or not may_repeat(method, path, headers, refusal is not None):
            return False
        wait = self.retry_backoff_s * 2 ** attempt * random.uniform(0.5, 1.0)
        if refusal is not None:  # the server's estimate, spread so the refused do not come back at once
            wait = max(wait, refusal.retry_after * random.uniform(1.0, 1.5))
        await asyncio.sleep(min(wait, self.retry_max_wait_s))
        return True

    def _fail_over(self, failed: str, method: str, exc: WireError, tried: list[str]) -> bool:
        """After ``exc`` at ``failed``: whether to send the request again, to ``self.endpoint``
        (moved on to the next endpoint this request has not tried, unless another request
        moved on first). Only when the request cannot have reached a server, or is safe to repeat."""
        if len(self._transports) < 2:
            return False
        never_left = isinstance(exc, CannotConnect)
        broken = isinstance(exc, ConnectionBroken)
        if not (never_left or (broken and method in _REPEATABLE)):
            return False
        tried.append(failed)
        if self.endpoint not in tried:
            return True
        at = self.endpoints.index(failed)
        for endpoint in (*self.endpoints[at + 1:], *self.endpoints[:at]):
            if endpoint not in tried:
                self.endpoint = endpoint
                self._transport = self._transports[endpoint]
                return True
        return False


def _key_headers(key: str | None) -> dict[str, str] | None:
    if key is None:
        return None
    try:
        return {KEY_HEADER: check_key(key)}
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def _job_path(job: str) -> str:
    try:
        return check_job_name(job)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def _split_endpoints(endpoints: str) -> tuple[str, ...]:
    """``"http://a:1,http://b:2"`` → each endpoint, without a trailing slash."""
    split = tuple(dict.fromkeys(e.strip().rstrip("/") for e in endpoints.split(",") if e.strip()))
    if not split:
        raise InvalidRequest(f"no DSec endpoint in {endpoints!r}")
    return split


def _unavailable(tried: list[str], endpoint: str, exc: WireError) -> ServerUnavailable:
    where = ", ".join(dict.fromkeys([*tried, endpoint]))
    return ServerUnavailable(f"cannot reach DSec at {where}: {exc}")


def _error_of(response: Answer) -> DSecError:
    """The error an answer says (the one mapping of error answers, ``error_from_wire``)."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = response.text
    return error_from_wire(body, response.status_code)

