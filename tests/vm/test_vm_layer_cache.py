"""MicroVMs read their layers through the node's layer cache (dsec.images.layercache): QEMU maps
the cache's file of a layer's DAX variant (a FUSE file, shared and read-only) as the guest's
pmem, so what the guest reads is fetched from the store in chunks, checked and kept on the
node's disk; the next VM of the image, on a cache started again, and a clone of its memory
snapshot read nothing from the store.
While a VM maps files of the cache it is not stopped under it (by the VMs' backend or a
restarted edge's layer mounts); with the last VM gone it is. A chunk damaged on the store never
reaches a guest. A full VM's base disk is built from the cache's files.
(The same for containers: tests/images/test_layer_cache.py.)"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from dsec.backends.base import ExecContext, SandboxSpec
from libdsec.protocol import ExecRequest

pytestmark = [pytest.mark.slow, pytest.mark.root]

ROOT = ExecContext(uid=0, gid=0, workdir="/", env={"PATH": "/bin:/usr/bin"})
# Every file of the image's /bin, /etc and /lib, read whole in the guest (from its pmem layers).
READ_ALL = "find /bin /etc /lib -xdev -type f 2>/dev/null | sort | xargs cat 2>/dev/null | md5sum"


def own_store(test_store: Path, state: Path):
    """A store of its own with the busybox image's layers (its DAX variants made there, with
    their sums): (store, image)."""
    from dsec.images.store import LayerStore

    shared = LayerStore(test_store)
    image = shared.get_image("busybox")
    store = LayerStore(state / "store")
    for digest in image.layers:
        shutil.copyfile(shared.layer_path(digest), store.tmp_dir / "layer.erofs")
        store.place_layer(digest, store.tmp_dir / "layer.erofs")
    store.put_image(image)
    return store, image


def microvm(state: Path, store, cache, test_store: Path):
    from test_microvm import assets_dir

    from dsec._sys import set_child_subreaper
    from dsec.backends.vm.microvm import MicroVMBackend

    set_child_subreaper()
    return MicroVMBackend(state / "node", store, assets_dir(test_store), boot_timeout_s=90, use_ksm=False,
                          layer_cache=cache)


async def cleaned_up(backend, cache, state: Path) -> list[str]:
    """Every VM of the backend ended, the cache stopped with the last: what is left (none)."""
    from test_microvm import qemu_processes

    from dsec.local import leftovers

    await backend.recover([])
    backend.release_unused()
    await backend.close()
    left = leftovers(state) + qemu_processes(str(state)) + (["the layer cache's server"] if cache.running() else [])
    shutil.rmtree(state, ignore_errors=True)
    return left


async def test_a_microvm_reads_its_layers_through_the_node_layer_cache(test_store):
    from dsec.images import sums
    from dsec.images.layercache import LayerCache
    from dsec.images.mounts import LayerMounts

    state = Path(tempfile.mkdtemp(prefix="vmc-", dir="/tmp"))  # (short: QEMU's sockets are in it)
    store, image = own_store(test_store, state)
    cache = LayerCache(state / "node" / "layer-cache", 256 << 20, store.layers_dir)
    backend = microvm(state, store, cache, test_store)
    spec = SandboxSpec(image="busybox", layers=image.layers, env=dict(image.env), limits=None)
    try:
        vm = await backend.create("clc1000000000000", spec)
        argv = Path(f"/proc/{vm.pid}/cmdline").read_bytes().decode(errors="replace")
        for digest in image.layers:  # QEMU maps the cache's file of each DAX variant, not the store's
            assert f"mem-path={cache.mountpoint}/{digest}.dax," in argv
            assert f"mem-path={store.layers_dir}" not in argv
            # (whose chunks the cache checks against the sums taken when it was made)
            assert sums.load(store.dax_layer_path(digest)).size == store.dax_layer_path(digest).stat().st_size
        first = await backend.exec(vm, ExecRequest(command=READ_ALL), ROOT)
        assert first.exit_code == 0, first.stderr
        cold = cache.stats()
        # (a) what the guest read was fetched in chunks from the store and kept.
        assert cold["fetched_bytes"] > 0 and cold["chunks_cached"] > 0
        assert cold["store_chunks_refused"] == 0 and cold["chunks_refused"] == 0
        assert cold["used_bytes"] <= sum(store.dax_layer_path(d).stat().st_size for d in image.layers)
        # Not stopped under a running VM: the cache's mount is busy with QEMU's mappings.
        assert not cache.stop_unless_busy() and cache.running()
        await backend.destroy(vm)
        backend.release_unused()  # the last VM gone: the cache stops
        assert not cache.running()

        # (b) a second VM of the image, on the cache started again (a new server: nothing in the
        # host's page cache of it), reads everything from the node's disk.
        vm = await backend.create("clc2000000000000", spec)
        second = await backend.exec(vm, ExecRequest(command=READ_ALL), ROOT)
        assert second.exit_code == 0, second.stderr
        assert second.stdout == first.stdout
        warm = cache.stats()
        assert warm["fetched_bytes"] == 0, warm
        assert warm["cached_bytes_served"] > 0 and warm["chunks_refused"] == 0
        assert warm["used_bytes"] == cold["used_bytes"]
        # An edge restarted under the VM (new handles on the same cache) whose containers mount
        # no layer: its layer mounts let go of what is unused, and the cache serves on.
        again = LayerCache(cache.cache_dir, cache.limit, store.layers_dir)
        LayerMounts(state / "node" / "layers", layers_dir=store.layers_dir, cache=again).release_unused()
        assert again.running() and again.device() == cache.device()
        still = await backend.exec(vm, ExecRequest(command=READ_ALL), ROOT)
        assert still.exit_code == 0 and still.stdout == first.stdout
        # A clone of a memory snapshot maps the same files of the cache (the pmem layers are no
        # part of the snapshot: x-ignore-shared).
        meta = await backend.snapshot(vm)
        clone = await backend.create("clc3000000000000", replace(spec, snapshot=meta["id"]))
        cloned = await backend.exec(clone, ExecRequest(command=READ_ALL), ROOT)
        assert cloned.exit_code == 0 and cloned.stdout == first.stdout
        assert cache.stats()["fetched_bytes"] == 0
        await backend.destroy(clone)
        await backend.destroy(vm)
    finally:
        # (c) nothing left: no QEMU, cgroup or mount (the cache's own under the state dir).
        left = await cleaned_up(backend, cache, state)
    assert not left, left


async def test_a_chunk_damaged_on_the_store_never_reaches_a_microvm(test_store):
    """A chunk of a DAX variant that does not match its sum is refused by the cache: the
    guest's pmem read of it faults in QEMU (a mapped file has no EIO to give), which ends, and
    the create fails naming the VM; the log names the layer and the chunk."""
    from damage import flip

    from dsec.images.layercache import LayerCache
    from libdsec import BackendError

    state = Path(tempfile.mkdtemp(prefix="vmc-", dir="/tmp"))
    store, image = own_store(test_store, state)
    cache = LayerCache(state / "node" / "layer-cache", 256 << 20, store.layers_dir)
    backend = microvm(state, store, cache, test_store)
    spec = SandboxSpec(image="busybox", layers=image.layers, env=dict(image.env), limits=None)
    try:
        dax = store.dax_layer(image.layers[0])
        flip(dax, 1024 + 100)  # in the EROFS superblock, which the guest reads to mount it
        with pytest.raises(BackendError, match="did not come up"):
            await backend.create("clcd000000000000", spec)
        assert cache.stats()["store_chunks_refused"] >= 1
        log = (cache.cache_dir / "log").read_text()
        assert f"chunk 0 of {dax.name} (bytes 0-65535) read from the store" in log
    finally:
        left = await cleaned_up(backend, cache, state)
    assert not left, left


def test_a_full_vm_base_disk_is_built_from_the_layer_cache(tmp_path, test_store):
    """A full VM's base disk (composed from the layers, kept on the node) is built from the
    cache's files of the layers: a node building it again reads nothing from the store."""
    import asyncio

    from dsec.backends.vm.fullvm import FullVMBackend
    from dsec.images.layercache import LayerCache
    from dsec.images.store import LayerStore
    from dsec.local import leftovers

    store = LayerStore(test_store)
    layers = store.get_image("busybox").layers
    cache = LayerCache(tmp_path / "node" / "layer-cache", 64 << 20, store.layers_dir)
    backend = FullVMBackend(tmp_path / "node", store, tmp_path / "vm", layer_cache=cache)
    try:
        disk = asyncio.run(backend.base_disk(layers))
        cold = cache.stats()
        assert cold["fetched_bytes"] > 0 and cold["chunks_cached"] > 0
        backend.release_unused()  # no VM: the cache stops
        assert not cache.running()
        built = subprocess.run(["debugfs", "-R", "stat /bin/busybox", str(disk)], capture_output=True, text=True)
        assert "Type: regular" in built.stdout, built.stdout + built.stderr
        disk.unlink()
        again = asyncio.run(backend.base_disk(layers))  # the cache started again: the node's disk
        warm = cache.stats()
        assert warm["fetched_bytes"] == 0 and warm["cached_bytes_served"] > 0
        assert again.stat().st_size > 0
    finally:
        backend.release_unused()
    assert not cache.running()
    assert not leftovers(tmp_path)
