"""Pausing a VM stops it and pushes its memory out of RAM (its QEMU runs in a memory cgroup of
its own); resuming brings it back with its processes and files as they were. Destroying a
paused VM leaves nothing (no QEMU, no cgroup)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dsec.backends.base import ExecContext, SandboxSpec
from dsec.resources import cgroups, reclaim
from libdsec import SandboxStateError
from libdsec.protocol import ExecRequest

pytestmark = [pytest.mark.slow, pytest.mark.root]

ROOT = ExecContext(uid=0, gid=0, workdir="/", env={"PATH": "/bin:/usr/bin"})
FILL_MB = 24
# Random bytes, not zeros: zram stores a page of one repeated byte as nothing at all (and a
# random page does not compress either). From /dev/urandom, not text made by ``seq``: busybox's
# seq formats each number as a double, which under TCG took 50 s of the guest's for 24 MiB where
# urandom took 8 (the same guest, one after the other, load average 100).
SETUP = (f"head -c {FILL_MB << 20} /dev/urandom > /root/fill && md5sum /root/fill | cut -c1-32;"
         "(n=0; while :; do n=$((n+1)); echo $n > /root/count; sleep 0.2; done) >/dev/null 2>&1 &")


@pytest.mark.parametrize("kind", ["microvm", "fullvm"])
async def test_paused_vm_memory_is_pushed_out_and_comes_back(kind, tmp_path_factory, test_store):
    from dsec._sys import set_child_subreaper
    from dsec.backends.vm import machine
    from dsec.backends.vm.fullvm import FullVMBackend
    from dsec.backends.vm.microvm import MicroVMBackend
    from dsec.images.store import LayerStore
    from dsec.local import leftovers

    set_child_subreaper()
    state = tmp_path_factory.mktemp(f"pause-{kind}")
    store = LayerStore(test_store)
    cls = MicroVMBackend if kind == "microvm" else FullVMBackend
    backend = cls(state / "node", store, Path(test_store).parent / "vm", boot_timeout_s=90)
    image = store.get_image("busybox")
    spec = SandboxSpec(image="busybox", layers=image.layers, env={}, limits=None)
    handle = await backend.create("cpausetest0000000", spec)
    try:
        # QEMU runs in the VM's own memory cgroup, and its memory is charged there.
        cgroup_lines = Path(f"/proc/{handle.pid}/cgroup").read_text()
        assert f"/{backend.cgroup_parent}/{handle.cid}" in cgroup_lines
        digest = (await backend.exec(handle, ExecRequest(command=SETUP, timeout=120), ROOT)).stdout.strip()
        # Its own pages (the guest's RAM, QEMU's heap): the mapped QEMU binary and libraries are
        # page cache shared with every other QEMU, charged where they were first read.
        before_rss = machine.rss_bytes(handle.pid, "RssAnon")
        assert (reclaim.usage(backend.cgroup_parent, handle.cid) or 0) >= FILL_MB << 20

        await backend.pause(handle)
        assert (await backend._live[handle.cid].qmp.execute("query-status"))["status"] == "paused"
        if reclaim.swap_total_bytes():
            after_rss = machine.rss_bytes(handle.pid, "RssAnon")
            assert after_rss < 0.3 * before_rss, (before_rss, after_rss, machine.rss_bytes(handle.pid))
            assert (reclaim.swapped_bytes(backend.cgroup_parent, handle.cid) or 0) >= FILL_MB << 20
        with pytest.raises(SandboxStateError, match="paused"):
            await backend.exec(handle, ExecRequest(command="true"), ROOT)

        await backend.resume(handle)
        check = await backend.exec(handle, ExecRequest(
            command="md5sum /root/fill | cut -c1-32; a=$(cat /root/count); sleep 1; b=$(cat /root/count);"
                    " [ $b -gt $a ] && echo counting", timeout=120), ROOT)
        assert check.stdout.split() == [digest, "counting"]

        await backend.pause(handle)  # destroyed while paused: nothing is left
    finally:
        await backend.destroy(handle)
        await backend.recover([])
        backend.release_unused()
        await backend.close()
    left = leftovers(state)
    shutil.rmtree(state, ignore_errors=True)
    assert not left, left
    assert not any(h.joinpath(backend.cgroup_parent).exists() for h in [cgroups.CGROUP_ROOT, cgroups.CGROUP_ROOT / "memory"])
