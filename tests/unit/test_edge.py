"""The edge's control logic over the in-memory fake backend: lifecycle, failures, batches,
recovery. Admission, the warm pool, the TTL reaper and the transition table have files of their
own (test_edge_admission.py, test_edge_pool.py, test_edge_reaper.py, test_edge_lifecycle.py)."""

from __future__ import annotations

import asyncio

import pytest

from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from libdsec import BackendError, ImageNotFound, InvalidRequest, SandboxNotFound, SandboxStateError
from libdsec.protocol import DSecContainerRunArgs, DSecMicroVMRunArgs, ExecRequest, SandboxKind, SandboxStatus


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


async def test_unknown_image_and_network(edge):
    with pytest.raises(ImageNotFound, match="nope"):
        await edge.create(DSecContainerRunArgs(container_image="nope"))
    with pytest.raises(InvalidRequest, match="network"):
        await edge.create(args(network_rules={"pypi": True}))


async def test_a_kind_is_the_one_enum_named_by_it_or_by_its_string(tmp_path, store):
    """The edge keeps a sandbox's kind as ``SandboxKind`` however it was named; its record on
    disk says the wire value; a kind the node does not serve is refused by that name."""
    config = EdgeConfig(node_dir=tmp_path / "node", pool_min=0, pool_max=0)
    backends = [FakeBackend(), FakeBackend("microvm")]
    edge = Edge(config, backends, store)
    await edge.start()
    try:
        assert set(edge.backends) == {SandboxKind.container, SandboxKind.microvm}
        assert all(type(kind) is SandboxKind for kind in edge.backends)
        vm_args = DSecMicroVMRunArgs(container_image="tiny")
        for named in (SandboxKind.microvm, "microvm"):
            info = await edge.create(vm_args, named)
            assert info.kind is SandboxKind.microvm and edge._records[info.id].kind is SandboxKind.microvm
            assert '"kind":"microvm"' in edge._records[info.id].to_json()
        info = await edge.create(args(), "container")
        assert edge._records[info.id].kind is SandboxKind.container
        assert [i async for _, i in edge.create_batch(args(), 1, "container")][0].kind is SandboxKind.container
        assert {kind for kind, _ in edge.idle_sandboxes(0)} <= set(SandboxKind)
        with pytest.raises(InvalidRequest, match=r"sandbox kind 'fullvm' is not served by node n0 \(it serves "
                                                 r"container, microvm\)"):
            await edge.create(args(), SandboxKind.fullvm)
        with pytest.raises(InvalidRequest, match="sandbox kind 'vm' is not served"):
            await edge.create(args(), "vm")
    finally:
        await edge.close()
    again = Edge(config, backends, store)  # re-adopts them: their kinds read back as the enum
    await again.start()
    try:
        assert len(again._records) == 4 and {type(r.kind) for r in again._records.values()} == {SandboxKind}
    finally:
        await again.close()


async def test_backend_failure_leaves_no_record(edge):
    edge.backend.fail_next_create = "crun exploded"
    with pytest.raises(BackendError, match="exploded"):
        await edge.create(args())
    assert await edge.list() == []


async def test_a_record_that_cannot_be_written_fails_the_create_and_leaves_nothing(edge, monkeypatch):
    import errno
    import os

    from dsec.edge import create as create_module
    from dsec.edge.journal import RecordJournal

    def disk_full(self, line):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(RecordJournal, "_append", disk_full)
    with pytest.raises(BackendError, match=r"cannot write the record of sandbox .*No space left on device \(ENOSPC\)"):
        await edge.create(args())
    assert await edge.list() == [] and not edge.journal._live
    assert len(edge.backend.destroyed) == 1 and not edge.backend.files  # what it made is gone
    monkeypatch.undo()
    monkeypatch.setattr(create_module, "MIN_FREE_FOR_CREATE", 1 << 62)  # a disk with less room than that
    with pytest.raises(BackendError, match=r"no space left on device \(ENOSPC\): \d+ KiB free on the filesystem of"):
        await edge.create(args())
    assert await edge.list() == []
    monkeypatch.undo()
    assert (await edge.create(args())).status is SandboxStatus.running  # with room again


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


async def test_a_stop_while_a_sandbox_fails_leaves_it_failed(tmp_path, store):
    """A sandbox found dead is failed and destroyed; a stop that comes meanwhile waits for that
    instead of destroying it a second time, and the sandbox stays failed, with its reason."""
    backend = FakeBackend()
    real_destroy = backend.destroy
    destroyed: list[str] = []

    async def slow_destroy(handle):
        destroyed.append(handle.cid)
        await asyncio.sleep(0.1)
        await real_destroy(handle)

    backend.destroy = slow_destroy
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=0, pool_max=0), backend, store)
    await edge.start()
    try:
        info = await edge.create(args())
        cid = edge._records[info.id].handle.cid
        backend.kill(cid)
        failing = asyncio.create_task(edge.exec(info.id, ExecRequest(command="true")))
        for _ in range(100):
            if (await edge.get(info.id)).status is SandboxStatus.failed:
                break
            await asyncio.sleep(0.005)
        got = await edge.stop(info.id)
        assert got.status is SandboxStatus.failed and "died" in got.reason
        with pytest.raises(SandboxStateError):
            await failing
        assert destroyed == [cid]
        assert (await edge.get(info.id)).status is SandboxStatus.failed
    finally:
        await edge.close()
