"""What an edge counts as it works, for ``node_stats`` (the apiserver's ``/metrics`` and
dashboard gather it from every node through the seam).

The edge calls in at a few points (a create done or refused, a command's end, a pause, a
resume, an FnCall's end); each costs a dict update or two and, for latencies, a bisect into
fixed buckets (``libdsec.protocol.LATENCY_BOUNDS``): nothing is read or written outside this
process on the hot path. The host's CPU and memory in use are read when a report is asked for.

``DSEC_METRICS=0`` in the environment turns the counting off (the edge still answers, with
zeros): the lifecycle benchmark's ``--compare-metrics`` measures what counting costs with it.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable
from datetime import datetime, timezone

from libdsec.protocol import LATENCY_BOUNDS, LatencyHistogram, NodeInfo, NodeStats, SandboxCount, SandboxKind

from .. import settings
from ..isolation.events import SecurityEvents
from .lifecycle import Record
from .pool import WarmPool


def metrics_enabled() -> bool:
    return settings.current().metrics


class Histogram:
    """Latencies in the buckets of ``LATENCY_BOUNDS``."""

    __slots__ = ("counts", "sum_s")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BOUNDS) + 1)
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(LATENCY_BOUNDS, seconds)] += 1
        self.sum_s += seconds

    def report(self) -> LatencyHistogram:
        return LatencyHistogram(counts=list(self.counts), sum_s=self.sum_s)


class _HostCPU:
    """Cores busy between two readings of /proc/stat."""

    def __init__(self) -> None:
        self._last = (0, 0)  # (busy, total) jiffies; from boot at the first reading

    def used_cores(self) -> float:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return 0.0
        total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
        busy = total - fields[3] - (fields[4] if len(fields) > 4 else 0)
        last_busy, last_total = self._last
        self._last = (busy, total)
        if total <= last_total:
            return 0.0
        return round((busy - last_busy) / (total - last_total) * (os.cpu_count() or 1), 3)


def memory_used_mb() -> int:
    values = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    values[name] = int(rest.split()[0])
    except (OSError, ValueError):
        return 0
    return (values.get("MemTotal", 0) - values.get("MemAvailable", 0)) // 1024


class EdgeStats:
    """One edge's counters (see the module docstring); ``enabled`` False: none is kept."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = metrics_enabled() if enabled is None else enabled
        self.started_at = datetime.now(timezone.utc)
        # By sandbox kind (the report's keys are the kinds' strings).
        self.creates: Counter[SandboxKind] = Counter()
        self.create_failures: Counter[SandboxKind] = Counter()
        self.create_seconds: dict[SandboxKind, Histogram] = {}
        self.command_seconds: dict[SandboxKind, Histogram] = {}
        self.refusals: Counter[str] = Counter()
        self.fncalls = 0
        self.fncall_failures = 0
        self.fncall_seconds = Histogram()
        self.pauses = 0
        self.resumes = 0
        self._cpu = _HostCPU()

    # -- what the edge calls ---------------------------------------------------------------------

    def created(self, kind: SandboxKind, seconds: float) -> None:
        """A sandbox of ``kind`` runs, ``seconds`` after its create arrived."""
        if not self.enabled:
            return
        self.creates[kind] += 1
        hist = self.create_seconds.get(kind)
        if hist is None:
            hist = self.create_seconds[kind] = Histogram()
        hist.observe(seconds)

    def refused(self, reason: str, count: int = 1) -> None:
        if self.enabled:
            self.refusals[reason] += count

    def create_failed(self, kind: SandboxKind) -> None:
        if self.enabled:
            self.create_failures[kind] += 1

    def command(self, kind: SandboxKind, seconds: float) -> None:
        if not self.enabled:
            return
        hist = self.command_seconds.get(kind)
        if hist is None:
            hist = self.command_seconds[kind] = Histogram()
        hist.observe(seconds)

    def fncall(self, seconds: float, failed: bool) -> None:
        if self.enabled:
            self.fncalls += 1
            self.fncall_failures += failed
            self.fncall_seconds.observe(seconds)

    def paused(self) -> None:
        if self.enabled:
            self.pauses += 1

    def resumed(self) -> None:
        if self.enabled:
            self.resumes += 1

    # -- the report ------------------------------------------------------------------------------

    def report(self, info: NodeInfo, records: Iterable[Record], events: SecurityEvents, pool: WarmPool) -> NodeStats:
        by: Counter[tuple] = Counter((r.status, r.kind, r.project) for r in records)
        return NodeStats(
            info=info, started_at=self.started_at, creates=dict(self.creates),
            create_failures=dict(self.create_failures),
            create_seconds={k: h.report() for k, h in self.create_seconds.items()},
            command_seconds={k: h.report() for k, h in self.command_seconds.items()},
            admission_refusals=dict(self.refusals), pool_hits=pool.hits, pool_misses=pool.misses,
            fncalls=self.fncalls, fncall_failures=self.fncall_failures, fncall_seconds=self.fncall_seconds.report(),
            pauses=self.pauses, resumes=self.resumes, security_events=dict(events.totals),
            recent_security_events=events.recent_events(),
            sandboxes=[SandboxCount(status=s, kind=k, project=p, count=n) for (s, k, p), n in sorted(
                by.items(), key=lambda item: (item[0][0].value, item[0][1], item[0][2]))],
            cpu_used_cores=self._cpu.used_cores(), memory_used_mb=memory_used_mb(),
        )
