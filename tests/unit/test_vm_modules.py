"""The guest initramfs's modules: found plain or compressed (Debian's kernels from 6.12 on ship
them xz-compressed), ordered by their dependencies, and decompressed for busybox's insmod."""

from __future__ import annotations

import lzma
import struct
from pathlib import Path

from dsec.backends.vm.assets import module_bytes, module_load_order, module_name


def _module(depends: str) -> bytes:
    """A minimal ELF64 with a ``.modinfo`` section (all that the order reads)."""
    modinfo = f"license=GPL\0depends={depends}\0".encode()
    shstrtab = b"\0.shstrtab\0.modinfo\0"
    body_at = 64
    modinfo_at, shstrtab_at = body_at, body_at + len(modinfo)
    shoff = shstrtab_at + len(shstrtab)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header += struct.pack("<HHIQQQIHHHHHH", 1, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, 3, 1)
    sections = [(0, 0, 0, 0, 0, 0), (1, 3, 0, 0, shstrtab_at, len(shstrtab)), (11, 1, 0, 0, modinfo_at, len(modinfo))]
    table = b"".join(struct.pack("<IIQQQQ", *s) + bytes(24) for s in sections)
    return header + modinfo + shstrtab + table


def test_compressed_and_plain_modules_are_ordered_and_decompressed(tmp_path: Path):
    (tmp_path / "kernel/drivers").mkdir(parents=True)
    plain = _module("")
    (tmp_path / "kernel/drivers/virtio.ko").write_bytes(plain)
    (tmp_path / "kernel/drivers/virtio_ring.ko.xz").write_bytes(lzma.compress(_module("virtio")))
    (tmp_path / "kernel/drivers/virtio_blk.ko.xz").write_bytes(lzma.compress(_module("virtio,virtio_ring")))
    order = module_load_order(tmp_path, ("virtio_blk", "not_in_this_kernel"))
    assert [module_name(p) for p in order] == ["virtio", "virtio_ring", "virtio_blk"]
    assert module_bytes(order[0]) == plain
    assert module_bytes(order[2]) == _module("virtio,virtio_ring")
