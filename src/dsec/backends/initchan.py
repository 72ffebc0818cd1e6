"""The host's end of a container sandbox's init channel (see ``dsec/native/init.c``).

The server makes a SOCK_SEQPACKET socketpair per sandbox and hands one end to the sandbox's init
as its stdin; over the other it asks the init to start commands (their stdio travels as file
descriptors with the request) and hears when they start and end. A command started this way
costs a fork and an exec inside the sandbox instead of a `crun exec` (a process that enters
every namespace and the cgroup, loads the seccomp filter and sets the capabilities again)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import os
import socket

MAX_REQUEST = 200 * 1024  # the init reads up to 256 KiB a packet; larger commands use crun exec


class ChannelClosed(ConnectionError):
    """The init's end is gone (the sandbox ended) or was never there."""


class TooLarge(ValueError):
    """The request does not fit one packet of this host's socket buffers (the channel stays)."""


class StartFailed(OSError):
    """The init could not start the command (``what`` names the step: chdir, setuid, exec …)."""

    def __init__(self, err: int, what: str) -> None:
        super().__init__(err, f"{what}: {os.strerror(err)}")
        self.what = what


class _Job:
    __slots__ = ("started", "ended")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.started: asyncio.Future[int] = loop.create_future()
        self.ended: asyncio.Future[int] = loop.create_future()


class InitChannel:
    """One sandbox's channel. ``pair()`` makes the socketpair; the init's end goes to crun."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)
        self.loop = asyncio.get_running_loop()
        self.jobs: dict[int, _Job] = {}
        self.ids = itertools.count(1)
        self.closed = False
        self.loop.add_reader(sock.fileno(), self._on_readable)

    @staticmethod
    def pair() -> tuple[socket.socket, socket.socket]:
        """(host end, init end). Both close on exec; the init's is passed explicitly."""
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def encode(self, argv: list[str], env: dict[str, str], cwd: str, uid: int, gid: int) -> tuple[int, bytes]:
        job_id = next(self.ids)
        fields = ["x", str(job_id), str(uid), str(gid), cwd, str(len(argv)), *argv,
                  *(f"{k}={v}" for k, v in env.items())]
        return job_id, b"\0".join(f.encode() for f in fields)

    async def start(self, job_id: int, request: bytes, fds: tuple[int, int, int]) -> int:
        """Ask the init to start a command; returns its pid inside the sandbox."""
        if self.closed:
            raise ChannelClosed("the sandbox's init channel is closed")
        job = self.jobs[job_id] = _Job(self.loop)
        try:
            await self._send(request, fds)
            return await job.started
        except BaseException:
            if not job.started.done() or job.started.exception() is not None:
                self.jobs.pop(job_id, None)
            raise

    async def wait(self, job_id: int) -> int:
        """The command's wait status once it ended."""
        job = self.jobs[job_id]
        try:
            return await asyncio.shield(job.ended)
        finally:
            if job.ended.done():
                self.jobs.pop(job_id, None)

    def kill(self, job_id: int) -> None:
        """SIGKILL the command's session (best effort: a closed channel has nothing to kill)."""
        with contextlib.suppress(OSError):
            self.sock.send(b"k\0%d" % job_id)

    async def _send(self, data: bytes, fds: tuple[int, int, int]) -> None:
        while True:
            try:
                socket.send_fds(self.sock, [data], list(fds))
                return
            except BlockingIOError:
                await asyncio.sleep(0.001)
            except OSError as exc:
                if exc.errno == errno.EMSGSIZE:  # over the socket's send buffer (a host sysctl)
                    raise TooLarge(f"{len(data)} bytes is over one packet here") from None
                self._close(exc)
                raise ChannelClosed(f"the sandbox's init channel failed: {exc.strerror}") from None

    def _on_readable(self) -> None:
        while True:
            try:
                msg = self.sock.recv(512)
            except BlockingIOError:
                return
            except OSError as exc:
                self._close(exc)
                return
            if not msg:
                self._close(ChannelClosed("the sandbox's init is gone"))
                return
            self._dispatch(msg.split(b"\0"))

    def _dispatch(self, fields: list[bytes]) -> None:
        try:
            kind, job = fields[0], self.jobs.get(int(fields[1]))
        except (IndexError, ValueError):
            return
        if job is None:
            return
        if kind == b"s" and not job.started.done():
            job.started.set_result(int(fields[2]))
        elif kind == b"e" and not job.started.done():
            job.started.set_exception(StartFailed(int(fields[2]), fields[3].decode(errors="replace")))
        elif kind == b"w" and not job.ended.done():
            job.ended.set_result(int(fields[2]))

    def _close(self, exc: BaseException) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.sock.fileno())
        for job in self.jobs.values():
            for fut in (job.started, job.ended):
                if not fut.done():
                    fut.set_exception(ChannelClosed(f"the sandbox's init channel closed: {exc}"))
                    fut.exception()  # retrieved: nobody may be waiting for it
        self.sock.close()

    def close(self) -> None:
        self._close(ChannelClosed("closed by the host"))


def exit_code(status: int) -> int:
    """A wait status as a shell would report it: the exit code, or 128 + the signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


