"""The edge's control logic over the in-memory fake backend: admission, lifecycle, TTL, warm
pool, batches, recovery."""

from __future__ import annotations

import asyncio

import pytest

from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from libdsec import (
    BackendError,
    CapacityExceeded,
    ImageNotFound,
    InvalidRequest,
    LimitOutOfRange,
    SandboxNotFound,
    SandboxStateError,
)
from libdsec.protocol import DSecContainerRunArgs, ExecRequest, SandboxStatus


@pytest.fixture
async def edge(tmp_path, store):
    backend = FakeBackend()
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", reaper_interval_s=0.05, pool_min=0, pool_max=0), backend, store)
    await edge.start()
    yield edge
    await edge.close()


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image="tiny", **kw)


async def test_lifecycle(edge):
    info = await edge.create(args(memory_limit_mb=64))
    assert info.status is SandboxStatus.running and info.id.startswith("n0-")
    result = await edge.exec(info.id, ExecRequest(command="echo hi"))
    assert result.stdout == "hi\n"
    stopped = await edge.stop(info.id)
    assert stopped.status is SandboxStatus.stopped
    assert (await edge.stop(info.id)).status is SandboxStatus.stopped  # second stop: no-op
    with pytest.raises(SandboxStateError, match="stopped"):
        await edge.exec(info.id, ExecRequest(command="echo late"))
    with pytest.raises(SandboxNotFound):
        await edge.get("n0-0123456789abcdef")


@pytest.mark.parametrize(
    "field, value",
    [("memory_limit_mb", 1), ("memory_limit_mb", 10**9), ("cpu_cores_limit", 0), ("cpu_cores_limit", 10**6),
     ("ttl_running_stop", 0), ("pids_limit", 1)],
)
async def test_limits_out_of_range_name_the_field(edge, field, value):
    with pytest.raises(LimitOutOfRange, match=field):
        await edge.create(args(**{field: value}))
    assert await edge.list() == []


async def test_unknown_image_and_network(edge):
    with pytest.raises(ImageNotFound, match="nope"):
        await edge.create(DSecContainerRunArgs(container_image="nope"))
    with pytest.raises(InvalidRequest, match="network"):
        await edge.create(args(network_rules={"pypi": True}))


async def test_capacity(tmp_path, store):
    edge = Edge(EdgeConfig(node_dir=tmp_path / "n", max_sandboxes=2, pool_min=0, pool_max=0), FakeBackend(), store)
    await edge.start()
    try:
        await edge.create(args())
        await edge.create(args())
        with pytest.raises(CapacityExceeded, match="full"):
            await edge.create(args())
    finally:
        await edge.close()


async def test_admission_totals_follow_sandboxes_in_and_out(tmp_path, store):
    """What admission counts (kept as sandboxes come and go, not summed per create) matches the
    records through creates, a failed create, a stop and a sandbox found dead; a stop frees its
    place and its memory at once."""
    from dsec.edge.edge import _HOLDING, _cpu_commit

    edge = Edge(EdgeConfig(node_dir=tmp_path / "n", max_sandboxes=3, pool_min=0, pool_max=0), FakeBackend(), store)
    await edge.start()

    def check() -> None:
        holding = [r for r in edge._records.values() if r.status in _HOLDING]
        assert sorted(edge._held) == sorted(r.id for r in holding)
        assert edge._held_memory_mb == sum(r.args.memory_limit_mb for r in holding)
        assert edge._held_ucores == sum(round(_cpu_commit(r.args) * 1_000_000) for r in holding)

    try:
        a = await edge.create(args(memory_limit_mb=64, cpu_cores_limit=0.1))
        b = await edge.create(args(memory_limit_mb=128, cpu_cores_limit=0.7))
        check()
        edge.backend.fail_next_create = "crun exploded"
        with pytest.raises(BackendError):
            await edge.create(args())
        check()
        c = await edge.create(args(memory_limit_mb=32))
        with pytest.raises(CapacityExceeded, match="full: 3 of 3"):
            await edge.create(args())
        await edge.stop(a.id)
        check()
        d = await edge.create(args())  # a's place is free again
        edge.backend.kill(edge._records[b.id].handle.cid)
        with pytest.raises(SandboxStateError):
            await edge.exec(b.id, ExecRequest(command="true"))
        check()
        for info in (c, d):
            await edge.stop(info.id)
        check()
        assert (edge._held, edge._held_memory_mb, edge._held_ucores) == ({}, 0, 0)
    finally:
        await edge.close()


