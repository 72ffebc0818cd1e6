"""PTYs on a node: commands on a terminal of the sandbox's, held by the edge.

The same operations for every kind (the backend's ``open_pty`` makes the terminal: a pty in a
container's devpts, or one of the VM guest's through its agent), kept simple so that other
protocols (E2B's pty calls) map onto them one to one:

- ``open(sandbox, cols, rows, command, env, workdir, user)`` → an id (per node);
- ``write(id, bytes)``: typed at the terminal (Ctrl-C is ``b"\\x03"``);
- ``resize(id, cols, rows)``: the command gets SIGWINCH;
- ``stream(id, encoding)``: ``ExecEvent``s — ``started``, ``stdout`` chunks as the command writes
  them (text, or base64 of the exact bytes), then ``exit`` with its exit code (one stream at a
  time: a new one takes over, the one before ends with ``SessionClosed``, and no output is lost
  between them; the terminal is read at the stream's pace);
- ``close(id)``: what it started is killed, the terminal released (again: nothing happens).

A PTY is the edge's, not the sandbox's: it lives in this process (the container's master fd,
the VM agent's job), so an edge restart ends it — its command gets the terminal's hangup, the VM
agent kills it when its host goes — and the restarted edge answers its id with
``SessionClosed`` saying so. It also ends with its sandbox, and after ``idle_timeout`` with no
stream reading it and no call (a client that went away leaves nothing behind for long).
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from libdsec import SessionClosed
from libdsec.protocol import ExecEvent, ExecResult

from ..backends.base import PtyProcess
from .stream import error_event

SWEEP_S = 5.0


@dataclass
class _Pty:
    sandbox_id: str
    proc: PtyProcess
    idle_timeout: float
    opened: float = field(default_factory=time.perf_counter)
    last_active: float = field(default_factory=time.monotonic)
    reader: asyncio.Event | None = None  # set: the stream reading it is to end
    pending: asyncio.Future | None = None  # a read in flight (handed on to the next stream)
    exit_code: int | None = None


class PtyTable:
    """The node's open PTYs. ``close_all()`` at the edge's end; a second does nothing."""

    def __init__(self) -> None:
        self._ptys: dict[int, _Pty] = {}
        self._ids = itertools.count(1)
        self._sweeper: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._ptys)

    def add(self, sandbox_id: str, proc: PtyProcess, idle_timeout: float) -> int:
        pty_id = next(self._ids)
        self._ptys[pty_id] = _Pty(sandbox_id, proc, idle_timeout)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep(), name="dsec-pty-sweeper")
        return pty_id

    def get(self, sandbox_id: str, pty_id: int) -> _Pty:
        pty = self._ptys.get(pty_id)
        if pty is None or pty.sandbox_id != sandbox_id:
            raise SessionClosed(f"no open PTY {pty_id} in sandbox {sandbox_id}: it was closed, or ended with its "
                                "sandbox, its idle timeout or a restart of the node's edge (PTYs do not outlive "
                                "the edge); open a new one")
        pty.last_active = time.monotonic()
        return pty

    async def write(self, sandbox_id: str, pty_id: int, data: bytes) -> None:
        await self.get(sandbox_id, pty_id).proc.write(data)

    async def resize(self, sandbox_id: str, pty_id: int, cols: int, rows: int) -> None:
        await self.get(sandbox_id, pty_id).proc.resize(cols, rows)

    async def stream(self, sandbox_id: str, pty_id: int, encoding: str = "utf-8") -> AsyncIterator[ExecEvent]:
        pty = self.get(sandbox_id, pty_id)
        if pty.reader is not None:
            pty.reader.set()  # the stream before ends (its client went, or another takes over)
        me = pty.reader = asyncio.Event()
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        try:
            yield ExecEvent(event="started")
            while True:
                if pty.pending is None:
                    pty.pending = asyncio.ensure_future(pty.proc.read())
                taken_over = asyncio.ensure_future(me.wait())
                await asyncio.wait([pty.pending, taken_over], return_when=asyncio.FIRST_COMPLETED)
                taken_over.cancel()
                if me.is_set():  # the read in flight is the next stream's
                    yield error_event(SessionClosed(f"PTY {pty_id} is read by another stream now"))
                    return
                read, pty.pending = pty.pending, None
                if read.exception() is not None:
                    yield error_event(read.exception())
                    return
                data = read.result()
                pty.last_active = time.monotonic()
                if not data:
                    break
                if encoding == "base64":
                    yield ExecEvent(event="stdout", data=base64.b64encode(data).decode())
                elif text := decoder.decode(data):
                    yield ExecEvent(event="stdout", data=text)
            if encoding != "base64" and (tail := decoder.decode(b"", final=True)):
                yield ExecEvent(event="stdout", data=tail)
            pty.exit_code = await pty.proc.wait()
            yield ExecEvent(event="exit", result=ExecResult(exit_code=pty.exit_code, stdout="", stderr="",
                                                            duration_s=time.perf_counter() - pty.opened))
        finally:
            if pty.reader is me:
                pty.reader = None
            pty.last_active = time.monotonic()

    async def close(self, sandbox_id: str, pty_id: int) -> None:
        if (pty := self._ptys.get(pty_id)) is not None and pty.sandbox_id == sandbox_id:
            del self._ptys[pty_id]
            if pty.reader is not None:
                pty.reader.set()
            await pty.proc.close()
            if pty.pending is not None and not pty.pending.done():
                pty.pending.cancel()

    async def close_sandbox(self, sandbox_id: str) -> None:
        """The sandbox stops: its PTYs end first."""
        mine = [i for i, p in self._ptys.items() if p.sandbox_id == sandbox_id]
        if mine:  # most sandboxes never open one: no gather (a task per stop) for them
            await asyncio.gather(*(self.close(sandbox_id, i) for i in mine), return_exceptions=True)

    async def close_all(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        ptys, self._ptys = list(self._ptys.values()), {}
        await asyncio.gather(*(p.proc.close() for p in ptys), return_exceptions=True)
        for pty in ptys:
            if pty.pending is not None and not pty.pending.done():
                pty.pending.cancel()

    async def _sweep(self) -> None:
        while self._ptys:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for pty_id, pty in list(self._ptys.items()):
                if pty.reader is None and now - pty.last_active > pty.idle_timeout:
                    with contextlib.suppress(Exception):
                        await self.close(pty.sandbox_id, pty_id)
