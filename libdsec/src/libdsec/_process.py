"""Background processes in a sandbox (``Sandbox.start_shell``), as the SDK sees them."""

from __future__ import annotations

import inspect
import signal as _signal
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from .api_ops import api_route
from ._errors import SandboxStateError, ServerError, error_from_wire
from .protocol import (
    DEFAULT_COMMAND_TIMEOUT_S,
    ExecEvent,
    ExecRequest,
    ExecResult,
    ProcessInfo,
    ProcessSignalRequest,
    ProcessStdinRequest,
    ProcessStreamRequest,
    ProcessWaitRequest,
    SessionInfo,
)

if TYPE_CHECKING:
    from ._client import Sandbox

_HTTP_SLACK_S = 30.0


async def events_of(stream: AsyncIterator[ExecEvent]) -> AsyncIterator[ExecEvent]:
    """A server's event stream as the caller sees it: ``started`` dropped, ``error`` raised."""
    async with aclosing(stream):
        async for event in stream:
            if event.event == "error":
                raise error_from_wire({"error": event.error}, 500)
            if event.event != "started":
                yield event
            if event.event == "exit":
                return
    raise ServerError("the stream ended without its exit")


class Process:
    """A process started with ``Sandbox.start_shell`` (or found again with
    ``connect_process``). It runs on its own: in the sandbox, not in this client or a request,
    until it ends, is killed, or the sandbox stops. ``async with`` kills it on the way out
    (if it still runs); a second ``kill()`` of an ended one raises ``SandboxStateError``."""

    def __init__(self, sandbox: Sandbox, info: ProcessInfo, *, stdout_offset: int = 0, stderr_offset: int = 0) -> None:
        self._sandbox = sandbox
        self.info = info
        self._offsets = [stdout_offset, stderr_offset]

    @property
    def pid(self) -> int:
        return self.info.pid

    def __repr__(self) -> str:
        return f"<Process {self.pid} in {self._sandbox.id} {'running' if self.info.running else self.info.exit_code}>"

    def _route(self, name: str) -> tuple[str, str]:
        return api_route(name, sandbox_id=self._sandbox.id, pid=self.pid)

    async def stream(self, *, timeout: float = 24 * 3600.0) -> AsyncIterator[ExecEvent]:
        """Its output from where this handle last read (the start, for ``start_shell``; the
        moment of ``connect_process`` for one found again) until it ends, then ``exit`` (with
        ``event.result.exit_code``). Leaving the loop early leaves the process running."""
        request = ProcessStreamRequest(stdout_offset=self._offsets[0], stderr_offset=self._offsets[1], timeout=timeout)
        client = self._sandbox._client
        client._guard(*self._route("stream_process"))
        async for event in events_of(client._stream(*self._route("stream_process"), request,
                                                    timeout + _HTTP_SLACK_S, ExecEvent)):
            if event.event in ("stdout", "stderr"):
                self._offsets[event.event == "stderr"] += len(event.data.encode())
            elif event.event == "exit" and event.result is not None:
                self.info = self.info.model_copy(update={"running": False, "exit_code": event.result.exit_code})
            yield event

    async def send_stdin(self, data: str | bytes) -> None:
        """Write to its stdin (blocks while its stdin's pipe is full: it reads at its pace)."""
        text = data.decode() if isinstance(data, bytes) else data
        await self._stdin(ProcessStdinRequest(data=text))

    async def close_stdin(self) -> None:
        """Close its stdin: it reads end of file."""
        await self._stdin(ProcessStdinRequest(close=True))

    async def _stdin(self, request: ProcessStdinRequest) -> None:
        await self._sandbox._client._request(*self._route("process_stdin"), model=request,
                                             timeout=DEFAULT_COMMAND_TIMEOUT_S + _HTTP_SLACK_S)

    async def signal(self, sig: int) -> None:
        """Send ``sig`` to it and its process group (``signal.SIGINT`` as Ctrl-C would)."""
        await self._sandbox._client._request(*self._route("signal_process"), model=ProcessSignalRequest(signal=int(sig)))

    async def kill(self) -> None:
        await self.signal(_signal.SIGKILL)

    async def wait(self, *, timeout: float = DEFAULT_COMMAND_TIMEOUT_S) -> ProcessInfo:
        """Its info once it ended (``exit_code``); ``CommandTimeout`` if it still runs after
        ``timeout`` (it goes on running)."""
        body = await self._sandbox._client._request(*self._route("wait_process"), model=ProcessWaitRequest(timeout=timeout),
                                                    timeout=timeout + _HTTP_SLACK_S)
        self.info = ProcessInfo.model_validate(body)
        return self.info

    async def refresh(self) -> ProcessInfo:
        self.info = ProcessInfo.model_validate(await self._sandbox._client._request(*self._route("get_process")))
        return self.info

    async def __aenter__(self) -> Process:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.kill()
        except SandboxStateError:
            pass  # ended already


