"""Streamed commands on a node: a backend's ``exec_stream`` turned into ``ExecEvent``s.

``stream_exec(start)`` runs ``start(emit)`` (the backend call) in a task of its own and yields
``started``, then the output as text chunks (UTF-8 decoded across chunk boundaries, invalid
bytes replaced), then ``exit`` with the result or ``error`` with a wire error. One event waits
here at most: ``emit`` returns only once the consumer took the previous one, so the command
runs at its reader's pace and the node holds no more of its output than one chunk. A consumer
that stops early (closes the iterator: its client went away) cancels the call, and the backend
kills the command.

On the wire (apiserver ↔ SDK, node ↔ apiserver) the events are NDJSON lines of a chunked
HTTP/1.1 answer: the framing the batch create already uses, readable by any HTTP client line by
line, carried by plain proxies, and TCP's own flow control is the backpressure (a server writes
the next line only after the transport drained the last). Output only flows one way here, so
WebSocket's two-way framing would buy nothing for it.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from libdsec import DSecError
from libdsec.protocol import ExecEvent, ExecResult

from ..backends.base import Emit

TERMINAL = ("exit", "error")


def error_event(exc: BaseException) -> ExecEvent:
    if isinstance(exc, DSecError):
        return ExecEvent(event="error", error=exc.to_wire()["error"])
    return ExecEvent(event="error", error={"code": "internal", "message": f"{type(exc).__name__}: {exc}"})


async def stream_exec(start: Callable[[Emit], Awaitable[ExecResult]]) -> AsyncIterator[ExecEvent]:
    events: asyncio.Queue[ExecEvent] = asyncio.Queue(maxsize=1)
    decoders = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in ("stdout", "stderr")}

    async def emit(kind: str, data: bytes) -> None:
        text = decoders[kind].decode(data)
        if text:
            await events.put(ExecEvent(event=kind, data=text))

    async def run() -> None:
        try:
            result = await start(emit)
        except Exception as exc:  # noqa: BLE001 - every failure reaches the consumer as an event
            await events.put(error_event(exc))
            return
        for kind, decoder in decoders.items():
            if tail := decoder.decode(b"", final=True):
                await events.put(ExecEvent(event=kind, data=tail))
        await events.put(ExecEvent(event="exit", result=result))

    task = asyncio.create_task(run())
    try:
        yield ExecEvent(event="started")
        while True:
            event = await events.get()
            yield event
            if event.event in TERMINAL:
                return
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def stream_bytes(start: Callable[[Emit], Awaitable[ExecResult]],
                       check: Callable[[ExecResult], object]) -> AsyncIterator[bytes]:
    """A streamed command's stdout as bytes (its stderr is only kept in the result), one chunk
    waiting here at most; at the end ``check(result)`` may raise (the consumer's stream breaks
    off: there is no trailer to carry an exit code). Leaving early kills the command."""
    chunks: asyncio.Queue[bytes | ExecResult | BaseException] = asyncio.Queue(maxsize=1)

    async def emit(kind: str, data: bytes) -> None:
        if kind == "stdout":
            await chunks.put(data)

    async def run() -> None:
        try:
            await chunks.put(await start(emit))
        except Exception as exc:  # noqa: BLE001 - reaches the consumer
            await chunks.put(exc)

    task = asyncio.create_task(run())
    try:
        while True:
            item = await chunks.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, ExecResult):
                check(item)
                return
            yield item
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
