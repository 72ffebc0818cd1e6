"""A small asyncio client for the QEMU Machine Protocol over a unix socket.

    client = await QMP.connect(path, timeout=5)   # greeting + qmp_capabilities
    await client.execute("stop")                 # returns the "return" value
    await client.wait_event("MIGRATION", lambda e: …, timeout=…)
    await client.close()                         # a second close does nothing

One command at a time (a lock serialises them); events are kept in a short queue for
``wait_event``. A QEMU that goes away makes every pending and later call raise ``QMPError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any


class QMPError(Exception):
    """QEMU answered with an error, or the monitor connection is gone."""


class QMP:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._lock = asyncio.Lock()
        self._events: deque[dict] = deque(maxlen=256)
        self._closed = False

    @classmethod
    async def connect(cls, path: Path | str, timeout: float = 5.0) -> QMP:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(path), limit=1 << 20), timeout)
        except (OSError, TimeoutError) as exc:
            raise QMPError(f"cannot connect to QMP at {path}: {exc!r}") from exc
        client = cls(reader, writer)
        try:
            greeting = await asyncio.wait_for(client._read(), timeout)
            if "QMP" not in greeting:
                raise QMPError(f"not a QMP greeting: {greeting!r}")
            await client.execute("qmp_capabilities", timeout=timeout)
        except BaseException:
            await client.close()
            raise
        return client

    async def _read(self) -> dict:
        line = await self._reader.readline()
        if not line:
            raise QMPError("QEMU closed the monitor connection")
        try:
            return json.loads(line)
        except ValueError as exc:
            raise QMPError(f"bad QMP message {line[:200]!r}") from exc

    async def execute(self, command: str, arguments: dict | None = None, timeout: float = 30.0) -> Any:
        if self._closed:
            raise QMPError("QMP connection is closed")
        async with self._lock:
            msg: dict = {"execute": command}
            if arguments:
                msg["arguments"] = arguments
            try:
                self._writer.write(json.dumps(msg).encode() + b"\n")
                await self._writer.drain()
                async with asyncio.timeout(timeout):
                    while True:
                        reply = await self._read()
                        if "event" in reply:
                            self._events.append(reply)
                            continue
                        if "error" in reply:
                            err = reply["error"]
                            raise QMPError(f"{command}: {err.get('desc', err)}")
                        return reply.get("return")
            except (OSError, TimeoutError) as exc:
                raise QMPError(f"{command}: {exc!r}") from exc

    async def wait_event(self, name: str, match: Callable[[dict], bool] = lambda e: True,
                         timeout: float = 30.0) -> dict:
        """The first event ``name`` (already queued or still to come) that ``match`` accepts."""
        async with self._lock:
            for event in list(self._events):
                self._events.remove(event)
                if event.get("event") == name and match(event):
                    return event
            try:
                async with asyncio.timeout(timeout):
                    while True:
                        event = await self._read()
                        if event.get("event") == name and match(event):
                            return event
            except TimeoutError:
                raise QMPError(f"no {name} event within {timeout:g}s") from None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