class Session:
    """A shell in the sandbox whose state persists between commands (``Sandbox.open_session``):
    ``cd``, ``export``, ``source env/bin/activate`` hold for the next ``run_shell``. Commands
    run one at a time. A command past its timeout is interrupted as Ctrl-C would (SIGINT to
    it; if it ignores that, its processes are killed) and ``CommandTimeout`` is raised; the
    session goes on. Once its shell ended (``exit``, closed, idle past its ``idle_timeout``)
    every call raises ``SessionClosed``. ``async with`` closes it; ``close()`` twice is fine."""

    def __init__(self, sandbox: Sandbox, info: SessionInfo) -> None:
        self._sandbox = sandbox
        self.info = info

    @property
    def id(self) -> int:
        return self.info.id

    def __repr__(self) -> str:
        return f"<Session {self.id} in {self._sandbox.id}>"

    def _route(self, name: str) -> tuple[str, str]:
        return api_route(name, sandbox_id=self._sandbox.id, session=self.id)

    async def run_shell(
        self,
        command: str,
        *,
        timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        max_output_bytes: int | None = None,
        on_stdout: Callable[[str], Any] | None = None,
        on_stderr: Callable[[str], Any] | None = None,
    ) -> ExecResult:
        """Run ``command`` in the session's shell: exit code, stdout and stderr of that command
        alone, as ``Sandbox.run_shell`` gives them (and its callbacks, streamed)."""
        request = ExecRequest(command=command, timeout=timeout,
                              **({"max_output_bytes": max_output_bytes} if max_output_bytes is not None else {}))
        client = self._sandbox._client
        if on_stdout is None and on_stderr is None:
            body = await client._request(*self._route("session_exec"), model=request, timeout=timeout + _HTTP_SLACK_S)
            return ExecResult.model_validate(body)
        client._guard(*self._route("session_exec_stream"))
        return await run_with_callbacks(
            events_of(client._stream(*self._route("session_exec_stream"), request, timeout + _HTTP_SLACK_S, ExecEvent)),
            on_stdout, on_stderr)

    async def interrupt(self) -> None:
        """Ctrl-C: SIGINT to the command that runs (the shell reads on)."""
        await self._sandbox._client._request(*self._route("interrupt_session"))

    async def close(self) -> None:
        await self._sandbox._client._request(*self._route("close_session"))

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def run_with_callbacks(events: AsyncIterator[ExecEvent], on_stdout: Callable[[str], Any] | None,
                             on_stderr: Callable[[str], Any] | None) -> ExecResult:
    """Hand each chunk to its callback (plain or async) and return the exit's result."""
    callbacks = {"stdout": on_stdout, "stderr": on_stderr}
    async with aclosing(events):
        async for event in events:
            if event.event == "exit" and event.result is not None:
                return event.result
            if (callback := callbacks.get(event.event)) is not None:
                done = callback(event.data)
                if inspect.isawaitable(done):
                    await done
    raise ServerError("the command's stream ended without its exit")
