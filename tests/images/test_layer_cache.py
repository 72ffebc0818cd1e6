"""The node's layer cache (dsec.images.layercache) in front of a store's layer files: a layer
mounted through it reads what it needs from the store once, and the next mount (the cache's
server started again, as after a node restart) reads it from the node's disk; the cache stays
within its bound, evicting least recently used; a chunk corrupted on the node's disk is refused
and fetched again; a full cache disk still serves every read from the store. (On a GlusterFS
store, with the nodes of a cluster: tests/cluster/test_gluster_store.py.)"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from damage import flip

from dsec.images import loopdev
from dsec.images.compose import LayerMount
from dsec.images.layercache import CHUNK, LayerCache
from dsec.images.mounts import LayerMounts
from dsec.images.store import LayerStore

pytestmark = [pytest.mark.slow, pytest.mark.root]

FILES = 8
FILE_BYTES = 512 << 10


@pytest.fixture
def layer(tmp_path):
    """A store with one layer of ``FILES`` incompressible files; (store, digest, {name: md5})."""
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(7)
    sums = {}
    for i in range(FILES):
        data = rng.randbytes(FILE_BYTES)
        (src / f"f{i}").write_bytes(data)
        sums[f"f{i}"] = hashlib.md5(data).hexdigest()
    store = LayerStore(tmp_path / "store")
    return store, store.add_dir(src), sums


class Node:
    """LayerMounts over the store with a cache of ``limit`` bytes; ``read`` mounts the layer,
    reads files and unmounts it (the cache stopped with it, as when a node's last sandbox ends)."""

    def __init__(self, tmp_path: Path, store: LayerStore, digest: str, limit: int, attach: str = "file") -> None:
        self.cache = LayerCache(tmp_path / "cache", limit, store.layers_dir)
        self.mounts = LayerMounts(tmp_path / "node" / "layers", attach=attach, layers_dir=store.layers_dir,
                                  cache=self.cache)
        self.layer = LayerMount(digest=digest, source=store.layer_path(digest), target=self.mounts.mount_dir / digest)

    def read(self, *names: str) -> tuple[dict[str, str], dict]:
        self.mounts.acquire((self.layer,))
        try:
            sums = {n: hashlib.md5((self.layer.target / n).read_bytes()).hexdigest() for n in names}
            stats = self.cache.stats()
        finally:
            self.mounts.release((self.layer,))
            self.mounts.release_unused()
        assert not self.cache.running()
        assert not loopdev.backed_by(self.cache.mountpoint)
        return sums, stats


@pytest.mark.parametrize("attach", ["file", "loop"])
def test_a_second_mount_reads_nothing_from_the_store_and_a_corrupted_chunk_is_refused(tmp_path, layer, attach):
    store, digest, sums = layer
    node = Node(tmp_path, store, digest, 64 << 20, attach)
    got, first = node.read("f0", "f1")
    assert got == {n: sums[n] for n in ("f0", "f1")}
    size = store.layer_size(digest)
    # What was read and little more: two of the eight files, the metadata, chunk rounding.
    assert 2 * FILE_BYTES <= first["fetched_bytes"] <= 2 * FILE_BYTES + 4 * CHUNK < size
    got, second = node.read("f0", "f1")  # a new server on the same cache: a node restarted
    assert got == {n: sums[n] for n in ("f0", "f1")}
    assert second["fetched_bytes"] == 0 and second["cached_bytes_served"] > 0
    assert second["used_bytes"] == first["used_bytes"]
    # A byte of a cached chunk changed on the node's disk: refused by its sha256, read anew.
    data = tmp_path / "cache" / "chunks" / f"{store.layer_path(digest).name}.data"
    with open(data, "r+b") as f:
        f.seek(2 * CHUNK + 5)
        byte = f.read(1)
        f.seek(2 * CHUNK + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    got, third = node.read("f0", "f1")
    assert got == {n: sums[n] for n in ("f0", "f1")}
    assert third["chunks_refused"] == 1 and third["fetched_bytes"] == CHUNK
    assert "does not match its sha256: refused" in (tmp_path / "cache" / "log").read_text()


def test_the_cache_stays_within_its_bound_evicting_the_least_recently_used(tmp_path, layer):
    store, digest, sums = layer
    limit = 3 * FILE_BYTES
    node = Node(tmp_path, store, digest, limit)
    names = [f"f{i}" for i in range(FILES)]
    got, first = node.read(*names)
    assert got == sums
    assert first["used_bytes"] <= limit and first["chunks_evicted"] > 0
    assert os.stat(tmp_path / "cache" / "chunks" / f"{store.layer_path(digest).name}.data").st_blocks * 512 <= limit
    # After a restart: the last file read is still there (the layer's head, its metadata, read
    # first and not since, was evicted: at most a chunk), the first files were evicted.
    _, last = node.read(names[-1])
    assert last["fetched_bytes"] <= CHUNK
    _, early = node.read(names[0])
    assert early["fetched_bytes"] >= FILE_BYTES and early["used_bytes"] <= limit


def test_a_full_cache_disk_serves_reads_from_the_store(tmp_path, layer):
    store, digest, sums = layer
    chunks = tmp_path / "cache" / "chunks"
    chunks.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "dsec-test-full", str(chunks)], check=True)
    try:
        node = Node(tmp_path, store, digest, 64 << 20)
        got, stats = node.read(*sums)
        assert got == sums
        assert stats["write_failures"] > 0 and stats["used_bytes"] <= 256 << 10
        assert "reading from the store" in (tmp_path / "cache" / "log").read_text()
    finally:
        subprocess.run(["umount", str(chunks)], check=True)


