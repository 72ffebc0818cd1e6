"""The host end of the guest agent's channel (see ``native/agent.c`` for the frames).

QEMU exposes the guest's virtio-serial port as a unix socket; ``AgentChannel`` connects to it,
writes requests and matches answers to them by id, so calls can run side by side (commands run
concurrently in the guest). A long answer may come first as "part" frames, handed to the
caller's sink as they arrive, before its final frame. When the connection drops or the guest stops answering, every
pending call raises ``AgentGone``. The agent's answer to ``ping`` names the operations it has
beyond the first agent's (``features``): a VM restored from a snapshot taken before keeps the
agent it had then.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class AgentGone(Exception):
    """The agent's channel closed, or the agent did not answer in time."""


class AgentFailure(Exception):
    """The agent refused a request: ``code`` is enoent, invalid, notdir, …"""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Done:
    exit_code: int
    stdout: bytes
    stdout_total: int
    stderr: bytes
    stderr_total: int


class AgentChannel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._pending: dict[str, asyncio.Future] = {}
        # Where the "part" frames of a streamed answer go (``request(..., sink=)``).
        self._sinks: dict[str, Callable[[bytes], object]] = {}
        # Where the "sout"/"serr" frames of a streamed command (srun) go: (kind, bytes).
        self.streams: dict[str, Callable[[str, bytes], object]] = {}
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._reader_task = asyncio.create_task(self._read_loop(), name="dsec-agent-reader")
        self.closed = False
        self.reason = ""
        self.features: frozenset[str] = frozenset()

    @classmethod
    async def connect(cls, path: Path, timeout: float = 5.0) -> AgentChannel:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(path), limit=1 << 16), timeout)
        except (OSError, TimeoutError) as exc:
            raise AgentGone(f"cannot connect to the guest agent socket {path}: {exc!r}") from exc
        return cls(reader, writer)

    async def wait_ready(self, timeout: float) -> None:
        """Ping until the agent answers (it may not have opened its port yet)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise AgentGone(f"the guest agent did not answer within {timeout:g}s")
            try:
                answer = await self.request("ping", timeout=min(0.5, left))
                assert isinstance(answer, bytes)
                self.features = frozenset(answer.decode(errors="replace").split())
                return
            except AgentGone:
                if self.closed:
                    raise

    async def _read_loop(self) -> None:
        try:
            while True:
                line = await self._reader.readline()
                if not line:
                    raise AgentGone("the guest agent closed its channel")
                fields = line.decode(errors="replace").split()
                if len(fields) < 2:
                    continue  # noise (a half frame after the host reconnected)
                rid, status, nums = fields[0], fields[1], fields[2:]
                if status == "part":
                    body = await self._reader.readexactly(int(nums[0]))
                    sink = self._sinks.get(rid)
                    if sink is not None:
                        sink(body)
                    continue
                if status in ("sout", "serr"):
                    body = await self._reader.readexactly(int(nums[0]))
                    stream = self.streams.get(rid)
                    if stream is not None:
                        stream("stdout" if status == "sout" else "stderr", body)
                    continue
                if status == "ok":
                    body = await self._reader.readexactly(int(nums[0]))
                    result: object = body
                elif status == "err":
                    body = await self._reader.readexactly(int(nums[1]))
                    result = AgentFailure(nums[0], body.decode(errors="replace"))
                elif status == "done":
                    rc, out_len, out_total, err_len, err_total = (int(x) for x in nums[:5])
                    out = await self._reader.readexactly(out_len)
                    err = await self._reader.readexactly(err_len)
                    result = Done(rc, out, out_total, err, err_total)
                else:
                    continue
                self._sinks.pop(rid, None)
                self.streams.pop(rid, None)
                fut = self._pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(result)
        except (AgentGone, OSError, ValueError, IndexError, asyncio.IncompleteReadError) as exc:
            self._shut(str(exc) or type(exc).__name__)
        except asyncio.CancelledError:
            self._shut("channel closed")
            raise

    def _shut(self, reason: str) -> None:
        if not self.closed:
            self.closed, self.reason = True, reason
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(AgentGone(reason))
        self._pending.clear()
        self._sinks.clear()
        self.streams.clear()
        self._writer.close()

    def new_id(self) -> str:
        return str(next(self._ids))

    async def send(self, rid: str, header: str, *payloads: bytes) -> asyncio.Future:
        """Write one request; returns the future of its answer."""
        if self.closed:
            raise AgentGone(f"the guest agent's channel is closed: {self.reason}")
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            async with self._write_lock:
                self._writer.write(f"{rid} {header}\n".encode() + b"".join(payloads))
                await self._writer.drain()
        except OSError as exc:
            self._pending.pop(rid, None)
            self._shut(f"cannot write to the guest agent: {exc!r}")
            raise AgentGone(self.reason) from exc
        return fut

    async def post(self, header: str) -> None:
        """Write one request that has no answer (``ack``)."""
        if self.closed:
            raise AgentGone(f"the guest agent's channel is closed: {self.reason}")
        try:
            async with self._write_lock:
                self._writer.write(f"{self.new_id()} {header}\n".encode())
                await self._writer.drain()
        except OSError as exc:
            self._shut(f"cannot write to the guest agent: {exc!r}")
            raise AgentGone(self.reason) from exc

    async def request(self, header: str, *payloads: bytes, timeout: float = 30.0,
                      sink: Callable[[bytes], object] | None = None) -> object:
        """Send one request and wait for its answer; ``sink`` gets the bytes of each "part"
        frame that comes before it (a streamed answer)."""
        rid = self.new_id()
        if sink is not None:
            self._sinks[rid] = sink
        try:
            fut = await self.send(rid, header, *payloads)
        except BaseException:
            self._sinks.pop(rid, None)
            raise
        try:
            result = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            self._pending.pop(rid, None)
            self._sinks.pop(rid, None)
            raise AgentGone(f"the guest agent did not answer {header.split()[0]!r} within {timeout:g}s") from None
        if isinstance(result, AgentFailure):
            raise result
        return result

    async def close(self) -> None:
        if self._reader_task.done():
            self._shut("channel closed")
            return
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader_task
        self._shut("channel closed")
