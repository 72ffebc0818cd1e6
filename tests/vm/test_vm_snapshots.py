"""Named snapshots of a real microVM (QEMU) through the server: a full one resumes its
processes, a filesystem one boots afresh with its files; each outlives the VM, starts only
microVMs, and cannot be removed while a VM started from it runs."""

from __future__ import annotations

import pytest

from libdsec import DSecContainerRunArgs, DSecMicroVMRunArgs, InvalidRequest, SnapshotConflict, SnapshotNotFound

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.asyncio(loop_scope="module")]


async def test_microvm_full_and_filesystem_snapshots(client):
    vm = await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=128), timeout=120)
    taken = []
    try:
        setup = await vm.run_shell("echo kept > /root/kept.txt; sleep 3600 >/dev/null 2>&1 &")
        assert setup.exit_code == 0, setup
        full = await vm.snapshot(name=f"vm-full-{vm.id[-8:]}")  # a microVM's default: full
        taken.append(full)
        assert (full.mode, full.kind, full.memory_mb, full.layer) == ("full", "microvm", 128, None)
        files = await vm.snapshot("filesystem")
        taken.append(files)
        assert files.mode == "filesystem" and files.layer
    finally:
        await vm.stop()
    try:
        async with await client.run_microvm(DSecMicroVMRunArgs(snapshot=full.name), timeout=120) as clone:
            again = await clone.run_shell("cat /root/kept.txt; pidof sleep >/dev/null && echo running")
            assert again.stdout == "kept\nrunning\n"
            with pytest.raises(SnapshotConflict, match=f"in use by the sandboxes started from it \\({clone.id}\\)"):
                await client.remove_snapshot(full.id)
        async with await client.run_microvm(DSecMicroVMRunArgs(snapshot=files.id, memory_limit_mb=128),
                                            timeout=120) as booted:
            fresh = await booted.run_shell("cat /root/kept.txt; pidof sleep >/dev/null || echo booted-afresh")
            assert fresh.stdout == "kept\nbooted-afresh\n"
        with pytest.raises(InvalidRequest, match="starts microvm sandboxes, not container"):
            await client.run_container(DSecContainerRunArgs(snapshot=full.id))
    finally:
        for snap in taken:
            await client.remove_snapshot(snap.id)
    with pytest.raises(SnapshotNotFound):
        await client.get_snapshot(full.id)
