"""The async SDK: ``DSecClient`` opens a connection to an apiserver; ``Sandbox`` is one handle.

Lifecycle: ``DSecClient()`` → ``await open()`` (or ``async with``) → calls → ``await close()``;
a second ``close()`` does nothing. A ``Sandbox`` is a handle to a server-side sandbox; ``stop()``
ends it (a second ``stop()`` does nothing), and ``async with sandbox`` stops it on exit.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import base64
import os
import random
import ssl
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

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
from ._files import SandboxFiles
from ._process import Process, Session, events_of, run_with_callbacks
from ._projects import _ProjectMethods
from ._replay import Replay
from ._pty import Pty
from ._wire import Answer, CannotConnect, ConnectionBroken, WireClient, WireError
from .protocol import ClusterStats, NetworkRulesRequest, SecurityEvent, SecurityEventList, TTLRequest
from .protocol import DSecFnCallArgs, FnCallBatchRequest, FnCallBatchResult, FnCallResult
from .protocol import JOB_HEADER, KEY_HEADER, JobInfo, JobList, JobLog, check_job_name, check_key
from .protocol import (
    DEFAULT_COMMAND_TIMEOUT_S,
    MAX_SANDBOX_BATCH,
    BatchEvent,
    CleanCopyRequest,
    CleanCopyResult,
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
    PauseResult,
    ProcessInfo,
    ProcessList,
    PtyInfo,
    SessionInfo,
    StartProcessRequest,
    SandboxInfo,
    SandboxList,
    SandboxStatus,
    SnapshotInfo,
)

DEFAULT_ENDPOINT = "http://127.0.0.1:8765"
DEFAULT_STATE_DIR = "/var/lib/dsec"
# Slack added to a command's own timeout for the HTTP round trip.
_HTTP_SLACK_S = 30.0
_POOL_SHARDS = 8  # connection pools a client takes turns over (see DSecClient.open)
# Requests that may go to another endpoint after they may have reached a server: the
# idempotent methods (RFC 9110), reads and stop among them; never a create or an exec (POST).
_REPEATABLE = frozenset({"GET", "HEAD", "PUT", "DELETE"})
# The calls that make a sandbox: sent again only when they carry an idempotency key.
_CREATE_PATHS = frozenset({"/v1/sandboxes", "/v1/microvms", "/v1/vms", "/v1/sandboxes:batch"})


def _is_create(method: str, path: str) -> bool:
    return method == "POST" and (path in _CREATE_PATHS or path.endswith("/clean_copy"))


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


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default TLS context, made once a process: each client making its own loads the
    CA bundle again, a cost per client opened larger than its first requests' (even for a
    plain http endpoint)."""
    return httpx.create_ssl_context()

