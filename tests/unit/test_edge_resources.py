"""The edge's resource logic over the fake backend: pause and resume (and the implicit resume of a
call), the TTLs of paused sandboxes, overcommitted admission, CPU caps and best effort, projects,
and what node_info reports for placement and quotas."""

from __future__ import annotations

import asyncio

import pytest

from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from libdsec import CapacityExceeded, LimitOutOfRange, SandboxStateError
from libdsec.protocol import DSecContainerRunArgs, ExecRequest, SandboxStatus


def make_edge(tmp_path, store, backend=None, **config) -> Edge:
    config = {"reaper_interval_s": 0.05, "pool_min": 0, "pool_max": 0, **config}
    return Edge(EdgeConfig(node_dir=tmp_path / "node", **config), backend or FakeBackend(), store)


@pytest.fixture
async def edge(tmp_path, store):
    edge = make_edge(tmp_path, store)
    await edge.start()
    yield edge
    await edge.close()


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image="tiny", **{"memory_limit_mb": 64, **kw})


async def test_pause_and_resume(edge):
    info = await edge.create(args())
    cid = edge._records[info.id].handle.cid
    result = await edge.pause(info.id)
    assert result.sandbox.status is SandboxStatus.paused and cid in edge.backend.paused
    assert result.memory_before_bytes == 0 and result.memory_after_bytes == 0 and result.pause_s >= 0
    assert (await edge.get(info.id)).status is SandboxStatus.paused
    with pytest.raises(SandboxStateError, match="paused already"):
        await edge.pause(info.id)
    resumed = await edge.resume(info.id)
    assert resumed.status is SandboxStatus.running and cid not in edge.backend.paused
    with pytest.raises(SandboxStateError, match="cannot resume: .* is running, not paused"):
        await edge.resume(info.id)


async def test_calls_on_a_paused_sandbox_resume_it(edge):
    info = await edge.create(args())
    cid = edge._records[info.id].handle.cid
    for call in (lambda: edge.exec(info.id, ExecRequest(command="echo hi")),
                 lambda: edge.write_file(info.id, "/a", b"x", 0o644),
                 lambda: edge.read_file(info.id, "/a")):
        await edge.pause(info.id)
        await call()
        assert cid not in edge.backend.paused and (await edge.get(info.id)).status is SandboxStatus.running


