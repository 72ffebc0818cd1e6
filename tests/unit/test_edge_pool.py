"""The warm pool over the fake backend: it serves creates, refills after a burst with the limits
creates ask for, and is released on close (dsec.edge.pool)."""

from __future__ import annotations

import asyncio

from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from libdsec.protocol import DSecContainerRunArgs


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image="tiny", **kw)


async def test_refills_wait_until_a_burst_is_served(tmp_path, store):
    backend = FakeBackend()
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=8, pool_max=8, pool_quiet_s=0.3), backend, store)
    await edge.start()
    try:
        await edge.create(args())  # the image's first use starts its pool
        for _ in range(200):
            if edge.warm_pool.pooled() >= 8:
                break
            await asyncio.sleep(0.01)
        assert edge.warm_pool.pooled() == 8
        made = len(backend.files)
        for _ in range(4):  # a burst: 4 of 8 taken, the pool keeps over a quarter
            await edge.create(args())
        await asyncio.sleep(0.1)
        assert len(backend.files) == made  # no refill while creates keep arriving
        for _ in range(100):
            if edge.warm_pool.pooled() >= 8:
                break
            await asyncio.sleep(0.02)
        assert edge.warm_pool.pooled() == 8  # refilled once the burst went quiet
        for _ in range(7):  # down to one: below a quarter, refills start at once
            await edge.create(args())
        for _ in range(10):
            if edge.warm_pool.pooled() + sum(p.filling for p in edge.warm_pool.pools.values()) >= 8:
                break
            await asyncio.sleep(0.01)
        assert edge.warm_pool.pooled() + sum(p.filling for p in edge.warm_pool.pools.values()) == 8
    finally:
        await edge.close()


async def test_refills_get_the_limits_creates_ask_for(tmp_path, store):
    backend = FakeBackend()
    applied: list[str] = []
    real = backend.apply_limits

    async def counting(handle, limits):
        applied.append(handle.cid)
        await real(handle, limits)

    backend.apply_limits = counting
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=2, pool_max=2, pool_quiet_s=0), backend, store)
    await edge.start()
    try:
        await edge.create(args(memory_limit_mb=64))
        for _ in range(200):
            pool = next(iter(edge.warm_pool.pools.values()))
            if len(pool.handles) >= 2 and not pool.filling:
                break
            await asyncio.sleep(0.01)
        applied.clear()
        same = await edge.create(args(memory_limit_mb=64))  # as prepared: nothing set on the way
        assert applied == []
        cid = edge._records[same.id].handle.cid
        assert backend.limits[cid].memory_mb == 64
        other = await edge.create(args(memory_limit_mb=100))  # prepared for 64: set to 100
        cid = edge._records[other.id].handle.cid
        assert applied[0] == cid and backend.limits[cid].memory_mb == 100
    finally:
        await edge.close()


async def test_warm_pool_serves_creates_and_is_released_on_close(tmp_path, store):
    backend = FakeBackend()
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=3, pool_max=8), backend, store)
    await edge.start()
    first = await edge.create(args())
    for _ in range(100):
        if edge.warm_pool.pooled() >= 3:
            break
        await asyncio.sleep(0.01)
    assert edge.warm_pool.pooled() == 3
    second = await edge.create(args(memory_limit_mb=100))
    cid = edge._records[second.id].handle.cid
    assert backend.limits[cid].memory_mb == 100  # limits set when a pooled sandbox is taken
    await edge.close()
    alive = set(backend.files)
    assert alive == {edge._records[first.id].handle.cid, cid}  # the pool is gone, sandboxes stay


async def test_pooled_sandboxes_made_before_the_store_was_mounted_again_are_not_handed_out(tmp_path, store):
    """Their layers read through the mount of the store that has gone (StoreHealth.remounted_at):
    a create gets a sandbox made anew, and they are destroyed."""
    import time

    backend = FakeBackend()
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=2, pool_max=2, pool_quiet_s=0), backend, store)
    await edge.start()
    try:
        await edge.create(args())
        for _ in range(200):
            pool = next(iter(edge.warm_pool.pools.values()))
            if len(pool.handles) >= 2 and not pool.filling:
                break
            await asyncio.sleep(0.01)
        old = {h.cid for h in pool.handles}
        hits = edge.warm_pool.hits
        served = await edge.create(args())
        assert edge._records[served.id].handle.cid in old and edge.warm_pool.hits == hits + 1
        for _ in range(200):  # refilled
            if len(pool.handles) >= 2 and not pool.filling:
                break
            await asyncio.sleep(0.01)
        old = {h.cid for h in pool.handles}
        edge.store_health.remounted_at = time.time()  # what a check sets when it sees the store on another device
        fresh = await edge.create(args())
        assert edge._records[fresh.id].handle.cid not in old
        assert edge.warm_pool.hits == hits + 1
        assert not old & {h.cid for h in pool.handles}
        assert not old & set(backend.files)  # destroyed
    finally:
        await edge.close()