ProgressCallback = Callable[[int, int], None]


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
        self.files = SandboxFiles(self)  # list, stat, remove, make_dir, rename, upload_dir, download_dir

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
            "POST",
            f"/v1/sandboxes/{self.id}/exec",
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
        self._client._guard("POST", f"/v1/sandboxes/{self.id}/exec:stream")
        return events_of(self._client._stream("POST", f"/v1/sandboxes/{self.id}/exec:stream", request,
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
        body = await self._client._request("POST", f"/v1/sandboxes/{self.id}/processes", model=request)
        return Process(self, ProcessInfo.model_validate(body))

    async def list_processes(self) -> list[ProcessInfo]:
        """The background processes started in this sandbox, running or ended."""
        body = await self._client._request("GET", f"/v1/sandboxes/{self.id}/processes")
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
        body = await self._client._request("POST", f"/v1/sandboxes/{self.id}/sessions", model=request, timeout=60)
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
        body = await self._client._request("POST", f"/v1/sandboxes/{self.id}/ptys", model=request, timeout=60)
        return Pty(self, PtyInfo.model_validate(body))

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
        body = await self._client._request("GET", f"/v1/sandboxes/{self.id}/processes/{int(session_id)}")
        info = ProcessInfo.model_validate(body)
        if not info.running:
            raise SessionClosed(f"session {session_id} has ended (exit code {info.exit_code}); open a new one")
        return Session(self, SessionInfo(id=info.pid))

    async def connect_process(self, pid: int) -> Process:
        """A handle on a background process started before (by any client); its ``stream()``
        gives what it writes from now on. ``ProcessNotFound`` for any other pid."""
        body = await self._client._request("GET", f"/v1/sandboxes/{self.id}/processes/{int(pid)}")
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
            "PUT",
            f"/v1/sandboxes/{self.id}/files",
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
            "GET", f"/v1/sandboxes/{self.id}/files", params={"path": path}, raw=True
        )

    async def pack_diff(self, name: str | None = None, *, role: str = "snapshot") -> PackDiffResult:
        """Turn the sandbox's changes into a new image (the sandbox is frozen meanwhile and
        keeps running after). Start new sandboxes from ``result.image`` to restore or branch."""
        request = PackDiffRequest(name=name, role=role)
        if self._client._replay is not None:
            answered, result = self._client._replay.call(self.id, "pack_diff", request.model_dump(mode="json"))
            if answered:
                return PackDiffResult.model_validate(result)
        body = await self._client._request("POST", f"/v1/sandboxes/{self.id}/pack_diff", model=request, timeout=600)
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
            body = await self._client._request("POST", f"/v1/sandboxes/{self.id}/clean_copy", model=request,
                                               timeout=600)
            result = CleanCopyResult.model_validate(body)
        copy = Sandbox(self._client, result.sandbox)
        copy.clean_copy_result = result
        return copy

    async def security_events(self) -> list[SecurityEvent]:
        """Denied actions the platform saw in this sandbox: blocked connections and DNS
        names, denied syscalls, limit hits, output caps (also after it stopped)."""
        body = await self._client._request("GET", f"/v1/sandboxes/{self.id}/security_events")
        return SecurityEventList.model_validate(body).events

    async def set_network_rules(self, network_rules: dict[str, bool | list[str]]) -> None:
        """Replace the sandbox's network allowlist while it runs (e.g. between task stages)."""
        request = NetworkRulesRequest(network_rules=network_rules)
        if self._client._replay is not None and \
                self._client._replay.call(self.id, "set_network_rules", request.model_dump(mode="json"))[0]:
            return
        await self._client._request("PUT", f"/v1/sandboxes/{self.id}/network_rules", model=request)

    async def set_ttl(self, ttl_running_stop: float) -> SandboxInfo:
        """A new idle TTL (``ttl_running_stop``), counted from now; paused or running."""
        request = TTLRequest(ttl_running_stop=ttl_running_stop)
        answered, result = (False, None) if self._client._replay is None else \
            self._client._replay.call(self.id, "set_ttl", request.model_dump(mode="json"))
        self.info = SandboxInfo.model_validate(result if answered else await self._client._request(
            "PUT", f"/v1/sandboxes/{self.id}/ttl", model=request))
        return self.info

    async def refresh(self) -> SandboxInfo:
        self.info = SandboxInfo.model_validate(
            await self._client._request("GET", f"/v1/sandboxes/{self.id}")
        )
        return self.info

    async def pause(self) -> PauseResult:
        """Freeze the sandbox and push its memory out (to swap); the result says how much
        memory it held before and after. Its next call (or ``resume()``) brings it back."""
        answered, logged = (False, None) if self._client._replay is None else \
            self._client._replay.call(self.id, "pause", {})
        result = PauseResult.model_validate(logged if answered else
                                            await self._client._request("POST", f"/v1/sandboxes/{self.id}/pause"))
        self.info = result.sandbox
        return result

    async def resume(self) -> SandboxInfo:
        """Thaw a paused sandbox (its memory comes back as it is touched)."""
        answered, logged = (False, None) if self._client._replay is None else \
            self._client._replay.call(self.id, "resume", {})
        self.info = SandboxInfo.model_validate(logged if answered else
                                               await self._client._request("POST", f"/v1/sandboxes/{self.id}/resume"))
        return self.info

    async def snapshot(self) -> SnapshotInfo:
        """Save a microVM's memory and device state (it keeps running); pass the result's
        ``id`` as ``DSecMicroVMRunArgs(snapshot=…)`` to start a copy where it was."""
        return SnapshotInfo.model_validate(await self._client._request("POST", f"/v1/sandboxes/{self.id}/snapshot"))

    async def stop(self) -> None:
        """Stop and remove the sandbox. Stopping a stopped sandbox does nothing."""
        if self.info.status in (SandboxStatus.stopped,):
            return
        if self._client._replay is not None:
            answered, result = self._client._replay.call(self.id, "stop", {})
            if answered:
                self.info = SandboxInfo.model_validate(result)
                return
        body = await self._client._request("DELETE", f"/v1/sandboxes/{self.id}")
        self.info = SandboxInfo.model_validate(body)

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class DSecClient(_ProjectMethods):
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
    """

    def __init__(
        self,
        endpoint: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
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
        self._transport = transport
        self._max_connections = max_connections
        self._http: list[httpx.AsyncClient] | None = None
        self._wire: WireClient | None = None
        self._turn = 0
        # By endpoint: its lean client (plain http://, no custom transport) and httpx pools.
        self._routes: dict[str, tuple[WireClient | None, list[httpx.AsyncClient]]] = {}

    async def open(self) -> DSecClient:
        if self._http is not None:
            return self
        token = self._token or default_token()
        headers = {"authorization": f"Bearer {token}"} if token else {}
        if self.job is not None:
            headers[JOB_HEADER] = self.job
        self._routes = {endpoint: self._route(endpoint, headers) for endpoint in self.endpoints}
        self._wire, self._http = self._routes[self.endpoint]
        if self._resume and self._replay is None:
            assert self.job is not None
            try:
                self._replay = Replay(await self.job_log(self.job))
            except BaseException:
                await self.close()
                raise
        return self

    def _route(self, endpoint: str, headers: dict[str, str]) -> tuple[WireClient | None, list[httpx.AsyncClient]]:
        wire = None
        if self._transport is None and endpoint.startswith("http://"):
            # Plain requests take the lean client (libdsec/_wire.py: httpx costs the client
            # more CPU than the server spends answering); httpx keeps the streamed answers.
            wire = WireClient(endpoint, headers, self._max_connections, check_idle=len(self.endpoints) > 1)
        # Requests take turns over a few connection pools: httpcore's pool looks at every
        # connection (a poll(2) for each idle one) and every queued request each time one is
        # sent or done, so its cost per request grows with the connections in flight; with
        # 64 in flight one pool cost the client more CPU than the request itself.
        shards = 1 if self._transport is not None or wire is not None else min(_POOL_SHARDS, self._max_connections)
        per_shard = -(-self._max_connections // shards)
        http = [
            httpx.AsyncClient(
                base_url=endpoint,
                headers=headers,
                timeout=self._timeout,
                transport=self._transport,
                verify=_tls_context(),
                limits=httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard),
            )
            for _ in range(shards)
        ]
        return wire, http

    async def close(self) -> None:
        routes, self._routes = self._routes, {}
        self._wire = self._http = None
        for wire, pools in routes.values():
            if wire is not None:
                await wire.aclose()
            await asyncio.gather(*(http.aclose() for http in pools))

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
        return await self._create("/v1/sandboxes", "container", args, key, timeout)

    async def run_microvm(self, args: DSecMicroVMRunArgs, *, key: str | None = None,
                          timeout: float | None = None) -> Sandbox:
        """Create one microVM (or restore one from ``args.snapshot``); returns once its guest
        agent answers. The handle is the same as a container's."""
        return await self._create("/v1/microvms", "microvm", args, key, timeout)

    async def run_vm(self, args: DSecFullVMRunArgs, *, key: str | None = None, timeout: float | None = None) -> Sandbox:
        """Create one full VM booting the image's own init; same handle as a container's."""
        return await self._create("/v1/vms", "fullvm", args, key, timeout)

    async def _create(self, path: str, kind: str, args: DSecContainerRunArgs, key: str | None,
                      timeout: float | None) -> Sandbox:
        headers = _key_headers(key)
        if self._replay is not None:
            logged = self._replay.create("create", {"kind": kind, "args": args.model_dump(mode="json")}, key)
            if logged is not None:
                return Sandbox(self, SandboxInfo.model_validate(logged))
        body = await self._request("POST", path, model=args, timeout=timeout, headers=headers)
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
        body = await self._request("GET", f"/v1/sandboxes/{sandbox_id}")
        return Sandbox(self, SandboxInfo.model_validate(body))

    async def list_sandboxes(self) -> list[SandboxInfo]:
        return SandboxList.model_validate(await self._request("GET", "/v1/sandboxes")).sandboxes

    async def list_images(self) -> ImageList:
        return ImageList.model_validate(await self._request("GET", "/v1/images"))

    async def inspect_image(self, ref: str) -> ImageInfo:
        """An image by name, or a composition such as ``python+repo-abc+harness``."""
        return ImageInfo.model_validate(await self._request("GET", f"/v1/images/{ref}"))

    async def remove_image(self, name: str) -> None:
        await self._request("DELETE", f"/v1/images/{name}")

    async def gc_images(self) -> list[str]:
        """Remove layers no image refers to and no sandbox holds; returns their digests."""
        return (await self._request("POST", "/v1/images:gc"))["removed"]

    async def node_info(self) -> list[NodeInfo]:
        return [NodeInfo.model_validate(n) for n in await self._request("GET", "/v1/nodes")]

    async def stats(self) -> ClusterStats:
        """Every node's counters and holdings, and the apiserver's own (root token only): what
        ``/metrics``, the dashboard and ``dsec top`` show."""
        return ClusterStats.model_validate_json(await self._request("GET", "/v1/stats", raw=True))

    # -- job logs ----------------------------------------------------------------------------

    async def list_jobs(self) -> list[JobInfo]:
        """The jobs of this client's project (every job, for the root token)."""
        return JobList.model_validate(await self._request("GET", "/v1/jobs")).jobs

    async def job_log(self, job: str, *, after: int = 0) -> JobLog:
        """A job and its log entries (past ``after``, a ``seq``), in order; ``JobNotFound`` when
        there is none (or it is another project's)."""
        return JobLog.model_validate(await self._request("GET", f"/v1/jobs/{_job_path(job)}",
                                                         params={"after": str(after)} if after else None))

    async def remove_job(self, job: str) -> None:
        await self._request("DELETE", f"/v1/jobs/{_job_path(job)}")

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
        raw = await self._request("POST", "/v1/fncall", model=args, raw=True,
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
                raw = await self._request("POST", "/v1/fncall:batch", model=FnCallBatchRequest(calls=chunk),
                                          raw=True, timeout=timeout)
            return FnCallBatchResult.model_validate_json(raw).results

        return [r for part in await asyncio.gather(*(one(c) for c in chunks)) for r in part]

    # -- transport -------------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise InvalidRequest("client is not open: call `await client.open()` first")
        self._turn = (self._turn + 1) % len(self._http)
        return self._http[self._turn]

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
        tried: list[str] | None = None
        attempt = 0
        while True:
            endpoint, wire = self.endpoint, self._wire
            try:
                if wire is not None:
                    answer: Answer | httpx.Response = await wire.request(
                        method, path, params=params, body=body, content_type=content_type,
                        timeout=self._timeout if timeout is None else timeout, headers=headers)
                else:
                    answer = await self._request_httpx(method, path, params, body, content_type, timeout, headers)
            except (WireError, httpx.TransportError) as exc:
                tried = [] if tried is None else tried
                if self._fail_over(endpoint, method, exc, tried):
                    continue
                if _broken(exc) and await self._backoff(attempt, method, path, headers, None):
                    attempt += 1
                    tried.clear()
                    continue
                raise _unavailable(tried, endpoint, exc) from exc
            try:
                return _body(answer, raw)
            except Overloaded as exc:
                if not await self._backoff(attempt, method, path, headers, exc):
                    raise
                attempt += 1

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

    async def _request_httpx(
        self, method: str, path: str, params: dict[str, str] | None, body: bytes | None, content_type: str,
        timeout: float | None, headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        http = self._client()
        kwargs: dict[str, Any] = {"params": params, "headers": dict(headers or {})}
        if body is not None:
            kwargs["content"] = body
            kwargs["headers"]["content-type"] = content_type
        if timeout is not None:
            kwargs["timeout"] = timeout
        return await http.request(method, path, **kwargs)

    async def _stream(
        self, method: str, path: str, model: BaseModel, timeout: float | None,
        event_model: type[BaseModel] = BatchEvent, headers: dict[str, str] | None = None,
    ) -> Any:
        if self._wire is not None:
            async for event in self._stream_wire(method, path, model, timeout, event_model, headers):
                yield event
            return
        tried: list[str] = []
        attempt = 0
        while True:
            endpoint, http = self.endpoint, self._client()
            try:
                async with http.stream(
                    method,
                    path,
                    content=model.model_dump_json(),
                    headers={**(headers or {}), "content-type": "application/json"},
                    timeout=timeout if timeout is not None else self._timeout,
                ) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        error = _error_of(response)
                        if isinstance(error, Overloaded) and await self._backoff(attempt, method, path, headers, error):
                            attempt += 1
                            continue
                        raise error
                    async for line in response.aiter_lines():
                        if line.strip():
                            yield event_model.model_validate_json(line)
                return
            except httpx.TransportError as exc:
                if not self._fail_over(endpoint, method, exc, tried):
                    raise _unavailable(tried, endpoint, exc) from exc

    async def _stream_wire(self, method: str, path: str, model: BaseModel, timeout: float | None,
                           event_model: type[BaseModel] = BatchEvent, headers: dict[str, str] | None = None) -> Any:
        assert self._wire is not None
        attempt = 0
        while True:
            try:
                async with self._wire.stream(method, path, body=model.model_dump_json().encode(),
                                             content_type="application/json", headers=headers,
                                             timeout=timeout if timeout is not None else self._timeout) as response:
                    if response.status_code >= 400:
                        error = _error_of(Answer(response.status_code, await response.read()))
                        if isinstance(error, Overloaded) and await self._backoff(attempt, method, path, headers, error):
                            attempt += 1
                            continue
                        raise error
                    rest = b""
                    async for chunk in response.chunks():
                        *lines, rest = (rest + chunk).split(b"\n")
                        for line in lines:
                            if line.strip():
                                yield event_model.model_validate_json(line)
                    if rest.strip():
                        yield event_model.model_validate_json(rest)
                    return
            except WireError as exc:
                raise ServerUnavailable(f"cannot reach DSec at {self.endpoint}: {exc}") from exc

    def _fail_over(self, failed: str, method: str, exc: Exception, tried: list[str]) -> bool:
        """After ``exc`` at ``failed``: whether to send the request again, to ``self.endpoint``
        (moved on to the next endpoint this request has not tried, unless another request
        moved on first). Only when the request cannot have reached a server, or is safe to repeat."""
        if len(self._routes) < 2:
            return False
        never_left = isinstance(exc, (CannotConnect, httpx.ConnectError))
        broken = isinstance(exc, (ConnectionBroken, httpx.NetworkError, httpx.RemoteProtocolError))
        if not (never_left or (broken and method in _REPEATABLE)):
            return False
        tried.append(failed)
        if self.endpoint not in tried:
            return True
        at = self.endpoints.index(failed)
        for endpoint in (*self.endpoints[at + 1:], *self.endpoints[:at]):
            if endpoint not in tried:
                self.endpoint = endpoint
                self._wire, self._http = self._routes[endpoint]
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


def _broken(exc: Exception) -> bool:
    """A connection that was reset or closed under a request (not one refused, not a timeout)."""
    return isinstance(exc, (ConnectionBroken, httpx.NetworkError, httpx.RemoteProtocolError)) and not isinstance(
        exc, httpx.ConnectError)


def _split_endpoints(endpoints: str) -> tuple[str, ...]:
    """``"http://a:1,http://b:2"`` → each endpoint, without a trailing slash."""
    split = tuple(dict.fromkeys(e.strip().rstrip("/") for e in endpoints.split(",") if e.strip()))
    if not split:
        raise InvalidRequest(f"no DSec endpoint in {endpoints!r}")
    return split


def _unavailable(tried: list[str], endpoint: str, exc: Exception) -> ServerUnavailable:
    where = ", ".join(dict.fromkeys([*tried, endpoint]))
    return ServerUnavailable(f"cannot reach DSec at {where}: {exc if isinstance(exc, WireError) else repr(exc)}")


def _body(response: httpx.Response | Answer, raw: bool) -> Any:
    """An answer's body (bytes with ``raw``, else parsed JSON); its error raised."""
    if response.status_code >= 400:
        raise _error_of(response)
    return response.content if raw else response.json()


def _error_of(response: httpx.Response | Answer) -> DSecError:
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = response.text
    return error_from_wire(body, response.status_code)

