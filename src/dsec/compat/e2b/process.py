"""envd's ``process.Process`` service on DSec's commands and background processes.

The SDK starts every command the same way, foreground or not (``background`` only decides when
its ``run`` returns), so ``Start`` chooses by ``stdin``:

- ``stdin=False`` (the SDK's default): a streamed command (``exec_stream``, DSec's one-call
  path), its pid told first by the shell that then becomes it. It reads ``/dev/null``. It is
  listed, killed and connected to through the apiserver that streams it (``streamed``). A client
  that goes away (``handle.disconnect()``, E2B Desktop's way of starting its desktop) leaves it
  running, as envd does: the apiserver follows it on its own (``_drain``), its output going to
  those connected, until it ends, is killed, or reaches its stream's deadline.
- ``stdin=True``: a DSec background process (``dsec.edge.processes``) started and followed in
  one call: it takes stdin (``SendInput``, ``CloseStdin``), outlives its client, and is listed,
  signalled and connected to (output from now on) through any apiserver.

A stream that ends by its deadline (``commands.run(timeout=…)``) kills its command, as envd
does. ``Start`` with a ``pty``, and the calls naming a PTY's pid, go to DSec's PTYs (``.pty``).
"""

from __future__ import annotations

import asyncio
import shlex
import signal as signals
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from e2b.envd.process import process_pb as pb

from libdsec import DSecError, SandboxStateError
from libdsec.protocol import ExecEvent, ExecRequest, ProcessStreamRequest, SandboxStatus, StartProcessRequest

from ...edge.processes import pid_first
from ._errors import rpc_error
from ._events import end as _end
from ._events import event as _event
from .envd import EnvdContext
from .pty import PtyService, is_pty

# Left to themselves, kills sent because a stream's deadline passed (a task each, held here).
_KILLS: set[asyncio.Task] = set()
# Streamed commands whose client went away, followed until they end (a task each, held here).
_DRAINS: set[asyncio.Task] = set()


def _command(config: pb.ProcessConfig | None, stdin: bool) -> str:
    if config is None or not config.cmd:
        raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
    return "exec " + shlex.join([config.cmd, *config.args]) + ("" if stdin else " </dev/null")


def _config_of(command: str) -> pb.ProcessConfig:
    """A listed process's config, from the command line DSec keeps (envs and cwd are not kept)."""
    line = command.removeprefix("exec ").removesuffix(" </dev/null")
    try:
        parts = shlex.split(line)
    except ValueError:  # cut at 200 characters mid-quote
        parts = line.split()
    return pb.ProcessConfig(cmd=parts[0] if parts else "", args=parts[1:])


@dataclass
class _Streamed:
    """A streamed command (``stdin=False``) while its ``Start`` follows it."""

    config: pb.ProcessConfig
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # its stream closed: the command is gone
    signal: int = signals.SIGKILL
    listeners: list[asyncio.Queue] = field(default_factory=list)


def _sandbox_gone(target) -> ConnectError:
    """A command's stream when its sandbox was killed under it: envd's stream breaks off, and
    the SDK asks the sandbox's health why (``SandboxNotRunningException``)."""
    return ConnectError(Code.UNAVAILABLE, f"the connection to sandbox {target.sandbox_id} ended before the stream "
                                          "completed")


async def _still_running(target) -> bool:
    try:
        return (await target.edge.get(target.sandbox_id)).status is SandboxStatus.running
    except DSecError:
        return False