def test_a_killed_cache_server_is_started_again_and_the_layer_mounted_anew(tmp_path, layer):
    """The cache's server killed (its mount answers ENOTCONN): the next mount of a layer starts
    it again and mounts the layer anew through it, though a sandbox still holds the old mount."""
    store, digest, sums = layer
    node = Node(tmp_path, store, digest, 64 << 20)
    node.mounts.acquire((node.layer,))
    try:
        assert hashlib.md5((node.layer.target / "f0").read_bytes()).hexdigest() == sums["f0"]
        pid = int((tmp_path / "cache" / "lock").read_text())
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while node.cache.running():
            assert time.monotonic() < deadline, "the killed server's mount still answers"
            time.sleep(0.05)
        node.mounts.acquire((node.layer,))  # a second sandbox of the layer
        try:
            assert hashlib.md5((node.layer.target / "f1").read_bytes()).hexdigest() == sums["f1"]
            assert node.cache.running() and node.cache.stats()["cached_bytes_served"] >= 0
        finally:
            node.mounts.release((node.layer,))
    finally:
        node.mounts.release((node.layer,))
        node.mounts.release_unused()
    assert not node.cache.running()


def test_a_layer_damaged_on_the_store_is_refused(tmp_path, layer):
    """A layer's file damaged on the store (dsec.images.sums): a chunk that does not match the
    sum the store took of it is refused by the cache (EIO to the reader, never cached), and
    served again once the store's file is whole; a file cut short, or a damaged sums file, is
    refused before it is mounted, naming the layer."""
    from libdsec import BackendError
    from dsec.images import sums as layer_sums

    store, digest, sums = layer
    path = store.layer_path(digest)
    # Where f3's bytes are in the layer file (incompressible: stored as they are).
    rng = random.Random(7)
    f3 = [rng.randbytes(FILE_BYTES) for _ in range(FILES)][3]
    at = path.read_bytes().find(f3[:4096])
    assert at > 0
    flip(path, at + 1000)
    node = Node(tmp_path, store, digest, 64 << 20)
    node.mounts.acquire((node.layer,))
    try:
        assert hashlib.md5((node.layer.target / "f0").read_bytes()).hexdigest() == sums["f0"]
        for _ in range(2):  # (not cached: refused again)
            with pytest.raises(OSError) as err:
                (node.layer.target / "f3").read_bytes()
            assert err.value.errno == 5  # EIO
        stats = node.cache.stats()
        assert stats["store_chunks_refused"] >= 1
        chunk = (at + 1000) // CHUNK
        log = (tmp_path / "cache" / "log").read_text()
        assert f"chunk {chunk} of {path.name}" in log and "damaged on the store, refused" in log
        flip(path, at + 1000)  # the store's file whole again (the same inode, size and mtime)
        assert hashlib.md5((node.layer.target / "f3").read_bytes()).hexdigest() == sums["f3"]
    finally:
        node.mounts.release((node.layer,))
        node.mounts.release_unused()
    # Cut short: refused before it is mounted, with or without the cache.
    size = path.stat().st_size
    os.truncate(path, size - CHUNK)
    for mounts in (node.mounts, LayerMounts(tmp_path / "direct", attach="file", layers_dir=store.layers_dir)):
        with pytest.raises(BackendError, match=f"layer {digest}: its file has {size - CHUNK} bytes, its sums "
                                               f"were taken over {size} \\(cut short\\): refused, not mounted"):
            mounts.acquire((node.layer,))
        assert not os.path.ismount(node.layer.target) and mounts.mounted() == {}
    # The sums damaged: refused too.
    layer_sums.path_of(path).write_bytes(b"not sums")
    with pytest.raises(BackendError, match="its sums file in the store is damaged"):
        node.mounts.acquire((node.layer,))
    node.mounts.release_unused()
    assert not node.cache.running()


def test_a_copy_of_the_cache_mount_in_another_namespace_does_not_keep_its_server(tmp_path, layer):
    """A process that unshared its mounts while the cache was mounted (a daemon started then:
    glusterd on this machine) holds a copy of the cache's mount, which keeps the FUSE connection
    alive: the cache's stop ends its server all the same, and it starts again at once."""
    store, digest, sums = layer
    node = Node(tmp_path, store, digest, 64 << 20)
    node.cache.ensure()
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while str(node.cache.mountpoint) not in Path(f"/proc/{holder.pid}/mountinfo").read_text():
            assert time.monotonic() < deadline, "unshare made no copy of the mount"
            time.sleep(0.01)
        start = time.monotonic()
        got, _ = node.read("f0")  # (the cache stopped at the end)
        assert got == {"f0": sums["f0"]} and time.monotonic() - start < 4
        got, again = node.read("f0")  # started again: its lock was let go
        assert got == {"f0": sums["f0"]} and again["fetched_bytes"] == 0
    finally:
        holder.kill()
        holder.wait()