async def test_backend_failure_leaves_no_record(edge):
    edge.backend.fail_next_create = "crun exploded"
    with pytest.raises(BackendError, match="exploded"):
        await edge.create(args())
    assert await edge.list() == []


async def test_ttl_stops_idle_sandbox_but_not_a_busy_one(edge):
    idle = await edge.create(args(ttl_running_stop=1))
    busy = await edge.create(args(ttl_running_stop=1))
    await edge.exec(busy.id, ExecRequest(command="sleep 1.5"))
    await asyncio.sleep(0.3)
    info = await edge.get(idle.id)
    assert info.status is SandboxStatus.stopped and "ttl_running_stop" in info.reason
    assert (await edge.get(busy.id)).status is SandboxStatus.running


async def test_dead_sandbox_is_marked_failed(edge):
    info = await edge.create(args())
    edge.backend.kill(edge._records[info.id].handle.cid)
    with pytest.raises(SandboxStateError):
        await edge.exec(info.id, ExecRequest(command="echo hi"))
    got = await edge.get(info.id)
    assert got.status is SandboxStatus.failed and "died" in got.reason


async def test_batch_all_or_nothing(edge):
    made = [(i, info) async for i, info in edge.create_batch(args(), 5)]
    assert sorted(i for i, _ in made) == list(range(5))
    backend: FakeBackend = edge.backend
    before = len(backend.files)
    original = backend.create
    calls = 0

    async def flaky(cid, spec):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise BackendError("third one fails")
        return await original(cid, spec)

    backend.create = flaky
    with pytest.raises(BackendError):
        async for _ in edge.create_batch(args(), 6):
            pass
    assert len(backend.files) == before  # everything the failed batch made was stopped


async def test_restart_readopts_running_sandboxes(tmp_path, store):
    backend = FakeBackend()
    config = EdgeConfig(node_dir=tmp_path / "node", pool_min=0, pool_max=0)
    first = Edge(config, backend, store)
    await first.start()
    keep = await first.create(args())
    lost = await first.create(args())
    await first.close()
    backend.kill(first._records[lost.id].handle.cid)
    second = Edge(config, backend, store)
    await second.start()
    try:
        assert (await second.get(keep.id)).status is SandboxStatus.running
        assert (await second.exec(keep.id, ExecRequest(command="echo back"))).stdout == "back\n"
        assert (await second.get(lost.id)).status is SandboxStatus.failed
    finally:
        await second.close()


async def test_refills_wait_until_a_burst_is_served(tmp_path, store):
    backend = FakeBackend()
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=8, pool_max=8, pool_quiet_s=0.3), backend, store)
    await edge.start()
    try:
        await edge.create(args())  # the image's first use starts its pool
        for _ in range(200):
            if edge.pooled() >= 8:
                break
            await asyncio.sleep(0.01)
        assert edge.pooled() == 8
        made = len(backend.files)
        for _ in range(4):  # a burst: 4 of 8 taken, the pool keeps over a quarter
            await edge.create(args())
        await asyncio.sleep(0.1)
        assert len(backend.files) == made  # no refill while creates keep arriving
        for _ in range(100):
            if edge.pooled() >= 8:
                break
            await asyncio.sleep(0.02)
        assert edge.pooled() == 8  # refilled once the burst went quiet
        for _ in range(7):  # down to one: below a quarter, refills start at once
            await edge.create(args())
        for _ in range(10):
            if edge.pooled() + sum(p.filling for p in edge._pools.values()) >= 8:
                break
            await asyncio.sleep(0.01)
        assert edge.pooled() + sum(p.filling for p in edge._pools.values()) == 8
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
            pool = next(iter(edge._pools.values()))
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
        if edge.pooled() >= 3:
            break
        await asyncio.sleep(0.01)
    assert edge.pooled() == 3
    second = await edge.create(args(memory_limit_mb=100))
    cid = edge._records[second.id].handle.cid
    assert backend.limits[cid].memory_mb == 100  # limits set when a pooled sandbox is taken
    await edge.close()
    alive = set(backend.files)
    assert alive == {edge._records[first.id].handle.cid, cid}  # the pool is gone, sandboxes stay
