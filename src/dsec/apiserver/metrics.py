"""The apiserver's figures: what passes through it (``ApiMetrics``, counted as it serves), and
``/metrics`` in Prometheus' text format, rendered from a ``ClusterStats``: this apiserver's own
counters plus every node's report (``EdgeAPI.node_stats``). The apiserver holds no per-sandbox
state: sandboxes by state, kind and project, node CPU and memory, pool hits, pauses, FnCall
calls and security events are the nodes' own counts, gathered when ``/metrics`` is scraped.

Metric names (``node`` labels the node a figure comes from):

=============================================  =========  ===========================================
``dsec_api_creates_total{kind,outcome}``        counter    creates answered: ok, refused, invalid, error
``dsec_api_create_seconds{kind}``               histogram  a create as its caller waited for it
``dsec_api_commands_total``                     counter    commands (``run_shell``) passed on
``dsec_api_command_seconds``                    histogram  a command as its caller waited for it
``dsec_api_refusals_total{reason}``             counter    creates refused here: capacity, quota
``dsec_api_fncalls_total``                      counter    FnCall calls passed on
``dsec_api_batch_sandboxes_total``              counter    sandboxes made by batch creates
``dsec_node_up{node}``                          gauge      1: answered this scrape; 0: lost
``dsec_sandboxes{node,state,kind,project}``     gauge      sandboxes held, by state
``dsec_node_creates_total{node,kind}``          counter    sandboxes made
``dsec_node_create_failures_total{node,kind}``  counter    creates that failed (refusals apart)
``dsec_node_create_seconds{node,kind}``         histogram  arrival at the node to running
``dsec_node_command_seconds{node,kind}``        histogram  a command's run on the node
``dsec_node_admission_refusals_total{node,reason}`` counter  capacity, limit
``dsec_node_pool_hits_total{node}``             counter    creates served from the warm pool
``dsec_node_pool_misses_total{node}``           counter    creates that found their pool empty
``dsec_node_fncalls_total{node}``               counter    FnCall calls run (and ``…_failures_total``)
``dsec_node_fncall_seconds{node}``              histogram  an FnCall's run
``dsec_node_pauses_total{node}``                counter    pauses (and ``dsec_node_resumes_total``)
``dsec_node_security_events_total{node,kind}``  counter    security events, repeats counted
``dsec_node_cpu_cores{node}``                   gauge      cores (also ``…_committed_cores``, ``…_used_cores``)
``dsec_node_memory_bytes{node}``                gauge      RAM (also ``…_committed_bytes``, ``…_used_bytes``)
=============================================  =========  ===========================================

plus ``process_*`` (this apiserver's CPU, memory, fds) from prometheus-client.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timezone

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from libdsec.protocol import LATENCY_BOUNDS, ApiserverStats, ClusterStats, LatencyHistogram

from ..edge.stats import Histogram, metrics_enabled

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_MB = 1 << 20


class ApiMetrics:
    """What this apiserver counts; ``enabled`` False (``DSEC_METRICS=0``): nothing."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = metrics_enabled() if enabled is None else enabled
        self.started_at = datetime.now(timezone.utc)
        self.creates: Counter[tuple[str, str]] = Counter()
        self.create_seconds: dict[str, Histogram] = {}
        self.commands = 0
        self.command_seconds = Histogram()
        self.refusals: Counter[str] = Counter()
        self.fncalls = 0
        self.batch_sandboxes = 0

    def create(self, kind: str, outcome: str, seconds: float) -> None:
        self.creates[kind, outcome] += 1
        hist = self.create_seconds.get(kind)
        if hist is None:
            hist = self.create_seconds[kind] = Histogram()
        hist.observe(seconds)

    def refused(self, reason: str) -> None:
        self.refusals[reason] += 1

    def command(self, seconds: float) -> None:
        self.commands += 1
        self.command_seconds.observe(seconds)

    def report(self) -> ApiserverStats:
        creates: dict[str, dict[str, int]] = {}
        for (kind, outcome), n in self.creates.items():
            creates.setdefault(kind, {})[outcome] = n
        return ApiserverStats(
            started_at=self.started_at, creates=creates,
            create_seconds={k: h.report() for k, h in self.create_seconds.items()}, commands=self.commands,
            command_seconds=self.command_seconds.report(), refusals=dict(self.refusals), fncalls=self.fncalls,
            batch_sandboxes=self.batch_sandboxes,
        )


def _buckets(hist: LatencyHistogram) -> list[tuple[str, float]]:
    out, running = [], 0
    for bound, n in zip(LATENCY_BOUNDS, hist.counts):
        running += n
        out.append((repr(float(bound)), running))
    out.append(("+Inf", hist.count))
    return out


