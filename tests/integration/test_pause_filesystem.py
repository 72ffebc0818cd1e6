"""A filesystem-only pause on a real ``dsec serve`` (crun): the sandbox's processes end and its
files stay; ``resume`` starts it afresh over them (a new boot id, its earlier processes gone,
its network link made again), a call before that is refused; ``on_ttl="pause_filesystem"``
does it when the sandbox idles; a full pause keeps the boot id; it is stopped like any other and
nothing is left behind. A VM cannot (unit tests: ``tests/unit/test_edge_lifecycle.py``)."""

from __future__ import annotations

import asyncio

import pytest

from libdsec import DSecContainerRunArgs, SandboxStateError, SandboxStatus

pytestmark = [pytest.mark.slow, pytest.mark.root]

ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=64)
BOOT_ID = "cat /proc/sys/kernel/random/boot_id"


async def test_a_filesystem_pause_keeps_the_files_and_a_resume_starts_it_afresh(server, client,
                                                                               no_sandbox_outlives_the_test):
    sandbox = await client.run_container(ARGS)
    try:
        await sandbox.write_file("/root/kept.txt", b"persisted")
        boot_before = (await sandbox.run_shell(BOOT_ID)).stdout.strip()
        with open("/proc/sys/kernel/random/boot_id") as f:
            assert boot_before != f.read().strip()  # its own, not the host's
        await sandbox.run_shell("(sleep 1000 &) ; echo started")
        assert "sleep 1000" in (await sandbox.run_shell("ps")).stdout

        result = await sandbox.pause("filesystem")
        assert result.sandbox.status is SandboxStatus.paused
        assert result.sandbox.pause_mode == "filesystem"
        assert (await client.get_sandbox(sandbox.id)).info.pause_mode == "filesystem"
        # A call does not start it again by surprise.
        with pytest.raises(SandboxStateError, match="keeping its files only"):
            await sandbox.run_shell("true")
        with pytest.raises(SandboxStateError, match="paused already"):
            await sandbox.pause()

        info = await sandbox.resume()
        assert info.status is SandboxStatus.running and info.pause_mode is None
        assert await sandbox.read_file("/root/kept.txt") == b"persisted"
        boot_after = (await sandbox.run_shell(BOOT_ID)).stdout.strip()
        assert boot_after and boot_after != boot_before
        assert "sleep 1000" not in (await sandbox.run_shell("ps")).stdout

        # A full pause keeps it as it is: the same boot id, its processes.
        await sandbox.run_shell("(sleep 1001 &) ; echo started")
        assert (await sandbox.pause()).sandbox.pause_mode == "full"
        await sandbox.resume()
        assert (await sandbox.run_shell(BOOT_ID)).stdout.strip() == boot_after
        assert "sleep 1001" in (await sandbox.run_shell("ps")).stdout

        # Stopped while paused keeping its files: nothing of it is left (the fixture checks).
        await sandbox.pause("filesystem")
    finally:
        await sandbox.stop()
    assert (await client.get_sandbox(sandbox.id)).info.status is SandboxStatus.stopped


async def test_its_network_link_is_made_again_on_resume(server, client, no_sandbox_outlives_the_test):
    """A sandbox with an allowlist gets its link back: its network namespace is new."""
    sandbox = await client.run_container(ARGS.model_copy(update={"network_rules": {"domains": ["127.0.0.1"]}}))
    try:
        links = "cat /proc/net/dev | grep -c :"
        before = (await sandbox.run_shell(links)).stdout.strip()
        assert int(before) >= 2  # lo and its link
        await sandbox.pause("filesystem")
        await sandbox.resume()
        assert (await sandbox.run_shell(links)).stdout.strip() == before
    finally:
        await sandbox.stop()


async def test_on_ttl_pause_filesystem_pauses_it_keeping_its_files(server, client, no_sandbox_outlives_the_test):
    sandbox = await client.run_container(ARGS.model_copy(update={"ttl_running_stop": 1.0,
                                                                 "on_ttl": "pause_filesystem"}))
    try:
        await sandbox.write_file("/root/kept.txt", b"idle")
        for _ in range(100):
            info = (await client.get_sandbox(sandbox.id)).info
            if info.status is SandboxStatus.paused:
                break
            await asyncio.sleep(0.1)
        assert info.status is SandboxStatus.paused and info.pause_mode == "filesystem"
        await sandbox.resume()
        assert await sandbox.read_file("/root/kept.txt") == b"idle"
    finally:
        await sandbox.stop()
