"""The layer cache's chunk store (dsec.images.layercache.ChunkCache) without its FUSE server:
a chunk is read from the store once and then from the node's disk; the bound holds, evicting
the least recently used, also as read back after a restart; a chunk changed on disk is refused
and fetched again; a layer file rebuilt under its name drops what was kept of the old one; a
write that cannot be made leaves the reader its data and keeps nothing."""

from __future__ import annotations

import os

from dsec.images.layercache import CHUNK, ChunkCache

NAME = "sha256-" + "ab" * 32 + ".erofs"


def store_file(tmp_path, chunks: int, fill: int = 0) -> tuple[int, bytes]:
    data = b"".join(bytes([(fill + i) % 256]) * CHUNK for i in range(chunks))
    path = tmp_path / "layer"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY), data


def test_a_chunk_is_fetched_once_then_read_from_the_cache_also_after_a_restart(tmp_path):
    fd, data = store_file(tmp_path, 4)
    cache = ChunkCache(tmp_path / "cache", 1 << 20)
    cache.opened(NAME, len(data), 1)
    assert cache.read(NAME, fd, 1, 10, 100) == data[CHUNK + 10: CHUNK + 110]
    assert cache.read(NAME, fd, 1) == data[CHUNK: 2 * CHUNK]
    assert cache.stats()["fetched_bytes"] == CHUNK and cache.stats()["cached_bytes_served"] == CHUNK
    cache.close()
    again = ChunkCache(tmp_path / "cache", 1 << 20)
    again.opened(NAME, len(data), 1)
    assert again.read(NAME, -1, 1, 5, 7) == data[CHUNK + 5: CHUNK + 12]  # -1: the store is not read
    assert again.stats()["fetched_bytes"] == 0 and again.stats()["used_bytes"] == CHUNK
    os.close(fd)


def test_the_bound_holds_evicting_the_least_recently_used_also_after_a_restart(tmp_path):
    fd, data = store_file(tmp_path, 6)
    cache = ChunkCache(tmp_path / "cache", 3 * CHUNK)
    cache.opened(NAME, len(data), 1)
    for chunk in (0, 1, 2, 0, 3):  # 1 is the least recently used when 3 comes
        cache.read(NAME, fd, chunk)
    stats = cache.stats()
    assert stats["used_bytes"] == 3 * CHUNK and stats["chunks_evicted"] == 1
    cache.close()
    again = ChunkCache(tmp_path / "cache", 2 * CHUNK)  # a smaller bound after the restart: 2 goes too
    again.opened(NAME, len(data), 1)
    assert again.stats()["used_bytes"] == 2 * CHUNK
    for chunk in (0, 3):
        again.read(NAME, -1, chunk)
    assert again.stats()["fetched_bytes"] == 0
    again.read(NAME, fd, 1)
    assert again.stats()["fetched_bytes"] == CHUNK
    os.close(fd)


def test_a_chunk_changed_on_disk_is_refused_and_fetched_again(tmp_path):
    fd, data = store_file(tmp_path, 2)
    cache = ChunkCache(tmp_path / "cache", 1 << 20)
    cache.opened(NAME, len(data), 1)
    cache.read(NAME, fd, 1)
    cache.close()
    with open(tmp_path / "cache" / "chunks" / f"{NAME}.data", "r+b") as f:
        f.seek(CHUNK + 3)
        f.write(b"\xff")
    again = ChunkCache(tmp_path / "cache", 1 << 20)
    again.opened(NAME, len(data), 1)
    assert again.read(NAME, fd, 1) == data[CHUNK:]
    assert again.stats()["chunks_refused"] == 1 and again.stats()["fetched_bytes"] == CHUNK
    os.close(fd)


def test_a_layer_rebuilt_under_its_name_is_fetched_anew(tmp_path):
    fd, data = store_file(tmp_path, 2)
    cache = ChunkCache(tmp_path / "cache", 1 << 20)
    cache.opened(NAME, len(data), 1)
    cache.read(NAME, fd, 0)
    os.close(fd)
    fd, other = store_file(tmp_path, 2, fill=7)
    cache.opened(NAME, len(other), 2)  # another mtime: another file
    assert cache.read(NAME, fd, 0) == other[:CHUNK]
    assert cache.stats()["fetched_bytes"] == 2 * CHUNK and cache.stats()["used_bytes"] == CHUNK
    os.close(fd)


def test_a_write_that_fails_leaves_the_reader_its_data_and_keeps_nothing(tmp_path):
    fd, data = store_file(tmp_path, 2)
    cache = ChunkCache(tmp_path / "cache", 1 << 20)
    cache.opened(NAME, len(data), 1)
    layer = cache._layer(NAME)
    os.close(layer.data)
    layer.data = os.open(tmp_path / "cache" / "chunks" / f"{NAME}.data", os.O_RDONLY)  # writes fail (EBADF)
    assert cache.read(NAME, fd, 1) == data[CHUNK:]
    stats = cache.stats()
    assert stats["write_failures"] == 1 and stats["chunks"] == 0 and stats["used_bytes"] == 0
    os.close(fd)


def test_layers_gc_removed_from_the_store_give_their_chunks_back_but_not_while_open_or_unlisted(tmp_path):
    from dsec.images.layercache import CacheFS

    layers = tmp_path / "layers"
    layers.mkdir()
    kept, gone, held = ("sha256-" + c * 64 + ".erofs" for c in "123")
    cache = ChunkCache(tmp_path / "cache", 1 << 20)
    for name in (kept, gone, held):
        (layers / name).write_bytes(bytes(2 * CHUNK))
        fd = os.open(layers / name, os.O_RDONLY)
        cache.opened(name, 2 * CHUNK, 1)
        cache.read(name, fd, 0)
        os.close(fd)
    fs = CacheFS(-1, layers, cache)
    fs._files[7] = (held, -1, 2 * CHUNK)  # a reader has it open
    assert fs.sweep() == 0  # everything still in the store
    (layers / gone).unlink()
    (layers / held).unlink()
    assert fs.sweep() == 1
    assert cache.stats()["used_bytes"] == 2 * CHUNK and cache.stats()["layers_removed"] == 1
    assert sorted(p.name for p in (tmp_path / "cache" / "chunks").iterdir()) == sorted(
        f"{name}{suffix}" for name in (kept, held) for suffix in (".data", ".idx"))
    del fs._files[7]
    (layers / kept).rename(tmp_path / "elsewhere")  # the store lists nothing (unmounted): kept
    assert fs.sweep() == 0 and cache.stats()["used_bytes"] == 2 * CHUNK
    (tmp_path / "elsewhere").rename(layers / kept)
    assert fs.sweep() == 1 and cache.stats()["used_bytes"] == CHUNK
    cache.close()
    again = ChunkCache(tmp_path / "cache", 1 << 20)  # what was removed stays removed
    assert again.stats()["used_bytes"] == CHUNK
