"""A command on a terminal in a sandbox (``Sandbox.open_pty``), as the SDK sees it."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from .api_ops import api_route
from ._errors import SessionClosed
from ._process import events_of
from .protocol import ExecEvent, PtyInfo, PtyInputRequest, PtyResizeRequest, PtyStreamRequest

if TYPE_CHECKING:
    from ._client import Sandbox

_HTTP_SLACK_S = 30.0


class Pty:
    """``sh -c command`` on a terminal of the sandbox's, its controlling terminal (so Ctrl-C,
    ``b"\\x03"``, interrupts its foreground job, and full-screen programs work).

    ``async for data in pty`` yields what it writes (bytes, exactly) until it ends; then
    ``exit_code`` is set. One reader at a time (a new stream takes over from the one before);
    nothing is read from the terminal while no loop asks (the command writes at its reader's
    pace). ``write`` types, ``resize`` changes the
    size (the command gets SIGWINCH). ``close()`` kills what it started and releases the
    terminal; a second ``close()`` does nothing, and a ``write`` or ``resize`` after it raises
    ``SessionClosed``. ``async with`` closes it. The PTY lives on the sandbox's node: a restart
    of that node's edge ends it (its calls then raise ``SessionClosed``)."""

    def __init__(self, sandbox: Sandbox, info: PtyInfo) -> None:
        self._sandbox = sandbox
        self.info = info
        self.exit_code: int | None = None
        self.closed = False
        self._reader: AsyncIterator[bytes] | None = None

    @property
    def id(self) -> int:
        return self.info.id

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running" if self.exit_code is None else f"exit {self.exit_code}"
        return f"<Pty {self.id} in {self._sandbox.id} {self.info.cols}x{self.info.rows} {state}>"

    def _route(self, name: str) -> tuple[str, str]:
        return api_route(name, sandbox_id=self._sandbox.id, pty=self.id)

    def _check(self, what: str) -> None:
        if self.closed:
            raise SessionClosed(f"cannot {what}: PTY {self.id} is closed")

    async def write(self, data: bytes | str) -> None:
        """Type ``data`` at the terminal (a ``str`` as UTF-8)."""
        self._check("write to it")
        payload = data.encode() if isinstance(data, str) else bytes(data)
        await self._sandbox._client._request(*self._route("pty_input"), model=PtyInputRequest(data=payload))

    async def resize(self, cols: int, rows: int) -> None:
        self._check("resize it")
        request = PtyResizeRequest(cols=cols, rows=rows)
        await self._sandbox._client._request(*self._route("resize_pty"), model=request)
        self.info = self.info.model_copy(update={"cols": cols, "rows": rows})

    async def events(self, *, encoding: str = "utf-8") -> AsyncIterator[ExecEvent]:
        """The terminal's output as ``ExecEvent``s (``stdout`` chunks, then ``exit``): text, or
        with ``encoding="base64"`` the base64 of the exact bytes."""
        self._check("read it")
        request = PtyStreamRequest(encoding=encoding)
        client = self._sandbox._client
        client._guard(*self._route("pty_stream"))
        async for event in events_of(client._stream(*self._route("pty_stream"), request,
                                                    request.timeout + _HTTP_SLACK_S, ExecEvent)):
            if event.event == "exit" and event.result is not None:
                self.exit_code = event.result.exit_code
            yield event

    def __aiter__(self) -> Pty:
        return self

    async def __anext__(self) -> bytes:
        """The next bytes it wrote (one stream for every loop over this handle: a loop left
        early and begun again goes on where it stopped)."""
        if self._reader is None:
            self._check("read it")
            self._reader = self._bytes()
        return await anext(self._reader)

    async def _bytes(self) -> AsyncIterator[bytes]:
        async for event in self.events(encoding="base64"):
            if event.event == "stdout":
                yield base64.b64decode(event.data)

    async def aclose(self) -> None:
        """Stop reading (the PTY stays open; a later loop reads on from a new stream)."""
        if self._reader is not None:
            reader, self._reader = self._reader, None
            await reader.aclose()

    async def wait(self) -> int:
        """Read on to the end (what is written is dropped) and return the exit code."""
        async for _ in self:
            pass
        assert self.exit_code is not None
        return self.exit_code

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.aclose()
        await self._sandbox._client._request(*self._route("close_pty"))

    async def __aenter__(self) -> Pty:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