class ProcessService:
    """The ``process.Process`` service (its generated protocol: ``e2b.envd.process.process_connect``)."""

    def __init__(self, envd: EnvdContext) -> None:
        self.envd = envd
        self.streamed: dict[tuple[str, int], _Streamed] = {}
        self.ptys = PtyService()

    async def _pid(self, ctx, selector: pb.ProcessSelector | None) -> int:
        if selector is None or selector.selector is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "process selector (pid) is required")
        if selector.selector.field != "pid":
            raise ConnectError(Code.NOT_FOUND, "no process by that tag: DSec's processes and PTYs are named by pid")
        return int(selector.selector.value)

    async def _follow(self, ctx, target, pid: int, events: AsyncIterator[ExecEvent],
                      started: float, streamed: _Streamed | None = None) -> AsyncIterator[pb.ProcessEvent]:
        """The process's output and end, from DSec's stream of it, as envd's events (and to
        those connected to a streamed command)."""
        deadline_ms = ctx.timeout_ms
        deadline = None if not deadline_ms else started + deadline_ms / 1000
        ended = False
        stopped = asyncio.ensure_future(streamed.stop.wait()) if streamed is not None else None
        step: asyncio.Future | None = None  # the read of the next event, while one is pending
        detached = False  # the client went away (a streamed command runs on: _drain)

        def tell(event: pb.ProcessEvent) -> pb.ProcessEvent:
            for queue in streamed.listeners if streamed is not None else ():
                queue.put_nowait(event)
            return event

        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError
                step = asyncio.ensure_future(anext(events))
                done, _ = await asyncio.wait({step} | ({stopped} if stopped else set()), timeout=left,
                                             return_when=asyncio.FIRST_COMPLETED)
                if step not in done:
                    step.cancel()
                    await asyncio.gather(step, return_exceptions=True)
                    if stopped is not None and stopped in done:  # killed: closing the stream ends it
                        ended = True
                        yield tell(_event(_end(128 + streamed.signal)))
                        return
                    raise TimeoutError
                try:
                    event: ExecEvent = step.result()
                except StopAsyncIteration:
                    break
                step = None
                if event.event in ("stdout", "stderr"):
                    data = pb.ProcessEvent.DataEvent(output=Oneof(event.event, event.data.encode()))
                    yield tell(_event(data))
                elif event.event == "started":
                    continue
                elif event.event == "exit" and event.result is not None:
                    if event.result.exit_code != 0 and not await _still_running(target):
                        raise _sandbox_gone(target)
                    ended = True
                    yield tell(_event(_end(event.result.exit_code)))
                    return
                elif event.event == "error":
                    if not await _still_running(target):
                        raise _sandbox_gone(target)
                    err = event.error or {}
                    raise ConnectError(Code.INTERNAL, str(err.get("message", "the process's stream failed")))
        except (GeneratorExit, asyncio.CancelledError):
            detached = True
            raise
        except TimeoutError:
            if streamed is None:  # (a streamed command dies with its stream)
                self._kill_later(target, pid)
            raise ConnectError(Code.DEADLINE_EXCEEDED, f"process {pid} ran past the stream's timeout: killed") from None
        except DSecError as exc:
            if not await _still_running(target):
                raise _sandbox_gone(target) from None
            raise rpc_error(exc) from None
        finally:
            if (detached and streamed is not None and not ended
                    and (deadline is None or time.monotonic() < deadline - 0.05)):
                # The client went away: the command runs on, followed (and ended) by _drain.
                task = asyncio.get_running_loop().create_task(
                    self._drain(target, pid, events, streamed, stopped, step, deadline))
                _DRAINS.add(task)
                task.add_done_callback(_DRAINS.discard)
            else:
                if stopped is not None:
                    stopped.cancel()
                    for queue in streamed.listeners:
                        queue.put_nowait(None)
                    self.streamed.pop((target.sandbox_id, pid), None)
                await events.aclose()
                if streamed is not None:
                    streamed.ended.set()
                if (streamed is None and not ended and deadline is not None
                        and time.monotonic() >= deadline - 0.05):
                    self._kill_later(target, pid)  # the client gave up at its deadline first

    async def _drain(self, target, pid: int, events: AsyncIterator[ExecEvent], streamed: _Streamed,
                     stopped: asyncio.Future, step: asyncio.Future | None, deadline: float | None) -> None:
        """A streamed command whose client went away: its events go to those connected to it
        until it ends; a kill (``streamed.stop``) or its stream's deadline closes its stream,
        which ends it."""

        def tell(event: pb.ProcessEvent) -> None:
            for queue in streamed.listeners:
                queue.put_nowait(event)

        try:
            while True:
                step = step or asyncio.ensure_future(anext(events))
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = await asyncio.wait({step, stopped}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if step not in done:  # killed, or at its deadline: closing the stream ends it
                    step.cancel()
                    await asyncio.gather(step, return_exceptions=True)
                    tell(_event(_end(128 + streamed.signal)))
                    return
                try:
                    event: ExecEvent = step.result()
                except (StopAsyncIteration, DSecError):
                    return
                step = None
                if event.event in ("stdout", "stderr"):
                    tell(_event(pb.ProcessEvent.DataEvent(output=Oneof(event.event, event.data.encode()))))
                elif event.event == "exit" and event.result is not None:
                    tell(_event(_end(event.result.exit_code)))
                    return
                elif event.event == "error":
                    return
        finally:
            stopped.cancel()
            for queue in streamed.listeners:
                queue.put_nowait(None)
            self.streamed.pop((target.sandbox_id, pid), None)
            await events.aclose()
            streamed.ended.set()

    def _kill_later(self, target, pid: int) -> None:
        async def kill() -> None:
            try:
                await target.edge.signal_process(target.sandbox_id, pid, signals.SIGKILL)
            except DSecError:
                pass  # it ended by itself meanwhile

        task = asyncio.get_running_loop().create_task(kill())
        _KILLS.add(task)
        task.add_done_callback(_KILLS.discard)

    async def start(self, request: pb.StartRequest, ctx) -> AsyncIterator[pb.StartResponse]:
        started = time.monotonic()
        target = self.envd.target(ctx)
        config = request.process
        if request.pty is not None:
            async for event in self.ptys.start(target, config, request.pty.size, ctx.timeout_ms, started):
                yield pb.StartResponse(event=event)
            return
        command = _command(config, bool(request.stdin))
        env, workdir = dict(config.envs), target.path(config.cwd) if config.cwd else target.cwd
        if request.stdin:  # a background process, started and followed in one call (the pid first)
            events = target.edge.start_process_stream(target.sandbox_id, StartProcessRequest(
                command=command, env=env, workdir=workdir, user=target.user))
        else:
            deadline_s = (ctx.timeout_ms or 0) / 1000
            events = pid_first(target.edge.exec_stream(target.sandbox_id, ExecRequest(
                command="echo $$; " + command, env=env, workdir=workdir, user=target.user, max_output_bytes=0,
                timeout=min(24 * 3600.0, deadline_s + 5) if deadline_s else 24 * 3600.0)))
        try:
            first = await anext(events)
        except DSecError as exc:
            await events.aclose()
            raise rpc_error(exc) from None
        if first.event != "started" or not first.data.isdigit():
            await events.aclose()
            raise ConnectError(Code.INTERNAL, f"the process did not start: {first.error or first.event}")
        pid = int(first.data)
        streamed = None
        if not request.stdin:
            streamed = self.streamed[(target.sandbox_id, pid)] = _Streamed(config)
        yield pb.StartResponse(event=_event(pb.ProcessEvent.StartEvent(pid=pid)))
        async for event in self._follow(ctx, target, pid, events, started, streamed):
            yield pb.StartResponse(event=event)

    async def connect(self, request: pb.ConnectRequest, ctx) -> AsyncIterator[pb.ConnectResponse]:
        started = time.monotonic()
        target = self.envd.target(ctx)
        pid = await self._pid(ctx, request.process)
        if is_pty(pid):
            async for event in self.ptys.connect(target, pid, ctx.timeout_ms, started):
                yield pb.ConnectResponse(event=event)
            return
        if (streamed := self.streamed.get((target.sandbox_id, pid))) is not None:
            async for event in self._listen(ctx, pid, streamed, started):
                yield pb.ConnectResponse(event=event)
            return
        try:
            info = await target.edge.get_process(target.sandbox_id, pid)
        except DSecError as exc:
            raise rpc_error(exc) from None
        yield pb.ConnectResponse(event=_event(pb.ProcessEvent.StartEvent(pid=pid)))
        if not info.running:
            yield pb.ConnectResponse(event=_event(_end(info.exit_code or 0)))
            return
        events = target.edge.stream_process(target.sandbox_id, pid, ProcessStreamRequest(
            stdout_offset=info.stdout_bytes, stderr_offset=info.stderr_bytes))
        async for event in self._follow(ctx, target, pid, events, started):
            yield pb.ConnectResponse(event=event)

    async def _listen(self, ctx, pid: int, streamed: _Streamed, started: float) -> AsyncIterator[pb.ProcessEvent]:
        """A streamed command's events from now on, as its ``Start`` relays them."""
        queue: asyncio.Queue = asyncio.Queue()
        streamed.listeners.append(queue)
        deadline = None if not ctx.timeout_ms else started + ctx.timeout_ms / 1000
        try:
            yield _event(pb.ProcessEvent.StartEvent(pid=pid))
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    event = await asyncio.wait_for(queue.get(), left)
                except TimeoutError:
                    raise ConnectError(Code.DEADLINE_EXCEEDED, f"process {pid} still runs at the stream's timeout") from None
                if event is None:  # its stream ended without an end: it is gone with it
                    yield _event(_end(128 + signals.SIGKILL))
                    return
                yield event
                if event.event is not None and event.event.field == "end":
                    return
        finally:
            streamed.listeners.remove(queue)

    async def list(self, request: pb.ListRequest, ctx) -> pb.ListResponse:
        target = self.envd.target(ctx)
        try:
            found = await target.edge.list_processes(target.sandbox_id)
        except DSecError as exc:
            raise rpc_error(exc) from None
        streamed = [pb.ProcessInfo(config=s.config, pid=pid) for (sid, pid), s in self.streamed.items()
                    if sid == target.sandbox_id]
        return pb.ListResponse(processes=[pb.ProcessInfo(config=_config_of(p.command), pid=p.pid)
                                          for p in found if p.running] + streamed)

    def _no_stdin(self, target, pid: int) -> None:
        if (target.sandbox_id, pid) in self.streamed:
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {pid} was started without stdin=True: "
                               "it reads /dev/null (commands.run(..., stdin=True) takes input)")

    async def send_input(self, request: pb.SendInputRequest, ctx) -> pb.SendInputResponse:
        target = self.envd.target(ctx)
        pid = await self._pid(ctx, request.process)
        data = request.input.input if request.input is not None else None
        if data is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "input (stdin or pty bytes) is required")
        if is_pty(pid):  # a PTY's input is typed at its terminal, whichever field carries it
            await self.ptys.send_input(target, pid, bytes(data.value))
            return pb.SendInputResponse()
        if data.field != "stdin":
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {pid} is not a PTY: send its input as stdin")
        self._no_stdin(target, pid)
        try:
            text = bytes(data.value).decode()
        except UnicodeDecodeError:
            raise ConnectError(Code.INVALID_ARGUMENT, "stdin must be UTF-8 text for DSec's processes") from None
        try:
            await target.edge.process_stdin(target.sandbox_id, pid, text, False)
        except SandboxStateError as exc:
            raise ConnectError(Code.NOT_FOUND, exc.message) from None
        except DSecError as exc:
            raise rpc_error(exc) from None
        return pb.SendInputResponse()

    async def stream_input(self, request, ctx) -> pb.StreamInputResponse:
        self.envd.target(ctx)  # refused before reading the stream
        pid = None
        async for message in request:
            match message.event:
                case Oneof(field="start", value=start):
                    pid = await self._pid(ctx, start.process)
                case Oneof(field="data", value=data):
                    if pid is None:
                        raise ConnectError(Code.INVALID_ARGUMENT, "the input stream starts with its process")
                    await self.send_input(pb.SendInputRequest(process=pb.ProcessSelector(selector=Oneof("pid", pid)),
                                                              input=data.input), ctx)
        return pb.StreamInputResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest, ctx) -> pb.CloseStdinResponse:
        target = self.envd.target(ctx)
        pid = await self._pid(ctx, request.process)
        if is_pty(pid):
            raise ConnectError(Code.FAILED_PRECONDITION, f"PTY {pid} has a terminal, not a stdin to close: "
                               "send Ctrl-D (b'\\x04') to end its input")
        self._no_stdin(target, pid)
        try:
            await target.edge.process_stdin(target.sandbox_id, pid, "", True)
        except DSecError as exc:
            raise rpc_error(exc) from None
        return pb.CloseStdinResponse()

    async def send_signal(self, request: pb.SendSignalRequest, ctx) -> pb.SendSignalResponse:
        target = self.envd.target(ctx)
        pid = await self._pid(ctx, request.process)
        number = int(request.signal) or signals.SIGKILL
        if is_pty(pid):
            await self.ptys.kill(target, pid, number)
            return pb.SendSignalResponse()
        if (streamed := self.streamed.get((target.sandbox_id, pid))) is not None:
            streamed.signal = number
            streamed.stop.set()  # its Start closes the stream, which ends it
            try:  # answered once it is gone (reaped, too), as a kill is
                await asyncio.wait_for(streamed.ended.wait(), 10)
                await target.edge.exec(target.sandbox_id, ExecRequest(command=(
                    f"i=0; while kill -0 {pid} 2>/dev/null && [ $i -lt 200 ]; do sleep 0.01; i=$((i + 1)); done"),
                    timeout=10))
            except (TimeoutError, DSecError):
                pass
            return pb.SendSignalResponse()
        try:
            await target.edge.signal_process(target.sandbox_id, pid, number)
        except SandboxStateError as exc:  # it ended: to envd, a process that is gone
            raise ConnectError(Code.NOT_FOUND, exc.message) from None
        except DSecError as exc:
            raise rpc_error(exc) from None
        return pb.SendSignalResponse()

    async def update(self, request: pb.UpdateRequest, ctx) -> pb.UpdateResponse:
        target = self.envd.target(ctx)
        pid = await self._pid(ctx, request.process)
        if request.pty is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "update: pty (its size) is required")
        if not is_pty(pid):
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {pid} is not a PTY: only PTYs are resized")
        await self.ptys.resize(target, pid, request.pty.size)
        return pb.UpdateResponse()
