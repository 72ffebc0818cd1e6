"""The FnCall pool of a node: warm workers per image, calls dispatched to them one at a time.

    call ─▶ check args ─▶ free worker of the image, or the queue ─▶ worker.submit ─▶ FnCallResult
                              ▲          (a worker that answers takes the      │ WorkerFailed
                              │           next queued call at once)            │
                              └── manager: start / retire ◀────────────────────┘ (worker replaced)

- Size: each image in use keeps ``workers_min`` workers (default one per core). Short calls
  just queue for the warm workers: more workers would only share the cores (measured here: two
  workers on two cores answer in half the time of four, at the same throughput). The pool grows
  (up to ``workers_max`` for the node) when calls queue behind calls that wait rather than
  compute (busy for over ``slow_call_s`` while their worker's cgroup used under ``blocked_cpu``
  of a core: sleep, I/O), one worker per such call, and by one worker a tick while the oldest
  queued call has waited over ``queue_grow_s`` whatever the reason. Workers idle for ``idle_s``
  above the minimum are retired; an image with no call for ``image_idle_s`` keeps none
  (``prewarm`` images always keep the minimum).
- A call whose caller goes away (cancelled) still finishes in its worker, which stays warm; one
  still queued is dropped.
- Dispatch costs the event loop as little as it can: a worker's answer is read by its reader
  task, which hands the worker the next queued call in the same turn (a worker waits for the
  node only that long between calls), and a call is a future, not a task.
- Failure: a worker that dies, hangs (no answer by the call's timeout plus ``answer_grace_s``)
  or breaks the protocol is destroyed and replaced in the background; its call gets a
  ``BackendError`` — unless the call never reached it, then it goes to another worker. If an
  image cannot start workers at all (no python3 in it, say), its waiting calls get that error.
- Lifecycle: ``start()`` (after the edge has removed the remains of an earlier run), calls,
  ``close()``: waiting calls fail with ``SandboxStateError``, every worker is destroyed; a second
  ``close()`` does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import posixpath
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

from libdsec import BackendError, DSecError, InvalidRequest, LimitOutOfRange, SandboxStateError
from libdsec.protocol import (
    DEFAULT_FNCALL_MEMORY_MB,
    MAX_OUTPUT_BYTES_LIMIT,
    DSecFnCallArgs,
    ErrorBody,
    FnCallResult,
)

from ..images.store import Image, LayerStore
from ..resources.cgroups import Limits
from .backend import WORKDIR, FnCallBackend, cpu_usage_s
from .worker import LANGUAGES, Answer, CallLimits, Worker, WorkerFailed, call_env, encode_request

log = logging.getLogger("dsec.fncall")

MIN_MEMORY_MB = 16
MAX_PATH_BYTES = 1024
MAX_FILES = 1000
_IMAGE_CACHE_S = 1.0


@dataclass
class FnCallConfig:
    workers_min: int = 0  # per image in use; 0: one per CPU core
    workers_max: int = 64  # all images together
    start_concurrency: int = 2
    idle_s: float = 60.0
    image_idle_s: float = 600.0
    prewarm: tuple[str, ...] = ("python",)
    slow_call_s: float = 0.05
    blocked_cpu: float = 0.3
    queue_grow_s: float = 1.0
    max_timeout_s: float = 600.0
    max_memory_mb: int = 4096
    # The worker's pids limit (cgroup) and the call's (RLIMIT_NPROC for the call's uid).
    worker_pids: int = 128
    call_nproc: int = 64
    call_nofile: int = 1024
    max_file_bytes: int = 64 << 20  # RLIMIT_FSIZE: any one file a call writes, stdout included
    max_input_bytes: int = 64 << 20  # code, stdin and files of one call
    max_fetch_bytes: int = 64 << 20  # all fetched files of one call
    tmpfs_mb: int = 256  # /work and /tmp each
    memory_overhead_mb: int = 64  # the zygote's share of the worker's memory limit
    cpu_cores: float = 1.0  # per worker
    preload: tuple[str, ...] = ()
    uid_base: int = 40000
    uid_count: int = 20000
    start_timeout_s: float = 60.0
    answer_grace_s: float = 5.0
    failure_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.workers_min <= 0:
            self.workers_min = os.cpu_count() or 1
        self.prewarm = tuple(self.prewarm)
        self.preload = tuple(self.preload)


@dataclass
class _Prepared:
    """A checked call, encoded for the zygote."""

    image: str
    frame: bytes
    limits: CallLimits
    fetch: list[str]
    memory_mb: int


@dataclass
class _Queued:
    """A call waiting for a worker of its image, or running in one (``worker`` set)."""

    prepared: _Prepared
    future: asyncio.Future  # its Answer, or WorkerFailed / the error that kept it from running
    queued_at: float
    sent_at: float = 0.0
    worker: Worker | None = None


@dataclass
class _ImagePool:
    image: Image
    idle: list[Worker] = field(default_factory=list)
    busy: set[Worker] = field(default_factory=set)
    waiters: deque[_Queued] = field(default_factory=deque)
    starting: int = 0
    last_used: float = field(default_factory=time.monotonic)
    last_error: str | None = None
    failed_at: float = 0.0
    failures: int = 0  # worker starts that failed in a row

    @property
    def size(self) -> int:
        return len(self.idle) + len(self.busy) + self.starting


class FnCallPool:
    """See the module docstring."""

    def __init__(self, backend: FnCallBackend, store: LayerStore, config: FnCallConfig | None = None) -> None:
        self.backend = backend
        self.store = store
        self.config = config or FnCallConfig()
        self._pools: dict[tuple[str, ...], _ImagePool] = {}
        self._images: dict[str, tuple[float, Image]] = {}
        self._limits: dict[tuple[float, int, int], CallLimits] = {}
        self._uids: set[int] = set()
        self._wakeup = asyncio.Event()
        self._start_sem = asyncio.Semaphore(self.config.start_concurrency)
        self._tasks: set[asyncio.Task] = set()
        self._discarded: set[Worker] = set()  # being closed
        self._manager: asyncio.Task | None = None
        self._closed = False
        self.stats = {"calls": 0, "workers_started": 0, "workers_replaced": 0, "workers_retired": 0}

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        for name in self.config.prewarm:
            try:
                self._pool_of(self._image(name))
            except DSecError:
                log.info("fncall: no image %r to prewarm", name)
        self._manager = asyncio.create_task(self._manage(), name="dsec-fncall-pool")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._manager is not None:
            self._manager.cancel()
            await asyncio.gather(self._manager, return_exceptions=True)
        workers = []
        for pool in self._pools.values():
            while pool.waiters:
                fut = pool.waiters.popleft().future
                if not fut.done():
                    fut.set_exception(SandboxStateError("the node is shutting down"))
            workers += [*pool.idle, *pool.busy]
            pool.idle.clear()
        # Calls under way fail as their workers go; starts under way see _closed and close
        # what they made.
        await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self._pools.clear()

    def workers(self) -> list[Worker]:
        return [w for pool in self._pools.values() for w in (*pool.idle, *pool.busy)]

    # -- calls -----------------------------------------------------------------------------

    async def call(self, args: DSecFnCallArgs) -> FnCallResult:
        """Run one call; a call that cannot run raises (``InvalidRequest``, ``BackendError``…)."""
        if self._closed:
            raise SandboxStateError("the node is shutting down")
        prepared = self._prepare(args)
        started = time.monotonic()
        for attempt in range(2):
            queued = self._enqueue(self._pool_of(self._image(prepared.image)), prepared)
            # If this caller is cancelled, so is the future: a queued call is then dropped, and
            # one under way finishes in its worker, which stays warm.
            try:
                answer: Answer = await queued.future
            except WorkerFailed as exc:
                if not exc.started and attempt == 0:
                    continue
                cid = queued.worker.cid if queued.worker is not None else "?"
                raise BackendError(f"fncall worker {cid} failed during the call: {exc}") from None
            self.stats["calls"] += 1
            cap = prepared.limits.max_output
            return FnCallResult(
                exit_code=answer.exit_code,
                stdout=answer.stdout.decode(errors="replace"),
                stderr=answer.stderr.decode(errors="replace"),
                stdout_truncated=answer.stdout_bytes > len(answer.stdout) or answer.stdout_bytes > cap,
                stderr_truncated=answer.stderr_bytes > len(answer.stderr) or answer.stderr_bytes > cap,
                stdout_bytes=answer.stdout_bytes, stderr_bytes=answer.stderr_bytes,
                timed_out=answer.timed_out, memory_exceeded=answer.memory_exceeded,
                files=answer.files, file_errors=answer.file_errors,
                duration_s=answer.duration_s, cpu_s=answer.cpu_s, worker_s=answer.worker_s,
                queued_s=queued.sent_at - started,
            )
        raise AssertionError("unreachable")

    async def call_many(self, calls: list[DSecFnCallArgs]) -> list[FnCallResult]:
        """Run calls concurrently, answers in order; a call that cannot run gets ``error`` set
        and does not affect the others. At most ``workers_max`` are under way at once, each
        prepared just before it goes out: preparing a whole large batch at once would hold up
        the event loop (and leave the workers idle) for tens of milliseconds."""
        results: list[FnCallResult | None] = [None] * len(calls)
        pending = iter(enumerate(calls))

        async def feed() -> None:
            for i, args in pending:
                try:
                    results[i] = await self.call(args)
                except DSecError as exc:
                    results[i] = FnCallResult(exit_code=-1, error=ErrorBody(code=exc.code, message=exc.message))

        await asyncio.gather(*(feed() for _ in range(min(len(calls), self.config.workers_max))))
        return results  # type: ignore[return-value]

    # -- checking ------------------------------------------------------------------------------

    def _prepare(self, args: DSecFnCallArgs) -> _Prepared:
        cfg = self.config
        if args.language not in LANGUAGES:
            raise InvalidRequest(f"unsupported language {args.language!r}: use one of {', '.join(LANGUAGES)}")
        if not 0 < args.timeout <= cfg.max_timeout_s:
            raise LimitOutOfRange(f"timeout={args.timeout:g} is out of range: (0, {cfg.max_timeout_s:g}] seconds")
        if not MIN_MEMORY_MB <= args.memory_limit_mb <= cfg.max_memory_mb:
            raise LimitOutOfRange(
                f"memory_limit_mb={args.memory_limit_mb} is out of range: {MIN_MEMORY_MB}..{cfg.max_memory_mb} MB")
        if not 0 <= args.max_output_bytes <= MAX_OUTPUT_BYTES_LIMIT:
            raise LimitOutOfRange(
                f"max_output_bytes={args.max_output_bytes} is out of range: 0..{MAX_OUTPUT_BYTES_LIMIT}")
        if len(args.files) > MAX_FILES or len(args.fetch_files) > MAX_FILES:
            raise LimitOutOfRange(f"more than {MAX_FILES} files to send or fetch")
        files = [(_workdir_path(p, "files"), data) for p, data in args.files.items()]
        fetch = list(dict.fromkeys(_workdir_path(p, "fetch_files") for p in args.fetch_files))
        stdin = args.stdin.encode("utf-8", "surrogateescape") if args.stdin is not None else None
        size = len(args.code) + len(stdin or b"") + sum(len(d) for _, d in files)
        if size > cfg.max_input_bytes:
            raise LimitOutOfRange(f"code, stdin and files of {size} bytes are over the {cfg.max_input_bytes}-byte limit")
        for name, value in args.env.items():
            if not name or "=" in name or "\0" in name or "\0" in value:
                raise InvalidRequest(f"invalid environment variable {name!r}")
        image = self._image(args.image)
        env = args.env
        if env:
            base = call_env(image)
            env = {k: v for k, v in env.items() if base.get(k) != v}  # the zygote has the rest
        key = (args.timeout, args.memory_limit_mb, args.max_output_bytes)
        limits = self._limits.get(key)
        if limits is None:  # calls mostly share their limits: one object for each set of them
            if len(self._limits) > 1000:
                self._limits.clear()
            limits = self._limits[key] = CallLimits(
                timeout_s=args.timeout, memory_bytes=args.memory_limit_mb << 20, max_output=args.max_output_bytes,
                max_fetch=cfg.max_fetch_bytes, max_fetch_total=cfg.max_fetch_bytes)
        frame = encode_request(args.language, args.code, env, stdin, files, fetch, limits)
        return _Prepared(image=args.image, frame=frame, limits=limits, fetch=fetch, memory_mb=args.memory_limit_mb)

    def _image(self, name: str) -> Image:
        now = time.monotonic()
        cached = self._images.get(name)
        if cached is not None and now - cached[0] < _IMAGE_CACHE_S:
            return cached[1]
        image = self.store.get_image(name)
        self._images[name] = (now, image)
        return image

    # -- workers -----------------------------------------------------------------------------

    def _pool_of(self, image: Image) -> _ImagePool:
        pool = self._pools.get(image.layers)
        if pool is None:
            pool = self._pools[image.layers] = _ImagePool(image=image)
            self._wakeup.set()
        pool.last_used = time.monotonic()
        return pool

    def _enqueue(self, pool: _ImagePool, prepared: _Prepared) -> _Queued:
        """Send the call to a free worker now, or queue it for the next one."""
        queued = _Queued(prepared, asyncio.get_running_loop().create_future(), time.monotonic())
        while pool.idle:
            worker = pool.idle.pop()  # the most recently used: its pages are warm
            if worker.alive:
                pool.busy.add(worker)
                self._send(pool, worker, queued)
                return queued
            self._discard(pool, worker, worker.failed or "the zygote exited")
        if self._closed:
            raise SandboxStateError("the node is shutting down")
        if pool.size == 0 and pool.failures >= 2 and time.monotonic() - pool.failed_at < self.config.failure_backoff_s:
            raise BackendError(f"cannot start an fncall worker for image {pool.image.name!r}: {pool.last_error}")
        pool.waiters.append(queued)
        if len(pool.waiters) == 1:
            self._wakeup.set()  # a queue formed: the manager may start workers
        return queued

    def _send(self, pool: _ImagePool, worker: Worker, queued: _Queued) -> None:
        """Give a call to a worker taken for it (in ``pool.busy``)."""
        queued.worker, queued.sent_at = worker, time.monotonic()
        limit = (queued.prepared.memory_mb + self.config.memory_overhead_mb) << 20
        if limit != worker.memory_limit:
            self._spawn(self._send_with_limit(pool, worker, queued, limit))
            return
        self._submit(pool, worker, queued)

    def _submit(self, pool: _ImagePool, worker: Worker, queued: _Queued) -> None:
        p = queued.prepared
        try:
            worker.submit(p.frame, p.limits, p.fetch, self.config.answer_grace_s, queued.future)
        except WorkerFailed as exc:
            self._discard(pool, worker, str(exc))
            if not queued.future.done():
                queued.future.set_exception(exc)

    async def _send_with_limit(self, pool: _ImagePool, worker: Worker, queued: _Queued, limit: int) -> None:
        try:
            await worker.set_memory_limit(limit)
        except WorkerFailed as exc:
            self._discard(pool, worker, str(exc))
            if not queued.future.done():
                queued.future.set_exception(exc)
            return
        except BaseException:
            self._discard(pool, worker, "interrupted")
            if not queued.future.done():
                queued.future.set_exception(WorkerFailed("interrupted", started=False))
            raise
        if queued.future.done():  # its caller went away meanwhile
            self._release(pool, worker)
        else:
            self._submit(pool, worker, queued)

    def _after_call(self, pool: _ImagePool, worker: Worker) -> None:
        """A worker's call ended (``Worker.on_done``)."""
        if worker.alive:
            self._release(pool, worker)
        else:
            self._discard(pool, worker, worker.failed or "the zygote exited")

    def _release(self, pool: _ImagePool, worker: Worker) -> None:
        if not worker.alive or self._closed or self._pools.get(pool.image.layers) is not pool:
            self._discard(pool, worker, worker.failed or "retired")
            return
        while pool.waiters:
            queued = pool.waiters.popleft()
            if not queued.future.done():  # not cancelled
                self._send(pool, worker, queued)  # stays in pool.busy
                return
        pool.busy.discard(worker)
        pool.idle.append(worker)

    def _discard(self, pool: _ImagePool, worker: Worker, reason: str) -> None:
        if worker in self._discarded:
            return
        self._discarded.add(worker)
        pool.busy.discard(worker)
        with contextlib.suppress(ValueError):
            pool.idle.remove(worker)
        if worker.failed is not None:
            log.warning("fncall worker %s replaced: %s", worker.cid, reason)
            self.stats["workers_replaced"] += 1
        self._spawn(self._close_worker(worker))
        self._wakeup.set()

    async def _close_worker(self, worker: Worker) -> None:
        await worker.close()
        self._uids.discard(worker.uid)
        self._discarded.discard(worker)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a turn whose caller went away may end in an error

    def _new_uid(self) -> int:
        for slot in range(self.config.uid_count):
            uid = self.config.uid_base + slot
            if uid not in self._uids:
                self._uids.add(uid)
                return uid
        raise BackendError("no uid left for another fncall worker")

    async def _start_worker(self, pool: _ImagePool) -> None:
        cfg = self.config
        uid: int | None = None
        try:
            async with self._start_sem:
                if self._closed:
                    return
                uid = self._new_uid()
                limits = _limits(DEFAULT_FNCALL_MEMORY_MB + cfg.memory_overhead_mb, cfg)
                worker = await Worker.start(
                    self.backend, f"f{secrets.token_hex(8)}", pool.image, uid, limits,
                    nproc=cfg.call_nproc, fsize=cfg.max_file_bytes, nofile=cfg.call_nofile,
                    preload=cfg.preload, timeout_s=cfg.start_timeout_s,
                )
        except (WorkerFailed, DSecError, OSError) as exc:
            if uid is not None:
                self._uids.discard(uid)
            pool.starting -= 1
            pool.last_error, pool.failed_at = str(exc), time.monotonic()
            pool.failures += 1
            log.warning("fncall: cannot start a worker for image %r: %s", pool.image.name, exc)
            if pool.size == 0 and pool.failures >= 2:
                error = BackendError(f"cannot start an fncall worker for image {pool.image.name!r}: {exc}")
                while pool.waiters:
                    fut = pool.waiters.popleft().future
                    if not fut.done():
                        fut.set_exception(error)
            self._wakeup.set()
            return
        except BaseException:
            if uid is not None:
                self._uids.discard(uid)
            pool.starting -= 1
            raise
        pool.starting -= 1
        pool.last_error, pool.failures = None, 0
        self.stats["workers_started"] += 1
        worker.on_done = lambda w: self._after_call(pool, w)
        worker._tasks.append(asyncio.create_task(self._watch(pool, worker), name=f"fncall-watch-{worker.cid}"))
        if self._closed or self._pools.get(pool.image.layers) is not pool:
            await self._close_worker(worker)
            return
        pool.busy.add(worker)
        self._release(pool, worker)

    async def _watch(self, pool: _ImagePool, worker: Worker) -> None:
        """Notice a zygote that dies between calls, so no call is sent to it."""
        await worker.proc.wait()
        if not worker._closed and worker.failed is None:
            worker.failed = f"the zygote exited with {worker.proc.returncode}"
            if worker in pool.idle:
                self._discard(pool, worker, worker.failed)
            self._wakeup.set()

    # -- sizing --------------------------------------------------------------------------------

    async def _manage(self) -> None:
        while True:
            queued = any(p.waiters for p in self._pools.values())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1 if queued else 0.5):
                    await self._wakeup.wait()
            self._wakeup.clear()
            try:
                self._resize(time.monotonic())
            except Exception:  # noqa: BLE001 - the manager must go on
                log.exception("fncall pool manager")
            await asyncio.sleep(0.005)

    def _resize(self, now: float) -> None:
        cfg = self.config
        total = sum(p.size for p in self._pools.values())
        for key, pool in list(self._pools.items()):
            latest = self._images.get(pool.image.name)
            current = latest is None or latest[1].layers == pool.image.layers  # not a rebuilt image's old pool
            in_use = (pool.image.name in cfg.prewarm and current) or now - pool.last_used < cfg.image_idle_s
            base = cfg.workers_min if in_use else 0
            want = base
            if pool.waiters:
                # Workers stuck on calls that wait do not serve the queue: add as many.
                want = max(want, min(base + self._blocked(pool, now), pool.size + len(pool.waiters)))
                while pool.waiters and pool.waiters[0].future.done():
                    pool.waiters.popleft()  # cancelled
                oldest = pool.waiters[0].queued_at if pool.waiters else now
                if now - oldest > cfg.queue_grow_s and pool.starting == 0:
                    want = max(want, pool.size + 1)
            backing_off = pool.failures >= 2 and now - pool.failed_at < cfg.failure_backoff_s
            while pool.size < want and total < cfg.workers_max and not backing_off:
                pool.starting += 1
                total += 1
                self._spawn(self._start_worker(pool))
            if not pool.waiters:
                extra = pool.size - base
                for worker in sorted(pool.idle, key=lambda w: w.idle_since):
                    if extra <= 0:
                        break
                    if now - worker.idle_since > cfg.idle_s or base == 0 and now - worker.idle_since > 1.0:
                        pool.idle.remove(worker)
                        self.stats["workers_retired"] += 1
                        self._spawn(self._close_worker(worker))
                        extra -= 1
                        total -= 1
            if pool.size == 0 and not pool.waiters and base == 0:
                del self._pools[key]

    def _blocked(self, pool: _ImagePool, now: float) -> int:
        """Busy workers whose call has run over ``slow_call_s`` using under ``blocked_cpu`` of
        a core since the last look (read from the worker's cgroup)."""
        blocked = 0
        for worker in pool.busy:
            if worker.busy_since is None or now - worker.busy_since < self.config.slow_call_s:
                continue
            used = cpu_usage_s(self.backend.cgroup_parent, worker.cid)
            last = worker.cpu_sample
            worker.cpu_sample = (worker.calls, now, used)
            if used is None or last is None or last[0] != worker.calls or now - last[1] <= 0:
                continue
            if (used - last[2]) / (now - last[1]) < self.config.blocked_cpu:
                blocked += 1
        return blocked


def _limits(memory_mb: int, cfg: FnCallConfig) -> Limits:
    """A worker's cgroup limits: memory is set again per call; CPU is a hard cap."""
    fields = Limits.__dataclass_fields__
    extra = {"cpu_cap": cfg.cpu_cores} if "cpu_cap" in fields else {}
    return Limits(memory_mb=memory_mb, cpu_cores=cfg.cpu_cores, pids=cfg.worker_pids, **extra)


def _workdir_path(path: str, what: str) -> str:
    """A path in the call's working directory, relative and normalised; else InvalidRequest."""
    if not path or "\0" in path or len(path.encode()) > MAX_PATH_BYTES:
        raise InvalidRequest(f"{what}: invalid path {path!r}")
    if path.startswith(WORKDIR + "/"):
        path = path[len(WORKDIR) + 1:]
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise InvalidRequest(
            f"{what}: {path!r} is not a path inside the working directory (relative, or under {WORKDIR}/, "
            "without '.', '..' or empty parts)")
    return posixpath.join(*parts)
