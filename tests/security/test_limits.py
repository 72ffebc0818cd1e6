"""Red team, resource floods: each is contained by the sandbox's own limit, the host and a
neighbour carry on, and the limit hit is recorded against the sandbox."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest

from libdsec import CommandTimeout, DSecContainerRunArgs
from redteam import event_kinds

pytestmark = [pytest.mark.slow, pytest.mark.root]


def _args(image: str, **kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image=image, **{"memory_limit_mb": 64, **kw})


async def _neighbour_and_host_fine(sclient, sec_server, neighbour) -> None:
    assert (await neighbour.run_shell("echo ok")).stdout == "ok\n"
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{sec_server.endpoint}/healthz")).status_code == 200
    assert os.statvfs("/").f_bavail > 0


async def _wait_for(sb, kind: str) -> list[str]:
    for _ in range(40):
        found = (await event_kinds(sb)).get(kind)
        if found:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {kind} event: {await event_kinds(sb)}")


async def test_fork_bomb(sclient, sec_server):
    async with await sclient.run_container(_args("busybox", pids_limit=64)) as sb, \
            await sclient.run_container(_args("busybox")) as neighbour:
        # The shell's own `sleep 30` may find no pid left and fail before the timeout: either
        # way the bomb ends, within the timeout or at it.
        try:
            result = await sb.run_shell("bomb() { bomb | bomb & }; bomb; sleep 30", timeout=4)
            timed_out = False
            assert result.exit_code != 0, result
        except CommandTimeout:
            timed_out = True
        await _neighbour_and_host_fine(sclient, sec_server, neighbour)
        assert "fork(s) refused" in (await _wait_for(sb, "limit.pids"))[0]
        if timed_out:
            assert any("timed out" in d for d in (await event_kinds(sb)).get("limit.timeout", []))


async def test_memory_bomb(sclient, sec_server, python_image):
    async with await sclient.run_container(_args(python_image)) as sb, \
            await sclient.run_container(_args("busybox")) as neighbour:
        r = await sb.run_shell("python3 -c \"x = []\nwhile True: x.append(bytearray(8 << 20))\"", timeout=60)
        assert r.exit_code in (137, -9), r  # SIGKILL by the OOM killer
        await _neighbour_and_host_fine(sclient, sec_server, neighbour)
        assert "killed at the memory limit" in (await _wait_for(sb, "limit.memory"))[0]
        assert (await sb.run_shell("echo alive")).stdout == "alive\n"


async def test_disk_fill(sclient, sec_server):
    async with await sclient.run_container(_args("busybox", memory_limit_mb=96)) as sb, \
            await sclient.run_container(_args("busybox")) as neighbour:
        r = await sb.run_shell("dd if=/dev/zero of=/fill bs=1M count=4096 2>&1; df -m / | tail -1", timeout=60)
        assert "No space left on device" in r.stdout, r
        size_mb = int(r.stdout.strip().split()[-5])
        assert size_mb <= 48, r.stdout  # the disk is capped at half the memory limit
        await _neighbour_and_host_fine(sclient, sec_server, neighbour)
        # The bytes went to the sandbox's own capped tmpfs, not to the node's disk.
        bundles = [line.split() for line in open("/proc/self/mounts")
                   if f"{sec_server.state_dir}/node/run/sandboxes/" in line and line.split()[1].count("/") ==
                   f"{sec_server.state_dir}/node/run/sandboxes/x".count("/")]
        assert bundles and all(b[2] == "tmpfs" for b in bundles), bundles
        assert (await neighbour.run_shell("dd if=/dev/zero of=/f bs=1M count=8 2>&1 && echo wrote")).stdout.endswith("wrote\n")
        assert "writable layer is full" in (await _wait_for(sb, "limit.disk"))[0]


async def test_yes_flood(sclient, sec_server):
    """The report's executor captured tens of GB of ``yes``: output is capped per stream."""
    async with await sclient.run_container(_args("busybox")) as sb, \
            await sclient.run_container(_args("busybox")) as neighbour:
        # Floods bounded by bytes, not by time: in the Debian 12 host rows' TCG guests beside the suite,
        # `timeout 3 yes` once wrote only 320 KiB, under the cap, and 50 MB through a pipe took over 30 s
        # (the command's bound is for a hang, not a speed).
        r = await sb.run_shell("yes | head -c 4000000; yes | head -c 50000000 >&2; echo done >&2",
                               max_output_bytes=1 << 20, timeout=120)
        assert r.stdout_truncated and len(r.stdout) == 1 << 20 and r.stdout_bytes >= 4_000_000, r.stdout_bytes
        assert r.stderr_truncated and r.stderr_bytes >= 50_000_000
        await _neighbour_and_host_fine(sclient, sec_server, neighbour)
        caps = (await event_kinds(sb)).get("limit.output", [])
        assert any(d.startswith("stdout") for d in caps) and any(d.startswith("stderr") for d in caps), caps
        # The same through the command line.
        env = {**os.environ, "DSEC_ENDPOINT": sec_server.endpoint, "DSEC_TOKEN": sec_server.token, "COLUMNS": "200"}
        cli = subprocess.run([sys.executable, "-m", "dsec", "events", sb.id], capture_output=True, text=True, env=env)
        assert cli.returncode == 0 and "limit.output" in cli.stdout, cli