def _layer_file(tmp_path: Path, layer) -> tuple[Path, bytes, LayerCache]:
    """The layer's file in the store, its bytes, and a cache (not started) of the store."""
    store, digest, _ = layer
    source = store.layer_path(digest)
    return source, source.read_bytes(), LayerCache(tmp_path / "cache", 64 << 20, store.layers_dir)


def test_a_read_of_part_of_a_chunk_brings_the_whole_chunk_into_the_page_cache(tmp_path, layer):
    """The server pushes each chunk a read falls in, whole, into the kernel's page cache: the
    chunk's other pages are then read with no request to the server, and are the store's bytes."""
    source, expected, cache = _layer_file(tmp_path, layer)
    try:
        fd = os.open(cache.path(source), os.O_RDONLY)
        try:
            assert os.pread(fd, 4096, 3 * CHUNK) == expected[3 * CHUNK: 3 * CHUNK + 4096]
            deadline = time.monotonic() + 5
            while (stats := cache.stats())["chunks_pushed"] < 1:
                assert time.monotonic() < deadline, "the chunk was not pushed"
                time.sleep(0.01)
            requests = stats["read_requests"]
            for at in range(3 * CHUNK + 4096, 4 * CHUNK, 4096):
                assert os.pread(fd, 4096, at) == expected[at: at + 4096]
            after = cache.stats()
            assert after["read_requests"] == requests and after["fetched_bytes"] == CHUNK
            assert after["server_cpu_s"] > 0
            # The next chunk was not pushed: reading it is a request (and a fetch).
            assert os.pread(fd, 4096, 4 * CHUNK) == expected[4 * CHUNK: 4 * CHUNK + 4096]
            assert cache.stats()["read_requests"] == requests + 1
        finally:
            os.close(fd)
    finally:
        cache.stop()
    assert not cache.running()


def test_the_server_runs_at_the_default_priority_when_its_node_runs_niced(tmp_path, layer):
    """A node in a Ray worker runs at nice 15: the cache's server, which every sandbox of the
    node waits on, takes the default priority (every thread of it)."""
    store, digest, _ = layer
    cache = LayerCache(tmp_path / "cache", 64 << 20, store.layers_dir)
    try:
        subprocess.run([sys.executable, "-c", "import os, sys; from pathlib import Path; "
                        "from dsec.images.layercache import LayerCache; os.nice(15); "
                        "LayerCache(Path(sys.argv[1]), 64 << 20, Path(sys.argv[2])).ensure()",
                        str(cache.cache_dir), str(store.layers_dir)], check=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        assert cache.running()
        pid = int((tmp_path / "cache" / "lock").read_text())
        nices = [int(open(t / "stat").read().rsplit(")", 1)[1].split()[16]) for t in Path(f"/proc/{pid}/task").iterdir()]
        assert len(nices) >= 4 and set(nices) == {0}
    finally:
        cache.stop()
    assert not cache.running()


def test_a_layer_opened_on_a_warm_node_has_what_the_cache_holds_of_it_in_the_page_cache(tmp_path, layer):
    """The cache's server started again (a node restarted, its cache kept): opening a layer
    pushes the chunks the cache holds of it, checked, into the kernel's page cache, so reading
    them is no request to the server; nothing is fetched, and a chunk damaged on the node's disk
    is refused, not pushed, and read from the store again when asked for."""
    source, expected, cache = _layer_file(tmp_path, layer)
    try:
        fd = os.open(cache.path(source), os.O_RDONLY)
        for chunk in (0, 3, 5):
            os.pread(fd, 4096, chunk * CHUNK)
        os.close(fd)
    finally:
        cache.stop()
    flip(tmp_path / "cache" / "chunks" / f"{source.name}.data", 5 * CHUNK + 9)
    try:
        fd = os.open(cache.path(source), os.O_RDONLY)
        try:
            deadline = time.monotonic() + 10
            while (stats := cache.stats())["chunks_pushed"] < 2 or stats["chunks_refused"] < 1:
                assert time.monotonic() < deadline, f"the held chunks were not pushed: {stats}"
                time.sleep(0.01)
            assert stats["prefilled_bytes"] == 2 * CHUNK and stats["chunks_refused"] == 1
            for chunk in (0, 3):
                for at in range(chunk * CHUNK, (chunk + 1) * CHUNK, 4096):
                    assert os.pread(fd, 4096, at) == expected[at: at + 4096]
            after = cache.stats()
            assert after["read_requests"] == 0 and after["fetched_bytes"] == 0
            # The damaged chunk: not in the page cache, a request, fetched from the store again.
            assert os.pread(fd, 4096, 5 * CHUNK) == expected[5 * CHUNK: 5 * CHUNK + 4096]
            after = cache.stats()
            assert after["read_requests"] == 1 and after["fetched_bytes"] == CHUNK
        finally:
            os.close(fd)
    finally:
        cache.stop()
    assert not cache.running()
