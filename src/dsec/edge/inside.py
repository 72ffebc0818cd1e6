"""Calls inside a running sandbox: ``Inside``, the part of ``dsec.edge.edge.Edge`` that runs
commands, background processes, sessions, terminals, directory watches, file calls and port
connections in a sandbox.

Each one finds its sandbox ready (``SandboxTable._ready``: allowed by the lifecycle table, a
paused one resumed first) and runs as a counted call (``_call``) on the sandbox's backend. The
scripts and parsing of each concern are in its own module (``processes``, ``sessions``,
``pty``, ``watches``, ``files``, ``stream``); here is only how each is called. Commands and
session commands pass the node's gate on commands running at once (``command_gate``).
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import time
import weakref
from collections.abc import AsyncIterator

from libdsec import (
    CommandTimeout, InvalidRequest, PortUnreachable, ProcessNotFound, SandboxFileNotFound, SandboxNotFound,
    SandboxStateError,
    SessionClosed,
)
from libdsec.protocol import (
    DEFAULT_COMMAND_TIMEOUT_S,
    MAX_OUTPUT_BYTES_LIMIT,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    OpenPtyRequest,
    OpenSessionRequest,
    OpenWatchRequest,
    ProcessInfo,
    ProcessStreamRequest,
    PtyInfo,
    SessionInfo,
    StartProcessRequest,
    WatchEvents,
    WatchInfo,
)

from ..backends.base import Capability, ExecContext
from . import files, processes, sessions, xattrs
from .lifecycle import Action, Record
from .stream import stream_bytes, stream_exec
from .table import SandboxTable


class Inside(SandboxTable):
    """Calls inside a running sandbox (see the module)."""

    # Made by Edge.__init__: one command at a time per session; held only while one runs.
    _session_locks: weakref.WeakValueDictionary[tuple[str, int], asyncio.Lock]

    # -- commands -----------------------------------------------------------------------------

    async def _exec_context(self, sandbox_id: str, request: ExecRequest) -> tuple[Record, ExecContext]:
        rec = await self._ready(sandbox_id, Action.exec)
        if request.user is not None:
            uid, gid = await self.backends[rec.kind].resolve_user(rec.handle, request.user)
        else:
            uid, gid = rec.uid, rec.gid
        return rec, ExecContext(
            uid=uid, gid=gid, workdir=request.workdir or rec.args.workdir,
            env={**rec.image.env, **rec.args.env, **request.env},
        )

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        async with self.command_gate.slot():
            rec, ctx = await self._exec_context(sandbox_id, request)
            call = self.security.watch_exec(rec, self._call(rec, self.backends[rec.kind].exec(rec.handle, request, ctx)))
            if not self.stats.enabled:
                return await call
            start = time.perf_counter()
            try:
                return await call
            finally:
                self.stats.command(rec.kind, time.perf_counter() - start)

    async def exec_stream(self, sandbox_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        """``exec`` whose output comes as it is written (``dsec.edge.stream``)."""
        async with self.command_gate.slot():
            rec, ctx = await self._exec_context(sandbox_id, request)
            backend = self.backends[rec.kind]
            async for event in stream_exec(
                    lambda emit: self.security.watch_exec(
                        rec, self._call(rec, backend.exec_stream(rec.handle, request, ctx, emit)))):
                yield event

    # -- background processes (kept in the sandbox: dsec.edge.processes) ----------------------

    async def _manage(self, sandbox_id: str, command: str, timeout: float = 30.0,
                      stdin: str | None = None) -> ExecResult:
        """One of processes' management scripts, run as the sandbox's root."""
        rec = await self._ready(sandbox_id, Action.exec)
        ctx = ExecContext(uid=0, gid=0, workdir="/", env={**rec.image.env, **rec.args.env})
        request = ExecRequest(command=command, timeout=timeout, stdin=stdin)
        return await self._call(rec, self.backends[rec.kind].exec(rec.handle, request, ctx))

    async def start_process(self, sandbox_id: str, request: StartProcessRequest) -> ProcessInfo:
        exec_request = ExecRequest(command=processes.start_script(request.command), timeout=30.0,
                                   env=request.env, workdir=request.workdir, user=request.user)
        rec, ctx = await self._exec_context(sandbox_id, exec_request)
        result = await self._call(rec, self.backends[rec.kind].exec(rec.handle, exec_request, ctx))
        return ProcessInfo(pid=processes.started_pid(result), command=request.command[:200], running=True)

    async def start_process_stream(self, sandbox_id: str, request: StartProcessRequest) -> AsyncIterator[ExecEvent]:
        """``start_process`` and ``stream_process`` in one command in the sandbox: ``started``
        with the pid as its data, the output, then ``exit`` with the process's code."""
        exec_request = ExecRequest(command=processes.start_follow_script(request.command), timeout=24 * 3600.0,
                                   env=request.env, workdir=request.workdir, user=request.user, max_output_bytes=0)
        rec, ctx = await self._exec_context(sandbox_id, exec_request)
        backend = self.backends[rec.kind]
        started = False
        events = stream_exec(lambda emit: self._call(rec, backend.exec_stream(rec.handle, exec_request, ctx, emit)))
        async for event in processes.pid_first(events):
            if event.event == "started":
                if not event.data.isdigit():
                    raise InvalidRequest(f"cannot start the background process: {event.data[-300:]!r}")
                started = True
            elif not started and event.event == "exit" and event.result is not None:
                processes.started_pid(event.result)  # the start failed: its error, raised
            yield event

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        return processes.parse_list((await self._manage(sandbox_id, processes.list_script())).stdout)

    async def get_process(self, sandbox_id: str, pid: int) -> ProcessInfo:
        for info in await self.list_processes(sandbox_id):
            if info.pid == pid:
                return info
        processes.check(ExecResult(exit_code=processes._NO_SUCH, stdout="", stderr="", duration_s=0), pid, "find it")
        raise AssertionError("unreachable")

    async def signal_process(self, sandbox_id: str, pid: int, signal: int) -> None:
        processes.check(await self._manage(sandbox_id, processes.signal_script(pid, signal)), pid, f"signal it ({signal})")

    async def process_stdin(self, sandbox_id: str, pid: int, data: str, close: bool) -> None:
        script = processes.stdin_script(pid, write=bool(data), close=close)
        processes.check(await self._manage(sandbox_id, script, timeout=DEFAULT_COMMAND_TIMEOUT_S,
                                           stdin=data if data else None), pid, "write to its stdin")

    async def wait_process(self, sandbox_id: str, pid: int, timeout: float) -> ProcessInfo:
        try:
            processes.check(await self._manage(sandbox_id, processes.wait_script(pid), timeout=timeout), pid, "wait for it")
        except CommandTimeout:
            raise CommandTimeout(f"process {pid} still runs after {timeout:g}s (it goes on running)") from None
        return await self.get_process(sandbox_id, pid)

    async def stream_process(self, sandbox_id: str, pid: int, request: ProcessStreamRequest) -> AsyncIterator[ExecEvent]:
        """Its output from the offsets given until it ends, then ``exit`` (the exit code only)."""
        # ProcessNotFound before the start (also when the look itself could not run)
        found = processes.check(await self._manage(sandbox_id, processes.find_script(pid)), pid, "find it")
        if found.exit_code != 0:
            raise ProcessNotFound(f"cannot find background process {pid} in this sandbox (exit code "
                                  f"{found.exit_code}: {(found.stderr.strip() or found.stdout.strip())[-200:]})")
        rec = await self._ready(sandbox_id, Action.exec)
        ctx = ExecContext(uid=0, gid=0, workdir="/", env={**rec.image.env, **rec.args.env})
        follow = ExecRequest(command=processes.follow_script(pid, request.stdout_offset, request.stderr_offset),
                             timeout=request.timeout, max_output_bytes=0)
        backend = self.backends[rec.kind]
        async for event in stream_exec(lambda emit: self._call(rec, backend.exec_stream(rec.handle, follow, ctx, emit))):
            yield event

    # -- sessions: a shell whose state persists (a background process: dsec.edge.processes) ---

    async def open_session(self, sandbox_id: str, request: OpenSessionRequest) -> SessionInfo:
        if request.shell != "sh" and (await self._as_user(sandbox_id, f"command -v {request.shell}")).exit_code != 0:
            raise InvalidRequest(f"no {request.shell} in the sandbox's image: open the session with shell='sh'")
        info = await self.start_process(sandbox_id, StartProcessRequest(
            command=processes.session_command(request.idle_timeout, request.shell), env=request.env, workdir=request.workdir,
            user=request.user))
        # A first command: the shell is up, and what it said starting is behind the next one.
        await self.session_exec(sandbox_id, info.pid, ExecRequest(command="true", timeout=30.0))
        return SessionInfo(id=info.pid)

    async def session_exec(self, sandbox_id: str, session: int, request: ExecRequest) -> ExecResult:
        return await self._session_call(sandbox_id, session, request, None)

    async def session_exec_stream(self, sandbox_id: str, session: int, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        await self._session_alive(sandbox_id, session)  # errors before the start are raised
        async for event in stream_exec(lambda emit: self._session_call(sandbox_id, session, request, emit)):
            yield event

    async def interrupt_session(self, sandbox_id: str, session: int) -> None:
        """Ctrl-C: SIGINT to what runs in the session (its shell reads on)."""
        await self._session_alive(sandbox_id, session)
        await self.signal_process(sandbox_id, session, 2)

    async def close_session(self, sandbox_id: str, session: int) -> None:
        """End its shell and all it started; closing a closed one does nothing."""
        try:
            await self.signal_process(sandbox_id, session, 9)
        except (SandboxStateError, ProcessNotFound):
            pass

    async def _session_alive(self, sandbox_id: str, session: int) -> ProcessInfo:
        try:
            info = await self.get_process(sandbox_id, session)
        except ProcessNotFound:
            raise ProcessNotFound(f"no session {session} in sandbox {sandbox_id}") from None
        if not info.running:
            raise SessionClosed(self._session_end(session, info))
        return info

    async def _session_ended(self, sandbox_id: str, session: int) -> None:
        """Its shell is gone: ``SessionClosed`` naming why, once its supervisor recorded the exit."""
        info = None
        for _ in range(250):
            try:
                info = await self.get_process(sandbox_id, session)
            except ProcessNotFound:
                raise ProcessNotFound(f"no session {session} in sandbox {sandbox_id}") from None
            if info.exit_code is not None and info.exit_code != -1:
                break  # (-1: its shell is gone and the supervisor has not recorded the exit yet)
            await asyncio.sleep(0.02)
        raise SessionClosed(self._session_end(session, info))

    def _session_end(self, session: int, info: ProcessInfo) -> str:
        why = {137: "it was closed, or idle past its idle_timeout"}.get(info.exit_code or 0, "its shell exited")
        return f"session {session} has ended: {why} (exit code {info.exit_code}); open a new one"

    async def _session_call(self, sandbox_id: str, session: int, request: ExecRequest, emit) -> ExecResult:
        async with self.command_gate.slot():
            return await self._session_command(sandbox_id, session, request, emit)

    async def _session_command(self, sandbox_id: str, session: int, request: ExecRequest, emit) -> ExecResult:
        if request.env or request.workdir or request.user or request.stdin is not None:
            raise InvalidRequest("a session's command runs in its shell, as that shell is: no env, workdir, user "
                                 "or stdin of its own (use export, cd, su in the command)")
        rec = await self._ready(sandbox_id, Action.exec)
        backend = self.backends[rec.kind]
        ctx = ExecContext(uid=0, gid=0, workdir="/", env={**rec.image.env, **rec.args.env})
        nonce = secrets.token_hex(8)
        run = ExecRequest(command=processes.session_run_script(session, nonce, stream=emit is not None),
                          timeout=request.timeout,
                          stdin=processes.session_input(request.command),
                          max_output_bytes=request.max_output_bytes)
        lock = self._session_locks.get((sandbox_id, session))
        if lock is None:
            lock = self._session_locks[(sandbox_id, session)] = asyncio.Lock()
        async with lock:  # one command at a time: they share the shell
            try:
                result = None
                if emit is None and sessions.applies(backend):
                    try:
                        result = await self._call(rec, sessions.run(backend, rec.handle, session, nonce, request))
                    except sessions.Missing:
                        raise ProcessNotFound(f"no session {session} in sandbox {sandbox_id}") from None
                    except sessions.Dead:
                        await self._session_ended(sandbox_id, session)
                if result is None:
                    call = backend.exec(rec.handle, run, ctx) if emit is None else backend.exec_stream(rec.handle, run, ctx, emit)
                    result = await self._call(rec, call)
            except CommandTimeout:
                after = await self._manage(sandbox_id, processes.interrupt_script(session, nonce))
                if after.exit_code == processes._SESSION_DEAD:
                    raise SessionClosed(self._session_end(session, await self.get_process(sandbox_id, session))) from None
                raise CommandTimeout(
                    f"command timed out after {request.timeout:g}s and was interrupted (as Ctrl-C would); "
                    + {0: "the session goes on",
                       3: "it ignored that, and its processes were killed; the session goes on"}.get(
                        after.exit_code, "it ignored that and could not be killed: the session is busy")) from None
        if result.exit_code in (processes._NO_SUCH, processes._SESSION_DEAD):
            await self._session_alive(sandbox_id, session)  # (raises: a command's own 91 or 94 passes)
        return result

    # -- PTYs: commands on a terminal, held by this edge (dsec.edge.pty) ----------------------

    async def open_pty(self, sandbox_id: str, request: OpenPtyRequest) -> PtyInfo:
        rec, ctx = await self._exec_context(sandbox_id, ExecRequest(
            command=request.command, env=request.env, workdir=request.workdir, user=request.user))
        ctx = ExecContext(uid=ctx.uid, gid=ctx.gid, workdir=ctx.workdir, env={"TERM": "xterm-256color", **ctx.env})
        proc = await self._call(rec, self.backends[rec.kind].open_pty(rec.handle, request.command, ctx,
                                                                      request.cols, request.rows))
        pty_id = self.ptys.add(sandbox_id, proc, request.idle_timeout)
        return PtyInfo(id=pty_id, cols=request.cols, rows=request.rows)

    async def pty_input(self, sandbox_id: str, pty: int, data: bytes) -> None:
        await self.ptys.write(sandbox_id, pty, data)
        if (rec := self._records.get(sandbox_id)) is not None:
            rec.last_active = time.time()  # someone types: the sandbox is in use

    async def resize_pty(self, sandbox_id: str, pty: int, cols: int, rows: int) -> None:
        await self.ptys.resize(sandbox_id, pty, cols, rows)

    def pty_stream(self, sandbox_id: str, pty: int, encoding: str = "utf-8") -> AsyncIterator[ExecEvent]:
        return self.ptys.stream(sandbox_id, pty, encoding)

    async def close_pty(self, sandbox_id: str, pty: int) -> None:
        await self.ptys.close(sandbox_id, pty)

    # -- directory watches: inotify from the node (dsec.edge.watches) -------------------------

    async def open_watch(self, sandbox_id: str, request: OpenWatchRequest) -> WatchInfo:
        path = files.check_path(request.path)
        open_dir = await self._path_opener(sandbox_id, Action.read_file, os.O_RDONLY | os.O_DIRECTORY,
                                           "directories cannot be watched")
        return self.watches.open(sandbox_id, path, request.recursive, open_dir)

    async def watch_events(self, sandbox_id: str, watch: int, wait: float = 0.0) -> WatchEvents:
        return await self.watches.events(sandbox_id, watch, wait)

    async def close_watch(self, sandbox_id: str, watch: int) -> None:
        self.watches.close(sandbox_id, watch)

    # -- extended attributes, from the node (dsec.edge.xattrs) --------------------------------

    async def _path_opener(self, sandbox_id: str, action: Action, flags: int, refused: str):
        """Opens paths of the sandbox from the node (``HostPaths.open_path`` with ``flags``), for
        a sandbox whose state allows ``action``; a kind the node cannot reach so is told it
        (``refused``: what cannot be done)."""
        rec = await self._ready(sandbox_id, action)
        backend = self.backends[rec.kind]
        if Capability.HOST_PATHS not in backend.capabilities:
            raise InvalidRequest(f"a {rec.kind.value} sandbox's {refused} from the node")
        rec.last_active = time.time()
        return lambda where: backend.open_path(rec.handle, where, flags)

    async def get_xattrs(self, sandbox_id: str, paths: list[str], prefix: str) -> list[dict[str, str]]:
        """Each path's attributes under ``prefix`` (``{}`` for a path that is not there, or is
        a symlink)."""
        prefix = xattrs.check_prefix(prefix)
        checked = [files.check_path(p) for p in paths]
        opener = await self._path_opener(sandbox_id, Action.read_file, os.O_PATH, "file attributes cannot be reached")

        def read_all() -> list[dict[str, str]]:
            found = []
            for path in checked:
                try:
                    found.append(xattrs.read(opener, path, prefix))
                except (SandboxFileNotFound, InvalidRequest):
                    found.append({})  # (not there, or a symlink: none)
            return found
        return await asyncio.to_thread(read_all)

    async def set_xattrs(self, sandbox_id: str, path: str, prefix: str, values: dict[str, str]) -> None:
        """Make ``values`` the attributes of ``path`` under ``prefix`` (others there go)."""
        prefix, path = xattrs.check_prefix(prefix), files.check_path(path)
        opener = await self._path_opener(sandbox_id, Action.write_file, os.O_PATH, "file attributes cannot be reached")
        await asyncio.to_thread(xattrs.write, opener, path, prefix, values)

    # -- files and file trees (a command each, as the sandbox's user or root: dsec.edge.files) ---

    async def _as_user(self, sandbox_id: str, command: str, stdin: str | None = None,
                       timeout: float = 120.0) -> ExecResult:
        request = ExecRequest(command=command, stdin=stdin, timeout=timeout, max_output_bytes=MAX_OUTPUT_BYTES_LIMIT)
        rec, ctx = await self._exec_context(sandbox_id, request)
        return await self._call(rec, self.backends[rec.kind].exec(rec.handle, request, ctx))

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileEntry]:
        path = files.check_path(path)
        result = files.check(await self._as_user(sandbox_id, files.list_script(path)), "list", path)
        return files.parse_entries(result.stdout, path)

    async def stat_path(self, sandbox_id: str, path: str) -> FileEntry:
        path = files.check_path(path)
        result = files.check(await self._as_user(sandbox_id, files.stat_script(path)), "stat", path)
        entries = files.parse_entries(result.stdout, None)
        if not entries:
            raise SandboxFileNotFound(f"cannot stat {path}: no such file or directory")
        return entries[0]

    async def remove_path(self, sandbox_id: str, path: str, recursive: bool) -> None:
        path = files.check_path(path)
        if path == "/":
            raise InvalidRequest("cannot remove /: the sandbox's root stays")
        files.check(await self._as_user(sandbox_id, files.remove_script(path, recursive)), "remove", path)

    async def make_dir(self, sandbox_id: str, path: str) -> None:
        path = files.check_path(path)
        files.check(await self._as_user(sandbox_id, files.make_dir_script(path)), "make directory", path)

    async def rename_path(self, sandbox_id: str, src: str, dst: str) -> None:
        src, dst = files.check_path(src, "source"), files.check_path(dst, "destination")
        files.check(await self._as_user(sandbox_id, files.rename_script(src, dst)), "rename", f"{src} to {dst}")

    async def upload_tree(self, sandbox_id: str, path: str, data: bytes | AsyncIterator[bytes]) -> None:
        """Unpack the tar ``data`` at ``path`` (made if missing), as the sandbox's user: streamed
        into the sandbox's ``tar x`` where the backend feeds a command a stream, each member
        checked on its way (``files.TarChecker``); else held, checked, and sent in pieces."""
        path = files.check_path(path)
        limit = self.config.max_upload_bytes
        request = ExecRequest(command=files.unpack_stdin_script(path), timeout=3600.0, max_output_bytes=1 << 16)
        rec, ctx = await self._exec_context(sandbox_id, request)
        backend = self.backends[rec.kind]
        if Capability.PIPED_STDIN in backend.capabilities:
            chunks = _one_chunk(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
            checker = files.TarChecker(limit)

            async def discard(kind: str, out: bytes) -> None:
                pass
            result = await self._call(rec, backend.exec_piped(rec.handle, request, ctx, checker.checked(chunks), discard))
            files.check(result, "unpack into", path)
            return
        if not isinstance(data, (bytes, bytearray, memoryview)):
            data = await _gathered(data, limit)
        if len(data) > limit:
            raise InvalidRequest(f"tar of {len(data)} bytes is over the {limit}-byte limit")
        files.checked_tar(data)
        tmp = f"/tmp/.dsec-upload-{secrets.token_hex(8)}.tar"
        for at in range(0, max(len(data), 1), files.UPLOAD_PIECE):
            piece = base64.b64encode(data[at:at + files.UPLOAD_PIECE]).decode()
            files.check(await self._as_user(sandbox_id, files.upload_piece_script(tmp, at == 0), stdin=piece),
                        "upload to", path)
        files.check(await self._as_user(sandbox_id, files.unpack_script(tmp, path), timeout=600.0), "unpack into", path)

    async def download_tree_tar(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """``tar c`` of the tree at ``path``, its bytes as they come (the consumer's pace)."""
        path = files.check_path(path)
        await self.stat_path(sandbox_id, path)  # errors before the start are raised
        request = ExecRequest(command=files.download_tar_script(path), timeout=3600.0, max_output_bytes=1 << 16)
        rec, ctx = await self._exec_context(sandbox_id, request)
        backend = self.backends[rec.kind]
        async for chunk in stream_bytes(lambda emit: self._call(rec, backend.exec_stream(rec.handle, request, ctx, emit)),
                                        lambda result: files.check(result, "download", path)):
            yield chunk

    async def download_tree(self, sandbox_id: str, path: str) -> AsyncIterator[ExecEvent]:
        """``tar c`` of the tree at ``path``, as base64 text in stdout events, then ``exit``."""
        path = files.check_path(path)
        await self.stat_path(sandbox_id, path)  # errors before the start are raised
        request = ExecRequest(command=files.download_script(path), timeout=3600.0, max_output_bytes=0)
        rec, ctx = await self._exec_context(sandbox_id, request)
        backend = self.backends[rec.kind]
        async for event in stream_exec(lambda emit: self._call(rec, backend.exec_stream(rec.handle, request, ctx, emit))):
            yield event

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        rec = await self._ready(sandbox_id, Action.read_file)
        backend = self.backends[rec.kind]
        return await self._call(rec, backend.read_file(rec.handle, path, self.config.max_file_bytes))

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None:
        rec = await self._ready(sandbox_id, Action.write_file)
        if len(data) > self.config.max_file_bytes:
            raise InvalidRequest(f"file of {len(data)} bytes is over the {self.config.max_file_bytes}-byte limit")
        if not 0 <= mode <= 0o7777:
            raise InvalidRequest(f"invalid file mode {oct(mode)}")
        backend = self.backends[rec.kind]
        await self._call(rec, backend.write_file(rec.handle, path, data, mode, rec.uid, rec.gid))

    async def read_file_stream(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """The file's bytes as they are read in the sandbox (``cat`` as its root, at the
        consumer's pace: no size limit, nothing held); errors before the first chunk raised."""
        path = files.check_path(path)
        rec = await self._ready(sandbox_id, Action.read_file)
        ctx = ExecContext(uid=0, gid=0, workdir="/", env={**rec.image.env, **rec.args.env})
        request = ExecRequest(command=files.read_script(path), timeout=3600.0, max_output_bytes=1 << 16)
        backend = self.backends[rec.kind]
        async for chunk in stream_bytes(lambda emit: self._call(rec, backend.exec_stream(rec.handle, request, ctx, emit)),
                                        lambda result: files.check(result, "read", path)):
            yield chunk

    async def write_file_stream(self, sandbox_id: str, path: str, data: bytes | AsyncIterator[bytes], mode: int) -> None:
        """Write the file from its chunks as they come (a container's ``cat`` fed the stream:
        no size limit, nothing held); a new file belongs to the sandbox's user, an existing one
        keeps its owner. Where the backend feeds no stream, held up to ``max_file_bytes``."""
        path = files.check_path(path)
        if not 0 <= mode <= 0o7777:
            raise InvalidRequest(f"invalid file mode {oct(mode)}")
        rec = await self._ready(sandbox_id, Action.write_file)
        backend = self.backends[rec.kind]
        if Capability.PIPED_STDIN not in backend.capabilities:
            held = data if isinstance(data, (bytes, bytearray, memoryview)) else await _gathered(data, self.config.max_file_bytes)
            await self.write_file(sandbox_id, path, bytes(held), mode)
            return
        chunks = _one_chunk(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
        ctx = ExecContext(uid=0, gid=0, workdir="/", env={**rec.image.env, **rec.args.env})
        request = ExecRequest(command=files.write_script(path, mode, rec.uid, rec.gid), timeout=3600.0,
                              max_output_bytes=1 << 16)

        async def discard(kind: str, out: bytes) -> None:
            pass
        result = await self._call(rec, backend.exec_piped(rec.handle, request, ctx, chunks, discard))
        files.check(result, "write", path)

    # -- ports: a TCP connection to a port inside (dsec.backends.portconn) --------------------

    async def connect_port(self, sandbox_id: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if not 1 <= port <= 65535:
            raise InvalidRequest(f"port {port} is outside 1-65535")
        rec = await self._ready(sandbox_id, Action.exec)
        backend = self.backends[rec.kind]
        if Capability.PORTS not in backend.capabilities:
            raise PortUnreachable(f"a {rec.kind.value} sandbox's ports cannot be reached from the node")
        reader, writer = await self._call(rec, backend.connect_port(rec.handle, port))
        if self._records.get(sandbox_id) is not rec:  # (it ended meanwhile)
            writer.close()
            raise SandboxNotFound(f"no sandbox {sandbox_id} on node {self.node}: it ended")
        # Ended with the sandbox (``_forget``), whatever the backend's connection is: a
        # client's kept connection then learns at its next request that the sandbox is gone.
        self._port_conns.setdefault(sandbox_id, weakref.WeakSet()).add(writer)
        return reader, writer


async def _one_chunk(data: bytes) -> AsyncIterator[bytes]:
    yield bytes(data)


async def _gathered(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    held = bytearray()
    async for chunk in chunks:
        held += chunk
        if len(held) > limit:
            raise InvalidRequest(f"tar of over {limit} bytes is over the node's {limit}-byte limit")
    return bytes(held)
