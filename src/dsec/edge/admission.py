"""Admission: whether this node takes one more sandbox, and what the sandboxes it holds commit.

A create asks ``limits(args)`` first: each limit in range for this node, else
``LimitOutOfRange`` naming the field. Then ``admit(sandbox_id, args)``: room for one more
sandbox, its memory within the node's memory times ``memory_overcommit``, its CPU weight within
the node's cores times ``cpu_overcommit`` (best-effort sandboxes commit no CPU), else
``CapacityExceeded``. An admitted sandbox holds what it commits until ``unhold``: the edge
unholds it when it leaves the states that hold resources (creating, running, paused: stopping,
failing or forgotten). The totals are kept as sandboxes come and go, so admitting one costs the
same at 10 sandboxes as at 10,000. ``commitments`` reports them, and what each project holds
here, for the placement view and the quotas.

``WorkGate``: how many creates (and commands) run at once, with a bounded queue behind them;
past it a call is refused with ``Overloaded`` (429, ``Retry-After``) instead of piling up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING

from libdsec import CapacityExceeded, LimitOutOfRange, Overloaded
from libdsec.protocol import DSecContainerRunArgs, ProjectUsage, SandboxStatus

from ..resources import cpu as cpu_sched
from ..resources import reclaim
from ..resources.cgroups import Limits
from .lifecycle import HOLDING, Record

if TYPE_CHECKING:
    from .config import EdgeConfig

MIN_MEMORY_MB = 16
MIN_CPU = 0.01
MAX_TTL_S = 7 * 24 * 3600.0
PIDS_RANGE = (16, 65536)
HOST_FACTS_MAX_AGE_S = 10.0


def cpu_commit(args: DSecContainerRunArgs) -> float:
    """CPU a sandbox commits on its node: its weight in cores, or none for best effort."""
    return 0.0 if args.best_effort else args.cpu_cores_limit


def memory_total_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


class Admission:
    """One node's admission; ``config`` is read on every call (its node, capacity and ratios)."""

    def __init__(self, config: EdgeConfig, memory_total_mb: int, cpu_cores: int) -> None:
        self.config = config
        self.memory_total_mb = memory_total_mb
        self.cpu_cores = cpu_cores
        # What the sandboxes that hold resources commit: id -> (CPU in millionths of a core, MB).
        self.held: dict[str, tuple[int, int]] = {}
        self.held_ucores = 0
        self.held_memory_mb = 0
        self._facts: tuple[float, dict] | None = None

    def limits(self, args: DSecContainerRunArgs) -> Limits:
        """The cgroup limits ``args`` ask for, each checked against this node."""
        node = self.config.node

        def out_of_range(name: str, value: object, low: object, high: object, unit: str) -> LimitOutOfRange:
            return LimitOutOfRange(f"{name}={value} is out of range: {low}..{high} {unit} on node {node}")

        if not MIN_MEMORY_MB <= args.memory_limit_mb <= self.memory_total_mb:
            raise out_of_range("memory_limit_mb", args.memory_limit_mb, MIN_MEMORY_MB, self.memory_total_mb, "MB")
        if not MIN_CPU <= args.cpu_cores_limit <= self.cpu_cores:
            raise out_of_range("cpu_cores_limit", args.cpu_cores_limit, MIN_CPU, self.cpu_cores, "cores")
        cap = args.cpu_cores_cap
        if cap is not None and not max(MIN_CPU, args.cpu_cores_limit) <= cap <= self.cpu_cores:
            low = max(MIN_CPU, args.cpu_cores_limit)
            raise out_of_range("cpu_cores_cap", cap, f"{low:g}", self.cpu_cores, "cores (at least cpu_cores_limit)")
        if not 1 <= args.ttl_running_stop <= MAX_TTL_S:
            raise out_of_range("ttl_running_stop", args.ttl_running_stop, 1, int(MAX_TTL_S), "seconds")
        if not PIDS_RANGE[0] <= args.pids_limit <= PIDS_RANGE[1]:
            raise out_of_range("pids_limit", args.pids_limit, *PIDS_RANGE, "processes")
        return Limits(memory_mb=args.memory_limit_mb, cpu_cores=args.cpu_cores_limit, pids=args.pids_limit,
                      cpu_cap=cap, best_effort=args.best_effort)

    def admit(self, sandbox_id: str, args: DSecContainerRunArgs) -> None:
        """Take ``sandbox_id`` in, holding what ``args`` commit; ``CapacityExceeded`` if it does not fit."""
        self.fits(args)
        self.hold(sandbox_id, args)

    def fits(self, args: DSecContainerRunArgs, count: int = 1) -> None:
        """``CapacityExceeded`` unless ``count`` more sandboxes of ``args`` fit beside what is held
        (a batch that cannot fit whole is refused before any of it is made)."""
        config = self.config
        some = f"{count} sandboxes of " if count > 1 else ""
        if len(self.held) + count > config.max_sandboxes:
            raise CapacityExceeded(f"node {config.node} is full: {len(self.held)} of {config.max_sandboxes} sandboxes"
                                   + (f", {count} more asked for" if count > 1 else ""))
        memory = args.memory_limit_mb * count
        committed = self.held_memory_mb + memory
        cap = int(self.memory_total_mb * config.memory_overcommit)
        if committed > cap:
            raise CapacityExceeded(
                f"node {config.node} cannot admit {some}{args.memory_limit_mb} MB more: "
                f"{self.held_memory_mb} of {cap} MB committed"
                f" ({config.memory_overcommit:g}× its {self.memory_total_mb} MB)"
            )
        cpu = cpu_commit(args) * count
        cpu_committed = self.held_ucores / 1_000_000
        cpu_cap = self.cpu_cores * config.cpu_overcommit
        if cpu and cpu_committed + cpu > cpu_cap + 1e-9:
            raise CapacityExceeded(
                f"node {config.node} cannot admit {some}{cpu_commit(args):g} CPU cores more: {cpu_committed:g} of "
                f"{cpu_cap:g} committed ({config.cpu_overcommit:g}× its {self.cpu_cores} cores; best-effort "
                "sandboxes commit none)"
            )

    def hold(self, sandbox_id: str, args: DSecContainerRunArgs) -> None:
        """``sandbox_id`` holds what ``args`` commit from now on (admitted, or re-adopted on restart)."""
        if sandbox_id not in self.held:
            held = self.held[sandbox_id] = (round(cpu_commit(args) * 1_000_000), args.memory_limit_mb)
            self.held_ucores += held[0]
            self.held_memory_mb += held[1]

    def unhold(self, sandbox_id: str) -> None:
        """``sandbox_id`` holds nothing any more; a second call does nothing."""
        if (held := self.held.pop(sandbox_id, None)) is not None:
            self.held_ucores -= held[0]
            self.held_memory_mb -= held[1]

    def _host_facts(self) -> dict:
        """What the host offers that the view reports: read again once older than
        ``HOST_FACTS_MAX_AGE_S`` (swap may be added; the rest is fixed while the node runs),
        not on each of the reports an apiserver asks for every second."""
        now = time.monotonic()
        if self._facts is None or now - self._facts[0] > HOST_FACTS_MAX_AGE_S:
            self._facts = (now, {"swap_total_mb": reclaim.swap_total_bytes() >> 20,
                                 "sched_idle": cpu_sched.sched_idle(), "core_scheduling": cpu_sched.core_scheduling()})
        return self._facts[1]

    def commitments(self, records: Iterable[Record]) -> dict:
        """Admission figures for the placement view, and what each project holds here."""
        paused = 0
        projects: dict[str, list] = {}
        for r in records:
            if r.status not in HOLDING:
                continue
            paused += r.status is SandboxStatus.paused
            if r.status is not SandboxStatus.creating:  # creates in flight are the apiserver's to count
                u = projects.setdefault(r.project, [0, 0.0, 0])
                u[0] += 1
                u[1] += cpu_commit(r.args)
                u[2] += r.args.memory_limit_mb
        config = self.config
        return {
            "max_sandboxes": config.max_sandboxes, "cpu_overcommit": config.cpu_overcommit,
            "memory_overcommit": config.memory_overcommit, "committed_cpu": self.held_ucores / 1_000_000,
            "committed_memory_mb": self.held_memory_mb, "paused": paused, **self._host_facts(),
            "projects": {p: ProjectUsage(sandboxes=n, cpu_cores=round(c, 6), memory_mb=m)
                         for p, (n, c, m) in projects.items()},
        }


