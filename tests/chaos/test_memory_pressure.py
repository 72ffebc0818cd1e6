"""Chaos: memory pressure on the node, made inside a cgroup (not the whole machine): the parent
cgroup of one server's sandboxes gets a memory limit below what its sandboxes may use together,
and one sandbox takes memory past it. The kernel's reclaim and OOM killer act inside that parent;
the command that pushed is killed (137) and its sandbox reports a ``limit.memory`` event, the
other sandboxes answer, and the server serves on."""

from __future__ import annotations

import asyncio

import pytest

from dsec.local import LocalServer, leftovers
from dsec.resources import cgroups
from libdsec import DSecClient, DSecContainerRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root]

LIMIT_MB = 160


def parent_limit_file(state) -> object:
    parent = cgroups.parent_for(state)
    if cgroups.is_v2():
        return cgroups.CGROUP_ROOT / parent / "memory.max"
    return cgroups.CGROUP_ROOT / "memory" / parent / "memory.limit_in_bytes"


async def test_memory_pressure_in_the_sandboxes_parent_fails_the_hog_only(new_state_dir):
    state = new_state_dir("dsec-mempressure")
    srv = LocalServer(state, extra_args=("--pool-max", "0"), env={"DSEC_VMS": "0"}).start()
    try:
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            quiet = [await client.run_container(DSecContainerRunArgs(container_image="busybox", memory_limit_mb=64))
                     for _ in range(3)]
            hog = await client.run_container(DSecContainerRunArgs(container_image="busybox", memory_limit_mb=512))
            for s in quiet:  # each holds a little (12 MB on its tmpfs, charged to it)
                await s.run_shell("dd if=/dev/urandom of=/dev/shm/held bs=1M count=12 2>/dev/null || "
                                  "dd if=/dev/urandom of=/root/held bs=1M count=12 2>/dev/null")
            limit = parent_limit_file(state)
            limit.write_text(str(LIMIT_MB << 20))
            # The hog's own limit (512 MB) would let it; its parent's (160 MB, 36 of them held) does not.
            outcome = await asyncio.gather(hog.run_shell(
                "awk 'BEGIN { s = \"x\"; while (length(s) < 300000000) s = s s; print length(s) }'", timeout=60),
                return_exceptions=True)
            result = outcome[0]
            events = {e.kind for e in await hog.security_events()}
            # The OOM killer, acting inside the parent, took the hog's command (the largest by far),
            # and the hog's events say so; the hog itself runs on.
            assert not isinstance(result, BaseException) and result.exit_code == 137, result
            assert "limit.memory" in events, events
            assert (await hog.run_shell("echo after")).stdout == "after\n"
            for s in quiet:
                assert (await s.run_shell("echo fine")).stdout == "fine\n"
            async with await client.run_container(DSecContainerRunArgs(container_image="busybox",
                                                                       memory_limit_mb=32)) as fresh:
                assert (await fresh.run_shell("echo new")).stdout == "new\n"
            for s in [*quiet, hog]:
                await s.stop()
        srv.stop()
        assert not leftovers(state), leftovers(state)
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            await srv.stop_sandboxes_async()
        srv.stop()
