"""A node's read cache of layer files on a shared store: what a node reads of a layer is kept on
its own disk, in chunks, so a second create of an image on the node reads nothing from the
shared filesystem.

The cache is a small FUSE filesystem of this module's own (``serve``, a process of its own per
node, started by ``LayerCache.ensure``): ``MOUNT/sha256-….erofs`` is the store's layer file of
that name, read-only. The node mounts that file (file-backed EROFS, or a loop device over it)
instead of the store's; its VMs map or attach its files of their layers, and of the layers' DAX
variants (``sha256-….dax``, served alike), instead of the store's (``dsec.backends.vm``). A read is served chunk by chunk (``CHUNK`` bytes): a chunk the node has
is read from its local cache file, one it has not is read from the store, written to the cache
and served. The kernel's EROFS reads on demand, so only what sandboxes read is fetched, metadata
first (the superblock, inodes and directories a create walks), and that stays on the node. A
chunk a read falls in part of is pushed whole into the kernel's page cache (FUSE_NOTIFY_STORE):
the rest of it is then read with no round trip to the server, and nothing more is fetched. A
layer opened (mounted) is prefilled: the chunks the cache holds of it are pushed alike, so a
node started again with its cache (warm) reads what it read before with no round trip at all.

On the node's disk (``DIR/chunks``), per layer: ``<digest>.data``, a sparse file holding the
chunks fetched at their offsets, and ``<digest>.idx``, a header (the store file's size and
mtime, so a layer rebuilt under its name is fetched anew) and one record per chunk: the sequence
number of its last use (least recently used goes first) and the sha256 of its bytes. The cache
is bounded by the operator (``DSEC_LAYER_CACHE_MB``): a chunk fetched over the bound evicts the
least recently used chunks of any layer (their space given back: holes punched). A restart
(of the cache process, the node, the machine) keeps every chunk: the records are read back.

Faults: a cached chunk whose bytes no longer match its sha256 is refused (never served; each
chunk is checked the first time a server reads it back from the node's disk, as after a restart),
dropped, logged naming the layer, chunk and file, and read from the store again. A chunk fetched
from the store is checked against the sums the store keeps beside the layer (``dsec.images.sums``,
taken when the layer was placed; a layer placed before has none): one damaged on the store is
refused (the reader gets EIO, the log names the layer and chunk, ``store_chunks_refused`` counts
it) and never cached; a layer whose sums file is damaged is not opened at all. A cache disk
that is full (or failing writes) degrades to reading from the store: the sandbox gets its data,
nothing is cached until writes work again, and ``stats()`` counts the failures. The store gone
gives the reader EIO for a chunk not cached (the edge's store check names the store).

A layer removed from the store (by GC) has its cache files removed too: the server looks at its
start and every ``SWEEP_S`` (a layer a reader still has open is kept until the next look; a
store it cannot list, or that lists no layer at all, as an unmounted shared filesystem's
mountpoint does, is taken as unreachable and nothing is removed).

``MOUNT/.stats`` is a JSON of the counters: bytes fetched from the store, bytes served from the
cache (of them, prefilled: pushed when their layer was opened), chunks cached, evicted and
refused, write failures, layers removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

from .. import _sys
from . import sums

log = logging.getLogger("dsec.images.layercache")

CHUNK = sums.CHUNK  # (so a chunk fetched is one the store's sums name)
# How often the cache looks for layers GC removed from the store (their chunks are given back).
SWEEP_S = 300.0
# (a layer's file, or its DAX variant, which microVMs map: ``dsec.backends.vm.microvm``)
_LAYER = re.compile(r"^sha256-[0-9a-f]{64}\.(?:erofs|dax)\Z")
_STATS = ".stats"

# -- the cache on disk -------------------------------------------------------------------------

_IDX_MAGIC = b"DSECLC01"
_IDX_HEADER = struct.Struct("<8sQQQ")  # magic, chunk size, store file size, store file mtime_ns
_RECORD = struct.Struct("<Q32s")  # last use (0: absent), sha256

class _Layer:
    """One layer's cache files, open."""

    def __init__(self, chunks_dir: Path, name: str) -> None:
        self.name = name
        self.data = os.open(chunks_dir / f"{name}.data", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.idx = os.open(chunks_dir / f"{name}.idx", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def header(self) -> tuple[int, int] | None:
        raw = os.pread(self.idx, _IDX_HEADER.size, 0)
        if len(raw) < _IDX_HEADER.size:
            return None
        magic, chunk, size, mtime = _IDX_HEADER.unpack(raw)
        return (size, mtime) if magic == _IDX_MAGIC and chunk == CHUNK else None

    def records(self) -> list[tuple[int, int, bytes]]:
        """(chunk, last use, sha256) of each chunk held."""
        raw = b""
        while part := os.pread(self.idx, 1 << 20, _IDX_HEADER.size + len(raw)):
            raw += part
        out = []
        for i in range(len(raw) // _RECORD.size):
            seq, sha = _RECORD.unpack_from(raw, i * _RECORD.size)
            if seq:
                out.append((i, seq, sha))
        return out

    def reset(self, size: int, mtime: int) -> None:
        os.ftruncate(self.idx, 0)
        os.ftruncate(self.data, 0)
        os.pwrite(self.idx, _IDX_HEADER.pack(_IDX_MAGIC, CHUNK, size, mtime), 0)

    def record(self, chunk: int, seq: int, sha: bytes) -> None:
        os.pwrite(self.idx, _RECORD.pack(seq, sha), _IDX_HEADER.size + chunk * _RECORD.size)

    def touch(self, chunk: int, seq: int) -> None:
        os.pwrite(self.idx, struct.pack("<Q", seq), _IDX_HEADER.size + chunk * _RECORD.size)

    def close(self) -> None:
        os.close(self.data)
        os.close(self.idx)


class ChunkCache:
    """The chunks of layer files kept under ``root``, at most ``limit`` bytes, LRU."""

    def __init__(self, root: Path, limit: int) -> None:
        self.root = Path(root)
        self.chunks_dir = self.root / "chunks"
        self.chunks_dir.mkdir(parents=True, exist_ok=True)
        self.limit = limit
        self._lock = threading.Lock()
        self._layers: dict[str, _Layer] = {}
        # (layer, chunk) -> (size, sha256), least recently used first
        self._lru: OrderedDict[tuple[str, int], tuple[int, bytes]] = OrderedDict()
        # chunks checked against their sha256 by this process (read back from disk, or written)
        self._verified: set[tuple[str, int]] = set()
        # layer -> the sums the store keeps of its file (none for a layer placed before sums)
        self._store_sums: dict[str, sums.LayerSums] = {}
        self._seq = 0
        self.used = 0
        self.counters = {"fetched_bytes": 0, "cached_bytes_served": 0, "chunks_cached": 0,
                         "chunks_evicted": 0, "chunks_refused": 0, "store_chunks_refused": 0,
                         "write_failures": 0, "read_requests": 0, "layers_removed": 0,
                         "prefilled_bytes": 0}
        self._load()

    def _load(self) -> None:
        found = []
        for idx in sorted(self.chunks_dir.glob("*.idx")):
            name = idx.name[: -len(".idx")]
            layer = self._layer(name)
            if layer.header() is None:
                layer.reset(0, 0)
                continue
            found += [(seq, name, chunk, sha) for chunk, seq, sha in layer.records()]
        for seq, name, chunk, sha in sorted(found):
            size = self._chunk_size(name, chunk)
            self._lru[(name, chunk)] = (size, sha)
            self.used += size
            self._seq = max(self._seq, seq)
        self._evict(0)

    def _chunk_size(self, name: str, chunk: int) -> int:
        header = self._layers[name].header()
        size = header[0] if header else 0
        return max(0, min(CHUNK, size - chunk * CHUNK))

    def _layer(self, name: str) -> _Layer:
        layer = self._layers.get(name)
        if layer is None:
            layer = self._layers[name] = _Layer(self.chunks_dir, name)
        return layer

    def opened(self, name: str, size: int, mtime: int, store_sums: sums.LayerSums | None = None) -> None:
        """The store's file of layer ``name`` is ``size`` bytes of ``mtime`` (its sums in the
        store: ``store_sums``): chunks cached of another file of that name (removed and built
        again) are dropped."""
        with self._lock:
            if store_sums is not None and store_sums.chunk == CHUNK:
                self._store_sums[name] = store_sums
            else:
                self._store_sums.pop(name, None)
            layer = self._layer(name)
            if layer.header() != (size, mtime):
                self._drop_layer(name)
                layer.reset(size, mtime)

    def _drop_layer(self, name: str) -> None:
        for key in [k for k in self._lru if k[0] == name]:
            self.used -= self._lru.pop(key)[0]
            self._verified.discard(key)

    def cached_layers(self) -> set[str]:
        """The layers with cache files (every layer with a chunk kept is open here)."""
        with self._lock:
            return set(self._layers)

    def remove_layers(self, names: set[str]) -> int:
        """Forget the layers ``names`` (gone from the store: removed by GC) and give their cache
        files back. Returns the bytes of chunks given back."""
        freed = 0
        with self._lock:
            for name in names:
                before = self.used
                self._drop_layer(name)
                freed += before - self.used
                self._store_sums.pop(name, None)
                layer = self._layers.pop(name, None)
                if layer is not None:
                    layer.close()
                for suffix in (".idx", ".data"):
                    with contextlib.suppress(FileNotFoundError):
                        (self.chunks_dir / f"{name}{suffix}").unlink()
                self.counters["layers_removed"] += 1
        return freed

    def held(self, name: str, limit: int) -> list[int]:
        """The chunks of layer ``name`` the cache holds, at most ``limit`` bytes of them (the most
        recently used), in the order of the file."""
        with self._lock:
            keys = [chunk for (layer, chunk) in reversed(self._lru) if layer == name]
        return sorted(keys[: max(0, limit // CHUNK)])

    def cached(self, name: str, chunk: int, start: int = 0, length: int = CHUNK, use: bool = True) -> bytes | None:
        """``length`` bytes from ``start`` in chunk ``chunk`` of layer ``name`` if the cache
        holds it (None if not, or if what it holds does not match its sha256: then dropped). A
        chunk is checked the first time this process serves it. ``use``: a read of a sandbox
        (the chunk becomes the most recently used), not a prefill."""
        with self._lock:
            held = self._lru.get((name, chunk))
            if held is None:
                return None
            layer = self._layer(name)
            size, sha = held
            if (name, chunk) in self._verified:
                data = os.pread(layer.data, min(length, size - start), chunk * CHUNK + start)
            else:
                whole = os.pread(layer.data, size, chunk * CHUNK)
                if len(whole) != size or hashlib.sha256(whole).digest() != sha:
                    log.error("layer cache: chunk %d of %s in %s does not match its sha256: refused, "
                              "read from the store again", chunk, name, self.chunks_dir / f"{name}.data")
                    self.counters["chunks_refused"] += 1
                    self._forget(name, chunk)
                    return None
                self._verified.add((name, chunk))
                data = whole[start: start + length]
            if use:
                self._used(layer, name, chunk, len(data))
            else:  # (served all the same: to the kernel's page cache, ahead of the reads)
                self.counters["prefilled_bytes"] += len(data)
                self.counters["cached_bytes_served"] += len(data)
            return data

    def read(self, name: str, store_fd: int, chunk: int, start: int = 0, length: int = CHUNK) -> bytes:
        """``length`` bytes from ``start`` in chunk ``chunk`` of layer ``name``: from the cache
        (``cached``), else from ``store_fd`` (the whole chunk fetched, and kept)."""
        data = self.cached(name, chunk, start, length)
        if data is not None:
            return data
        data = _pread_all(store_fd, CHUNK, chunk * CHUNK)
        sha = hashlib.sha256(data).digest()
        with self._lock:
            self.counters["fetched_bytes"] += len(data)
            expected = self._store_sums.get(name)
            if expected is not None and not expected.sha_ok(chunk, len(data), sha):
                self.counters["store_chunks_refused"] += 1
                log.error("layer cache: chunk %d of %s (bytes %d-%d) read from the store %s does not match the "
                          "sum the store took of it: damaged on the store, refused (the reader gets EIO); "
                          "`dsec image verify` lists the store's damaged layers", chunk, name, chunk * CHUNK,
                          chunk * CHUNK + len(data) - 1, self.root)
                raise OSError(errno.EIO, f"chunk {chunk} of layer {name} is damaged on the store")
            if data and (name, chunk) not in self._lru and len(data) <= self.limit:
                self._keep(name, chunk, data, sha)
        return data[start: start + length]

    def _used(self, layer: _Layer, name: str, chunk: int, served: int) -> None:
        self._seq += 1
        self._lru.move_to_end((name, chunk))
        with contextlib.suppress(OSError):
            layer.touch(chunk, self._seq)
        self.counters["cached_bytes_served"] += served

    def _keep(self, name: str, chunk: int, data: bytes, sha: bytes) -> None:
        self._evict(len(data))
        layer = self._layer(name)
        self._seq += 1
        try:
            if os.pwrite(layer.data, data, chunk * CHUNK) != len(data):  # (a disk that filled up)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            layer.record(chunk, self._seq, sha)
        except OSError as exc:
            # A full or failing cache disk: the reader has its data from the store all the same.
            self.counters["write_failures"] += 1
            if self.counters["write_failures"] in (1, 10, 100) or self.counters["write_failures"] % 1000 == 0:
                log.warning("layer cache: cannot keep a chunk of %s in %s (%s): reading from the store",
                            name, self.chunks_dir, exc.strerror)
            with contextlib.suppress(OSError):
                _sys.punch_hole(layer.data, chunk * CHUNK, CHUNK)
            return
        self._lru[(name, chunk)] = (len(data), sha)
        self._verified.add((name, chunk))
        self.used += len(data)
        self.counters["chunks_cached"] += 1

    def _forget(self, name: str, chunk: int) -> None:
        size, _ = self._lru.pop((name, chunk))
        self._verified.discard((name, chunk))
        self.used -= size
        layer = self._layer(name)
        with contextlib.suppress(OSError):
            layer.record(chunk, 0, bytes(32))
            _sys.punch_hole(layer.data, chunk * CHUNK, CHUNK)

    def _evict(self, room: int) -> None:
        while self._lru and self.used + room > self.limit:
            (name, chunk), _ = next(iter(self._lru.items()))
            self._forget(name, chunk)
            self.counters["chunks_evicted"] += 1

    def stats(self) -> dict:
        with self._lock:
            return {**self.counters, "used_bytes": self.used, "limit_bytes": self.limit,
                    "chunks": len(self._lru), "chunk_size": CHUNK}

    def close(self) -> None:
        with self._lock:
            for layer in self._layers.values():
                layer.close()
            self._layers.clear()


def _pread_all(fd: int, size: int, offset: int) -> bytes:
    out = b""
    while len(out) < size:
        part = os.pread(fd, size - len(out), offset + len(out))
        if not part:
            break
        out += part
    return out


# -- the FUSE filesystem -----------------------------------------------------------------------

_IN = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, pad
_OUT = struct.Struct("<IiQ")  # len, error, unique
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # ino size blocks atime mtime ctime (nsec x3) mode nlink uid gid rdev blksize flags
_LOOKUP, _FORGET, _GETATTR, _OPEN, _READ, _STATFS, _RELEASE = 1, 2, 3, 14, 15, 17, 18
_FLUSH, _INIT, _OPENDIR, _READDIR, _RELEASEDIR, _INTERRUPT, _DESTROY, _BATCH_FORGET = 25, 26, 27, 28, 29, 36, 38, 42
_NO_REPLY = (_FORGET, _BATCH_FORGET, _INTERRUPT)
_NOTIFY_STORE = 4  # (a notice of the server's own: these bytes of a file, into the kernel's page cache)
_STORE_OUT = struct.Struct("<QQII")  # nodeid, offset, size, padding
_PUSH_QUEUE = 256  # chunks waiting to be pushed (more are not pushed: the kernel asks for them)
# At most this much of a layer the cache holds is pushed into the page cache when the layer is
# opened (``CacheFS._prefilling``): the most recently used chunks.
PREFILL_BYTES = 256 << 20
_FOPEN_DIRECT_IO, _FOPEN_KEEP_CACHE = 1 << 0, 1 << 1
_FUSE_ASYNC_READ, _FUSE_MAX_PAGES = 1 << 0, 1 << 22
_MAX_PAGES = 256  # reads of up to 1 MiB
_BUFSIZE = (_MAX_PAGES << 12) + 4096
# Threads answering requests: a cold node's every miss waits on a fetch from the store (a
# round trip through the shared filesystem's client, slow under a burst), and a burst's
# sandboxes miss together; with 4, a node's reads queued behind 4 fetches at a time.
_THREADS = 16
_ROOT = 1
_VALID_S = 1


class CacheFS:
    """The FUSE server: ``layers_dir``'s layer files, read through ``cache``."""

    def __init__(self, fd: int, layers_dir: Path, cache: ChunkCache) -> None:
        self.fd = fd
        self.layers_dir = Path(layers_dir)
        self.cache = cache
        self._lock = threading.Lock()
        self._inodes: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._files: dict[int, tuple[str, int, int]] = {}  # fh -> (name, store fd, size); -1 fd: .stats
        self._stats_text: dict[int, bytes] = {}
        self._next_fh = 1
        self._pushes: queue.Queue[tuple[int, int, bytes]] = queue.Queue(_PUSH_QUEUE)
        self.pushed = 0
        self._prefills: queue.Queue[tuple[int, str]] = queue.Queue()
        self._prefilled: set[int] = set()  # the inodes prefilled (once per server: KEEP_CACHE)

    def serve(self, threads: int = _THREADS) -> None:
        workers = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads - 1)]
        workers.append(threading.Thread(target=self._sweeping, daemon=True))
        workers.append(threading.Thread(target=self._pushing, daemon=True))
        workers.append(threading.Thread(target=self._prefilling, daemon=True))
        for w in workers:
            w.start()
        self._loop()

    def sweep(self) -> int:
        """Give back the cache files of layers no longer in the store (GC removed them), but for
        one a reader still has open. A store that cannot be listed, or lists nothing (an
        unmounted shared filesystem's empty mountpoint), keeps the cache as it is. Returns the
        number of layers removed."""
        try:
            present = {name for name in os.listdir(self.layers_dir) if _LAYER.match(name)}
        except OSError as exc:
            log.warning("layer cache: cannot list the store's layers in %s (%s): nothing swept",
                        self.layers_dir, exc.strerror)
            return 0
        if not present:
            return 0
        with self._lock:
            open_names = {name for name, _, _ in self._files.values()}
        gone = self.cache.cached_layers() - present - open_names
        if gone:
            freed = self.cache.remove_layers(gone)
            log.info("layer cache: %d layer(s) gone from the store: their %d MiB of chunks given back",
                     len(gone), freed >> 20)
        return len(gone)

    def _sweeping(self) -> None:
        while True:
            try:
                self.sweep()
            except Exception:
                log.exception("layer cache: the sweep of removed layers failed")
            time.sleep(SWEEP_S)

    def _push(self, nodeid: int, offset: int, data: bytes) -> None:
        """Have the kernel keep ``data`` (a whole chunk, checked) at ``offset`` of the file in its
        page cache: a read of the chunk's other pages is then no request to this server. Queued
        for ``_pushing``; dropped when the queue is full (the kernel asks for them, then)."""
        with contextlib.suppress(queue.Full):
            self._pushes.put_nowait((nodeid, offset, data))

    def _pushing(self) -> None:
        """Push the queued chunks into the kernel's page cache (FUSE_NOTIFY_STORE). A thread of
        its own: the kernel locks each page it stores, and a page may be locked by a read that
        waits for a reply from this server, so a thread that answers requests never pushes."""
        while True:
            nodeid, offset, data = self._pushes.get()
            try:  # (ENOENT: the kernel has let go of the file's inode; nothing to keep)
                self._store(nodeid, offset, data)
            except OSError as exc:
                if exc.errno == errno.ENODEV:
                    return

    def _store(self, nodeid: int, offset: int, data: bytes) -> None:
        """FUSE_NOTIFY_STORE: ``data`` at ``offset`` of inode ``nodeid``, into the page cache."""
        head = _OUT.pack(_OUT.size + _STORE_OUT.size + len(data), _NOTIFY_STORE, 0)
        os.write(self.fd, head + _STORE_OUT.pack(nodeid, offset, len(data), 0) + data)
        self.pushed += 1

    def _prefilling(self) -> None:
        """Push what the cache holds of a layer just opened into the page cache (at most
        ``PREFILL_BYTES``, each chunk checked against its sha256 as a read would be): a node
        started again with its cache kept (a warm node) then serves its sandboxes' reads of what
        it had read before with no request to this server at all, where each page missed would
        otherwise be a round trip through it (under a burst that holds every core, the round
        trips, not the node's disk, are what a warm node's reads wait on). Nothing is fetched:
        only chunks already held are pushed. A thread of its own, like ``_pushing``."""
        while True:
            nodeid, name = self._prefills.get()
            for chunk in self.cache.held(name, PREFILL_BYTES):
                try:
                    data = self.cache.cached(name, chunk, use=False)
                    if data:
                        self._store(nodeid, chunk * CHUNK, data)
                except OSError as exc:
                    if exc.errno == errno.ENODEV:
                        return
                    break  # (ENOENT: the kernel let go of the inode, the file closed; a disk error)

    def _loop(self) -> None:
        while True:
            try:
                req = os.read(self.fd, _BUFSIZE)
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue  # (ENOENT: a request interrupted before it was read)
                if exc.errno == errno.ENODEV:  # unmounted: the connection has ended
                    os._exit(0)
                raise
            _, opcode, unique, nodeid, *_ = _IN.unpack_from(req)
            body = req[_IN.size:]
            try:
                reply = self._handle(opcode, nodeid, body)
            except OSError as exc:
                reply = -(exc.errno or errno.EIO)
            except Exception:
                log.exception("layer cache: request %d failed", opcode)
                reply = -errno.EIO
            if opcode in _NO_REPLY:
                continue
            if isinstance(reply, int):
                out = _OUT.pack(_OUT.size, reply, unique)
            else:
                out = _OUT.pack(_OUT.size + len(reply), 0, unique) + reply
            with contextlib.suppress(OSError):  # (ENOENT: the request was interrupted)
                os.write(self.fd, out)

    def _handle(self, opcode: int, nodeid: int, body: bytes) -> bytes | int:
        if opcode == _INIT:
            # No readahead on the cache's files: a node fetches the chunks its sandboxes read
            # and no others, so what a warm node reads is what it has (64 KiB of readahead cut
            # the requests 7.6-fold but fetched chunks a cold run had not read).
            major, minor, readahead, _flags = struct.unpack_from("<IIII", body)
            return struct.pack("<IIIIHHIIHHII6I", 7, 31, 0, _FUSE_ASYNC_READ | _FUSE_MAX_PAGES,
                               16, 12, 1 << 20, 1, _MAX_PAGES, 0, 0, 0, *([0] * 6))
        if opcode == _LOOKUP:
            return self._lookup(body.split(b"\0", 1)[0].decode(errors="replace"))
        if opcode == _GETATTR:
            return struct.pack("<QII", _VALID_S, 0, 0) + self._attr(nodeid)
        if opcode == _OPEN:
            return self._open(nodeid)
        if opcode == _READ:
            fh, offset, size = struct.unpack_from("<QQI", body)
            return self._read(fh, offset, size, nodeid)
        if opcode == _RELEASE:
            (fh,) = struct.unpack_from("<Q", body)
            with self._lock:
                name, store_fd, _ = self._files.pop(fh, ("", -1, 0))
                self._stats_text.pop(fh, None)
            if store_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(store_fd)
            return b""
        if opcode in (_FLUSH, _RELEASEDIR, _DESTROY):
            return b""
        if opcode == _OPENDIR:
            return struct.pack("<QII", 0, 0, 0)
        if opcode == _READDIR:
            return b""  # nothing is listed: layers are opened by name
        if opcode == _STATFS:
            st = os.statvfs(self.cache.root)
            return struct.pack("<QQQQQIII I6I", st.f_blocks, st.f_bfree, st.f_bavail, 0, 0,
                               st.f_bsize, 255, st.f_frsize, 0, *([0] * 6))
        return -errno.ENOSYS

    def _ino(self, name: str) -> int:
        with self._lock:
            ino = self._inodes.get(name)
            if ino is None:
                ino = self._inodes[name] = len(self._inodes) + 2
                self._names[ino] = name
            return ino

    def _lookup(self, name: str) -> bytes | int:
        if name != _STATS and not _LAYER.match(name):
            return -errno.ENOENT
        ino = self._ino(name)
        return struct.pack("<QQQQII", ino, 0, _VALID_S, _VALID_S, 0, 0) + self._attr(ino)

    def _attr(self, ino: int) -> bytes:
        if ino == _ROOT:
            return _ATTR.pack(_ROOT, 0, 0, 0, 0, 0, 0, 0, 0, 0o40555, 2, 0, 0, 0, 4096, 0)
        name = self._names.get(ino)
        if name is None:
            raise OSError(errno.ENOENT, "unknown inode")
        if name == _STATS:
            return _ATTR.pack(ino, 0, 0, 0, 0, 0, 0, 0, 0, 0o100444, 1, 0, 0, 0, 4096, 0)
        st = os.stat(self.layers_dir / name)
        mtime = int(st.st_mtime)
        return _ATTR.pack(ino, st.st_size, (st.st_size + 511) // 512, mtime, mtime, mtime, 0, 0, 0,
                          0o100444, 1, 0, 0, 0, 4096, 0)

    def _open(self, ino: int) -> bytes | int:
        name = self._names.get(ino)
        if name is None:
            return -errno.ENOENT
        if name == _STATS:
            with self._lock:
                fh = self._next_fh
                self._next_fh += 1
                self._files[fh] = (name, -1, 0)
                self._stats_text[fh] = json.dumps(self.stats()).encode()
            return struct.pack("<QIi", fh, _FOPEN_DIRECT_IO, 0)
        try:
            store_sums = sums.load(self.layers_dir / name)
        except sums.SumsDamaged as exc:
            log.error("layer cache: the sums of %s in the store %s are damaged (%s): the layer is not opened",
                      name, self.layers_dir, exc)
            return -errno.EIO
        store_fd = os.open(self.layers_dir / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(store_fd)
            self.cache.opened(name, st.st_size, st.st_mtime_ns, store_sums)
        except BaseException:
            os.close(store_fd)
            raise
        with self._lock:
            fh = self._next_fh
            self._next_fh += 1
            self._files[fh] = (name, store_fd, st.st_size)
            prefill = ino not in self._prefilled
            self._prefilled.add(ino)
        if prefill:
            self._prefills.put((ino, name))
        return struct.pack("<QIi", fh, _FOPEN_KEEP_CACHE, 0)

    def stats(self) -> dict:
        """The cache's counters, the chunks pushed to the kernel and the CPU seconds this
        server has spent (a request is a round trip through it)."""
        cpu = os.times()
        return {**self.cache.stats(), "chunks_pushed": self.pushed, "server_cpu_s": round(cpu.user + cpu.system, 3)}

    def _read(self, fh: int, offset: int, size: int, nodeid: int = 0) -> bytes | int:
        """The bytes asked for. The kernel asks for the pages a reader misses (no readahead: see
        INIT); each chunk the read falls in is fetched whole anyway, so a chunk the read does
        not cover is pushed whole into the page cache (``_push``): its other pages are then read
        with no request, and nothing is fetched that the read had not made the node fetch."""
        with self._lock:
            opened = self._files.get(fh)
            text = self._stats_text.get(fh)
        if opened is None:
            return -errno.EBADF
        if text is not None:
            return text[offset: offset + size]
        name, store_fd, file_size = opened
        self.cache.counters["read_requests"] += 1
        end = min(offset + size, file_size)
        out = []
        pos = offset
        while pos < end:
            chunk = pos // CHUNK
            start = pos - chunk * CHUNK
            whole = self.cache.read(name, store_fd, chunk)
            piece = whole[start: start + min(CHUNK - start, end - pos)]
            if not piece:
                break
            out.append(piece)
            if nodeid and len(piece) < len(whole):
                self._push(nodeid, chunk * CHUNK, whole)
            pos += len(piece)
        return b"".join(out)


def serve(layers_dir: Path, cache_dir: Path, limit: int, mountpoint: Path) -> None:
    """Mount the cache's filesystem at ``mountpoint`` and serve it until it is unmounted. One
    server per cache dir (it holds ``cache_dir/lock``)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    lock = os.open(cache_dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    cache = ChunkCache(cache_dir, limit)
    mountpoint.mkdir(parents=True, exist_ok=True)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    _sys.mount("dsec-layer-cache", str(mountpoint), "fuse.dsec-layer-cache",
               _sys.MS_RDONLY | _sys.MS_NODEV | _sys.MS_NOSUID,
               f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other,max_read={_MAX_PAGES << 12}")
    os.write(lock, str(os.getpid()).encode())
    # Every sandbox of the node that reads a layer waits on this server's replies: it runs at
    # the default priority even when its node runs niced (a Ray worker is nice 15), or a burst
    # of the node's own sandboxes, or anything else on the machine, starves the reads they wait
    # on. (Before its threads start: a thread's nice is its own, taken by the threads it starts.)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    CacheFS(fd, layers_dir, cache).serve()


# -- the node's handle on it --------------------------------------------------------------------


class LayerCache:
    """The node's layer cache at ``cache_dir`` (``limit`` bytes) over the store's ``layers_dir``:
    ``path(source)`` is where a layer file of the store reads through the cache."""

    def __init__(self, cache_dir: Path, limit: int, layers_dir: Path) -> None:
        self.cache_dir = Path(cache_dir)
        self.limit = limit
        self.layers_dir = Path(layers_dir)
        self.mountpoint = self.cache_dir / "mnt"
        self._lock = threading.Lock()

    def path(self, source: Path) -> Path:
        self.ensure()
        return self.mountpoint / source.name

    def running(self) -> bool:
        """Whether its server is serving: its mount is there and answers (a killed server's
        mount answers ENOTCONN)."""
        return self.device() is not None

    def device(self) -> int | None:
        """The device of the mount being served (another after a restart of the server)."""
        try:
            dev = os.stat(self.mountpoint).st_dev
            return dev if dev != os.stat(self.cache_dir).st_dev else None
        except OSError:
            return None

    def ensure(self) -> None:
        """Start the cache's server unless it is serving (an earlier edge's is taken as it is)."""
        with self._lock:
            if self.running():
                return
            self._unmount()  # a dead one's mount (its server killed)
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            logfile = open(self.cache_dir / "log", "ab")
            proc = subprocess.Popen(
                [sys.executable, "-m", "dsec.images.layercache", str(self.layers_dir), str(self.cache_dir),
                 str(self.limit), str(self.mountpoint)],
                stdin=subprocess.DEVNULL, stdout=logfile, stderr=logfile, start_new_session=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
            logfile.close()
            deadline = time.monotonic() + 20
            while not self.running():
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (self.cache_dir / "log").read_text(errors="replace").splitlines()[-5:]
                    raise OSError(errno.EIO, f"the layer cache at {self.cache_dir} did not start: {' '.join(tail)}")
                time.sleep(0.02)

    def stats(self) -> dict:
        """The cache's counters (empty when it is not running)."""
        if not self.running():
            return {}
        return json.loads((self.mountpoint / _STATS).read_text())

    def stop(self, wait_s: float = 5.0) -> None:
        """Unmount it: its server ends once the kernel lets go of the last file open on it. Wait
        (at most ``wait_s``) until it has ended, its cache files closed, so the cache's disk can
        be let go of at once (a server that ends holds the cache dir's lock until then)."""
        with self._lock:
            self._unmount()
            try:
                lock = os.open(self.cache_dir / "lock", os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                return
            try:
                deadline = time.monotonic() + wait_s
                while True:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        return
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            log.warning("layer cache: its server at %s has not ended %.0f s after its unmount",
                                        self.cache_dir, wait_s)
                            return
                        time.sleep(0.01)
            finally:
                os.close(lock)

    def stop_unless_busy(self) -> bool:
        """``stop`` it unless a file of it is open or mapped (a VM's QEMU maps its layers from
        it, another process's layer mount reads through it): the kernel refuses to unmount a
        busy mount, and tells across processes (an edge restarted under running VMs) what no
        count kept here could. Returns whether it was stopped.

        Unmounted, its server is ended outright: a copy of its mount in another mount namespace
        (a daemon that unshared its mounts while the cache was mounted: glusterd did here, in 3
        of about 60 stops) keeps the FUSE connection, and so the server, alive, and the next start
        would find the cache's lock held. Nothing of the node reads through such a copy."""
        with self._lock:
            try:
                _sys.umount(str(self.mountpoint))
            except OSError as exc:
                if exc.errno == errno.EBUSY:
                    return False
                if exc.errno not in (errno.EINVAL, errno.ENOENT, errno.ENOTCONN):  # (not mounted, or dead)
                    raise
            argv = [b"-m", b"dsec.images.layercache", os.fsencode(self.layers_dir), os.fsencode(self.cache_dir)]

            def serves() -> bool:
                return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:5] == argv
            for pid in filter(str.isdigit, os.listdir("/proc")):
                with contextlib.suppress(OSError):
                    if serves():
                        pidfd = os.pidfd_open(int(pid))
                        try:  # (looked at again once held: the pid cannot be another's by then)
                            if serves():
                                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                        finally:
                            os.close(pidfd)
        self.stop()
        return True

    def _unmount(self) -> None:
        while _fuse_mounted(self.mountpoint):
            _sys.umount(str(self.mountpoint), _sys.MNT_DETACH)


def _fuse_mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    layers_dir, cache_dir, limit, mountpoint = argv
    serve(Path(layers_dir), Path(cache_dir), int(limit), Path(mountpoint))


if __name__ == "__main__":
    main(sys.argv[1:])
