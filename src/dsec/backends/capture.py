"""A command's output as the backends read it: kept up to a cap (``Capture``), read from a pipe
as it comes (``PipeReader``), or handed on chunk by chunk to a consumer that sets the pace
(``PipeStream``, ``Flow``: backpressure), and the pipes waited for once the command exited."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable

from libdsec.protocol import ExecResult

from .base import Emit

READ_CHUNK = 1 << 16
# Pipes still held open by a command's background children are waited for this long at most
# once the command itself exited.
PIPE_GRACE_S = 0.5


class Capture:
    """Keeps the first ``cap`` bytes of a stream and counts the rest."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = bytearray()
        self.total = 0

    async def drain(self, stream: asyncio.StreamReader, emit: Emit | None = None, kind: str = "") -> None:
        while chunk := await stream.read(READ_CHUNK):
            self.feed(chunk)
            if emit is not None:
                await emit(kind, chunk)

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if len(self.kept) < self.cap:
            self.kept += chunk[: self.cap - len(self.kept)]

    @property
    def text(self) -> str:
        return self.kept.decode(errors="replace")

    @property
    def truncated(self) -> bool:
        return self.total > len(self.kept)

    @staticmethod
    def result(rc: int, out: Capture, err: Capture, start: float) -> ExecResult:
        return ExecResult(
            exit_code=rc,
            stdout=out.text,
            stderr=err.text,
            duration_s=time.perf_counter() - start,
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
            stdout_bytes=out.total,
            stderr_bytes=err.total,
        )


class PipeReader:
    """Feeds what a command writes to a pipe (non-blocking, ours to close) into a capture;
    ``done`` at end of file. A reader on the loop, not a pipe transport: no protocol, file
    object or extra loop iteration to set it up, for the two pipes of every command."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, capture: Capture) -> None:
        self.loop, self.fd, self.capture = loop, fd, capture
        self.done = loop.create_future()
        loop.add_reader(fd, self._ready)

    def _ready(self) -> None:
        try:
            data = os.read(self.fd, 1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            self.capture.feed(data)
        else:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
        if not self.done.done():
            self.done.set_result(None)


class PipeStream:
    """Hands what a command writes to a pipe to ``emit`` chunk by chunk (and into a capture),
    reading no more while ``emit`` has not returned: a consumer that reads slowly leaves the
    data in the pipe, and the command blocks on its next write (backpressure, no buffer here).
    ``done`` is a task that ends at end of file."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, capture: Capture, kind: str, emit: Emit) -> None:
        self.loop, self.fd, self.capture, self.kind, self.emit = loop, fd, capture, kind, emit
        self.done = loop.create_task(self._run())
        self.done.add_done_callback(lambda _: self._close_fd())  # also when cancelled before it ran

    def _close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    async def _readable(self) -> None:
        ready = self.loop.create_future()
        self.loop.add_reader(self.fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            self.loop.remove_reader(self.fd)

    async def _run(self) -> None:
        try:
            while True:
                try:
                    data = os.read(self.fd, READ_CHUNK)
                except (BlockingIOError, InterruptedError):
                    await self._readable()
                    continue
                except OSError:
                    data = b""
                if not data:
                    return
                self.capture.feed(data)
                await self.emit(self.kind, data)
        finally:
            self._close_fd()

    def close(self) -> None:
        self.done.cancel()


class Flow:
    """``emit`` wrapped: counts the chunks handed on and whether one is being handed now."""

    def __init__(self, emit: Emit) -> None:
        self.emit, self.moved, self.busy = emit, 0, 0

    async def __call__(self, kind: str, data: bytes) -> None:
        self.busy += 1
        try:
            await self.emit(kind, data)
        finally:
            self.busy -= 1
            self.moved += 1


async def wait_pipes(flow: Flow | None, tasks: list[asyncio.Future]) -> None:
    """Wait for the pipes' end of file after the command exited: pipes still flowing to a
    slow consumer are waited for; pipes idle for ``PIPE_GRACE_S`` (held open by a background
    process) are not."""
    while True:
        before = flow.moved if flow is not None else 0
        _, pending = await asyncio.wait(tasks, timeout=PIPE_GRACE_S)
        if not pending or flow is None or (not flow.busy and flow.moved == before):
            return


def feed_pipe(loop: asyncio.AbstractEventLoop, fd: int, chunks: AsyncIterator[bytes]) -> asyncio.Task:
    """A task writing ``chunks`` to the pipe ``fd`` (its own from now: closed when it ends, even
    cancelled before it ran) as the command reads it: the next chunk is asked for only once the
    last one is in the pipe (backpressure both ways). A command that stops reading ends the
    feeding quietly."""
    held = [fd]

    def close() -> None:
        if held[0] >= 0:
            os.close(held[0])
            held[0] = -1

    async def run() -> None:
        os.set_blocking(fd, False)
        try:
            async for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    try:
                        view = view[os.write(fd, view):]
                    except BlockingIOError:
                        ready = loop.create_future()
                        loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
                        try:
                            await ready
                        finally:
                            loop.remove_writer(fd)
                    except (BrokenPipeError, ConnectionResetError):
                        return
        finally:
            close()

    task = loop.create_task(run())
    task.add_done_callback(lambda _: close())
    return task


async def with_feeder(wait: Awaitable, feeder: asyncio.Future | None):
    """``await wait`` while ``feeder`` feeds the command's stdin; an error of the feeder's (its
    source failed: a refused upload, a client gone) is raised at once; the feeder is cancelled
    once the command ended."""
    if feeder is None:
        return await wait
    waiter = asyncio.ensure_future(wait)
    try:
        while True:
            await asyncio.wait({waiter} if feeder.done() else {waiter, feeder}, return_when=asyncio.FIRST_COMPLETED)
            if feeder.done() and not feeder.cancelled() and feeder.exception() is not None:
                raise feeder.exception()
            if waiter.done():
                return waiter.result()
    finally:
        feeder.cancel()
        waiter.cancel()