class WorkGate:
    """At most ``running`` calls of one kind (creates, commands) at once on this node, and at
    most ``queued`` more waiting, each for at most ``wait_s`` seconds; past that the call is
    refused with ``Overloaded`` before any of its work began (so it may be sent again), never
    left hanging. ``retry_after`` in the refusal is what the calls that hold the slots are
    expected to need to make room: the mean time a slot was held lately, times the queue in front.

    ``async with gate.slot():`` around the work; ``gate.check()`` refuses at once when the queue
    is full (a batch, before it starts, whose parts then wait in ``slot(queue=False)``).
    """

    def __init__(self, what: str, node: str, running: int, queued: int, wait_s: float) -> None:
        if running < 1 or queued < 0 or wait_s <= 0:
            raise ValueError(f"{what} gate: running={running} (>= 1), queued={queued} (>= 0), wait_s={wait_s} (> 0)")
        self.what, self.node = what, node
        self.running_max, self.queued_max, self.wait_s = running, queued, wait_s
        self.running = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._held_s = 0.05  # moving mean of how long a slot is held
        self.refused = 0

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def _retry_after(self) -> float:
        ahead = self.queued + 1
        return min(30.0, max(0.05, self._held_s * ahead / self.running_max))

    def _refuse(self, why: str) -> Overloaded:
        self.refused += 1
        return Overloaded(f"node {self.node} is overloaded: {why}; retry later", self._retry_after())

    def check(self) -> None:
        """``Overloaded`` now if a call would find no slot and no room to wait."""
        if self.running >= self.running_max and self.queued >= self.queued_max:
            raise self._refuse(f"{self.running} {self.what} running and {self.queued} waiting "
                               f"(at most {self.running_max} and {self.queued_max})")

    @contextlib.asynccontextmanager
    async def slot(self, queue: bool = True) -> AsyncIterator[None]:
        """Hold one slot for the block. ``queue=False``: wait for a slot however long the queue
        is (the parts of a batch that ``check`` let in), still at most ``wait_s``."""
        if self.running >= self.running_max or self._waiters:
            if queue:
                self.check()
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(asyncio.shield(waiter), self.wait_s)
            except TimeoutError:
                if not waiter.done():
                    waiter.cancel()
                    raise self._refuse(f"no slot for {self.what} within {self.wait_s:g} s "
                                       f"({self.running} running, {self.queued} waiting)") from None
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._release()  # handed a slot just as this call was cancelled: pass it on
                else:
                    waiter.cancel()
                raise
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        else:
            self.running += 1
        start = time.monotonic()
        try:
            yield
        finally:
            self._held_s += (time.monotonic() - start - self._held_s) * 0.1
            self._release()

    def _release(self) -> None:
        """Hand the slot to the first caller still waiting, else free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: ``running`` stays
                return
        self.running -= 1