def families(stats: ClusterStats) -> Iterator[Metric]:
    """Every metric of the module docstring, from one ``ClusterStats``."""
    api = stats.apiserver
    f = CounterMetricFamily("dsec_api_creates", "Creates answered by this apiserver.", labels=["kind", "outcome"])
    for kind, outcomes in sorted(api.creates.items()):
        for outcome, n in sorted(outcomes.items()):
            f.add_metric([kind, outcome], n)
    yield f
    f = HistogramMetricFamily("dsec_api_create_seconds", "Create latency as callers of this apiserver saw it.",
                              labels=["kind"])
    for kind, hist in sorted(api.create_seconds.items()):
        f.add_metric([kind], _buckets(hist), hist.sum_s)
    yield f
    yield CounterMetricFamily("dsec_api_commands", "Commands passed on by this apiserver.", value=api.commands)
    f = HistogramMetricFamily("dsec_api_command_seconds", "Command latency as callers of this apiserver saw it.")
    f.add_metric([], _buckets(api.command_seconds), api.command_seconds.sum_s)
    yield f
    f = CounterMetricFamily("dsec_api_refusals", "Creates refused by this apiserver.", labels=["reason"])
    for reason, n in sorted(api.refusals.items()):
        f.add_metric([reason], n)
    yield f
    yield CounterMetricFamily("dsec_api_fncalls", "FnCall calls passed on by this apiserver.", value=api.fncalls)
    yield CounterMetricFamily("dsec_api_batch_sandboxes", "Sandboxes made by batch creates through this apiserver.",
                              value=api.batch_sandboxes)

    up = GaugeMetricFamily("dsec_node_up", "1: the node answered this scrape; 0: it left the cluster.",
                           labels=["node"])
    for n in stats.nodes:
        up.add_metric([n.info.node], 1)
    for node in stats.lost_nodes:
        up.add_metric([node], 0)
    yield up
    f = GaugeMetricFamily("dsec_sandboxes", "Sandboxes held by the nodes.", labels=["node", "state", "kind", "project"])
    for n in stats.nodes:
        for c in n.sandboxes:
            f.add_metric([n.info.node, c.status.value, c.kind.value, c.project], c.count)
    yield f

    def per_kind(name: str, doc: str, attr: str) -> Metric:
        fam = CounterMetricFamily(name, doc, labels=["node", "kind"])
        for n in stats.nodes:
            for kind, v in sorted(getattr(n, attr).items()):
                fam.add_metric([n.info.node, kind], v)
        return fam

    def hist_per_kind(name: str, doc: str, attr: str) -> Metric:
        fam = HistogramMetricFamily(name, doc, labels=["node", "kind"])
        for n in stats.nodes:
            for kind, hist in sorted(getattr(n, attr).items()):
                fam.add_metric([n.info.node, kind], _buckets(hist), hist.sum_s)
        return fam

    def per_node(name: str, doc: str, value, family=CounterMetricFamily) -> Metric:
        fam = family(name, doc, labels=["node"])
        for n in stats.nodes:
            fam.add_metric([n.info.node], value(n))
        return fam

    yield per_kind("dsec_node_creates", "Sandboxes made by the node.", "creates")
    yield per_kind("dsec_node_create_failures", "Creates that failed on the node (refusals apart).", "create_failures")
    yield hist_per_kind("dsec_node_create_seconds", "A create's arrival at the node to its sandbox running.",
                        "create_seconds")
    yield hist_per_kind("dsec_node_command_seconds", "A command's run on the node.", "command_seconds")
    f = CounterMetricFamily("dsec_node_admission_refusals", "Creates the node's admission refused.",
                            labels=["node", "reason"])
    for n in stats.nodes:
        for reason, v in sorted(n.admission_refusals.items()):
            f.add_metric([n.info.node, reason], v)
    yield f
    yield per_node("dsec_node_pool_hits", "Creates served from the warm pool.", lambda n: n.pool_hits)
    yield per_node("dsec_node_pool_misses", "Creates that found their warm pool empty.", lambda n: n.pool_misses)
    yield per_node("dsec_node_fncalls", "FnCall calls run by the node.", lambda n: n.fncalls)
    yield per_node("dsec_node_fncall_failures", "FnCall calls that failed, timed out or exited non-zero.",
                   lambda n: n.fncall_failures)
    f = HistogramMetricFamily("dsec_node_fncall_seconds", "An FnCall's run.", labels=["node"])
    for n in stats.nodes:
        f.add_metric([n.info.node], _buckets(n.fncall_seconds), n.fncall_seconds.sum_s)
    yield f
    yield per_node("dsec_node_pauses", "Sandboxes paused.", lambda n: n.pauses)
    yield per_node("dsec_node_resumes", "Sandboxes resumed.", lambda n: n.resumes)
    yield per_kind("dsec_node_security_events", "Security events seen (repeats counted).", "security_events")
    gauge = GaugeMetricFamily
    yield per_node("dsec_node_cpu_cores", "The node's CPU cores.", lambda n: n.info.cpu_cores, gauge)
    yield per_node("dsec_node_cpu_committed_cores", "CPU weights its sandboxes commit, in cores.",
                   lambda n: n.info.committed_cpu, gauge)
    yield per_node("dsec_node_cpu_used_cores", "Cores busy on the node's host.", lambda n: n.cpu_used_cores, gauge)
    yield per_node("dsec_node_memory_bytes", "The node's RAM.", lambda n: n.info.memory_total_mb * _MB, gauge)
    yield per_node("dsec_node_memory_committed_bytes", "Memory limits its sandboxes commit.",
                   lambda n: n.info.committed_memory_mb * _MB, gauge)
    yield per_node("dsec_node_memory_used_bytes", "Memory in use on the node's host (MemTotal - MemAvailable).",
                   lambda n: n.memory_used_mb * _MB, gauge)


class _Snapshot:
    """A prometheus-client collector over the ``ClusterStats`` being rendered."""

    def __init__(self) -> None:
        self.stats: ClusterStats | None = None

    def collect(self) -> Iterator[Metric]:
        if self.stats is not None:
            yield from families(self.stats)


class Exposition:
    """Renders ``ClusterStats`` as the text ``/metrics`` answers, with this process's own."""

    def __init__(self) -> None:
        self._snapshot = _Snapshot()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._snapshot)
        ProcessCollector(registry=self._registry)
        self._lock = threading.Lock()

    def render(self, stats: ClusterStats) -> bytes:
        with self._lock:
            self._snapshot.stats = stats
            try:
                return generate_latest(self._registry)
            finally:
                self._snapshot.stats = None
