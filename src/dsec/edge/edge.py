"""The edge: one per node. It owns the node's sandbox table and every sandbox's lifecycle.

    creating ──▶ running ──▶ stopping ──▶ stopped
        │          ▲  │ pause
        │   resume │  ▼
        │         paused ─────▶ stopping
        └──────────┴────────────┴──────▶ failed

- Admission: limits in range for this node, sandbox count and (overcommitted) memory within
  the node's capacity; otherwise ``LimitOutOfRange`` / ``CapacityExceeded``.
- Warm pool: for images in demand the edge keeps pre-created sandboxes with no limits yet; a
  create takes one and sets its limits (run args that vary per sandbox — user, env, workdir —
  apply per call), so a burst of creates does not wait for crun. The pool follows demand.
- ``ttl_running_stop``: a sandbox with no call for that many seconds is stopped. A paused
  sandbox is exempt until it has been paused for ``paused_ttl_s``.
- Pause freezes a sandbox and pushes its memory out (swap); exec and file calls on a paused
  sandbox resume it first. CPU requests are weights (overcommitted, ``cpu_overcommit``);
  best-effort sandboxes commit none and run under SCHED_IDLE.
- Records are kept in one append-only log (``journal``); on start the edge re-adopts the
  sandboxes still running and removes the remains of the rest. ``close()`` (SIGTERM) releases
  what no running sandbox uses — the warm pool, unused layer mounts — and leaves running
  sandboxes to be adopted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from libdsec import (
    CapacityExceeded,
    DSecError,
    InvalidRequest,
    LimitOutOfRange,
    SandboxNotFound,
    SandboxStateError,
)
from libdsec.protocol import (
    DSecContainerRunArgs,
    ExecRequest,
    ExecResult,
    ImageInfo,
    LayerUse,
    SecurityEvent,
    NodeInfo,
    RUN_ARGS_BY_KIND,
    PackDiffResult,
    PauseResult,
    ProjectUsage,
    SandboxInfo,
    SandboxStatus,
    SnapshotInfo,
)
from libdsec.protocol import DSecFnCallArgs, FnCallResult

from ..backends.base import ExecContext, Handle, SandboxBackend, SandboxSpec
from ..fncall.pool import FnCallPool
from ..images.store import Image, LayerStore, check_name
from ..placement import DEFAULT_CPU_OVERCOMMIT, DEFAULT_MEMORY_OVERCOMMIT
from ..resources import cgroups
from ..resources import cpu as cpu_sched
from ..resources import reclaim
from ..resources.cgroups import Limits
from .api import new_sandbox_id
from .journal import RecordJournal
from .security import EdgeSecurity

log = logging.getLogger("dsec.edge")

MIN_MEMORY_MB = 16
MIN_CPU = 0.01
MAX_TTL_S = 7 * 24 * 3600.0
PIDS_RANGE = (16, 65536)


# States in which a sandbox holds its node's resources (and counts against its project's quota).
_HOLDING = (SandboxStatus.creating, SandboxStatus.running, SandboxStatus.paused)


def _cpu_commit(args: DSecContainerRunArgs) -> float:
    """CPU a sandbox commits on its node: its weight in cores, or none for best effort."""
    return 0.0 if getattr(args, "best_effort", False) else args.cpu_cores_limit


def _memory_total_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


@dataclass
class EdgeConfig:
    node_dir: Path
    # Where sandbox records live; they must outlive an edge restart, like the sandboxes.
    records_dir: Path | None = None
    node: str = "n0"
    max_sandboxes: int = 4096
    memory_overcommit: float = DEFAULT_MEMORY_OVERCOMMIT
    cpu_overcommit: float = DEFAULT_CPU_OVERCOMMIT
    # A paused sandbox is stopped after this long paused (its run TTL does not run meanwhile).
    paused_ttl_s: float = 24 * 3600.0
    batch_concurrency: int = 16
    reaper_interval_s: float = 1.0
    max_file_bytes: int = 64 << 20
    # Warm pool per image: grows to the peak number of creates in flight, within these bounds;
    # an image unused for pool_idle_s loses its pool.
    pool_min: int = 2
    pool_max: int = 64
    pool_idle_s: float = 600.0
    pool_fill_concurrency: int = 2
    # While creates keep arriving and the pool still has a quarter of its target, refills wait
    # until none has arrived for this long: starting sandboxes takes the CPU that a burst being
    # served from the pool needs (docs/BENCHMARKS.md → Lifecycle).
    pool_quiet_s: float = 0.05
    finished_kept: int = 10_000


@dataclass
class Record:
    id: str
    kind: str
    handle: Handle
    args: DSecContainerRunArgs
    image: Image
    status: SandboxStatus
    created_at: float
    last_active: float
    uid: int = 0
    gid: int = 0
    reason: str | None = None
    calls: int = 0
    create_s: float | None = None
    project: str = "root"
    paused_at: float | None = None
    # Serialises pause and resume (and the implicit resume of a call) on one sandbox.
    transition: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def info(self, node: str) -> SandboxInfo:
        return SandboxInfo(
            id=self.id, kind=self.kind, node=node, image=self.image.name, status=self.status,
            created_at=datetime.fromtimestamp(self.created_at, timezone.utc),
            last_active_at=datetime.fromtimestamp(self.last_active, timezone.utc),
            memory_limit_mb=self.args.memory_limit_mb, cpu_cores_limit=self.args.cpu_cores_limit,
            ttl_running_stop=self.args.ttl_running_stop, init_user=self.args.init_user,
            workdir=self.args.workdir, reason=self.reason, create_s=self.create_s, project=self.project,
            cpu_cores_cap=getattr(self.args, "cpu_cores_cap", None), best_effort=getattr(self.args, "best_effort", False),
        )

    def to_json(self) -> str:
        return json.dumps({
            "id": self.id, "kind": self.kind, "handle": self.handle.to_json(), "args": self.args.model_dump(mode="json"),
            "image": {"name": self.image.name, "layers": list(self.image.layers), "env": self.image.env,
                      "workdir": self.image.workdir, "user": self.image.user, "roles": list(self.image.roles)},
            "created_at": self.created_at, "uid": self.uid, "gid": self.gid,
            "project": self.project, "paused_at": self.paused_at,
        })

    @classmethod
    def from_json(cls, text: str) -> Record:
        d = json.loads(text)
        img = d["image"]
        now = time.time()
        return cls(
            id=d["id"], kind=d.get("kind", "container"), handle=Handle.from_json(d["handle"]),
            args=RUN_ARGS_BY_KIND.get(d.get("kind", "container"), DSecContainerRunArgs).model_validate(d["args"]),
            image=Image(name=img["name"], layers=tuple(img["layers"]), env=img["env"],
                        workdir=img["workdir"], user=img["user"], roles=tuple(img.get("roles", ()))),
            status=SandboxStatus.paused if d.get("paused_at") else SandboxStatus.running,
            created_at=d["created_at"], last_active=now, uid=d["uid"], gid=d["gid"],
            project=d.get("project", "root"), paused_at=d.get("paused_at"),
        )


@dataclass
class _Pool:
    kind: str = "container"
    image: Image | None = None
    handles: deque[Handle] = field(default_factory=deque)
    want: int = 0
    filling: int = 0
    in_flight: int = 0
    last_used: float = 0.0
    # The limits its latest create asked for: refills get them ahead, so a create that asks
    # the same (the common case: a trainer's sandboxes are alike) sets none on its way.
    limits: Limits | None = None
    prepared: dict[str, Limits] = field(default_factory=dict)  # cid -> limits set on it
    # When recent creates started: a create served from the pool may finish before the next
    # one arrives, so the size of a burst shows in arrivals, not in creates in flight.
    arrivals: deque[float] = field(default_factory=deque)

    def demand(self, now: float, window_s: float = 0.5) -> int:
        self.arrivals.append(now)
        while self.arrivals and now - self.arrivals[0] > window_s:
            self.arrivals.popleft()
        return max(self.in_flight, len(self.arrivals))


class Edge:
    """The node daemon's core. ``await start()`` before use; ``await close()`` at the end
    (a second ``close()`` does nothing)."""

    def __init__(
        self, config: EdgeConfig, backends: SandboxBackend | Iterable[SandboxBackend], store: LayerStore,
        fncalls: FnCallPool | None = None,
    ) -> None:
        self.config = config
        self.node = config.node
        if hasattr(backends, "kind"):
            backends = [backends]
        # One backend per sandbox kind (container, microvm, …); the first is the default.
        self.backends: dict[str, SandboxBackend] = {b.kind: b for b in backends}
        self.backend = next(iter(self.backends.values()))
        self.store = store
        self.records_dir = Path(config.records_dir or Path(config.node_dir) / "records")
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.journal = RecordJournal(self.records_dir)
        self._records: dict[str, Record] = {}
        # What the sandboxes that hold resources (creating, running, paused) commit, kept as
        # they come and go so that admitting one is O(1): id -> (CPU in millionths of a core, MB).
        self._held: dict[str, tuple[int, int]] = {}
        self._held_ucores = 0
        self._held_memory_mb = 0
        self._finished: OrderedDict[str, SandboxInfo] = OrderedDict()
        self._pools: dict[tuple[str, tuple[str, ...]], _Pool] = defaultdict(_Pool)
        self._pool_wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._pool_tasks: set[asyncio.Task] = set()
        self._memory_total_mb = _memory_total_mb()
        self._cpu_cores = os.cpu_count() or 1
        self._closed = False
        self.security = EdgeSecurity(self)  # network allowlists, security events
        self.fncalls = fncalls  # the warm pool for stateless calls (dsec.fncall), if served here

    # -- start / close ---------------------------------------------------------------------

    async def start(self) -> None:
        records = []
        for sandbox_id, text in self.journal.load().items():
            try:
                records.append(Record.from_json(text))
            except (ValueError, KeyError) as exc:
                log.warning("dropping the unreadable record of %s: %s", sandbox_id, exc)
                self.journal.drop(sandbox_id)
        alive: set[str] = set()
        for kind, backend in self.backends.items():
            mine = [r.handle for r in records if r.kind == kind]
            alive |= {h.cid for h in await backend.recover(mine)}
        for rec in records:
            if rec.handle.cid in alive:
                self._records[rec.id] = rec
                self._hold(rec)
                log.info("re-adopted running sandbox %s", rec.id)
            else:
                rec.status, rec.reason = SandboxStatus.failed, "sandbox was gone when the edge restarted"
                self._forget(rec)
        if self.fncalls is not None:  # after recover, which removed the workers of an earlier run
            await self.fncalls.start()
        await self.security.start(self._records.values())
        self._tasks = [
            asyncio.create_task(self._reaper(), name="dsec-ttl-reaper"),
            asyncio.create_task(self._pool_filler(), name="dsec-pool-filler"),
        ]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Refills and trims under way finish (a refill sees _closed and undoes itself).
        await asyncio.gather(*self._pool_tasks, return_exceptions=True)
        pooled = [(pool.kind, h) for pool in self._pools.values() for h in pool.handles]
        self._pools.clear()
        await asyncio.gather(*(self.backends[k].destroy(h) for k, h in pooled), return_exceptions=True)
        if self.fncalls is not None:
            await self.fncalls.close()
        for backend in self.backends.values():
            backend.release_unused()
        self.security.close()
        self.journal.close()

    # -- admission -------------------------------------------------------------------------

    def _check_limits(self, args: DSecContainerRunArgs) -> Limits:
        def out_of_range(name: str, value: object, low: object, high: object, unit: str) -> LimitOutOfRange:
            return LimitOutOfRange(f"{name}={value} is out of range: {low}..{high} {unit} on node {self.node}")

        if not MIN_MEMORY_MB <= args.memory_limit_mb <= self._memory_total_mb:
            raise out_of_range("memory_limit_mb", args.memory_limit_mb, MIN_MEMORY_MB, self._memory_total_mb, "MB")
        if not MIN_CPU <= args.cpu_cores_limit <= self._cpu_cores:
            raise out_of_range("cpu_cores_limit", args.cpu_cores_limit, MIN_CPU, self._cpu_cores, "cores")
        cap = getattr(args, "cpu_cores_cap", None)
        if cap is not None and not max(MIN_CPU, args.cpu_cores_limit) <= cap <= self._cpu_cores:
            low = max(MIN_CPU, args.cpu_cores_limit)
            raise out_of_range("cpu_cores_cap", cap, f"{low:g}", self._cpu_cores, "cores (at least cpu_cores_limit)")
        if not 1 <= args.ttl_running_stop <= MAX_TTL_S:
            raise out_of_range("ttl_running_stop", args.ttl_running_stop, 1, int(MAX_TTL_S), "seconds")
        if not PIDS_RANGE[0] <= args.pids_limit <= PIDS_RANGE[1]:
            raise out_of_range("pids_limit", args.pids_limit, *PIDS_RANGE, "processes")
        self.security.check_rules(args.network_rules)
        return Limits(memory_mb=args.memory_limit_mb, cpu_cores=args.cpu_cores_limit, pids=args.pids_limit,
                      cpu_cap=cap, best_effort=getattr(args, "best_effort", False))

    def _hold(self, rec: Record) -> None:
        """``rec`` holds resources from now on (it is creating, running or paused)."""
        if rec.id not in self._held:
            held = self._held[rec.id] = (round(_cpu_commit(rec.args) * 1_000_000), rec.args.memory_limit_mb)
            self._held_ucores += held[0]
            self._held_memory_mb += held[1]

    def _unhold(self, rec: Record) -> None:
        """``rec`` holds nothing any more (stopping, stopped, failed or forgotten)."""
        if (held := self._held.pop(rec.id, None)) is not None:
            self._held_ucores -= held[0]
            self._held_memory_mb -= held[1]

    def _admit(self, args: DSecContainerRunArgs) -> None:
        if len(self._held) >= self.config.max_sandboxes:
            raise CapacityExceeded(f"node {self.node} is full: {len(self._held)} of {self.config.max_sandboxes} sandboxes")
        committed = self._held_memory_mb + args.memory_limit_mb
        cap = int(self._memory_total_mb * self.config.memory_overcommit)
        if committed > cap:
            raise CapacityExceeded(
                f"node {self.node} cannot admit {args.memory_limit_mb} MB more: "
                f"{committed - args.memory_limit_mb} of {cap} MB committed"
                f" ({self.config.memory_overcommit:g}× its {self._memory_total_mb} MB)"
            )
        cpu = _cpu_commit(args)
        cpu_committed = self._held_ucores / 1_000_000
        cpu_cap = self._cpu_cores * self.config.cpu_overcommit
        if cpu and cpu_committed + cpu > cpu_cap + 1e-9:
            raise CapacityExceeded(
                f"node {self.node} cannot admit {cpu:g} CPU cores more: {cpu_committed:g} of {cpu_cap:g} committed "
                f"({self.config.cpu_overcommit:g}× its {self._cpu_cores} cores; best-effort sandboxes commit none)"
            )

    # -- create ----------------------------------------------------------------------------

    def _backend(self, kind: str) -> SandboxBackend:
        backend = self.backends.get(kind)
        if backend is None:
            raise InvalidRequest(
                f"sandbox kind {kind!r} is not served by node {self.node} (it serves {', '.join(self.backends)})"
            )
        return backend

    async def create(self, args: DSecContainerRunArgs, kind: str = "container", project: str = "root") -> SandboxInfo:
        if self._closed:
            raise SandboxStateError(f"edge {self.node} is shutting down")
        backend = self._backend(kind)
        limits = self._check_limits(args)
        image = self.store.resolve(args.image_ref)
        self._admit(args)
        now = time.time()
        rec = Record(
            id=new_sandbox_id(self.node), kind=kind, handle=Handle(cid="", image=image.name, layers=image.layers),
            args=args, image=image, status=SandboxStatus.creating, created_at=now, last_active=now, project=project,
        )
        self._records[rec.id] = rec
        self._hold(rec)
        # VMs (whose memory is set at boot) and restores from a snapshot are made to order.
        snapshot = getattr(args, "snapshot", None)
        pooled = getattr(backend, "pooled", True) and snapshot is None
        pool = self._pools[(kind, image.layers)] if pooled else _Pool(kind=kind, image=image)
        pool.kind, pool.image = kind, image
        pool.in_flight += 1
        pool.last_used = time.monotonic()
        if pooled:
            pool.limits = limits
            demand = pool.demand(pool.last_used)
            pool.want = min(self.config.pool_max, max(pool.want, self.config.pool_min, demand))
            self._pool_wakeup.set()
        try:
            if pooled:
                rec.handle, has = await self._take_or_create(pool, limits)
            else:
                spec = SandboxSpec(image=image.name, layers=image.layers, env=dict(image.env), limits=limits,
                                   snapshot=snapshot)
                rec.handle, has = await backend.create(f"c{secrets.token_hex(8)}", spec), None
            try:
                if has != limits:
                    await backend.apply_limits(rec.handle, limits)
                rec.uid, rec.gid = await backend.resolve_user(rec.handle, args.init_user)
                if args.workdir != "/":
                    await backend.make_dir(rec.handle, args.workdir, rec.uid, rec.gid)
                await self.security.attach(rec)
            except BaseException:
                self.security.forget(rec)
                await backend.destroy(rec.handle)
                raise
        except BaseException:
            del self._records[rec.id]
            self._unhold(rec)
            raise
        finally:
            pool.in_flight -= 1
        rec.status = SandboxStatus.running
        rec.last_active = time.time()
        rec.create_s = rec.last_active - now
        self._persist(rec)
        return rec.info(self.node)

    async def _take_or_create(self, pool: _Pool, limits: Limits) -> tuple[Handle, Limits | None]:
        """A sandbox of the pool's image, and the limits it already has (see _Pool.limits)."""
        backend = self.backends[pool.kind]
        while pool.handles:
            handle = pool.handles.popleft()
            self._pool_wakeup.set()
            has = pool.prepared.pop(handle.cid, None)
            if await backend.is_alive(handle):
                return handle, has
            await backend.destroy(handle)
        return await self._new_handle(pool.kind, pool.image, limits), limits

    async def _new_handle(self, kind: str, image: Image, limits: Limits | None) -> Handle:
        """A new sandbox of ``image``, with ``limits`` set (None: none yet)."""
        spec = SandboxSpec(image=image.name, layers=image.layers, env=dict(image.env), limits=limits)
        return await self.backends[kind].create(f"c{secrets.token_hex(8)}", spec)

    async def create_batch(
        self, args: DSecContainerRunArgs, count: int, kind: str = "container", project: str = "root"
    ) -> AsyncIterator[tuple[int, SandboxInfo]]:
        """Create ``count`` sandboxes; yields (index, info) as each comes up. All or none: on the
        first failure (or if the consumer goes away) every sandbox made so far is stopped."""
        self._backend(kind)
        self._check_limits(args)
        self.store.resolve(args.image_ref)
        sem = asyncio.Semaphore(self.config.batch_concurrency)
        queue: asyncio.Queue[tuple[int, SandboxInfo | BaseException]] = asyncio.Queue()

        abandoned = False

        async def one(i: int) -> None:
            async with sem:
                if abandoned:
                    return
                try:
                    await queue.put((i, await self.create(args, kind, project)))
                except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                    await queue.put((i, exc))

        tasks = [asyncio.create_task(one(i)) for i in range(count)]
        made: list[str] | None = []
        try:
            for _ in range(count):
                i, result = await queue.get()
                if isinstance(result, BaseException):
                    raise result
                made.append(result.id)
                yield i, result
            made = None
        finally:
            # Also when the failure came first (nothing made yet), creates are under way. They
            # finish (a create cancelled inside crun could leave a container behind), the
            # others do not start, and whatever was made is stopped.
            if made is not None:
                abandoned = True
                # In a task of its own: a consumer that went away may be under a cancel scope
                # that cancels every await made here (anyio's, in Starlette's streaming).
                undo = asyncio.create_task(self._undo_batch(tasks, queue, made))
                self._pool_tasks.add(undo)  # referenced until done; close() waits for it
                undo.add_done_callback(self._pool_tasks.discard)
                await asyncio.shield(undo)

    async def _undo_batch(self, tasks: list[asyncio.Task], queue: asyncio.Queue, made: list[str]) -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        while not queue.empty():
            _, result = queue.get_nowait()
            if isinstance(result, SandboxInfo):
                made.append(result.id)
        await asyncio.gather(*(self.stop(sid, reason="batch create failed") for sid in made), return_exceptions=True)

    # -- calls -----------------------------------------------------------------------------

    def _get(self, sandbox_id: str) -> Record:
        rec = self._records.get(sandbox_id)
        if rec is None:
            if sandbox_id in self._finished:
                info = self._finished[sandbox_id]
                raise SandboxStateError(f"sandbox {sandbox_id} is {info.status.value}" + (f": {info.reason}" if info.reason else ""))
            raise SandboxNotFound(f"no sandbox {sandbox_id} on node {self.node}")
        return rec

    def _running(self, sandbox_id: str, action: str) -> Record:
        rec = self._get(sandbox_id)
        if rec.status is not SandboxStatus.running:
            raise SandboxStateError(f"cannot {action}: sandbox {sandbox_id} is {rec.status.value}")
        return rec

    async def _call(self, rec: Record, coro):
        rec.calls += 1
        rec.last_active = time.time()
        try:
            return await coro
        except SandboxStateError:
            if rec.status is SandboxStatus.running and not await self.backends[rec.kind].is_alive(rec.handle):
                await self._fail(rec, "sandbox processes died")
            raise
        finally:
            rec.calls -= 1
            rec.last_active = time.time()

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        rec = await self._ready(sandbox_id, "exec")
        if request.user is not None:
            uid, gid = await self.backends[rec.kind].resolve_user(rec.handle, request.user)
        else:
            uid, gid = rec.uid, rec.gid
        ctx = ExecContext(
            uid=uid, gid=gid, workdir=request.workdir or rec.args.workdir,
            env={**rec.image.env, **rec.args.env, **request.env},
        )
        return await self.security.watch_exec(rec, self._call(rec, self.backends[rec.kind].exec(rec.handle, request, ctx)))

    async def security_events(self, sandbox_id: str) -> list[SecurityEvent]:
        """Denied actions seen in the sandbox (see dsec.isolation.events); kept after it ends."""
        await self.get(sandbox_id)  # SandboxNotFound for an id this node never had
        return self.security.list(sandbox_id)

    async def set_network_rules(self, sandbox_id: str, rules: dict) -> None:
        rec = self._running(sandbox_id, "change network rules")
        await self.security.set_rules(rec, rules)
        self._persist(rec)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        rec = await self._ready(sandbox_id, "read a file")
        backend = self.backends[rec.kind]
        return await self._call(rec, backend.read_file(rec.handle, path, self.config.max_file_bytes))

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None:
        rec = await self._ready(sandbox_id, "write a file")
        if len(data) > self.config.max_file_bytes:
            raise InvalidRequest(f"file of {len(data)} bytes is over the {self.config.max_file_bytes}-byte limit")
        if not 0 <= mode <= 0o7777:
            raise InvalidRequest(f"invalid file mode {oct(mode)}")
        backend = self.backends[rec.kind]
        await self._call(rec, backend.write_file(rec.handle, path, data, mode, rec.uid, rec.gid))

    # -- fncall: stateless calls in the warm pool (no record, no sandbox id) -------------------

    def _fncall_pool(self) -> FnCallPool:
        if self.fncalls is None:
            raise InvalidRequest(f"node {self.node} does not serve fncall")
        if self._closed:
            raise SandboxStateError(f"edge {self.node} is shutting down")
        return self.fncalls

    async def fncall(self, args: DSecFnCallArgs) -> FnCallResult:
        return await self._fncall_pool().call(args)

    async def fncall_many(self, calls: list[DSecFnCallArgs]) -> list[FnCallResult]:
        return await self._fncall_pool().call_many(calls)

    async def pack_diff(self, sandbox_id: str, name: str | None = None, role: str = "snapshot") -> PackDiffResult:
        """The sandbox's changes as a new image on top of its own (it keeps running)."""
        rec = self._running(sandbox_id, "pack")
        if name is not None:
            check_name(name)
            if self.store.has_image(name):
                raise InvalidRequest(f"image {name!r} exists already; pick another name")
        backend = self.backends[rec.kind]
        digest, scrubbed = await self._call(rec, backend.pack_diff(rec.handle))
        image = Image(
            name=name or f"snap-{digest.removeprefix('sha256-')[:16]}",
            layers=rec.image.layers + (digest,), roles=rec.image.roles + (role,),
            env=rec.image.env, workdir=rec.image.workdir, user=rec.image.user, parent=rec.image.name,
        )
        self.store.put_image(image)
        return PackDiffResult(image=image.name, layer=digest, layers=list(image.layers),
                              size_bytes=self.store.layer_size(digest), scrubbed=scrubbed)

    async def snapshot(self, sandbox_id: str) -> SnapshotInfo:
        """Save a running sandbox's memory and device state (it keeps running); restore it with
        run args that name the snapshot. Only backends with memory snapshots (microvm) can."""
        rec = self._running(sandbox_id, "snapshot")
        backend = self.backends[rec.kind]
        if not hasattr(backend, "snapshot"):
            raise InvalidRequest(f"a {rec.kind} sandbox takes no memory snapshots (use pack_diff)")
        meta = await self._call(rec, backend.snapshot(rec.handle))
        return SnapshotInfo(
            id=meta["id"], sandbox_id=rec.id, kind=rec.kind, node=self.node, image=rec.image.name,
            size_bytes=meta["size_bytes"], memory_mb=meta["memory_mb"], save_s=meta["save_s"],
            created_at=datetime.fromtimestamp(meta["created_at"], timezone.utc),
        )

    async def layer_use(self) -> LayerUse:
        """The image refs and layer digests this node's sandboxes hold, pooled ones included."""
        recs = list(self._records.values())
        refs = {r.image.name for r in recs}
        layers = {d for r in recs for d in r.image.layers}
        layers |= {d for pool in self._pools.values() if pool.image for d in pool.image.layers}
        return LayerUse(images=sorted(refs), layers=sorted(layers))

    # -- the layer store, as this node sees it -----------------------------------------------

    async def list_images(self) -> list[ImageInfo]:
        return [self.store.describe(self.store.get_image(name)) for name in self.store.image_names()]

    async def inspect_image(self, ref: str) -> ImageInfo:
        return self.store.describe(self.store.resolve(ref))

    async def remove_image(self, name: str, in_use: frozenset[str]) -> None:
        self.store.remove_image(name, in_use=frozenset(in_use))

    async def gc_layers(self, in_use: frozenset[str]) -> list[str]:
        return self.store.gc(in_use=frozenset(in_use))

    async def get(self, sandbox_id: str) -> SandboxInfo:
        rec = self._records.get(sandbox_id)
        if rec is not None:
            return rec.info(self.node)
        if sandbox_id in self._finished:
            return self._finished[sandbox_id]
        raise SandboxNotFound(f"no sandbox {sandbox_id} on node {self.node}")

    async def list(self) -> list[SandboxInfo]:
        return [r.info(self.node) for r in self._records.values()]

    async def stop(self, sandbox_id: str, reason: str = "stopped by request") -> SandboxInfo:
        rec = self._records.get(sandbox_id)
        if rec is None:
            return await self.get(sandbox_id)  # already stopped: nothing to do
        if rec.status is SandboxStatus.creating:
            raise SandboxStateError(f"cannot stop: sandbox {sandbox_id} is still being created")
        if rec.status is SandboxStatus.stopping:
            while rec.status is SandboxStatus.stopping:
                await asyncio.sleep(0.01)
            return await self.get(sandbox_id)
        rec.status = SandboxStatus.stopping
        self._unhold(rec)
        try:
            await self.backends[rec.kind].destroy(rec.handle)
        except Exception as exc:
            await self._fail(rec, f"stop failed: {exc}")
            raise
        rec.status, rec.reason = SandboxStatus.stopped, reason
        self._forget(rec)
        return rec.info(self.node)

    # -- pause and resume ------------------------------------------------------------------

    async def pause(self, sandbox_id: str) -> PauseResult:
        """Freeze the sandbox and push its memory out; says what it held before and after."""
        rec = self._get(sandbox_id)
        async with rec.transition:
            if rec.status is SandboxStatus.paused:
                raise SandboxStateError(f"cannot pause: sandbox {sandbox_id} is paused already")
            if rec.status is not SandboxStatus.running:
                raise SandboxStateError(f"cannot pause: sandbox {sandbox_id} is {rec.status.value}")
            if rec.calls:
                raise SandboxStateError(f"cannot pause: sandbox {sandbox_id} has {rec.calls} calls in flight")
            backend = self.backends[rec.kind]
            before = backend.memory_usage(rec.handle)
            start = time.perf_counter()
            # Calls that arrive from here on find it paused and wait (on the lock) to resume it.
            rec.status = SandboxStatus.paused
            try:
                await backend.pause(rec.handle)
            except BaseException:
                if rec.status is SandboxStatus.paused:
                    rec.status = SandboxStatus.running
                raise
            if rec.status is not SandboxStatus.paused:  # stopped meanwhile
                raise SandboxStateError(f"sandbox {sandbox_id} was {rec.status.value} while it was being paused")
            rec.paused_at = time.time()
            self._persist(rec)
            return PauseResult(sandbox=rec.info(self.node), memory_before_bytes=before,
                               memory_after_bytes=backend.memory_usage(rec.handle),
                               pause_s=time.perf_counter() - start)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        rec = self._get(sandbox_id)
        async with rec.transition:
            if rec.status is not SandboxStatus.paused:
                raise SandboxStateError(f"cannot resume: sandbox {sandbox_id} is {rec.status.value}, not paused")
            await self._thaw(rec)
        return rec.info(self.node)

    async def _thaw(self, rec: Record) -> None:
        """Resume a paused sandbox (the caller holds ``rec.transition``)."""
        await self.backends[rec.kind].resume(rec.handle)
        rec.status, rec.paused_at = SandboxStatus.running, None
        rec.last_active = time.time()
        self._persist(rec)

    async def _ready(self, sandbox_id: str, action: str) -> Record:
        """The record of a sandbox that can take a call: a paused one is resumed first."""
        rec = self._get(sandbox_id)
        if rec.status is SandboxStatus.paused:
            async with rec.transition:
                if rec.status is SandboxStatus.paused:
                    await self._thaw(rec)
        return self._running(sandbox_id, action)

    def idle_sandboxes(self, idle_s: float) -> list[tuple[str, Handle]]:
        """(kind, handle) of the running sandboxes without a call for ``idle_s`` seconds."""
        now = time.time()
        return [(r.kind, r.handle) for r in self._records.values()
                if r.status is SandboxStatus.running and r.calls == 0 and now - r.last_active >= idle_s]

    async def _fail(self, rec: Record, reason: str) -> None:
        log.warning("sandbox %s failed: %s", rec.id, reason)
        rec.status, rec.reason = SandboxStatus.failed, reason
        self._unhold(rec)
        try:
            await self.backends[rec.kind].destroy(rec.handle)
        finally:
            self._forget(rec)

    def _forget(self, rec: Record) -> None:
        self.security.forget(rec)
        self._records.pop(rec.id, None)
        self._unhold(rec)
        self.journal.drop(rec.id)
        self._finished[rec.id] = rec.info(self.node)
        while len(self._finished) > self.config.finished_kept:
            self._finished.popitem(last=False)

    def _persist(self, rec: Record) -> None:
        self.journal.put(rec.id, rec.to_json())

    async def node_info(self) -> NodeInfo:
        return NodeInfo(
            node=self.node, cgroup_version=cgroups.version(),
            runtime="; ".join([b.describe() if hasattr(b, "describe") else k for k, b in self.backends.items()]
                              + (["fncall"] if self.fncalls is not None else [])),
            sandboxes=len(self._records), memory_total_mb=self._memory_total_mb, cpu_cores=self._cpu_cores,
            layer_attach=getattr(self.backends.get("container"), "layer_attach", "file"),
            **self._commitments(),
        )

    def _commitments(self) -> dict:
        """Admission figures for the placement view, and what each project holds here."""
        paused = 0
        projects: dict[str, list] = {}
        for r in self._records.values():
            if r.status not in _HOLDING:
                continue
            paused += r.status is SandboxStatus.paused
            if r.status is not SandboxStatus.creating:  # creates in flight are the apiserver's to count
                u = projects.setdefault(r.project, [0, 0.0, 0])
                u[0] += 1
                u[1] += _cpu_commit(r.args)
                u[2] += r.args.memory_limit_mb
        return {
            "max_sandboxes": self.config.max_sandboxes, "cpu_overcommit": self.config.cpu_overcommit,
            "memory_overcommit": self.config.memory_overcommit, "committed_cpu": self._held_ucores / 1_000_000,
            "committed_memory_mb": self._held_memory_mb, "paused": paused, "swap_total_mb": reclaim.swap_total_bytes() >> 20,
            "sched_idle": cpu_sched.sched_idle(), "core_scheduling": cpu_sched.core_scheduling(),
            "projects": {p: ProjectUsage(sandboxes=n, cpu_cores=round(c, 6), memory_mb=m)
                         for p, (n, c, m) in projects.items()},
        }

    def pooled(self) -> int:
        return sum(len(p.handles) for p in self._pools.values())

    # -- background work -------------------------------------------------------------------

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(self.config.reaper_interval_s)
            now = time.time()
            expired = [
                (r, f"idle for over ttl_running_stop={r.args.ttl_running_stop:g}s") for r in self._records.values()
                if r.status is SandboxStatus.running and r.calls == 0
                and now - r.last_active > r.args.ttl_running_stop
            ]
            expired += [
                (r, f"paused for over paused_ttl_s={self.config.paused_ttl_s:g}s") for r in self._records.values()
                if r.status is SandboxStatus.paused and r.paused_at is not None
                and now - r.paused_at > self.config.paused_ttl_s
            ]
            for rec, reason in expired:
                try:
                    await self.stop(rec.id, reason=reason)
                except DSecError as exc:
                    log.warning("TTL stop of %s failed: %s", rec.id, exc)

    async def _pool_filler(self) -> None:
        sem = asyncio.Semaphore(self.config.pool_fill_concurrency)
        while True:
            await self._pool_wakeup.wait()
            self._pool_wakeup.clear()
            now = time.monotonic()
            for pool in list(self._pools.values()):
                if now - pool.last_used > self.config.pool_idle_s:
                    pool.want = 0
                while len(pool.handles) > pool.want:
                    handle = pool.handles.pop()
                    pool.prepared.pop(handle.cid, None)
                    self._spawn(self.backends[pool.kind].destroy(handle))
                if self._burst_on(pool, now):
                    continue
                while len(pool.handles) + pool.filling < pool.want and self._room_for_pool():
                    pool.filling += 1
                    self._spawn(self._fill_one(pool, sem))
            await asyncio.sleep(0.01)

    def _burst_on(self, pool: _Pool, now: float) -> bool:
        """True while a burst is being served from ``pool``: its refills wait (a timer wakes
        the filler once the burst is quiet), unless the pool runs low."""
        quiet = self.config.pool_quiet_s
        since = now - pool.last_used
        if quiet <= 0 or since >= quiet or len(pool.handles) * 4 < pool.want:
            return False
        asyncio.get_running_loop().call_later(quiet - since, self._pool_wakeup.set)
        return True

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._pool_tasks.add(task)
        task.add_done_callback(self._pool_tasks.discard)

    def _room_for_pool(self) -> bool:
        return len(self._records) + self.pooled() < self.config.max_sandboxes

    async def _fill_one(self, pool: _Pool, sem: asyncio.Semaphore) -> None:
        try:
            async with sem:
                if self._closed or pool.image is None:
                    return
                backend = self.backends[pool.kind]
                limits = pool.limits
                handle = await self._new_handle(pool.kind, pool.image, limits)
                if self._closed or self._pools.get((pool.kind, pool.image.layers)) is not pool:
                    await backend.destroy(handle)
                else:
                    if limits is not None:
                        pool.prepared[handle.cid] = limits
                    pool.handles.append(handle)
        except Exception as exc:  # noqa: BLE001 - a failed refill is retried on next demand
            log.warning("warm pool refill failed: %s", exc)
        finally:
            pool.filling -= 1
            self._pool_wakeup.set()
