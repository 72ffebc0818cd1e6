"""Named snapshots of real VMs (QEMU) through the server: a microVM's full one resumes its
processes, a filesystem one boots afresh with its files (a full VM's are filesystem ones); each
outlives the VM, starts sandboxes of its own kind only, and cannot be removed while a VM started
from it runs."""

from __future__ import annotations

import pytest

from libdsec import (
    DSecContainerRunArgs, DSecFullVMRunArgs, DSecMicroVMRunArgs, InvalidRequest, SnapshotConflict, SnapshotNotFound,
)

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


async def test_fullvm_snapshot_is_a_filesystem_one(client):
    """A full VM keeps no memory snapshot: its default (and only) mode is filesystem, and a full
    VM booted from it has the files."""
    vm = await client.run_vm(DSecFullVMRunArgs(container_image="busybox", memory_limit_mb=128), timeout=180)
    try:
        assert (await vm.run_shell("echo kept > /root/kept.txt")).exit_code == 0
        with pytest.raises(InvalidRequest, match="a fullvm sandbox takes no full snapshots"):
            await vm.snapshot("full")
        snap = await vm.snapshot()
        assert (snap.mode, snap.kind) == ("filesystem", "fullvm")
    finally:
        await vm.stop()
    try:
        async with await client.run_vm(DSecFullVMRunArgs(snapshot=snap.id, memory_limit_mb=128), timeout=180) as booted:
            assert await booted.read_file("/root/kept.txt") == b"kept\n"
    finally:
        await client.remove_snapshot(snap.id)
