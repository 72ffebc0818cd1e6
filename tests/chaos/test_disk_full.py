"""Chaos: the state dir's own filesystem (a small ext4 image loop-mounted for the test: file-backed
EROFS layers do not mount from tmpfs), holding the layer store
and the project database) fills up. A pack_diff then fails with a clear error and leaves no
half-made layer or image, the sandbox it packed keeps running, creates and commands go on; once
there is room again pack_diff works."""

from __future__ import annotations

import os
import subprocess

import pytest

from dsec.local import LocalServer, leftovers
from libdsec import BackendError, DSecClient, DSecContainerRunArgs, DSecError

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
            # Only that call failed: the sandbox runs on, and creates and commands work.
            assert (await sandbox.run_shell("cat /root/f199")).stdout == "199\n"
            async with await client.run_container(ARGS) as other:
                assert (await other.run_shell("echo ok")).stdout == "ok\n"
            os.unlink(filler)
            packed = await sandbox.pack_diff("packed-with-room")
            async with await client.run_container(ARGS.model_copy(update={"container_image": packed.image})) as b:
                assert (await b.run_shell("cat /root/f199")).stdout == "199\n"
            await sandbox.stop()
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            await srv.stop_sandboxes_async()
        srv.stop()
