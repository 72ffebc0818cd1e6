"""Commands in a container sandbox, and connections to its ports.

A command is asked of the sandbox's init over its channel (dsec.backends.initchan): the init
forks it with our pipes as its stdio, so it inherits the namespaces, cgroup, capabilities,
no_new_privs and seccomp filter the init has. A sandbox adopted after a restart has lost its
channel, and a request too large for one packet cannot go over it: such commands go through
``crun exec`` (which enters the namespaces and applies the same profile), started by a shell
that first joins the sandbox's cgroup. Output is captured (``exec``), streamed
(``exec_stream``), with stdin fed as the command reads it (``exec_piped``); a command that
outlives its timeout is killed with all it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from libdsec import BackendError, CommandTimeout, SandboxStateError
from libdsec.protocol import ExecRequest, ExecResult

from ...resources import cgroups
from .. import portconn
from ..base import Emit, ExecContext, Handle
from ..capture import Capture, Flow, PipeReader, PipeStream, feed_pipe, wait_pipes, with_feeder
from ..initchan import MAX_REQUEST, ChannelClosed, InitChannel, StartFailed, TooLarge, exit_code
from ..procs import kill_session_of, kill_tree, pid_in_cgroup, wait_process
from .crun import CHRT

log = logging.getLogger("dsec.backends.container")

# A command ranks above the sandbox's init (crun gives the init 500) for the OOM killer, so that
# an overrun takes a command and not the sandbox (dsec-init sets the same for the commands it
# starts; this is for those started by `crun exec`).
COMMAND_OOM_SCORE_ADJ = 1000
# How long a command whose init channel closed waits for the init to be seen dead (a killed
# pid namespace init closes its files well before it counts as exited).
_INIT_EXIT_GRACE_S = 1.0


async def _feed_stream(writer: asyncio.StreamWriter, chunks: AsyncIterator[bytes]) -> None:
    try:
        async for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
    except (BrokenPipeError, ConnectionResetError):
        return  # the command stopped reading
    finally:
        writer.close()


class Exec:
    """``ContainerBackend``'s commands and ports: the state they use is the backend's, liveness
    its lifecycle's, the workdir's check its files'."""

    cgroup_parent: str
    cgroup_controllers: tuple[str, ...]
    run_dir: Path
    channels: dict[str, InitChannel]

    async def exec(self, handle: Handle, request: ExecRequest, ctx: ExecContext) -> ExecResult:
        return await self._exec(handle, request, ctx, None)

    async def exec_stream(self, handle: Handle, request: ExecRequest, ctx: ExecContext, emit: Emit) -> ExecResult:
        return await self._exec(handle, request, ctx, emit)

    async def exec_piped(self, handle: Handle, request: ExecRequest, ctx: ExecContext,
                         stdin: AsyncIterator[bytes] | None, emit: Emit) -> ExecResult:
        """``exec_stream`` with the command's stdin fed from ``stdin`` as the command reads it."""
        return await self._exec(handle, request, ctx, emit, stdin)

    async def _exec(self, handle: Handle, request: ExecRequest, ctx: ExecContext, emit: Emit | None,
                    feed: AsyncIterator[bytes] | None = None) -> ExecResult:
        flow = Flow(emit) if emit is not None else None
        if not await self.is_alive(handle):
            raise SandboxStateError(f"cannot exec: sandbox process of {handle.cid} is gone")
        self._check_dir(handle, ctx.workdir)
        channel = self.channels.get(handle.cid)
        if channel is not None and not channel.closed:
            job_id, message = channel.encode(["/bin/sh", "-c", request.command], ctx.env, ctx.workdir, ctx.uid, ctx.gid)
            if len(message) <= MAX_REQUEST:
                try:
                    return await self._exec_init(channel, job_id, message, request, flow, feed)
                except TooLarge:
                    pass  # this command alone goes through crun exec
                except ChannelClosed:
                    if not await self._alive_after(handle, _INIT_EXIT_GRACE_S):
                        raise SandboxStateError(f"sandbox process of {handle.cid} is gone{self._why_gone(handle)}") from None
                    log.warning("init channel of %s closed; commands go through crun exec", handle.cid)
        return await self._exec_crun(handle, request, ctx, flow, feed)

    async def _exec_init(self, channel: InitChannel, job_id: int, message: bytes, request: ExecRequest,
                         emit: Flow | None = None, feed: AsyncIterator[bytes] | None = None) -> ExecResult:
        """Run a command through the sandbox's init: it forks it with our pipes as its stdio."""
        loop = asyncio.get_running_loop()
        cap = request.max_output_bytes
        out, err = Capture(cap), Capture(cap)
        ours: list[int] = []
        theirs: list[int] = []
        transports: list[asyncio.BaseTransport] = []
        pipes: list[PipeReader | PipeStream] = []
        try:
            if request.stdin is not None or feed is not None:
                stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
                theirs.append(stdin_r)
                ours.append(stdin_w)
            else:
                theirs.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            for capture, kind in ((out, "stdout"), (err, "stderr")):
                r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
                os.set_blocking(w, True)  # the command's end
                theirs.append(w)
                ours.append(r)
                pipes.append(PipeReader(loop, r, capture) if emit is None else PipeStream(loop, r, capture, kind, emit))
                ours.remove(r)  # the reader owns it now
            start = time.perf_counter()
            try:
                await channel.start(job_id, message, (theirs[0], theirs[1], theirs[2]))
            except StartFailed as exc:
                raise BackendError(f"cannot start the command: {exc}") from None
            finally:
                for fd in theirs:
                    os.close(fd)
                theirs.clear()
            feeder = None
            if feed is not None:
                feeder = feed_pipe(loop, ours.pop(), feed)
            elif request.stdin is not None:
                wt, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(ours.pop(), "wb", 0))
                transports.append(wt)
                wt.write(request.stdin.encode())
                wt.close()  # after the buffered data is written (or the reader is gone)
            try:
                status = await asyncio.wait_for(with_feeder(channel.wait(job_id), feeder), request.timeout)
            except TimeoutError:
                channel.kill(job_id)
                with contextlib.suppress(TimeoutError, ChannelClosed):
                    await asyncio.wait_for(channel.wait(job_id), 5)
                tail = out.text[-500:]
                raise CommandTimeout(
                    f"command timed out after {request.timeout:g}s and was killed"
                    + (f"; last output: {tail!r}" if tail else "")
                ) from None
            except BaseException:
                channel.kill(job_id)
                raise
            # Output still in the pipes is read at once; a background process that keeps them
            # open is not waited for.
            await wait_pipes(emit, [p.done for p in pipes])
        finally:
            for pipe in pipes:
                pipe.close()
            for t in transports:
                t.close()
            for fd in theirs + ours:
                os.close(fd)
        return Capture.result(exit_code(status), out, err, start)

    async def _exec_crun(self, handle: Handle, request: ExecRequest, ctx: ExecContext,
                         emit: Flow | None = None, feed: AsyncIterator[bytes] | None = None) -> ExecResult:
        """Run a command through `crun exec` (a sandbox adopted after a restart has no channel)."""
        # Beside the bundles, on the node's own tmpfs: in the bundle it sat on the sandbox's capped
        # disk, and a sandbox that had filled it could run no command (not even an rm).
        exec_dir = self.run_dir / "exec"
        exec_dir.mkdir(mode=0o700, exist_ok=True)
        pidfile = exec_dir / f"{handle.cid}-{os.urandom(4).hex()}.pid"
        # crun exec does not take no_new_privs from the container's config: ask for it.
        argv = ["exec", "--no-new-privs", "--cwd", ctx.workdir, "--user", f"{ctx.uid}:{ctx.gid}", "--pid-file", str(pidfile)]
        for k, v in ctx.env.items():
            argv += ["--env", f"{k}={v}"]
        argv += [handle.cid, "/bin/sh", "-c", request.command]
        command = cgroups.join_argv(self.cgroup_parent, handle.cid, self._crun(*argv), self.cgroup_controllers,
                                    oom_score_adj=COMMAND_OOM_SCORE_ADJ)
        if cgroups.cpu_idle(self.cgroup_parent, handle.cid):
            # Best effort: crun exec, and the command it starts, run under SCHED_IDLE.
            command = [CHRT, "--idle", "0", *command]
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE if request.stdin is not None or feed is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        cap = request.max_output_bytes
        out, err = Capture(cap), Capture(cap)
        readers = [asyncio.ensure_future(out.drain(proc.stdout, emit, "stdout")),
                   asyncio.ensure_future(err.drain(proc.stderr, emit, "stderr"))]
        timed_out = False
        feeder = None
        try:
            if feed is not None:
                feeder = asyncio.ensure_future(_feed_stream(proc.stdin, feed))
            elif request.stdin is not None:
                try:
                    proc.stdin.write(request.stdin.encode())
                    await proc.stdin.drain()
                    proc.stdin.close()
                except (BrokenPipeError, ConnectionResetError):
                    pass
            try:
                rc = await asyncio.wait_for(with_feeder(wait_process(proc, request.timeout + 1), feeder), request.timeout)
            except TimeoutError:
                timed_out = True
                kill_session_of(pidfile, handle.cid)
                self._kill_exec(pidfile, proc)
                try:
                    rc = await wait_process(proc, 5)
                except TimeoutError:
                    kill_tree(proc.pid)
                    rc = await wait_process(proc, 60)
            # Output still in the pipes is read at once; a background process that keeps them
            # open is not waited for.
            await wait_pipes(emit, readers)
        except BaseException:
            self._kill_exec(pidfile, proc)
            raise
        finally:
            for task in readers:
                task.cancel()
            pidfile.unlink(missing_ok=True)
        if timed_out:
            tail = out.text[-500:]
            raise CommandTimeout(
                f"command timed out after {request.timeout:g}s and was killed"
                + (f"; last output: {tail!r}" if tail else "")
            )
        return Capture.result(rc, out, err, start)

    def _kill_exec(self, pidfile: Path, proc: asyncio.subprocess.Process) -> None:
        """Kill what a command started. ``crun exec`` itself is left to reap its child and
        exit; only if it had not started the command yet is it killed too."""
        try:
            kill_tree(int(pidfile.read_text()))
        except (OSError, ValueError):
            if proc.returncode is None:
                kill_tree(proc.pid)

    async def connect_port(self, handle: Handle, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """127.0.0.1:``port`` in the sandbox's network namespace (``dsec.backends.portconn``)."""
        if handle.pid <= 0 or not pid_in_cgroup(handle.pid, handle.cid):
            raise SandboxStateError(f"cannot connect to port {port}: sandbox {handle.cid}'s processes are gone")
        return await portconn.connect_in_netns(handle.pid, port)
