"""Chaos: the state dir's own filesystem (a small ext4 image loop-mounted for the test: file-backed
EROFS layers do not mount from tmpfs), holding the layer store, the sandboxes' records and the
project database, fills up. A pack_diff then fails with a clear error and leaves no half-made
layer or image, and creates fail at once with ``BackendError`` naming ENOSPC (a sandbox whose
record cannot be written would not survive a restart) leaving no mount, cgroup or record; the
sandboxes there run on and take commands; once there is room again packs and creates work."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from dsec.edge import journal
from dsec.local import LocalServer, leftovers
from dsec.resources import cgroups
from libdsec import BackendError, DSecClient, DSecContainerRunArgs, DSecError, DSecMicroVMRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root]

ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32)


@pytest.fixture
def small_state(tmp_path_factory):
    state = tmp_path_factory.mktemp("dsec-diskfull")
    image = state.parent / f"{state.name}.img"
    subprocess.run(["truncate", "-s", "128M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(state)], check=True)  # (autoclear: detached at umount)
    try:
        yield state
    finally:
        left = leftovers(state)
        subprocess.run(["umount", str(state)], check=False)
        image.unlink()
        assert not left, left


def fill(path: str) -> None:
    """Take every free byte of the filesystem at ``path`` (a file that ends in ENOSPC)."""
    with open(path, "wb") as f:
        chunk = b"\0" * (1 << 20)
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass


async def test_a_full_state_dir_fails_pack_diff_clearly_and_nothing_else(small_state):
    srv = LocalServer(small_state, extra_args=("--pool-max", "2"), env={"DSEC_VMS": "0"}).start()
    try:
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            sandbox = await client.run_container(ARGS)
            await sandbox.run_shell("i=0; while [ $i -lt 200 ]; do echo $i > /root/f$i; i=$((i+1)); done; "
                                    "dd if=/dev/urandom of=/root/blob bs=1M count=4 2>/dev/null")
            images_before = {i.name for i in (await client.list_images()).images}
            filler = small_state / "filler"
            fill(str(filler))
            assert os.statvfs(small_state).f_bavail == 0
            with pytest.raises(DSecError, match="(?i)no space left|ENOSPC|space") as err:
                await sandbox.pack_diff("packed-when-full")
            assert isinstance(err.value, BackendError), err.value
            assert {i.name for i in (await client.list_images()).images} == images_before
            store_tmp = small_state / "store" / "tmp"
            assert not store_tmp.exists() or list(store_tmp.iterdir()) == [], list(store_tmp.iterdir())
            # Only that call failed: the sandbox runs on; a create is refused (the next test).
            assert (await sandbox.run_shell("cat /root/f199")).stdout == "199\n"
            os.unlink(filler)
            async with await client.run_container(ARGS) as other:
                assert (await other.run_shell("echo ok")).stdout == "ok\n"
            packed = await sandbox.pack_diff("packed-with-room")
            async with await client.run_container(ARGS.model_copy(update={"container_image": packed.image})) as b:
                assert (await b.run_shell("cat /root/f199")).stdout == "199\n"
            await sandbox.stop()
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            await srv.stop_sandboxes_async()
        srv.stop()


def made(state) -> tuple[list[str], list[str], list[str]]:
    """The mounts under the state dir, the sandbox cgroups and the live records."""
    with open("/proc/self/mountinfo") as f:
        mounts = sorted(p for p in (line.split()[4] for line in f) if p.startswith(f"{state}/"))
    groups = sorted(cgroups.sandbox_cgroup_dirs(cgroups.parent_for(state)))
    return mounts, groups, sorted(journal.read(state / "node" / "records"))


def resize_tmpfs(path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size >> 10}k", str(path)], check=True)


async def test_creates_with_their_filesystem_full_fail_clearly_and_leave_nothing(small_state):
    """A container create writes nothing to the state dir's disk: with it full, creates work. What
    a create writes (its record, crun's state) goes to the node's own tmpfs: with that full too,
    each create is refused at once with ``BackendError`` naming ENOSPC, nothing is made, the
    sandbox already there runs on, and once there is room creates work again."""
    srv = LocalServer(small_state, extra_args=("--pool-max", "0"), env={"DSEC_VMS": "0"}).start()
    run = small_state / "node" / "run"  # the node's tmpfs: records, crun's state, the bundles' mounts
    original = os.statvfs(run).f_blocks * os.statvfs(run).f_frsize
    try:
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            keeper = await client.run_container(ARGS)  # (its create mounted the layers)
            filler = small_state / "filler"
            fill(str(filler))
            assert os.statvfs(small_state).f_bavail == 0
            async with await client.run_container(ARGS) as other:  # the state dir's disk is not in its way
                assert (await other.run_shell("echo ok")).stdout == "ok\n"
            await asyncio.sleep(0.5)  # the last overlay's detach from the host is done by then
            before = made(small_state)
            st = os.statvfs(run)
            resize_tmpfs(run, (st.f_blocks - st.f_bfree) * st.f_frsize + (64 << 10))
            try:
                answers = await asyncio.wait_for(asyncio.gather(*(client.run_container(ARGS) for _ in range(6)),
                                                                return_exceptions=True), 60)
                for answer in answers:
                    assert isinstance(answer, BackendError), answer
                    assert "no space left on device (ENOSPC)" in str(answer), answer
                with pytest.raises(BackendError, match=r"\(ENOSPC\)"):
                    await asyncio.wait_for(client.run_containers(ARGS, count=3), 60)
                assert made(small_state) == before  # nothing half-made: no mount, cgroup or record
                assert [s.id for s in await client.list_sandboxes()] == [keeper.id]
                assert (await keeper.run_shell("echo still here")).stdout == "still here\n"
            finally:
                resize_tmpfs(run, original)
            os.unlink(filler)
            made_now = await asyncio.gather(*(client.run_container(ARGS) for _ in range(3)))
            for sandbox in made_now:
                assert (await sandbox.run_shell("echo room")).stdout == "room\n"
                await sandbox.stop()
            await keeper.stop()
    finally:
        await srv.stop_sandboxes_async()
        srv.stop()


async def test_a_microvm_create_on_a_full_state_dir_fails_clearly_and_leaves_nothing(small_state):
    """A microVM's directory (QEMU's sockets, its console, its machine file) is on the state dir's
    disk: with that full its create fails with ``BackendError`` naming ENOSPC, not a hang or a
    boot timeout, and leaves no directory, cgroup or process; with room it boots."""
    srv = LocalServer(small_state, extra_args=("--pool-max", "0")).start()
    vms = small_state / "node" / "vms" / "microvm"
    args = DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=128)
    try:
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            filler = small_state / "filler"
            fill(str(filler))
            with pytest.raises(BackendError, match=r"(?i)no space left on device|ENOSPC") as err:
                await asyncio.wait_for(client.run_microvm(args, timeout=120), 60)
            assert "ENOSPC" in str(err.value) or "No space left" in str(err.value), err.value
            assert not vms.is_dir() or list(vms.iterdir()) == [], list(vms.iterdir())
            assert await client.list_sandboxes() == []
            os.unlink(filler)
            async with await client.run_microvm(args, timeout=300) as vm:
                assert (await vm.run_shell("echo booted")).stdout == "booted\n"
    finally:
        await srv.stop_sandboxes_async()
        srv.stop()


async def test_a_full_disk_fails_a_microvm_snapshot_clearly_and_keeps_nothing(small_state):
    """A full snapshot of a microVM writes its memory to the state dir's disk: with that full, the
    call fails with ``BackendError`` naming the disk, nothing of it is listed or kept (no memory
    directory, no record, its name free), and the VM and the server go on."""
    srv = LocalServer(small_state, extra_args=("--pool-max", "0")).start()
    snapshots = small_state / "node" / "snapshots"
    try:
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            vm = await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=128),
                                          timeout=300)
            await vm.run_shell("head -c 4194304 /dev/urandom > /root/held")
            # Full but for 256 KiB: the snapshot's record fits, its memory does not.
            room, filler = small_state / "room", small_state / "filler"
            room.write_bytes(b"\1" * (256 << 10))
            fill(str(filler))
            room.unlink()
            with pytest.raises(BackendError, match=r"no space left on the disk of .*\(ENOSPC\); nothing was kept"):
                await vm.snapshot("full", name="taken-when-full")
            assert [s for s in await client.list_snapshots() if s.sandbox_id == vm.id] == []
            assert list(snapshots.iterdir()) == [], list(snapshots.iterdir())
            catalog = small_state / "store" / "snapshots"
            assert not (catalog / "names" / "taken-when-full").exists()
            assert list((catalog / "pending").iterdir()) == []
            # The VM runs on; the server answers.
            assert (await vm.run_shell("wc -c < /root/held")).stdout.strip() == "4194304"
            assert [s.id for s in await client.list_sandboxes()] == [vm.id]
            os.unlink(filler)
            await vm.stop()
    finally:
        await srv.stop_sandboxes_async()
        srv.stop()