async def test_concurrent_calls_on_a_paused_sandbox_resume_it_once(edge):
    info = await edge.create(args())
    await edge.pause(info.id)
    calls = []
    original = edge.backend.resume

    async def counted(handle):
        calls.append(handle.cid)
        await asyncio.sleep(0.01)
        await original(handle)

    edge.backend.resume = counted
    results = await asyncio.gather(*(edge.exec(info.id, ExecRequest(command=f"echo {i}")) for i in range(5)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(5)] and len(calls) == 1


async def test_pause_of_stopped_or_busy_sandboxes(edge):
    info = await edge.create(args())
    busy = asyncio.create_task(edge.exec(info.id, ExecRequest(command="sleep 0.3")))
    await asyncio.sleep(0.05)
    with pytest.raises(SandboxStateError, match="1 calls in flight"):
        await edge.pause(info.id)
    await busy
    await edge.stop(info.id)
    with pytest.raises(SandboxStateError, match="stopped"):
        await edge.pause(info.id)
    with pytest.raises(SandboxStateError, match="stopped"):
        await edge.resume(info.id)


async def test_a_paused_sandbox_can_be_stopped(edge):
    info = await edge.create(args())
    await edge.pause(info.id)
    assert (await edge.stop(info.id)).status is SandboxStatus.stopped
    assert edge.backend.files == {}


async def test_ttl_skips_paused_sandboxes_until_the_paused_ttl(tmp_path, store):
    edge = make_edge(tmp_path, store, paused_ttl_s=0.6)
    await edge.start()
    try:
        info = await edge.create(args(ttl_running_stop=1))
        await edge.pause(info.id)
        await asyncio.sleep(0.3)
        assert (await edge.get(info.id)).status is SandboxStatus.paused
        await asyncio.sleep(0.6)
        got = await edge.get(info.id)
        assert got.status is SandboxStatus.stopped and "paused_ttl_s" in got.reason
    finally:
        await edge.close()


async def test_resume_restarts_the_idle_clock(edge):
    info = await edge.create(args(ttl_running_stop=1))
    await edge.pause(info.id)
    await asyncio.sleep(1.2)  # paused longer than the run TTL
    await edge.resume(info.id)
    await asyncio.sleep(0.3)
    assert (await edge.get(info.id)).status is SandboxStatus.running


async def test_paused_state_and_project_survive_an_edge_restart(tmp_path, store):
    backend = FakeBackend()
    first = make_edge(tmp_path, store, backend)
    await first.start()
    info = await first.create(args(), project="team")
    await first.pause(info.id)
    await first.close()
    second = make_edge(tmp_path, store, backend)
    await second.start()
    try:
        got = await second.get(info.id)
        assert got.status is SandboxStatus.paused and got.project == "team"
        assert (await second.exec(info.id, ExecRequest(command="echo back"))).stdout == "back\n"
        assert (await second.get(info.id)).status is SandboxStatus.running
    finally:
        await second.close()


async def test_cpu_weights_are_overcommitted_and_best_effort_commits_none(tmp_path, store):
    edge = make_edge(tmp_path, store, cpu_overcommit=2.0)
    await edge.start()
    try:
        cores = edge.admission.cpu_cores
        for _ in range(2 * cores):
            await edge.create(args(cpu_cores_limit=1))
        with pytest.raises(CapacityExceeded, match="cannot admit 1 CPU cores more.*best-effort sandboxes commit none"):
            await edge.create(args(cpu_cores_limit=1))
        best = await edge.create(args(cpu_cores_limit=1, best_effort=True))
        assert best.best_effort
        limits = edge.backend.limits[edge._records[best.id].handle.cid]
        assert limits.best_effort and limits.cpu_shares == 2 and limits.cpu_quota_us == -1
    finally:
        await edge.close()


async def test_memory_is_admitted_against_its_ratio_paused_ones_included(tmp_path, store):
    edge = make_edge(tmp_path, store, memory_overcommit=1.0)
    await edge.start()
    try:
        half = edge.admission.memory_total_mb // 2
        first = await edge.create(args(memory_limit_mb=half))
        await edge.pause(first.id)  # paused sandboxes still hold their commitment
        await edge.create(args(memory_limit_mb=half))
        with pytest.raises(CapacityExceeded, match=r"cannot admit 16 MB more.*\(1× its"):
            await edge.create(args(memory_limit_mb=16))
    finally:
        await edge.close()


async def test_cpu_cap(edge):
    capped = await edge.create(args(cpu_cores_limit=0.5, cpu_cores_cap=1.0))
    limits = edge.backend.limits[edge._records[capped.id].handle.cid]
    assert capped.cpu_cores_cap == 1.0 and limits.cpu_quota_us == 100_000 and limits.cpu_shares == 512
    plain = edge.backend.limits[edge._records[(await edge.create(args())).id].handle.cid]
    assert plain.cpu_quota_us == -1  # no cap: the weight alone


@pytest.mark.parametrize("cap", [0.0, -1.0, 0.4, 10_000.0])
async def test_cpu_cap_out_of_range(edge, cap):
    with pytest.raises(LimitOutOfRange, match=r"cpu_cores_cap=.* is out of range: 0\.5\.\."):
        await edge.create(args(cpu_cores_limit=0.5, cpu_cores_cap=cap))
    assert await edge.list() == []


async def test_node_info_reports_commitments_and_projects(edge):
    await edge.create(args(cpu_cores_limit=0.5, memory_limit_mb=100), project="a")
    await edge.create(args(cpu_cores_limit=1, memory_limit_mb=50, best_effort=True), project="a")
    paused = await edge.create(args(cpu_cores_limit=2, memory_limit_mb=200), project="b")
    await edge.pause(paused.id)
    n = await edge.node_info()
    assert (n.committed_cpu, n.committed_memory_mb, n.paused) == (2.5, 350, 1)
    assert n.max_sandboxes == edge.config.max_sandboxes and n.cpu_overcommit == edge.config.cpu_overcommit
    assert n.projects["a"].sandboxes == 2 and n.projects["a"].cpu_cores == 0.5 and n.projects["a"].memory_mb == 150
    assert n.projects["b"].sandboxes == 1
    assert n.core_scheduling.startswith(("supported", "unsupported")) and isinstance(n.sched_idle, bool)
    await edge.stop(paused.id)
    assert "b" not in (await edge.node_info()).projects


async def test_idle_sandboxes(edge):
    a = await edge.create(args())
    b = await edge.create(args())
    await asyncio.sleep(0.2)
    await edge.exec(b.id, ExecRequest(command="true"))
    idle = {h.cid for _, h in edge.idle_sandboxes(0.15)}
    assert idle == {edge._records[a.id].handle.cid}
    await edge.pause(a.id)
    assert edge.idle_sandboxes(0) == [("container", edge._records[b.id].handle)]
