"""Pause and resume against a real ``dsec serve``: the cgroup is frozen and its memory pushed out
to swap (zram, from scripts/setup-host.sh), calls resume it, a paused sandbox can be stopped, and
bad transitions are refused. Also the cold-memory reclaimer on idle running sandboxes."""

from __future__ import annotations

import asyncio
import time

import pytest

from libdsec import DSecClient, DSecContainerRunArgs, SandboxStateError, SandboxStatus
from dsec.resources import cgroups, reclaim

pytestmark = [pytest.mark.slow, pytest.mark.root]

FILL_MB = 32
# Text, not zeros: zram stores a page of one repeated byte as nothing at all.
FILL = f"seq 1 9000000 | head -c {FILL_MB << 20} > /fill && md5sum /fill | cut -c1-32"


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(**{"container_image": "busybox", "memory_limit_mb": 128, **kw})


async def cgroup_of(sandbox) -> tuple[str, str]:
    """(parent, cid) of a sandbox's cgroups, as its init sees them (no cgroup namespace)."""
    out = (await sandbox.run_shell("cat /proc/1/cgroup")).stdout
    for line in out.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") or controllers == "":
            parent, cid = path.strip("/").split("/")[-2:]
            return parent, cid
    raise AssertionError(f"no memory cgroup in {out!r}")


def has_swap() -> bool:
    return reclaim.swap_total_bytes() > 0


async def test_pause_pushes_memory_out_and_a_call_brings_it_back(client):
    async with await client.run_container(args()) as sandbox:
        digest = (await sandbox.run_shell(FILL, timeout=60)).stdout.strip()
        parent, cid = await cgroup_of(sandbox)
        result = await sandbox.pause()
        assert result.sandbox.status is SandboxStatus.paused and sandbox.status is SandboxStatus.paused
        assert cgroups.frozen(parent, cid)
        assert result.memory_before_bytes >= FILL_MB << 20
        if has_swap():
            assert result.memory_after_bytes <= 0.2 * result.memory_before_bytes, result
            assert (reclaim.swapped_bytes(parent, cid) or 0) >= (FILL_MB << 20) * 0.8
        assert (await client.get_sandbox(sandbox.id)).status is SandboxStatus.paused
        # A call resumes it, and everything is still there.
        check = await sandbox.run_shell("md5sum /fill | cut -c1-32")
        assert check.stdout.strip() == digest
        assert not cgroups.frozen(parent, cid)
        assert (await sandbox.refresh()).status is SandboxStatus.running
        # Explicit pause and resume, and files through a paused sandbox.
        await sandbox.pause()
        assert (await sandbox.resume()).status is SandboxStatus.running
        await sandbox.pause()
        assert await sandbox.read_file("/etc/hostname")
        assert (await sandbox.refresh()).status is SandboxStatus.running


async def test_bad_transitions(client):
    sandbox = await client.run_container(args())
    with pytest.raises(SandboxStateError, match="is running, not paused"):
        await sandbox.resume()
    await sandbox.pause()
    with pytest.raises(SandboxStateError, match="paused already"):
        await sandbox.pause()
    await sandbox.resume()
    await sandbox.stop()
    with pytest.raises(SandboxStateError, match="stopped"):
        await sandbox.pause()
    with pytest.raises(SandboxStateError, match="stopped"):
        await sandbox.resume()


async def test_a_paused_sandbox_stops_cleanly(client, server):
    sandbox = await client.run_container(args())
    parent, cid = await cgroup_of(sandbox)
    await sandbox.run_shell("sleep 1000 >/dev/null 2>&1 &")
    await sandbox.pause()
    start = time.monotonic()
    await sandbox.stop()
    assert time.monotonic() - start < 10
    assert sandbox.status is SandboxStatus.stopped
    assert not any(d.name == cid for d in cgroups.sandbox_cgroup_dirs(parent))


async def test_many_pauses_at_once(client):
    sandboxes = await client.run_containers(args(memory_limit_mb=64), count=6)
    try:
        await asyncio.gather(*(s.run_shell("head -c 4194304 /dev/urandom > /fill") for s in sandboxes))
        results = await asyncio.gather(*(s.pause() for s in sandboxes))
        assert all(r.sandbox.status is SandboxStatus.paused for r in results)
        node = (await client.node_info())[0]
        assert node.paused >= 6
        outs = await asyncio.gather(*(s.run_shell("wc -c < /fill") for s in sandboxes))
        assert {o.stdout.strip() for o in outs} == {"4194304"}
    finally:
        await asyncio.gather(*(s.stop() for s in sandboxes))


@pytest.fixture(scope="module")
def cold_server(new_state_dir):
    from dsec.local import serving

    with serving(new_state_dir("dsec-coldmem"), "--pool-max", "0", "--cold-memory-idle-s", "2",
                 "--cold-memory-interval-s", "0.5") as srv:
        yield srv


@pytest.mark.skipif(not has_swap(), reason="no swap: cold anonymous memory has nowhere to go")
async def test_cold_memory_reclaimer_takes_idle_memory_and_leaves_busy_sandboxes_be(cold_server):
    async with DSecClient(cold_server.endpoint, token=cold_server.token) as client:
        idle = await client.run_container(args())
        busy = await client.run_container(args())
        try:
            idle_cg = await cgroup_of(idle)
            busy_cg = await cgroup_of(busy)
            filled = await asyncio.gather(idle.run_shell(FILL, timeout=60), busy.run_shell(FILL, timeout=60))
            before = reclaim.usage(*idle_cg)  # read at once: the reclaimer waits for 2 s of idling
            assert before >= FILL_MB << 20
            digest = filled[0].stdout.strip()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and reclaim.usage(*idle_cg) > before * 0.25:
                await busy.run_shell("true")  # keeps the busy one from idling
                await asyncio.sleep(0.2)
            assert reclaim.usage(*idle_cg) <= before * 0.25
            assert reclaim.usage(*busy_cg) >= (FILL_MB << 20) * 0.8
            # It keeps running, and what was pushed out comes back on use.
            assert (await idle.run_shell("md5sum /fill | cut -c1-32")).stdout.strip() == digest
            assert (await idle.refresh()).status is SandboxStatus.running
        finally:
            await idle.stop()
            await busy.stop()
