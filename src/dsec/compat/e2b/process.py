"""envd's ``process.Process`` service on DSec's background processes (``dsec.edge.processes``).

Every command E2B starts, foreground or not, is a DSec background process (the SDK sends both
the same way; ``background`` only decides when its ``run`` returns): ``Start`` starts it and
follows its output to its end, ``Connect`` follows it from the output it has now, ``List``,
``SendInput``, ``CloseStdin`` and ``SendSignal`` are the process calls of the same name.

- A stream that ends by its deadline (``commands.run(timeout=…)``) kills its process, as envd
  does; a client that only goes away (``handle.disconnect()``) leaves it running.
- ``stdin=False`` (the SDK's default) gives the command ``/dev/null`` for its stdin.
- PTYs are not there yet: ``Start`` with a ``pty`` and ``Update`` answer ``UNIMPLEMENTED``.
"""

from __future__ import annotations

import asyncio
import shlex
import signal as signals
import time
from collections.abc import AsyncIterator

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from e2b.envd.process import process_pb as pb

from libdsec import DSecError, SandboxStateError
from libdsec.protocol import ExecEvent, ProcessStreamRequest, StartProcessRequest

from ._errors import rpc_error
from .envd import EnvdContext

PTY_UNSUPPORTED = ("PTYs are not supported by DSec's E2B API yet (docs/COMPAT.md): "
                   "use commands.run, whose output streams as it is written")
# Left to themselves, kills sent because a stream's deadline passed (a task each, held here).
_KILLS: set[asyncio.Task] = set()


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


def _event(value: pb.ProcessEvent.StartEvent | pb.ProcessEvent.DataEvent | pb.ProcessEvent.EndEvent) -> pb.ProcessEvent:
    field = {pb.ProcessEvent.StartEvent: "start", pb.ProcessEvent.DataEvent: "data", pb.ProcessEvent.EndEvent: "end"}
    return pb.ProcessEvent(event=Oneof(field[type(value)], value))


def _end(exit_code: int) -> pb.ProcessEvent.EndEvent:
    if exit_code > 128:  # the supervisor's 128 + N for a kill by signal N
        try:
            name = signals.Signals(exit_code - 128).name.removeprefix("SIG").lower()
        except ValueError:
            name = str(exit_code - 128)
        return pb.ProcessEvent.EndEvent(exit_code=exit_code, exited=False, status=f"signal: {name}")
    return pb.ProcessEvent.EndEvent(exit_code=exit_code, exited=True, status=f"exit status {exit_code}")


class ProcessService:
    """The ``process.Process`` service (its generated protocol: ``e2b.envd.process.process_connect``)."""

    def __init__(self, envd: EnvdContext) -> None:
        self.envd = envd

    async def _pid(self, ctx, selector: pb.ProcessSelector | None) -> int:
        if selector is None or selector.selector is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "process selector (pid) is required")
        if selector.selector.field != "pid":
            raise ConnectError(Code.NOT_FOUND, "no process by that tag: tags name PTYs, which DSec has not yet")
        return int(selector.selector.value)

    async def _follow(self, ctx, target, pid: int, events: AsyncIterator[ExecEvent],
                      started: float) -> AsyncIterator[pb.ProcessEvent]:
        """The process's output and end, from DSec's stream of it, as envd's events."""
        deadline_ms = ctx.timeout_ms
        deadline = None if not deadline_ms else started + deadline_ms / 1000
        ended = False
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError
                try:
                    event: ExecEvent = await asyncio.wait_for(anext(events), left)
                except StopAsyncIteration:
                    break
                if event.event in ("stdout", "stderr"):
                    data = pb.ProcessEvent.DataEvent(output=Oneof(event.event, event.data.encode()))
                    yield _event(data)
                elif event.event == "started":
                    continue
                elif event.event == "exit" and event.result is not None:
                    ended = True
                    yield _event(_end(event.result.exit_code))
                    return
                elif event.event == "error":
                    err = event.error or {}
                    raise ConnectError(Code.INTERNAL, str(err.get("message", "the process's stream failed")))
        except TimeoutError:
            self._kill_later(target, pid)
            raise ConnectError(Code.DEADLINE_EXCEEDED, f"process {pid} ran past the stream's timeout: killed") from None
        except DSecError as exc:
            raise rpc_error(exc) from None
        finally:
            await events.aclose()
            if not ended and deadline is not None and time.monotonic() >= deadline - 0.05:
                self._kill_later(target, pid)  # the client gave up at its deadline first

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
        if request.pty is not None:
            raise ConnectError(Code.UNIMPLEMENTED, PTY_UNSUPPORTED)
        config = request.process
        command = _command(config, bool(request.stdin))
        # Started and followed in one command in the sandbox (the pid first).
        events = target.edge.start_process_stream(target.sandbox_id, StartProcessRequest(
            command=command, env=dict(config.envs), workdir=config.cwd or None, user=target.user))
        try:
            first = await anext(events)
        except DSecError as exc:
            await events.aclose()
            raise rpc_error(exc) from None
        if first.event != "started" or not first.data.isdigit():
            await events.aclose()
            raise ConnectError(Code.INTERNAL, f"the process did not start: {first.error or first.event}")
        pid = int(first.data)
        yield pb.StartResponse(event=_event(pb.ProcessEvent.StartEvent(pid=pid)))
        async for event in self._follow(ctx, target, pid, events, started):
            yield pb.StartResponse(event=event)

    async def connect(self, request: pb.ConnectRequest, ctx) -> AsyncIterator[pb.ConnectResponse]:
        started = time.monotonic()
        target = self.envd.target(ctx)
        pid = await self._pid(ctx, request.process)
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

    async def list(self, request: pb.ListRequest, ctx) -> pb.ListResponse:
        target = self.envd.target(ctx)
        try:
            found = await target.edge.list_processes(target.sandbox_id)
        except DSecError as exc:
            raise rpc_error(exc) from None
        return pb.ListResponse(processes=[pb.ProcessInfo(config=_config_of(p.command), pid=p.pid)
                                          for p in found if p.running])

    async def send_input(self, request: pb.SendInputRequest, ctx) -> pb.SendInputResponse:
        target = self.envd.target(ctx)
        pid = await self._pid(ctx, request.process)
        data = request.input.input if request.input is not None else None
        if data is None or data.field != "stdin":
            raise ConnectError(Code.UNIMPLEMENTED, PTY_UNSUPPORTED)
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
        try:
            await target.edge.process_stdin(target.sandbox_id, pid, "", True)
        except DSecError as exc:
            raise rpc_error(exc) from None
        return pb.CloseStdinResponse()

    async def send_signal(self, request: pb.SendSignalRequest, ctx) -> pb.SendSignalResponse:
        target = self.envd.target(ctx)
        pid = await self._pid(ctx, request.process)
        number = int(request.signal) or signals.SIGKILL
        try:
            await target.edge.signal_process(target.sandbox_id, pid, number)
        except SandboxStateError as exc:  # it ended: to envd, a process that is gone
            raise ConnectError(Code.NOT_FOUND, exc.message) from None
        except DSecError as exc:
            raise rpc_error(exc) from None
        return pb.SendSignalResponse()

    async def update(self, request: pb.UpdateRequest, ctx) -> pb.UpdateResponse:
        self.envd.target(ctx)
        raise ConnectError(Code.UNIMPLEMENTED, PTY_UNSUPPORTED)
