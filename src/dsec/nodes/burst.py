"""Cloud bursting: when to ask for more nodes, when to let them go. A pure function of the
cluster view; no I/O (``dsec.nodes.ray_burst`` applies its plans on a Ray cluster).

    plan = decide(infos, burst_nodes, state, now, settings)

``infos`` are the nodes' reports (``NodeInfo``), ``burst_nodes`` the names of the nodes that
came for bursting (a Ray node offering ``dsec_burst``), ``state`` the last plan's ``state``
(``BurstState()`` at first). The plan says how many burst nodes to ask the autoscaler for,
which burst nodes to drain (no new creates; they keep serving their sandboxes) or take back,
and which drained nodes are empty and may go.

Committed share: over the nodes that take new creates (all but the draining ones), the most
committed resource — CPU weights, memory limits, sandbox count — as a fraction of what those
nodes may commit (capacity times each node's overcommit ratio; the count against
``max_sandboxes``), as placement counts room (``dsec.placement``).

- At or above ``high_water``: draining nodes are taken back first (they are already there);
  else enough burst nodes are asked for that the share would fall below ``high_water`` if each
  were like the average node, counting those asked for and not yet joined, up to
  ``max_nodes``.
- Below ``low_water`` for ``quiet_s`` on end: nodes asked for and not yet joined are no longer
  wanted, and the emptiest burst nodes are drained while the rest could hold everything that is
  committed below ``low_water``.
- A draining node holding no sandbox for ``settle_s`` since it began draining (creates placed
  before then have landed) is released: the caller lets it go.
- In between, nothing changes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from libdsec.protocol import NodeInfo


@dataclass(frozen=True)
class BurstSettings:
    """Water marks are committed shares; ``max_nodes`` the most burst nodes asked for at once;
    ``settle_s`` how long a node drains at least before it may go."""

    high_water: float = 0.8
    low_water: float = 0.5
    quiet_s: float = 60.0
    max_nodes: int = 4
    settle_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.low_water < self.high_water <= 1:
            raise ValueError(f"bursting needs 0 < low water < high water <= 1, not {self.low_water:g} and "
                             f"{self.high_water:g}")
        if self.max_nodes < 0 or self.quiet_s < 0 or self.settle_s < 0:
            raise ValueError("bursting: max_nodes, quiet_s and settle_s must be >= 0")


@dataclass(frozen=True)
class BurstState:
    """What a plan remembers for the next one."""

    requested: int = 0  # burst nodes wanted: the ones here that are not draining, and those asked for
    quiet_since: float | None = None  # below low water since then
    draining: dict[str, float] = field(default_factory=dict)  # node -> since when


@dataclass(frozen=True)
class Plan:
    request: int  # burst nodes to ask the autoscaler for, in all (not more of them)
    drain: frozenset[str]  # burst nodes that take no new creates (all draining ones, not only new)
    release: frozenset[str]  # draining nodes now empty: let them go
    share: float  # the committed share the plan was made on
    state: BurstState


@dataclass(frozen=True)
class _Sums:
    """What some nodes commit, and what they may commit (``count_cap`` None: no count limit)."""

    cpu: float
    cpu_cap: float
    memory: float
    memory_cap: float
    count: int
    count_cap: int | None

    @classmethod
    def of(cls, infos: Iterable[NodeInfo]) -> _Sums:
        infos = list(infos)
        caps = [i.max_sandboxes for i in infos]
        return cls(
            cpu=sum(i.committed_cpu for i in infos), cpu_cap=sum(i.cpu_cores * i.cpu_overcommit for i in infos),
            memory=sum(i.committed_memory_mb for i in infos),
            memory_cap=sum(i.memory_total_mb * i.memory_overcommit for i in infos),
            count=sum(i.sandboxes for i in infos),
            # One node without a count limit: the count binds nowhere.
            count_cap=None if None in caps else sum(caps),
        )

    def share_on(self, room: _Sums) -> float:
        """The most committed resource of these commitments over ``room``'s capacity."""

        def share(used: float, cap: float) -> float:
            return used / cap if cap > 0 else (1.0 if used > 0 else 0.0)

        shares = [share(self.cpu, room.cpu_cap), share(self.memory, room.memory_cap)]
        if room.count_cap is not None:
            shares.append(share(self.count, room.count_cap))
        return max(shares)


def committed_share(infos: Iterable[NodeInfo]) -> float:
    """The nodes' most committed resource as a fraction of what they may commit together
    (0 with no node)."""
    sums = _Sums.of(infos)
    return sums.share_on(sums)


def decide(infos: Sequence[NodeInfo], burst_nodes: Iterable[str], state: BurstState, now: float,
           settings: BurstSettings) -> Plan:
    burst = frozenset(burst_nodes)
    by_node = {i.node: i for i in infos}
    # A draining node that left (released, or lost) is no longer draining.
    draining = {n: since for n, since in state.draining.items() if n in burst}
    active = [i for i in infos if i.node not in draining]
    share = committed_share(active)
    staying = len(burst - draining.keys())  # burst nodes here that take creates
    requested, quiet_since = state.requested, state.quiet_since

    if share >= settings.high_water:
        quiet_since = None
        if draining:
            requested += len(draining)  # wanted again: the cheapest capacity there is
            draining = {}
        else:
            pending = max(0, requested - staying)
            # Nodes like the average one, so that the share would fall below high water once
            # those asked for and not yet here have joined too.
            total = math.floor(share * len(active) / settings.high_water) + 1
            more = total - len(active) - pending
            requested = staying + pending + max(more, 0 if pending else 1)
    elif share < settings.low_water:
        quiet_since = now if quiet_since is None else quiet_since
        if now - quiet_since >= settings.quiet_s:
            requested = staying  # those asked for and not here yet: no longer wanted
            held = _Sums.of(active)
            remaining = list(active)
            for info in sorted((by_node[n] for n in burst - draining.keys() if n in by_node),
                               key=lambda i: (i.sandboxes, i.committed_memory_mb, i.node)):
                rest = [i for i in remaining if i.node != info.node]
                if not rest or held.share_on(_Sums.of(rest)) >= settings.low_water:
                    break
                remaining = rest
                draining[info.node] = now
                requested -= 1
    else:
        quiet_since = None

    requested = max(0, min(requested, settings.max_nodes))
    release = frozenset(n for n, since in draining.items()
                        if n in by_node and by_node[n].sandboxes == 0 and now - since >= settings.settle_s)
    return Plan(request=requested, drain=frozenset(draining), release=release, share=share,
                state=BurstState(requested=requested, quiet_since=quiet_since, draining=draining))
