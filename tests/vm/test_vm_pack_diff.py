"""pack_diff of microVMs and full VMs through the server: the VM's changes become a layer on top
of its image, and the new image runs as a container, a microVM and a full VM with the changes,
deletions and replaced directories kept and the residue scrubbed. Bad cases give clear errors,
and nothing is left behind (the server's own check, and the store's scratch space)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from dsec.resources import reclaim
from libdsec import DSecContainerRunArgs, DSecFullVMRunArgs, DSecMicroVMRunArgs, SandboxStateError

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.asyncio(loop_scope="module")]

# /usr/sbin is replaced by a directory of one file (opaque: busybox's applets must not show
# through), /bin/vi deleted (a whiteout), and residue left in /tmp and the shell history. All
# below the top level: in a VM a command cannot make or remove entries of `/` itself (the
# guest's Landlock rules, see docs/SECURITY.md).
CHANGES = (
    "set -e; echo kept > /root/result.txt; rm /bin/vi; rm -rf /usr/sbin; mkdir /usr/sbin; echo new > /usr/sbin/only;"
    "echo junk > /tmp/junk; echo 'cat secret' > /root/.ash_history; mkdir -p '/var/a b'; echo 1 > '/var/a b/f';"
    "ln -s ../root/result.txt /var/link; mkfifo /var/pipe; sleep 3600 >/dev/null 2>&1 &"
)
CHECK = (
    "cat /root/result.txt; ls -A /usr/sbin; test -e /bin/vi || echo vi-gone; test -e /tmp/junk || echo no-junk;"
    "test -e /root/.ash_history || echo no-history; cat '/var/a b/f'; cat /var/link; test -e /bin/sh && echo sh-kept;"
    "test -p /var/pipe && echo fifo-kept"
)
EXPECTED = ["kept", "only", "vi-gone", "no-junk", "no-history", "1", "kept", "sh-kept", "fifo-kept"]


@pytest.fixture(scope="module")
def vm_server(tmp_path_factory, test_store):
    from dsec.images.store import LayerStore
    from dsec.local import serving

    from conftest import make_state_dir

    scratch = LayerStore(test_store).tmp_dir
    tars_before = set(scratch.glob("*.tar"))
    with serving(make_state_dir(tmp_path_factory, test_store, "dsec-vmpack"), "--pool-max", "0") as srv:
        yield srv
    assert set(scratch.glob("*.tar")) <= tars_before, "pack_diff left its tar in the store's tmp/"


async def runs_with_the_changes(client, image: str, kinds: tuple[str, ...]) -> None:
    for kind in kinds:
        if kind == "container":
            sandbox = await client.run_container(DSecContainerRunArgs(container_image=image, memory_limit_mb=64))
        elif kind == "microvm":
            sandbox = await client.run_microvm(DSecMicroVMRunArgs(container_image=image, memory_limit_mb=128), timeout=120)
        else:
            sandbox = await client.run_vm(DSecFullVMRunArgs(container_image=image, memory_limit_mb=128), timeout=180)
        async with sandbox:
            check = await sandbox.run_shell(CHECK)
            assert check.stdout.split() == EXPECTED, (kind, check)


async def pack_and_check(client, vm, restore_as: tuple[str, ...]) -> None:
    setup = await vm.run_shell(CHANGES)
    assert setup.exit_code == 0, setup.stderr
    snap = await vm.pack_diff()
    try:
        assert {"/tmp/junk", "/root/.ash_history"} <= set(snap.scrubbed)
        assert snap.layers[-1] == snap.layer and snap.image.startswith("snap-")
        info = await client.inspect_image(snap.image)
        assert info.parent == "busybox" and info.roles[-1] == "snapshot"
        # The VM runs on, its background command too (frozen while it was packed, thawed after).
        after = await vm.run_shell("pidof sleep >/dev/null && echo sleeping; echo more > /root/later")
        assert after.stdout == "sleeping\n"
        await runs_with_the_changes(client, snap.image, restore_as)
    finally:
        await client.remove_image(snap.image)


async def test_microvm_pack_diff_runs_as_container_microvm_and_fullvm(client):
    vm = await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=128), timeout=120)
    async with vm:
        await pack_and_check(client, vm, ("container", "microvm", "fullvm"))


async def test_fullvm_pack_diff_runs_as_container_and_fullvm(client):
    vm = await client.run_vm(DSecFullVMRunArgs(container_image="busybox", memory_limit_mb=128), timeout=180)
    async with vm:
        # The root is an overlay of the image's disk and the VM's own.
        root = await vm.run_shell("grep ' / ' /proc/mounts | cut -d' ' -f3")
        assert root.stdout == "overlay\n"
        await pack_and_check(client, vm, ("container", "fullvm"))


async def test_pack_of_a_paused_dead_or_stopped_vm_is_refused(client, vm_server):
    from test_microvm import qemu_processes

    vm = await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=128), timeout=120)
    async with vm:
        paused = await vm.pause()
        if reclaim.swap_total_bytes():  # its memory went out to swap
            assert paused.memory_after_bytes < 0.3 * paused.memory_before_bytes, paused
        with pytest.raises(SandboxStateError, match="paused"):
            await vm.pack_diff()
        await vm.resume()
        # Its QEMU ends behind the edge's back (a command cannot power the guest off: no
        # CAP_SYS_BOOT, and reboot(2) is refused).
        for line in qemu_processes(str(vm_server.state_dir)):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        for _ in range(300):
            if not qemu_processes(str(vm_server.state_dir)):
                break
            await asyncio.sleep(0.1)
        with pytest.raises(SandboxStateError, match="gone"):
            await vm.pack_diff()
        assert (await vm.refresh()).status.value == "failed"
    with pytest.raises(SandboxStateError, match="is (failed|stopped)"):
        await vm.pack_diff()
