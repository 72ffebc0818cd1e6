"""The warm pool: sandboxes made ahead, per image in demand, so a burst of creates does not wait
for the backend to start each one.

A pooled sandbox has its image but no run args yet; a create takes one and sets what varies per
sandbox (its limits unless they are the ones it was made with, its user, its workdir). Per
(kind, layers) the pool grows to the peak demand it has seen (creates in flight, or arriving
within half a second) within ``pool_min``..``pool_max``, and an image unused for ``pool_idle_s``
loses its pool. Refills are made with the limits of the image's latest create, so a create that
asks the same sets none on its way, and they wait while a burst is being served from the pool
(unless it runs low), since starting sandboxes takes the CPU the burst needs. Sandboxes of kinds
whose backend lacks ``Capability.WARM_POOL`` (VMs, whose memory is set at boot) and restores from a
snapshot are made to order, never pooled.

A create calls ``arrive`` (counts it, returns its image's pool), ``take`` (a sandbox from the
pool, or a new one), then ``leave`` once it is done, failed or not. ``start()`` runs the filler;
``stop_filling()`` ends it (refills under way then undo themselves); ``close()`` waits for the
refills and trims under way and destroys every pooled sandbox (a second call does nothing).
Pooled sandboxes count against the node's ``max_sandboxes`` with the live ones (``sandboxes``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from libdsec.protocol import SandboxKind

from ..backends.base import Handle, SandboxBackend, SandboxSpec
from ..images.store import Image
from ..resources.cgroups import Limits

if TYPE_CHECKING:
    from .config import EdgeConfig

log = logging.getLogger("dsec.edge")


@dataclass
class ImagePool:
    kind: SandboxKind = SandboxKind.container
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
    made_at: dict[str, float] = field(default_factory=dict)  # cid -> when it was made (wall clock)
    # When recent creates started: a create served from the pool may finish before the next
    # one arrives, so the size of a burst shows in arrivals, not in creates in flight.
    arrivals: deque[float] = field(default_factory=deque)

    def demand(self, now: float, window_s: float = 0.5) -> int:
        self.arrivals.append(now)
        while self.arrivals and now - self.arrivals[0] > window_s:
            self.arrivals.popleft()
        return max(self.in_flight, len(self.arrivals))


async def new_handle(backend: SandboxBackend, image: Image, limits: Limits | None) -> Handle:
    """A new sandbox of ``image``, with ``limits`` set (None: none yet)."""
    spec = SandboxSpec(image=image.name, layers=image.layers, env=dict(image.env), limits=limits, setuid=image.setuid)
    return await backend.create(f"c{secrets.token_hex(8)}", spec)


class WarmPool:
    """The warm pools of one node. ``sandboxes()`` counts the node's live sandboxes."""

    def __init__(self, config: EdgeConfig, backends: dict[str, SandboxBackend], sandboxes: Callable[[], int]) -> None:
        self.config = config
        self.backends = backends
        self.sandboxes = sandboxes
        self.pools: dict[tuple[str, tuple[str, ...]], ImagePool] = defaultdict(ImagePool)
        self.wakeup = asyncio.Event()
        self.closed = False
        self._filler: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # refills and trims under way
        # Creates served from a pool, and those that found it empty (for the node's stats).
        self.hits = 0
        self.misses = 0

    def start(self) -> None:
        # A node that pools nothing runs no filler (and its creates wake none).
        if self.config.pool_max > 0:
            self._filler = asyncio.create_task(self._fill(), name="dsec-pool-filler")

    def stop_filling(self) -> None:
        self.closed = True
        if self._filler is not None:
            self._filler.cancel()

    async def close(self) -> None:
        self.stop_filling()
        if self._filler is not None:
            await asyncio.gather(self._filler, return_exceptions=True)
        # Refills and trims under way finish (a refill sees it closed and undoes itself).
        await asyncio.gather(*self._tasks, return_exceptions=True)
        pooled = [(pool.kind, h) for pool in self.pools.values() for h in pool.handles]
        self.pools.clear()
        await asyncio.gather(*(self.backends[k].destroy(h) for k, h in pooled), return_exceptions=True)

    def pooled(self) -> int:
        return sum(len(p.handles) for p in self.pools.values())

    def layers(self) -> set[str]:
        """The layer digests of the images whose pools hold sandboxes, are making them, serve a
        create or want sandboxes (a refill will make them). A pool that holds and wants none (an
        image no longer in demand, or no warm pool at all) keeps no layer from GC."""
        return {d for pool in self.pools.values()
                if pool.image and (pool.handles or pool.filling or pool.in_flight or pool.want)
                for d in pool.image.layers}

    # -- a create ------------------------------------------------------------------------------

    def arrive(self, kind: SandboxKind, image: Image, limits: Limits) -> ImagePool:
        """A create of ``image`` with ``limits`` starts: its pool, sized for the demand it shows."""
        pool = self.pools[(kind, image.layers)]
        pool.kind, pool.image = kind, image
        pool.in_flight += 1
        pool.last_used = time.monotonic()
        pool.limits = limits
        demand = pool.demand(pool.last_used)
        pool.want = min(self.config.pool_max, max(pool.want, self.config.pool_min, demand))
        if self._filler is not None:
            self.wakeup.set()
        return pool

    def leave(self, pool: ImagePool) -> None:
        """The create that arrived at ``pool`` is over."""
        pool.in_flight -= 1

    async def take(self, pool: ImagePool, limits: Limits, made_after: float = 0.0) -> tuple[Handle, Limits | None]:
        """A sandbox of the pool's image, and the limits it already has (see ImagePool.limits).
        Pooled sandboxes made before ``made_after`` (wall clock: when the layer store was mounted
        again, so their layers read through a mount that has gone) are destroyed, not handed out."""
        backend = self.backends[pool.kind]
        while pool.handles:
            handle = pool.handles.popleft()
            if self._filler is not None:
                self.wakeup.set()
            has = pool.prepared.pop(handle.cid, None)
            if pool.made_at.pop(handle.cid, 0.0) >= made_after and await backend.is_alive(handle):
                self.hits += 1
                return handle, has
            await backend.destroy(handle)
        self.misses += 1
        return await new_handle(backend, pool.image, limits), limits

    # -- the filler ----------------------------------------------------------------------------

    async def _fill(self) -> None:
        sem = asyncio.Semaphore(self.config.pool_fill_concurrency)
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            now = time.monotonic()
            for pool in list(self.pools.values()):
                if now - pool.last_used > self.config.pool_idle_s:
                    pool.want = 0
                while len(pool.handles) > pool.want:
                    handle = pool.handles.pop()
                    pool.prepared.pop(handle.cid, None)
                    pool.made_at.pop(handle.cid, None)
                    self._spawn(self.backends[pool.kind].destroy(handle))
                if self._burst_on(pool, now):
                    continue
                while len(pool.handles) + pool.filling < pool.want and self._room():
                    pool.filling += 1
                    self._spawn(self._fill_one(pool, sem))
            await asyncio.sleep(0.01)

    def _burst_on(self, pool: ImagePool, now: float) -> bool:
        """True while a burst is being served from ``pool``: its refills wait (a timer wakes
        the filler once the burst is quiet), unless the pool runs low."""
        quiet = self.config.pool_quiet_s
        since = now - pool.last_used
        if quiet <= 0 or since >= quiet or len(pool.handles) * 4 < pool.want:
            return False
        asyncio.get_running_loop().call_later(quiet - since, self.wakeup.set)
        return True

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _room(self) -> bool:
        return self.sandboxes() + self.pooled() < self.config.max_sandboxes

    async def _fill_one(self, pool: ImagePool, sem: asyncio.Semaphore) -> None:
        try:
            async with sem:
                if self.closed or pool.image is None:
                    return
                backend = self.backends[pool.kind]
                limits = pool.limits
                made_at = time.time()
                handle = await new_handle(backend, pool.image, limits)
                if self.closed or self.pools.get((pool.kind, pool.image.layers)) is not pool:
                    await backend.destroy(handle)
                else:
                    if limits is not None:
                        pool.prepared[handle.cid] = limits
                    pool.made_at[handle.cid] = made_at
                    pool.handles.append(handle)
        except Exception as exc:  # noqa: BLE001 - a failed refill is retried on next demand
            log.warning("warm pool refill failed: %s", exc)
        finally:
            pool.filling -= 1
            self.wakeup.set()
