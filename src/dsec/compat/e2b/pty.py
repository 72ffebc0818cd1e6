"""envd's PTY calls (``sandbox.pty.*``) on DSec's PTYs (``dsec.edge.pty``), one to one:

- ``Start`` with a ``pty`` → ``open_pty`` (the command on a new terminal of that size), then the
  terminal's output as ``pty`` data events and its end;
- ``SendInput`` to a PTY → ``pty_input``; ``Update`` → ``resize_pty``; ``SendSignal`` (``kill``)
  → ``close_pty`` (what it started is killed, the terminal released);
- ``Connect`` → the terminal's output from now on.

envd names a PTY by its pid. A DSec PTY's is ``PTY_PID_BASE`` + its DSec PTY id: above any
Linux pid (``pid_max`` is at most 2**22), so it is never a process's, and any apiserver routes
it to the PTY without a lookup. DSec's PTY has one reader at a time: an apiserver reads each
PTY its streams follow once and hands the events to all of them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shlex
import signal as signals
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof
from pydantic import ValidationError

from e2b.envd.process import process_pb as pb

from libdsec import DSecError, SandboxStateError, SessionClosed
from libdsec.protocol import OpenPtyRequest, PtyResizeRequest

from ._errors import rpc_error
from ._events import end as _end
from ._events import event as _event

PTY_PID_BASE = 1 << 22  # PID_MAX_LIMIT: no Linux process has this pid or a higher one
# Kills of PTYs whose stream's deadline passed after its client left (a task each, held here).
_KILLS: set[asyncio.Task] = set()
_Sized = TypeVar("_Sized", OpenPtyRequest, PtyResizeRequest)
_QUEUED = 64  # output chunks a stream may have waiting before the PTY is read on


def is_pty(pid: int) -> bool:
    return pid > PTY_PID_BASE


def _pty_id(pid: int) -> int:
    return pid - PTY_PID_BASE


def _gone(exc: DSecError, pid: int) -> ConnectError:
    """A PTY closed, ended, or not there: to envd, a process that is not found."""
    if isinstance(exc, SessionClosed | SandboxStateError):
        return ConnectError(Code.NOT_FOUND, f"PTY {pid}: {exc.message}")
    return rpc_error(exc)


def _size(size: pb.PTY.Size | None, model: type[_Sized], **more) -> _Sized:
    if size is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "pty.size (cols, rows) is required")
    try:
        return model(cols=size.cols, rows=size.rows, **more)
    except ValidationError as exc:
        bad = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConnectError(Code.INVALID_ARGUMENT,
                           f"bad PTY size {size.cols}x{size.rows} (cols x rows, each 1 to 4096): {bad}") from None


@dataclass
class _Relay:
    """One PTY's output as this apiserver reads it, handed to every stream that follows it."""

    listeners: set[asyncio.Queue] = field(default_factory=set)
    task: asyncio.Task | None = None
    drained: asyncio.Event = field(default_factory=asyncio.Event)  # a listener took events: read on
    killed: int | None = None  # the signal of the kill that closed it (its streams then end by it)


