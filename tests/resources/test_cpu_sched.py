"""CPU against a real ``dsec serve``: requests are weights (cpu.shares / cpu.weight) with no CFS
quota unless a cap is asked for; best-effort sandboxes get an idle-class cgroup and SCHED_IDLE
for their init and every command; core scheduling is detected, and reported unsupported where
the kernel lacks it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.local import persisted_record
from dsec.resources import cgroups
from libdsec import DSecContainerRunArgs, LimitOutOfRange

pytestmark = [pytest.mark.slow, pytest.mark.root]

SCHED_IDLE = 5


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(**{"container_image": "busybox", "memory_limit_mb": 64, **kw})


async def cpu_dir(sandbox):
    out = (await sandbox.run_shell("cat /proc/1/cgroup")).stdout
    for line in out.splitlines():
        _, controllers, path = line.split(":", 2)
        if cgroups.is_v2() and controllers == "":
            return cgroups.CGROUP_ROOT / path.strip("/")
        if "cpu" in controllers.split(","):
            return cgroups.CGROUP_ROOT / "cpu" / path.strip("/")
    raise AssertionError(out)


async def policies(sandbox) -> tuple[int, int]:
    """(policy of a command, policy of the init): field 41 of /proc/PID/stat."""
    out = (await sandbox.run_shell("cut -d' ' -f41 /proc/self/stat /proc/1/stat")).stdout.split()
    return int(out[0]), int(out[1])


async def test_weights_not_caps(client):
    async with await client.run_container(args(cpu_cores_limit=0.5)) as sandbox:
        d = await cpu_dir(sandbox)
        if cgroups.is_v2():
            assert (d / "cpu.max").read_text().split()[0] == "max"
            assert int((d / "cpu.weight").read_text()) == 50
        else:
            assert int((d / "cpu.cfs_quota_us").read_text()) == -1
            assert int((d / "cpu.shares").read_text()) == 512
        assert await policies(sandbox) == (0, 0)


async def test_optional_hard_cap(client):
    async with await client.run_container(args(cpu_cores_limit=0.5, cpu_cores_cap=1.5)) as sandbox:
        d = await cpu_dir(sandbox)
        if cgroups.is_v2():
            assert (d / "cpu.max").read_text().split() == ["150000", "100000"]
        else:
            assert int((d / "cpu.cfs_quota_us").read_text()) == 150_000
        assert sandbox.info.cpu_cores_cap == 1.5
    with pytest.raises(LimitOutOfRange, match="cpu_cores_cap=0.2 is out of range: 0.5"):
        await client.run_container(args(cpu_cores_limit=0.5, cpu_cores_cap=0.2))


async def test_best_effort_runs_under_sched_idle(client):
    async with await client.run_container(args(best_effort=True)) as sandbox:
        assert sandbox.info.best_effort
        d = await cpu_dir(sandbox)
        if (d / "cpu.idle").exists():
            assert (d / "cpu.idle").read_text().strip() == "1"
        assert await policies(sandbox) == (SCHED_IDLE, SCHED_IDLE)
        # Also a command run as another user, and one in the background.
        out = await sandbox.run_shell("sleep 5 & cut -d' ' -f41 /proc/$!/stat; kill %1", user="1000")
        assert out.stdout.strip() == str(SCHED_IDLE)


def _kernel_config() -> str | None:
    import gzip
    import os

    for path in ("/proc/config.gz", f"/boot/config-{os.uname().release}"):
        if os.path.exists(path):
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt") as f:
                return f.read()
    return None


async def test_node_info_says_what_the_kernel_has(client):
    """Judged from the kernel's own build configuration, not from the function that answers."""
    node = (await client.node_info())[0]
    assert node.sched_idle is True
    config = _kernel_config()
    if config is None:
        pytest.skip("no kernel configuration to judge the answer by (/proc/config.gz, /boot/config-*)")
    if "CONFIG_SCHED_CORE=y" in config:
        assert node.core_scheduling.startswith("supported"), node.core_scheduling
        smt = Path("/sys/devices/system/cpu/smt/active")
        if smt.exists() and smt.read_text().strip() == "0":
            assert "SMT is off" in node.core_scheduling
    else:
        assert node.core_scheduling.startswith("unsupported") and "CONFIG_SCHED_CORE" in node.core_scheduling


def memory_limits(sandbox_init: int) -> tuple[int, int | None]:
    """(memory.limit_in_bytes, memory.memsw.limit_in_bytes or None) of a process's cgroup."""
    with open(f"/proc/{sandbox_init}/cgroup") as f:
        for line in f:
            _, controllers, path = line.strip().split(":", 2)
            if cgroups.is_v2() and controllers == "":
                d = cgroups.CGROUP_ROOT / path.strip("/")
                return int(d.joinpath("memory.max").read_text()), None
            if "memory" in controllers.split(","):
                d = cgroups.CGROUP_ROOT / "memory" / path.strip("/")
                swap = d / "memory.memsw.limit_in_bytes"
                return (int(d.joinpath("memory.limit_in_bytes").read_text()),
                        int(swap.read_text()) if swap.exists() else None)
    raise AssertionError("no memory cgroup")


async def test_memory_limit_raised_and_lowered(client, server):
    """Warm sandboxes get the limits of the latest create; one taken for other limits is set
    again, up (memsw first, or the kernel refuses) as well as down."""
    for mb in (64, 64, 512, 96):
        async with await client.run_container(args(memory_limit_mb=mb)) as sb:
            mem, swap = memory_limits(persisted_record(server.state_dir, sb.id)["handle"]["pid"])
            assert mem == mb << 20
            assert swap in (None, mb << 20)
