"""Admission over the fake backend: limits in range, the node's capacity, and the running totals
of what held sandboxes commit (dsec.edge.admission). Overcommit, CPU caps and what node_info
reports are in test_edge_resources.py."""

from __future__ import annotations

import pytest

from dsec.backends.fake import FakeBackend
from dsec.edge.admission import cpu_commit
from dsec.edge.edge import Edge, EdgeConfig
from dsec.edge.lifecycle import HOLDING
from libdsec import BackendError, CapacityExceeded, LimitOutOfRange, SandboxStateError
from libdsec.protocol import DSecContainerRunArgs, ExecRequest


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image="tiny", **kw)


@pytest.mark.parametrize(
    "field, value",
    [("memory_limit_mb", 1), ("memory_limit_mb", 10**9), ("cpu_cores_limit", 0), ("cpu_cores_limit", 10**6),
     ("ttl_running_stop", 0), ("pids_limit", 1)],
)
async def test_limits_out_of_range_name_the_field(edge, field, value):
    with pytest.raises(LimitOutOfRange, match=field):
        await edge.create(args(**{field: value}))
    assert await edge.list() == []


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
    edge = Edge(EdgeConfig(node_dir=tmp_path / "n", max_sandboxes=3, pool_min=0, pool_max=0), FakeBackend(), store)
    await edge.start()

    def check() -> None:
        holding = [r for r in edge._records.values() if r.status in HOLDING]
        assert sorted(edge.admission.held) == sorted(r.id for r in holding)
        assert edge.admission.held_memory_mb == sum(r.args.memory_limit_mb for r in holding)
        assert edge.admission.held_ucores == sum(round(cpu_commit(r.args) * 1_000_000) for r in holding)

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
        assert (edge.admission.held, edge.admission.held_memory_mb, edge.admission.held_ucores) == ({}, 0, 0)
    finally:
        await edge.close()
