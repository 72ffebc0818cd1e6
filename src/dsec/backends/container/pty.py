"""Terminals in a container sandbox (``SandboxBackend.open_pty``): a PTY pair in the sandbox's
own devpts, the command started as any command is (through the init, or ``crun exec`` without a
channel) with the slave as its stdio, and ``dsec-init --ctty`` making it the controlling
terminal of the command's session.

A ``ContainerPty`` is open until ``close``, which kills what the command started if it still
runs and closes the master; a second ``close`` does nothing. Writing to or resizing a PTY whose
command has exited is a ``SandboxStateError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from libdsec import BackendError, SandboxStateError

from ...resources import cgroups
from .. import terminal
from ..base import ExecContext, Handle
from ..initchan import MAX_REQUEST, InitChannel, StartFailed, exit_code
from ..procs import kill_session_of
from .exec import COMMAND_OOM_SCORE_ADJ
from .oci import INIT_PATH


class ContainerPty:
    """A container's PTY (``SandboxBackend.open_pty``): the master here, the command's end
    (``ended``: its exit code) and how to kill all it started."""

    def __init__(self, master: terminal.Master, ended, kill: Callable[[], None]) -> None:
        self.master = master
        self.kill = kill
        self.ended = asyncio.ensure_future(ended)

    async def read(self) -> bytes:
        return await self.master.read()

    def _check(self, what: str) -> None:
        if self.master.closed:
            raise SandboxStateError(f"cannot {what}: the PTY is closed")
        if self.ended.done():
            raise SandboxStateError(f"cannot {what}: the PTY's command has exited (exit code {self._code()})")

    async def write(self, data: bytes) -> None:
        self._check("write to the PTY")
        try:
            await self.master.write(data)
        except OSError as exc:
            raise SandboxStateError(f"cannot write to the PTY: {exc.strerror or exc}") from None

    async def resize(self, cols: int, rows: int) -> None:
        self._check("resize the PTY")
        self.master.resize(cols, rows)

    def _code(self) -> int:
        if self.ended.cancelled() or self.ended.exception() is not None:
            return -1
        return self.ended.result()

    async def wait(self) -> int:
        with contextlib.suppress(Exception):
            await asyncio.shield(self.ended)
        return self._code()

    async def close(self) -> None:
        if self.master.closed:
            return
        if not self.ended.done():
            self.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self.ended), 5)
        self.master.close()
        if not self.ended.done():
            self.ended.cancel()


class Pty:
    """``ContainerBackend``'s PTYs: liveness is its lifecycle's, the workdir's check its files',
    killing a ``crun exec``'s command its exec's."""

    cgroup_parent: str
    cgroup_controllers: tuple[str, ...]
    sandboxes_dir: Path
    channels: dict[str, InitChannel]

    async def open_pty(self, handle: Handle, command: str, ctx: ExecContext, cols: int, rows: int) -> ContainerPty:
        """The command on a terminal in the sandbox's devpts, started as any command is (through
        the init, or ``crun exec`` without a channel) with the slave as its stdio; ``dsec-init
        --ctty`` makes it the controlling terminal of the command's session."""
        if not await self.is_alive(handle):
            raise SandboxStateError(f"cannot open a PTY: sandbox process of {handle.cid} is gone")
        self._check_dir(handle, ctx.workdir)
        argv = [INIT_PATH, "--ctty", "/bin/sh", "-c", command]
        master, slave = terminal.open_pair(handle.pid, cols, rows)
        try:
            channel = self.channels.get(handle.cid)
            if channel is not None and not channel.closed:
                job_id, message = channel.encode(argv, ctx.env, ctx.workdir, ctx.uid, ctx.gid)
                if len(message) <= MAX_REQUEST:
                    try:
                        await channel.start(job_id, message, (slave, slave, slave))
                    except StartFailed as exc:
                        raise BackendError(f"cannot start the PTY's command: {exc}") from None
                    async def exited() -> int:
                        return exit_code(await channel.wait(job_id))

                    return ContainerPty(terminal.Master(master), exited(), lambda: channel.kill(job_id))
            pidfile = self.sandboxes_dir / handle.cid / f"pty-{os.urandom(4).hex()}.pid"
            args = ["exec", "--no-new-privs", "--cwd", ctx.workdir, "--user", f"{ctx.uid}:{ctx.gid}", "--pid-file", str(pidfile)]
            for k, v in ctx.env.items():
                args += ["--env", f"{k}={v}"]
            proc = await asyncio.create_subprocess_exec(
                *cgroups.join_argv(self.cgroup_parent, handle.cid, self._crun(*args, handle.cid, *argv),
                                   self.cgroup_controllers, oom_score_adj=COMMAND_OOM_SCORE_ADJ),
                stdin=slave, stdout=slave, stderr=slave)

            async def ended() -> int:
                try:
                    rc = await proc.wait()
                    return 128 - rc if rc < 0 else rc
                finally:
                    pidfile.unlink(missing_ok=True)

            def kill() -> None:
                kill_session_of(pidfile, handle.cid)
                self._kill_exec(pidfile, proc)

            return ContainerPty(terminal.Master(master), ended(), kill)
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
