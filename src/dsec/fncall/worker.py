"""One FnCall worker: a locked-down container with the zygote running in it, driven over the
pipes of the ``crun exec`` that started the zygote (see ``zygote.py`` for the wire protocol).

Lifecycle: ``await Worker.start(…)`` returns once the zygote has said it is ready (or raises
``WorkerFailed`` having removed the container). ``submit`` sends one request (one at a time: the
worker must be free) and returns at once; the worker's reader task reads the answer, calls
``on_done(worker)`` — in the same turn of the event loop, so the pool can send the next request
before anything else runs — and then resolves the call's future. A caller that stops waiting
(cancels that future) does not disturb the worker. A worker whose zygote dies, breaks the
protocol or does not answer by the call's deadline fails its call with ``WorkerFailed`` and is
then useless: the pool ``close()``s it (idempotent: kills the container and reaps the
``crun exec``) and starts another.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import struct
import sys
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..backends.base import Handle, SandboxSpec
from ..images.store import Image
from ..resources import cgroups
from ..resources.cgroups import Limits
from .backend import WORKDIR, FnCallBackend, set_memory_limit

log = logging.getLogger("dsec.fncall")

LANGUAGES = ("python", "bash")
_REQUEST = struct.Struct("!II")
_HEADER = struct.Struct("!dQIQQQ")
_FRAME = struct.Struct("!cI")
_RESULT = struct.Struct("!i?ddQQQQH")
_FETCHED = struct.Struct("!HqH")
_BODY = struct.Struct("!BIIiI")
_FILE = struct.Struct("!HI")
_U16 = struct.Struct("!H")
_MAX_PAYLOAD = 1 << 20
_STDERR_KEPT = 4096


class WorkerFailed(Exception):
    """The worker is broken (dead, hung or speaking nonsense) and must be replaced.
    ``started`` is False when the call never reached it (it may safely go to another)."""

    def __init__(self, message: str, started: bool = True) -> None:
        super().__init__(message)
        self.started = started


@dataclass(frozen=True)
class CallLimits:
    """What the zygote enforces on one call."""

    timeout_s: float
    memory_bytes: int
    max_output: int
    max_fetch: int
    max_fetch_total: int


@dataclass
class Answer:
    exit_code: int
    timed_out: bool
    duration_s: float
    cpu_s: float
    stdout: bytes
    stderr: bytes
    stdout_bytes: int
    stderr_bytes: int
    files: dict[str, bytes] = field(default_factory=dict)
    file_errors: dict[str, str] = field(default_factory=dict)
    memory_exceeded: bool = False
    worker_s: float = 0.0


@dataclass
class _Sent:
    """The call a worker is running: sent, its answer not read yet."""

    future: asyncio.Future
    limits: CallLimits
    fetch: list[str]
    wait_s: float  # the call's timeout plus the grace: its answer must have come by then
    deadline: float  # the same, in loop time


def _unread_bytes(fd: int) -> int:
    """Bytes written to a pipe and not read yet (FIONREAD works on either end)."""
    buf = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return int.from_bytes(buf, sys.byteorder)


def call_env(image: Image) -> dict[str, str]:
    """The environment a call starts with (the zygote's own): the image's, with HOME and TMPDIR
    pointing at the call's writable places. A call's ``env`` is sent as additions to it."""
    env = {**image.env, "HOME": WORKDIR, "TMPDIR": "/tmp"}
    env.setdefault("LANG", "C.UTF-8")
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    return env


def encode_request(language: str, code: str, env: dict[str, str], stdin: bytes | None,
                   files: list[tuple[str, bytes]], fetch: list[str], limits: CallLimits) -> bytes:
    """One request frame (header for the zygote, body for the call's child)."""
    code_b = code.encode("utf-8", "surrogatepass")
    env_b = b"".join(f"{k}={v}\0".encode("utf-8", "surrogateescape") for k, v in env.items())
    body = [_BODY.pack(LANGUAGES.index(language), len(code_b), len(env_b), -1 if stdin is None else len(stdin),
                       len(files)), code_b, env_b, stdin or b""]
    for path, data in files:
        p = path.encode()
        body += [_FILE.pack(len(p), len(data)), p, data]
    header = [_HEADER.pack(limits.timeout_s, limits.memory_bytes, int(limits.timeout_s) + 1, limits.max_output,
                           limits.max_fetch, limits.max_fetch_total), _U16.pack(len(fetch))]
    for path in fetch:
        p = path.encode()
        header += [_U16.pack(len(p)), p]
    head, tail = b"".join(header), b"".join(body)
    return _REQUEST.pack(len(head), len(tail)) + head + tail


class Worker:
    def __init__(self, backend: FnCallBackend, handle: Handle, uid: int, image: Image, proc) -> None:
        self.backend = backend
        self.handle = handle
        self.uid = uid
        self.image = image
        self.proc: asyncio.subprocess.Process = proc
        self.memory_limit: int | None = None  # bytes, as last written to the cgroup
        self.busy_since: float | None = None
        self.idle_since = time.monotonic()
        self.calls = 0
        self.failed: str | None = None
        self.python = ""
        self.loop = ""  # the zygote's per-call loop: "native" (C) or "python"
        self.code_on_huge_pages = 0  # bytes of the interpreter's code the zygote moved onto huge pages
        self.oom_kills = 0
        self.cpu_sample: tuple[int, float, float | None] | None = None  # (call number, time, CPU s)
        self.on_done: Callable[[Worker], None] | None = None
        self._sent: _Sent | None = None
        self._wakeup: asyncio.Future | None = None  # the reader waits on it while no call is out
        self._stderr = bytearray()
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        # Our own handle on the request pipe: it outlives the transport, which closes when the
        # zygote's end does, and tells (FIONREAD) whether a request was read.
        pipe = proc.stdin.transport.get_extra_info("pipe")
        self._stdin_fd = os.dup(pipe.fileno()) if pipe is not None else -1

    @property
    def cid(self) -> str:
        return self.handle.cid

    @property
    def alive(self) -> bool:
        return self.failed is None and not self._closed and self.proc.returncode is None

    @property
    def busy(self) -> bool:
        return self._sent is not None

    def __repr__(self) -> str:
        return f"<Worker {self.cid} uid={self.uid} calls={self.calls}{' failed' if self.failed else ''}>"

    @classmethod
    async def start(cls, backend: FnCallBackend, cid: str, image: Image, uid: int, limits: Limits, *,
                    nproc: int, fsize: int, nofile: int, preload: tuple[str, ...], timeout_s: float) -> Worker:
        spec = SandboxSpec(image=image.name, layers=image.layers, env=dict(image.env), limits=limits,
                           hostname="fncall")
        try:
            handle = await backend.create(cid, spec)
        except Exception as exc:  # noqa: BLE001 - any failure to start is the same to the pool
            raise WorkerFailed(f"cannot create the worker container: {exc}", started=False) from exc
        try:
            proc = await asyncio.create_subprocess_exec(
                *backend.zygote_argv(cid, uid, uid, call_env(image), preload, nproc, fsize, nofile),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )
        except BaseException:
            await backend.destroy(handle)
            raise
        worker = cls(backend, handle, uid, image, proc)
        worker.memory_limit = limits.memory_bytes
        worker._tasks.append(asyncio.create_task(worker._log_stderr(), name=f"fncall-stderr-{cid}"))
        try:
            async with asyncio.timeout(timeout_s):
                kind, payload = await worker._frame()
            if kind != b"R":
                raise WorkerFailed(f"zygote said {kind!r} instead of ready")
            version, _, rest = payload.decode(errors="replace").partition("\0")
            missing, _, rest = rest.partition("\0")
            worker.loop, _, huge = rest.partition("\0")
            worker.code_on_huge_pages = int(huge or 0)
            worker.python = version
            if missing:
                log.warning("fncall worker %s: cannot preload %s", cid, missing)
            worker._tasks.append(asyncio.create_task(worker._read_answers(), name=f"fncall-answers-{cid}"))
        except BaseException as exc:
            detail = await worker._stderr_tail()
            await worker.close()
            if isinstance(exc, (WorkerFailed, TimeoutError, asyncio.IncompleteReadError, ConnectionError)):
                why = "did not get ready in time" if isinstance(exc, TimeoutError) else str(exc) or "exited"
                raise WorkerFailed(f"the zygote {why}" + (f": {detail}" if detail else ""), started=False) from None
            raise
        return worker

    async def _log_stderr(self) -> None:
        with contextlib.suppress(Exception):
            while line := await self.proc.stderr.readline():
                self._stderr += line
                del self._stderr[:-_STDERR_KEPT]
                log.warning("fncall worker %s: %s", self.cid, line.decode(errors="replace").rstrip())

    async def _stderr_tail(self) -> str:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1):
                await asyncio.shield(self._tasks[0])
        return self._stderr.decode(errors="replace").strip()[-800:]

    async def _frame(self) -> tuple[bytes, bytes]:
        kind, n = _FRAME.unpack(await self.proc.stdout.readexactly(_FRAME.size))
        if n > _MAX_PAYLOAD:
            raise WorkerFailed(f"answer of {n} bytes")
        return kind, await self.proc.stdout.readexactly(n)

    async def set_memory_limit(self, limit: int) -> None:
        """Set the worker's cgroup memory limit (the call's limit plus the zygote's share).

        Raising is a file write. Lowering makes the kernel reclaim down to it, which can take a
        while (so it runs in a thread) or fail while the last call's files are still being
        wiped (EBUSY): the higher limit then stays for this call, whose processes are each held
        to the call's own limit by RLIMIT_AS anyway."""
        if limit == self.memory_limit:
            return
        try:
            if self.memory_limit is not None and limit < self.memory_limit:
                await asyncio.to_thread(set_memory_limit, self.backend.cgroup_parent, self.cid, limit)
            else:
                set_memory_limit(self.backend.cgroup_parent, self.cid, limit)
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                log.debug("fncall worker %s: memory limit stays at %s: %s", self.cid, self.memory_limit, exc)
                return
            raise WorkerFailed(f"cannot set the memory limit: {exc}", started=False) from exc
        self.memory_limit = limit

    def submit(self, frame: bytes, limits: CallLimits, fetch: list[str], grace_s: float,
               future: asyncio.Future) -> None:
        """Send one request; ``future`` gets its ``Answer`` or ``WorkerFailed``. The worker must
        be free (not ``busy``). The zygote enforces the call's timeout; if no answer comes
        within the timeout plus ``grace_s`` the worker is taken for hung. Raises
        ``WorkerFailed`` (not started) if the request cannot be sent."""
        if not self.alive:
            raise WorkerFailed(self.failed or "the zygote is gone", started=False)
        if self._sent is not None:
            raise RuntimeError(f"{self!r} is busy")
        sent_at = time.monotonic()  # before the write: the zygote may start the call before it returns
        try:
            self.proc.stdin.write(frame)
            if self.proc.stdin.transport.is_closing():  # the write hit EPIPE: nobody reads
                raise ConnectionResetError("the pipe has no reader")
        except (ConnectionError, RuntimeError) as exc:
            self.failed = f"the zygote's channel is closed: {exc}"
            raise WorkerFailed(self.failed, started=False) from None
        self.calls += 1
        self.busy_since = sent_at
        loop = asyncio.get_running_loop()
        wait_s = limits.timeout_s + grace_s
        self._sent = _Sent(future, limits, fetch, wait_s, loop.time() + wait_s)
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def call(self, frame: bytes, limits: CallLimits, fetch: list[str], grace_s: float) -> Answer:
        """``submit`` and wait for the answer."""
        future = asyncio.get_running_loop().create_future()
        self.submit(frame, limits, fetch, grace_s, future)
        return await future

    async def _read_answers(self) -> None:
        """Read the answer of each call sent, until the worker fails or is closed."""
        loop = asyncio.get_running_loop()
        while True:
            sent = self._sent
            if sent is None:
                self._wakeup = loop.create_future()
                try:
                    await self._wakeup
                finally:
                    self._wakeup = None
                continue
            try:
                async with asyncio.timeout_at(sent.deadline):
                    answer = await self._answer(sent.limits, sent.fetch)
            except TimeoutError:
                self._fail(f"no answer {sent.wait_s:g}s after the call was sent", started=True)
                return
            except (asyncio.IncompleteReadError, ConnectionError):
                self._fail("the zygote exited" + (f": {self._stderr.decode(errors='replace').strip()[-300:]}"
                                                  if self._stderr else ""),
                           # Dead before it read the request (still in the pipe): never started.
                           started=not self._request_unread())
                return
            except WorkerFailed as exc:
                self._fail(str(exc), started=exc.started)
                return
            except asyncio.CancelledError:
                self._fail("the worker was closed", started=not self._request_unread())
                raise
            except Exception as exc:  # noqa: BLE001 - an answer that cannot be parsed: a broken zygote
                self._fail(f"unreadable answer: {exc!r}", started=True)
                return
            now = time.monotonic()
            answer.worker_s = now - self.busy_since
            if answer.exit_code == -9 and not answer.timed_out:
                # SIGKILL that was not ours: the kernel's, for memory, if the cgroup counted a kill.
                kills = cgroups.oom_kills(self.backend.cgroup_parent, self.cid) or 0
                answer.memory_exceeded, self.oom_kills = kills > self.oom_kills, kills
            self._sent = None
            self.busy_since = None
            self.idle_since = now
            self._tell_pool()  # which may send the next call at once
            if not sent.future.done():  # its caller may have gone away
                sent.future.set_result(answer)

    def _tell_pool(self) -> None:
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:  # noqa: BLE001 - the call's own answer must still reach its caller
                log.exception("fncall worker %s: after a call", self.cid)

    def _fail(self, message: str, started: bool) -> None:
        """The worker is broken: fail the call under way, tell the pool."""
        if self.failed is None:
            self.failed = message
        sent, self._sent = self._sent, None
        self.busy_since = None
        self._tell_pool()
        if sent is not None and not sent.future.done():
            sent.future.set_exception(WorkerFailed(message, started=started))

    def _request_unread(self) -> bool:
        """The zygote did not read the request: its bytes are still in the pipe."""
        try:
            return self._stdin_fd >= 0 and _unread_bytes(self._stdin_fd) > 0
        except OSError:
            return False

    async def _answer(self, limits: CallLimits, fetch: list[str]) -> Answer:
        """Read and check one answer; a zygote is not trusted to keep within the limits."""
        kind, payload = await self._frame()
        if kind == b"E":
            raise WorkerFailed(f"the zygote could not start the call: {payload.decode(errors='replace')}")
        if kind != b"A" or len(payload) < _RESULT.size:
            raise WorkerFailed(f"unexpected answer {kind!r}")
        (exit_code, timed_out, duration, cpu, out_sent, err_sent, out_total, err_total,
         nfiles) = _RESULT.unpack_from(payload)
        if out_sent > min(out_total, limits.max_output) or err_sent > min(err_total, limits.max_output):
            raise WorkerFailed("answer over the output limit")
        pos, entries, budget = _RESULT.size, [], limits.max_fetch_total
        for _ in range(nfiles):
            path_len, size, reason_len = _FETCHED.unpack_from(payload, pos)
            pos += _FETCHED.size
            path = payload[pos:pos + path_len].decode(errors="replace")
            pos += path_len
            reason = payload[pos:pos + reason_len].decode(errors="replace")
            pos += reason_len
            if path not in fetch or size > limits.max_fetch or size > budget:
                raise WorkerFailed("answer with a file that was not asked for, or too big")
            budget -= max(size, 0)
            entries.append((path, size, reason))
        read = self.proc.stdout.readexactly
        answer = Answer(exit_code=exit_code, timed_out=timed_out, duration_s=duration, cpu_s=cpu,
                        stdout=await read(out_sent) if out_sent else b"",
                        stderr=await read(err_sent) if err_sent else b"",
                        stdout_bytes=out_total, stderr_bytes=err_total)
        for path, size, reason in entries:
            if size >= 0:
                answer.files[path] = await read(size) if size else b""
            else:
                answer.file_errors[path] = reason
        return answer

    async def close(self) -> None:
        """Kill the container (and with it the zygote) and reap the ``crun exec``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
        if self._stdin_fd >= 0:
            os.close(self._stdin_fd)
            self._stdin_fd = -1
        try:
            await self.backend.destroy(self.handle)
        except Exception as exc:  # noqa: BLE001
            log.warning("fncall worker %s: destroy failed: %s", self.cid, exc)
        if self.proc.returncode is None:
            try:
                async with asyncio.timeout(10):
                    await self.proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