class PtyService:
    """The PTY half of ``process.Process`` (``ProcessService`` hands it PTY pids)."""

    def __init__(self) -> None:
        self.relays: dict[tuple[str, int], _Relay] = {}

    def _join(self, target, pid: int) -> asyncio.Queue:
        key = (target.sandbox_id, pid)
        relay = self.relays.get(key)
        if relay is None:
            relay = self.relays[key] = _Relay()
            relay.task = asyncio.get_running_loop().create_task(self._read(target, pid, relay),
                                                                name=f"dsec-e2b-pty-{pid}")
        queue: asyncio.Queue = asyncio.Queue()
        relay.listeners.add(queue)
        return queue

    async def _leave(self, target, pid: int, queue: asyncio.Queue) -> None:
        key = (target.sandbox_id, pid)
        relay = self.relays.get(key)
        if relay is None:
            return
        relay.listeners.discard(queue)
        relay.drained.set()
        if not relay.listeners and relay.task is not None:  # no one follows it here: stop reading (it stays open)
            del self.relays[key]
            relay.task.cancel()
            await asyncio.gather(relay.task, return_exceptions=True)

    async def _read(self, target, pid: int, relay: _Relay) -> None:
        def tell(event: pb.ProcessEvent | ConnectError | None) -> None:
            for queue in relay.listeners:
                queue.put_nowait(event)

        events = target.edge.pty_stream(target.sandbox_id, _pty_id(pid), "base64")
        try:
            async for event in events:
                if event.event == "stdout":
                    tell(_event(pb.ProcessEvent.DataEvent(output=Oneof("pty", base64.b64decode(event.data)))))
                    # the terminal is read at the pace of the slowest stream following it here
                    while any(queue.qsize() >= _QUEUED for queue in relay.listeners):
                        relay.drained.clear()
                        await relay.drained.wait()
                elif event.event == "exit" and event.result is not None:
                    tell(_event(_end(event.result.exit_code)))
                    return
                elif event.event == "error":
                    if relay.killed is not None:
                        tell(_event(_end(128 + relay.killed)))
                        return
                    err = event.error or {}
                    tell(ConnectError(Code.NOT_FOUND if err.get("code") == SessionClosed.code else Code.INTERNAL,
                                      f"PTY {pid}: {err.get('message', 'its stream failed')}"))
                    return
        except DSecError as exc:
            tell(_event(_end(128 + relay.killed)) if relay.killed is not None else _gone(exc, pid))
        finally:
            tell(None)
            await events.aclose()
            if self.relays.get((target.sandbox_id, pid)) is relay:
                del self.relays[(target.sandbox_id, pid)]

    async def _follow(self, target, pid: int, deadline: float | None, kill_at_deadline: bool
                      ) -> AsyncIterator[pb.ProcessEvent]:
        queue = self._join(target, pid)
        ended = False
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    event = await asyncio.wait_for(queue.get(), left)
                except TimeoutError:
                    if kill_at_deadline:
                        ended = True
                        with contextlib.suppress(ConnectError):  # (it ended meanwhile)
                            await self.kill(target, pid, signals.SIGKILL)
                        raise ConnectError(Code.DEADLINE_EXCEEDED,
                                           f"PTY {pid} ran past the stream's timeout: killed") from None
                    raise ConnectError(Code.DEADLINE_EXCEEDED, f"PTY {pid} still runs at the stream's timeout") from None
                if (relay := self.relays.get((target.sandbox_id, pid))) is not None:
                    relay.drained.set()
                if event is None:  # read no more without an end: it is gone
                    ended = True
                    yield _event(_end(128 + signals.SIGKILL))
                    return
                if isinstance(event, ConnectError):
                    ended = True
                    raise event
                yield event
                if event.event is not None and event.event.field == "end":
                    ended = True
                    return
        finally:
            await self._leave(target, pid, queue)
            if (kill_at_deadline and not ended and deadline is not None
                    and time.monotonic() >= deadline - 0.05):
                self._kill_later(target, pid)  # the client gave up at its deadline first

    def _kill_later(self, target, pid: int) -> None:
        async def kill() -> None:
            with contextlib.suppress(ConnectError, DSecError):
                await self.kill(target, pid, signals.SIGKILL)

        task = asyncio.get_running_loop().create_task(kill())
        _KILLS.add(task)
        task.add_done_callback(_KILLS.discard)

    async def start(self, target, config: pb.ProcessConfig, size: pb.PTY.Size | None,
                    timeout_ms: int | None, started: float) -> AsyncIterator[pb.ProcessEvent]:
        if config is None or not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
        request = _size(size, OpenPtyRequest, command="exec " + shlex.join([config.cmd, *config.args]),
                        env=dict(config.envs), workdir=target.path(config.cwd) if config.cwd else target.cwd, user=target.user)
        try:
            info = await target.edge.open_pty(target.sandbox_id, request)
        except DSecError as exc:
            raise rpc_error(exc) from None
        pid = PTY_PID_BASE + info.id
        deadline = None if not timeout_ms else started + timeout_ms / 1000
        yield _event(pb.ProcessEvent.StartEvent(pid=pid))
        async for event in self._follow(target, pid, deadline, kill_at_deadline=True):
            yield event

    async def connect(self, target, pid: int, timeout_ms: int | None, started: float) -> AsyncIterator[pb.ProcessEvent]:
        try:  # there (an empty write checks it without typing anything)
            await target.edge.pty_input(target.sandbox_id, _pty_id(pid), b"")
        except DSecError as exc:
            raise _gone(exc, pid) from None
        deadline = None if not timeout_ms else started + timeout_ms / 1000
        yield _event(pb.ProcessEvent.StartEvent(pid=pid))
        async for event in self._follow(target, pid, deadline, kill_at_deadline=False):
            yield event

    async def send_input(self, target, pid: int, data: bytes) -> None:
        try:
            await target.edge.pty_input(target.sandbox_id, _pty_id(pid), data)
        except DSecError as exc:
            raise _gone(exc, pid) from None

    async def resize(self, target, pid: int, size: pb.PTY.Size | None) -> None:
        request = _size(size, PtyResizeRequest)
        try:
            await target.edge.resize_pty(target.sandbox_id, _pty_id(pid), request.cols, request.rows)
        except DSecError as exc:
            raise _gone(exc, pid) from None

    async def kill(self, target, pid: int, signal: int) -> None:
        """Close it (any signal: what it started is killed); ``NOT_FOUND`` if it is not open or
        its command has ended already (closed all the same)."""
        try:
            await target.edge.pty_input(target.sandbox_id, _pty_id(pid), b"")
            running = True
        except SessionClosed as exc:
            raise _gone(exc, pid) from None
        except SandboxStateError:  # its command exited: closed below, and not found, as envd's
            running = False
        except DSecError as exc:
            raise rpc_error(exc) from None
        if running and (relay := self.relays.get((target.sandbox_id, pid))) is not None:
            relay.killed = signal
        try:
            await target.edge.close_pty(target.sandbox_id, _pty_id(pid))
        except DSecError as exc:
            raise _gone(exc, pid) from None
        if not running:
            raise ConnectError(Code.NOT_FOUND, f"PTY {pid} has ended already")

