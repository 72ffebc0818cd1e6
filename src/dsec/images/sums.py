"""Each layer file's chunk sums, kept beside it in the store (``layers/DIGEST.sums``).

A layer is named by the digest of its tree (``tree_digest``), not of its file's bytes, so a
layer file damaged on the store (a bit flipped on a disk, a copy cut short by a node that died,
a shared filesystem that lost a write) cannot be told by its name. The store takes the sha256
of each ``CHUNK`` of the file as it places it and keeps them beside it: 32 bytes a 64 KiB chunk
(0.05% of the layer), the file's size, and a sha256 of the whole, so damage to the sums
themselves is found too.

Checked where it costs nothing or little:

- a node mounting a layer compares the file's size with the size its sums were taken over: a
  file cut short (or grown) is refused before it is mounted, naming the layer and both sizes;
- the node's layer cache (``dsec.images.layercache``) hashes every chunk it fetches from the
  store anyway: a chunk that does not match its sum is refused (the reader gets EIO, the log
  names the layer and the chunk) and never cached, so a damaged chunk reaches no sandbox;
- ``dsec image verify`` reads layers whole and names each damaged chunk.

A layer mounted straight from the store's file (no layer cache) is read by the kernel on
demand, and its chunks are not checked as they are read: ``verify`` is the full check there.
Layers placed before the store kept sums have none and are taken as they are. A layer's DAX
variant (``DIGEST.dax``, made by ``LayerStore.dax_layer`` for microVMs) has sums of its own
(``DIGEST.dax.sums``), taken when it is made: the layer cache checks its chunks alike.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

CHUNK = 64 << 10  # the layer cache's chunk: a fetched chunk is checked against one sum
_MAGIC = b"DSECSUM1"
_HEADER = struct.Struct("<8sQQ")  # magic, chunk size, the layer file's size
_SHA = 32
SUFFIX = ".sums"


class SumsDamaged(ValueError):
    """A sums file that is not one, or whose own sha256 does not match."""


@dataclass(frozen=True)
class LayerSums:
    size: int
    chunk: int
    shas: tuple[bytes, ...]

    def chunk_ok(self, index: int, data: bytes) -> bool:
        """Whether ``data`` is chunk ``index`` of the file the sums were taken of (the last one
        may be short; a chunk past the end is not)."""
        return self.sha_ok(index, len(data), hashlib.sha256(data).digest())

    def sha_ok(self, index: int, length: int, sha: bytes) -> bool:
        """``chunk_ok`` of a chunk of ``length`` bytes whose sha256 is taken already."""
        return index < len(self.shas) and length == min(self.chunk, self.size - index * self.chunk) \
            and sha == self.shas[index]


def take(layer: Path) -> bytes:
    """The sums file's bytes for the layer file ``layer``, read whole."""
    shas = []
    size = 0
    with open(layer, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            shas.append(hashlib.sha256(chunk).digest())
            size += len(chunk)
    body = _HEADER.pack(_MAGIC, CHUNK, size) + b"".join(shas)
    return body + hashlib.sha256(body).digest()


def file_digest(taken: bytes) -> str:
    """A layer's name from its file's bytes: the sha256 a sums file (``take``'s answer) ends
    with, over the file's size and every chunk's sha256, in the form of a tree digest
    (``sha256-<hex>``) for a layer named by its file (``LayerStore.add_dir``'s ``once``)."""
    return "sha256-" + taken[-_SHA:].hex()


def parse(data: bytes) -> LayerSums:
    if len(data) < _HEADER.size + _SHA or hashlib.sha256(data[:-_SHA]).digest() != data[-_SHA:]:
        raise SumsDamaged("its own sha256 does not match (cut short or altered)")
    magic, chunk, size = _HEADER.unpack_from(data)
    body = data[_HEADER.size:-_SHA]
    if magic != _MAGIC or chunk <= 0 or len(body) != -(-size // chunk) * _SHA:
        raise SumsDamaged("not a layer's sums file")
    return LayerSums(size, chunk, tuple(body[i: i + _SHA] for i in range(0, len(body), _SHA)))


def path_of(layer: Path) -> Path:
    """Where the sums of the layer file ``layer`` are kept: ``DIGEST.sums`` for ``DIGEST.erofs``,
    ``DIGEST.dax.sums`` for its DAX variant ``DIGEST.dax`` (which the layer cache serves too)."""
    return layer.with_suffix(SUFFIX) if layer.suffix == ".erofs" else layer.with_name(layer.name + SUFFIX)


def load(layer: Path) -> LayerSums | None:
    """The sums of the layer file ``layer``; None when it has none (placed before sums were
    kept). ``SumsDamaged`` when its sums file is damaged."""
    try:
        data = path_of(layer).read_bytes()
    except FileNotFoundError:
        return None
    return parse(data)


def size_problem(digest: str, sums: LayerSums, size: int) -> str | None:
    """What is wrong with a layer file of ``size`` bytes, by its sums (None: nothing seen)."""
    if size == sums.size:
        return None
    how = "cut short" if size < sums.size else "grown"
    return f"layer {digest}: its file has {size} bytes, its sums were taken over {sums.size} ({how})"


REFUSED = ("refused, not mounted; `dsec image verify` lists the store's damaged layers: build, import or pull "
           "the image again")


def mount_problem(layer: Path, size: int | None = None) -> str | None:
    """Why the layer file ``layer`` (``size`` bytes: its size now if None) must not be mounted,
    by what costs no read of it: its sums file damaged, or its size not the one its sums were
    taken over. None: nothing seen (or no sums)."""
    digest = layer.name.removesuffix(".erofs")
    try:
        found = load(layer)
    except SumsDamaged as exc:
        return f"layer {digest}: its sums file in the store is damaged ({exc}): {REFUSED}"
    if found is None:
        return None
    problem = size_problem(digest, found, os.stat(layer).st_size if size is None else size)
    return None if problem is None else f"{problem}: {REFUSED}"


def verify(layer: Path) -> list[str]:
    """Every problem of the layer file ``layer`` against its sums, read whole: its size and
    each chunk that does not match. Empty: intact, or no sums to check against (``load``)."""
    digest = layer.name.removesuffix(".erofs")
    try:
        sums = load(layer)
    except SumsDamaged as exc:
        return [f"layer {digest}: its sums file {path_of(layer).name} is damaged: {exc}"]
    if sums is None:
        return []
    problems = []
    size = os.stat(layer).st_size
    if (problem := size_problem(digest, sums, size)) is not None:
        problems.append(problem)
    bad = []
    with open(layer, "rb", buffering=0) as f:
        for index in range(len(sums.shas)):
            data = f.read(sums.chunk)
            if not sums.chunk_ok(index, data):
                if not data:
                    break  # (cut short: said above)
                bad.append(index)
    if bad:
        shown = ", ".join(f"{i} (bytes {i * sums.chunk}-{min((i + 1) * sums.chunk, sums.size) - 1})" for i in bad[:8])
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        problems.append(f"layer {digest}: {len(bad)} chunk(s) do not match their sums: {shown}{more}")
    return problems
