"""The cold-memory reclaimer: pushes out memory that running sandboxes are not using.

Every ``interval_s`` it takes the sandboxes that have had no call for ``idle_s`` and reclaims
``fraction`` of what each holds (at least ``min_bytes``), through the cgroup (``reclaim``): the
kernel takes the coldest pages of that cgroup first (its LRU order), to swap or, for clean
file pages, nowhere. A sandbox that keeps idling loses a further fraction each pass, so what it
holds decays toward what it touches; a call stops the decay until it idles again. What a
page-in costs later is the price: a minor fault from zram (microseconds per page).

(The host here already runs a kdamond of its own, DAMON paging out physical memory idle for a
minute with no cgroup filter; DAMON's per-memcg filters match one cgroup each and this kernel
has no per-process address monitoring, so per-sandbox reclaim goes through the cgroups.)

``start()`` runs it on the current event loop; ``close()`` stops it (a second call does
nothing). ``reclaim_once()`` is one pass, for tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from . import reclaim

log = logging.getLogger("dsec.resources.coldmem")


@dataclass
class ColdMemoryStats:
    passes: int = 0
    reclaimed_bytes: int = 0
    sandboxes_touched: int = 0
    last_pass_s: float = 0.0
    errors: list[str] = field(default_factory=list)


class ColdMemoryReclaimer:
    def __init__(
        self,
        cgroup_parent: str,
        idle_cids: Callable[[float], Iterable[str]],
        *,
        idle_s: float = 60.0,
        interval_s: float = 30.0,
        fraction: float = 0.5,
        min_bytes: int = 1 << 20,
        concurrency: int = 2,
    ) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], not {fraction}")
        self.parent = cgroup_parent
        self.idle_cids = idle_cids
        self.idle_s = idle_s
        self.interval_s = interval_s
        self.fraction = fraction
        self.min_bytes = min_bytes
        self.concurrency = concurrency
        self.stats = ColdMemoryStats()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="dsec-cold-memory")

    async def close(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.reclaim_once()
            except Exception as exc:  # noqa: BLE001 - a pass that fails is logged; the next one runs
                log.warning("cold-memory pass failed: %s", exc)

    async def reclaim_once(self) -> int:
        """One pass over the idle sandboxes; returns the bytes reclaimed."""
        start = time.perf_counter()
        cids = list(self.idle_cids(self.idle_s))
        sem = asyncio.Semaphore(self.concurrency)
        total = 0

        async def one(cid: str) -> None:
            nonlocal total
            async with sem:
                held = reclaim.usage(self.parent, cid) or 0
                want = max(self.min_bytes, int(held * self.fraction))
                if held < self.min_bytes:
                    return
                try:
                    got = await asyncio.to_thread(reclaim.reclaim, self.parent, cid, want)
                except OSError as exc:  # the sandbox went away meanwhile, most likely
                    self.stats.errors = (self.stats.errors + [f"{cid}: {exc}"])[-20:]
                    return
                total += got
                self.stats.sandboxes_touched += got > 0

        await asyncio.gather(*(one(c) for c in cids))
        self.stats.passes += 1
        self.stats.reclaimed_bytes += total
        self.stats.last_pass_s = time.perf_counter() - start
        return total
