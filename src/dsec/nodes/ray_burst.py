"""Bursting on a Ray cluster: the plans of ``dsec.nodes.burst``, applied once per membership poll
by ``RayNodes`` (``dsec serve --ray ADDRESS --burst-max N``).

Burst nodes are the Ray nodes that offer the custom resource ``dsec_burst`` besides ``dsec_edge``:
the autoscaler's node type for bursting gives both (``resources: {"dsec_edge": 1, "dsec_burst":
1}``), the base nodes only ``dsec_edge``. Asking for N burst nodes is
``request_resources(bundles=[{"dsec_edge": 1, "dsec_burst": 1}] * N)``: a request is for the
cluster's total, not more on top, and only the burst node type fits such a bundle. Each step:

- placement takes the burst nodes only for what the base nodes have no room for
  (``Cluster.overflow``), and draining nodes not at all (``Cluster.draining``);
- the request changes when the plan's number does (a request stands until the next one);
- a released node is let go (``RayNodes.let_go``): its edge stops and its actor ends, so the
  node holds nothing of Ray's and the autoscaler removes it once idle for its
  ``idle_timeout_minutes``; it gets no edge again while it stays.

A request replaces any other made on the same Ray cluster (``request_resources`` keeps one):
one apiserver of a cluster bursts, and nothing else there calls it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from ..apiserver.cluster import Cluster
from .burst import BurstSettings, BurstState, Plan, decide

log = logging.getLogger("dsec.nodes.ray_burst")

BURST_RESOURCE = "dsec_burst"


class RayBurst:
    """Applies bursting plans to a cluster (see the module docstring). ``step`` is called by one
    task at a time; ``request`` is blocking (run in a thread), ``let_go`` a coroutine."""

    def __init__(self, settings: BurstSettings, cluster: Cluster, let_go: Callable[[str], Awaitable[None]], *,
                 request: Callable[[int], None], view_max_age_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.cluster, self.let_go, self.request = settings, cluster, let_go, request
        self.view_max_age_s, self.clock = view_max_age_s, clock
        self.state = BurstState()
        self._asked: int | None = None  # the standing request, once this apiserver made one

    async def step(self, burst_nodes: Iterable[str]) -> Plan:
        burst = frozenset(burst_nodes)
        infos = await self.cluster.node_infos(max_age_s=self.view_max_age_s)
        plan = decide(infos, burst, self.state, self.clock(), self.settings)
        begun, taken_back = plan.drain - self.state.draining.keys(), (self.state.draining.keys() - plan.drain) & burst
        if begun:
            log.info("bursting: draining %s (committed share %.2f)", ", ".join(sorted(begun)), plan.share)
        if taken_back:
            log.info("bursting: taking %s back (committed share %.2f)", ", ".join(sorted(taken_back)), plan.share)
        self.state = plan.state
        self.cluster.overflow, self.cluster.draining = burst, plan.drain
        if plan.request != self._asked:
            log.info("bursting: asking the autoscaler for %d burst nodes (%d here; committed share %.2f)",
                     plan.request, len(burst), plan.share)
            await asyncio.to_thread(self.request, plan.request)
            self._asked = plan.request
        for node in sorted(plan.release):
            log.info("bursting: burst node %s is drained and empty: letting it go", node)
            await self.let_go(node)
        return plan
