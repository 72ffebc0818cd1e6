"""Placement: which nodes get new sandboxes. A pure function of a cluster view; no I/O.

Power of k choices: keep the nodes that can take the sandbox (each resource within its
capacity times its overcommit ratio), sample ``k`` of them at random, take the least loaded.
Sampling a few instead of scanning for the global minimum keeps many apiservers with slightly
stale views from all piling onto the same "emptiest" node, and spreads as well: with k = 2 the
most loaded node sits close to the mean.

A batch of N is placed one sandbox at a time against a private copy of the view, so it
spreads over nodes as N single creates would. The k candidates are found by drawing nodes at
random until k of them fit (a uniform sample of the nodes that fit, without scanning them all);
only when fitting nodes are scarce does it fall back to filtering the whole view, once per call.
A decision thus costs O(k) on a roomy cluster and O(nodes) on a nearly full one.

CPU requests are weights (``cpu.shares``), so CPU is overcommitted far above 1× by default;
memory limits are ceilings the kernel enforces, so memory stays near 1×. A node's edge still
admits or refuses against its real state: a view can be stale, and the caller tries another
node when an edge refuses.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# CPU: ~90% of agent sandboxes use at most 5% of the CPU they ask for, and an idle one uses
# none, so CPU weights are overcommitted until the sandbox count binds (on this 2-core machine,
# 4,096 sandboxes of 1 core: 2,048×). Memory: limits are ceilings, not reservations, but memory
# is the resource that cannot be taken back quickly; 2.5× is the lowest round ratio that holds
# the demo's 200 × 256 MB on a 24 GB node (paused sandboxes give their memory to swap).
DEFAULT_CPU_OVERCOMMIT = 2048.0
DEFAULT_MEMORY_OVERCOMMIT = 2.5
DEFAULT_K = 2


@dataclass(frozen=True)
class Overcommit:
    """How far each resource may be committed beyond the node's capacity."""

    cpu: float = DEFAULT_CPU_OVERCOMMIT
    memory: float = DEFAULT_MEMORY_OVERCOMMIT

    def __post_init__(self) -> None:
        for name in ("cpu", "memory"):
            value = getattr(self, name)
            if not (value > 0 and value < float("inf")):
                raise ValueError(f"{name} overcommit must be a positive finite ratio, not {value!r}")


@dataclass(frozen=True)
class NodeLoad:
    """One node of the cluster view: capacity and what is committed on it."""

    node: str
    cpu_cores: float
    memory_mb: float
    max_sandboxes: int | None = None
    committed_cpu: float = 0.0
    committed_memory_mb: float = 0.0
    sandboxes: int = 0
    healthy: bool = True


@dataclass(frozen=True)
class Demand:
    """What one sandbox commits: its CPU weight in cores (0 for best effort) and memory."""

    cpu_cores: float
    memory_mb: float


def fits(node: NodeLoad, demand: Demand, overcommit: Overcommit = Overcommit()) -> bool:
    """True when ``node`` can take one more sandbox of ``demand``."""
    return _Slots(node, overcommit).fits(demand)


def load(node: NodeLoad, overcommit: Overcommit = Overcommit()) -> float:
    """The node's dominant share: its most committed resource, as a fraction of what it may
    commit (0 empty, 1 full)."""
    return _Slots(node, overcommit).load()


class _Slots:
    """Mutable per-node numbers of one placement call (the view itself is not touched)."""

    __slots__ = ("cpu", "mem", "count", "cpu_cap", "mem_cap", "max_count", "healthy")

    def __init__(self, n: NodeLoad, oc: Overcommit) -> None:
        self.cpu = n.committed_cpu
        self.mem = n.committed_memory_mb
        self.count = n.sandboxes
        self.cpu_cap = n.cpu_cores * oc.cpu
        self.mem_cap = n.memory_mb * oc.memory
        self.max_count = n.max_sandboxes
        self.healthy = n.healthy

    def fits(self, d: Demand) -> bool:
        return (
            self.healthy
            and (self.max_count is None or self.count < self.max_count)
            and self.cpu + d.cpu_cores <= self.cpu_cap + 1e-9
            and self.mem + d.memory_mb <= self.mem_cap + 1e-9
        )

    def load(self) -> float:
        share = max(self.cpu / self.cpu_cap if self.cpu_cap > 0 else 1.0,
                    self.mem / self.mem_cap if self.mem_cap > 0 else 1.0)
        if self.max_count is not None:
            share = max(share, self.count / self.max_count if self.max_count > 0 else 1.0)
        return share

    def take(self, d: Demand) -> None:
        self.cpu += d.cpu_cores
        self.mem += d.memory_mb
        self.count += 1


def place(
    view: Sequence[NodeLoad],
    demand: Demand,
    count: int = 1,
    *,
    overcommit: Overcommit = Overcommit(),
    k: int = DEFAULT_K,
    rng: random.Random | None = None,
    exclude: Iterable[str] = (),
) -> list[str]:
    """Choose a node for each of ``count`` sandboxes of ``demand``.

    Returns the node names, one per sandbox, in order; fewer than ``count`` (possibly none)
    when the view has no room for the rest. Nodes in ``exclude`` (ones that just refused) are
    never chosen. Ties in load go to the node with fewer sandboxes."""
    if count < 0:
        raise ValueError(f"count must be >= 0, not {count}")
    if k < 1:
        raise ValueError(f"k must be >= 1, not {k}")
    rng = rng or random
    skip = set(exclude)
    n = len(view)
    slots: dict[int, _Slots | None] = {}

    def slot(i: int) -> _Slots | None:
        if i not in slots:
            slots[i] = None if view[i].node in skip else _Slots(view[i], overcommit)
        return slots[i]

    def fit(i: int) -> bool:
        s = slot(i)
        return s is not None and s.fits(demand)

    fitting: list[int] | None = None  # the filtered view, once sampling stops paying
    position: dict[int, int] = {}
    chosen: list[str] = []
    while len(chosen) < count:
        if fitting is None:
            # Draw distinct nodes at random until k fit: a uniform k-subset of the fitting ones.
            sample, drawn = [], set()
            for _ in range(min(n, 4 * k + 8)):
                i = rng.randrange(n)
                if i in drawn:
                    continue
                drawn.add(i)
                if fit(i):
                    sample.append(i)
                    if len(sample) == k:
                        break
            if len(sample) < k:  # few nodes fit (or a small view): filter it all, once
                fitting = [i for i in range(n) if fit(i)]
                position = {i: p for p, i in enumerate(fitting)}
                continue
        else:
            if not fitting:
                break
            sample = fitting if len(fitting) <= k else rng.sample(fitting, k)
        best = min(sample, key=lambda i: (slots[i].load(), slots[i].count))
        s = slots[best]
        s.take(demand)
        chosen.append(view[best].node)
        if fitting is not None and not s.fits(demand):
            # Swap-remove from the fitting list in O(1).
            p = position.pop(best)
            last = fitting.pop()
            if last != best:
                fitting[p] = last
                position[last] = p
    return chosen


def least_loaded(view: Sequence[NodeLoad], *, overcommit: Overcommit = Overcommit(),
                 exclude: Iterable[str] = ()) -> str | None:
    """The healthy node with the most room left, fitting or not (a last resort: its edge gives
    the authoritative answer when the view says nothing fits)."""
    skip = set(exclude)
    candidates = [n for n in view if n.healthy and n.node not in skip]
    if not candidates:
        return None
    return min(candidates, key=lambda n: (load(n, overcommit), n.sandboxes)).node
