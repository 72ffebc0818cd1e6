"""The guest kernel unpacked for a PVH boot (``assets.pvh_kernel``): a bzImage's payload unpacked
once to ``vmlinux`` when it is a whole ELF with a PVH entry note; else no ``vmlinux`` (the VMs
boot ``vmlinuz``), and a kernel that cannot have one is not unpacked again."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

from dsec.backends.vm.assets import pvh_kernel


def _note(name: bytes, kind: int, desc: bytes) -> bytes:
    pad = lambda b: b + bytes(-len(b) % 4)  # noqa: E731
    return struct.pack("<III", len(name), len(desc), kind) + pad(name) + pad(desc)


def _elf(notes: bytes, body: bytes = b"\x90" * 4096) -> bytes:
    """An ELF64 with a PT_NOTE segment (``notes``) and a PT_LOAD one (``body``)."""
    phoff, phnum = 64, 2
    notes_at = phoff + phnum * 56
    body_at = notes_at + len(notes)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header += struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, 0x1000000, phoff, 0, 0, 64, 56, phnum, 64, 0, 0)
    segments = struct.pack("<IIQQQQQQ", 4, 4, notes_at, 0, 0, len(notes), len(notes), 4)
    segments += struct.pack("<IIQQQQQQ", 1, 5, body_at, 0x1000000, 0x1000000, len(body), len(body), 4096)
    return header + segments + notes + body


def _bzimage(payload: bytes) -> bytes:
    """A bzImage as the boot protocol lays it out: the set-up sectors with the header, then the
    protected-mode part, whose compressed payload sits at ``payload_offset``."""
    setup_sects, offset = 4, 0x40
    setup = bytearray((setup_sects + 1) * 512)
    setup[0x1F1] = setup_sects
    setup[0x202:0x206] = b"HdrS"
    struct.pack_into("<II", setup, 0x248, offset, len(payload))
    return bytes(setup) + bytes(offset) + payload + struct.pack("<I", 12345)  # (and the size field after it)


PVH = _note(b"Xen", 18, struct.pack("<I", 0x1000000))


def test_a_kernel_with_a_pvh_entry_is_unpacked_once(tmp_path: Path):
    elf = _elf(_note(b"Xen", 6, b"linux\0") + PVH)
    (tmp_path / "vmlinuz").write_bytes(_bzimage(gzip.compress(elf)))
    assert pvh_kernel(tmp_path) == tmp_path / "vmlinux"
    assert (tmp_path / "vmlinux").read_bytes() == elf
    (tmp_path / "vmlinuz").write_bytes(b"changed")  # not read again: the vmlinux is there
    assert pvh_kernel(tmp_path) == tmp_path / "vmlinux"


def test_a_kernel_without_one_boots_as_vmlinuz_and_is_not_asked_again(tmp_path: Path):
    (tmp_path / "vmlinuz").write_bytes(_bzimage(gzip.compress(_elf(_note(b"Xen", 6, b"linux\0")))))
    assert pvh_kernel(tmp_path) is None
    assert not (tmp_path / "vmlinux").exists() and (tmp_path / "vmlinux.none").exists()
    (tmp_path / "vmlinuz").write_bytes(_bzimage(gzip.compress(_elf(PVH))))
    assert pvh_kernel(tmp_path) is None


def test_a_payload_cut_short_or_unknown_or_no_bzimage_gives_none(tmp_path: Path):
    whole = _elf(PVH, body=bytes(range(256)) * 64)
    cut = gzip.compress(whole[: len(whole) - 100])
    for name, image in (("cut", _bzimage(cut)), ("unknown", _bzimage(b"\x00\x01\x02\x03" + bytes(64))),
                        ("plain", b"\x7fELF" + bytes(4096))):
        kdir = tmp_path / name
        kdir.mkdir()
        (kdir / "vmlinuz").write_bytes(image)
        assert pvh_kernel(kdir) is None, name
        assert not (kdir / "vmlinux").exists(), name
