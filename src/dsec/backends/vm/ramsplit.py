"""Split a QEMU migration stream into guest-RAM files and a stream of the rest.

A microVM snapshot is QEMU's migration of the stopped VM to a file. To let clones share the
snapshot's memory, the pages of the guest's RAM blocks are taken out of that stream and written
at their offsets into one sparse file per block (``<block>.ram``, as big as the block); the
stream that is left holds the device state and the small ROM blocks. A clone maps each RAM file
``share=off`` (MAP_PRIVATE: the host page cache holds one copy, a clone's writes are its own)
and loads the leftover stream, which carries no pages for those blocks.

The format is QEMU's (migration/savevm.c, migration/ram.c, stream version 3): a header, the
``configuration`` section, the ``ram`` section's START / PART / END parts, then every device's
FULL section. Only the RAM parts are rewritten; what follows the RAM END part is copied as it is.
Anything this reader does not know (compression, XBZRLE, postcopy, another iterable section)
is a ``StreamError`` naming it: the snapshot then fails instead of saving something a clone
could not load.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

MAGIC, VERSION = 0x5145564D, 3
EOF, SECTION_START, SECTION_PART, SECTION_END, SECTION_FULL = 0x00, 0x01, 0x02, 0x03, 0x04
SUBSECTION, CONFIGURATION, FOOTER = 0x05, 0x07, 0x7E
PAGE_SIZE = 4096
FLAG_ZERO, FLAG_MEM_SIZE, FLAG_PAGE, FLAG_EOS, FLAG_CONTINUE = 0x02, 0x04, 0x08, 0x10, 0x20
KNOWN_FLAGS = FLAG_ZERO | FLAG_MEM_SIZE | FLAG_PAGE | FLAG_EOS | FLAG_CONTINUE
IOV_MAX = 1024
_BE32, _BE64 = struct.Struct(">I"), struct.Struct(">Q")


class StreamError(Exception):
    """The stream is not one this splitter understands (or is cut short)."""


@dataclass
class SplitResult:
    blocks: dict[str, int] = field(default_factory=dict)  # every RAM block in the stream: size
    pages_written: int = 0  # non-zero pages written into the RAM files
    state_bytes: int = 0


class _Reader:
    """The stream, mapped: headers are read at an offset, a page is a view of the mapping (no
    copy on its way to its RAM file)."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> memoryview:
        start, self.pos = self.pos, self.pos + n
        if self.pos > len(self.data):
            raise StreamError("the migration stream ends early")
        return self.data[start:self.pos]

    def u8(self) -> int:
        if self.pos >= len(self.data):
            raise StreamError("the migration stream ends early")
        self.pos += 1
        return self.data[self.pos - 1]

    def be32(self) -> int:
        return _BE32.unpack(self.take(4))[0]

    def be64(self) -> int:
        return _BE64.unpack(self.take(8))[0]

    def peek8(self) -> int | None:
        return self.data[self.pos] if self.pos < len(self.data) else None

    def name(self) -> bytes:
        return bytes(self.take(self.u8()))


class _PageRun:
    """Consecutive pages of one RAM file, written with one ``pwritev`` (a page at a time, the
    split of a 384 MB guest took a second of Python)."""

    def __init__(self) -> None:
        self.fd = -1
        self.start = 0
        self.pages: list[memoryview] = []

    def add(self, fd: int, addr: int, page: memoryview) -> None:
        if fd != self.fd or addr != self.start + len(self.pages) * PAGE_SIZE or len(self.pages) >= IOV_MAX:
            self.flush()
            self.fd, self.start = fd, addr
        self.pages.append(page)

    def flush(self) -> None:
        if self.pages:
            want = len(self.pages) * PAGE_SIZE
            done = os.pwritev(self.fd, self.pages, self.start)
            if done != want:  # (a regular file takes it whole or fails: ENOSPC is an OSError)
                os.pwrite(self.fd, b"".join(self.pages)[done:], self.start + done)
            self.pages = []


def _configuration(r: _Reader, out: BinaryIO) -> bool:
    """Copy the configuration section; True if the stream was saved with x-ignore-shared."""
    if r.u8() != CONFIGURATION:
        raise StreamError("no configuration section after the stream header")
    out.write(bytes([CONFIGURATION]))
    length = r.be32()
    out.write(struct.pack(">I", length) + r.take(length))
    ignore_shared = False
    while r.peek8() == SUBSECTION:
        r.u8()
        name = r.name()
        version = r.be32()
        out.write(bytes([SUBSECTION, len(name)]) + name + struct.pack(">I", version))
        if name == b"configuration/capabilities":
            count = r.be32()
            out.write(struct.pack(">I", count))
            for _ in range(count):
                cap = r.name()
                out.write(bytes([len(cap)]) + cap)
                ignore_shared |= cap == b"x-ignore-shared"
        elif name == b"configuration/target-page-bits":
            bits = r.be32()
            if 1 << bits != PAGE_SIZE:
                raise StreamError(f"target pages of {1 << bits} bytes; this splitter knows {PAGE_SIZE}")
            out.write(struct.pack(">I", bits))
        elif name == b"configuration/uuid":
            out.write(r.take(16))
        else:
            raise StreamError(f"unknown configuration subsection {name.decode(errors='replace')!r}")
    return ignore_shared


class _RamSection:
    """The ``ram`` section's records: pages of the blocks in ``extract`` go to their files."""

    def __init__(self, extract: dict[str, Path], result: SplitResult) -> None:
        self.extract = extract
        self.result = result
        self.fds: dict[str, int] = {}
        self.block: str | None = None
        self.ignore_shared = False
        self.run = _PageRun()

    def close(self) -> None:
        self.run.pages = []  # (views of the mapping: let go before it closes)
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def records(self, r: _Reader, out: BinaryIO) -> None:
        """Read records up to and including EOS; write the kept ones to ``out``."""
        while True:
            word = r.be64()
            flags, addr = word & (PAGE_SIZE - 1), word & ~(PAGE_SIZE - 1)
            if flags & ~KNOWN_FLAGS:
                raise StreamError(f"RAM record flags {flags:#x} (compression, XBZRLE, RDMA?) are not supported")
            if flags & FLAG_EOS:
                self.run.flush()
                out.write(struct.pack(">Q", word))
                return
            if flags & FLAG_MEM_SIZE:
                out.write(struct.pack(">Q", word))
                self._block_list(r, out, word & ~(PAGE_SIZE - 1))
                continue
            if not flags & (FLAG_ZERO | FLAG_PAGE):
                raise StreamError(f"RAM record flags {flags:#x} carry no page")
            name = None
            if not flags & FLAG_CONTINUE:
                name = r.name()
                self.block = name.decode()
            if self.block is None:
                raise StreamError("a RAM page continues a block that was never named")
            data = bytes([r.u8()]) if flags & FLAG_ZERO else r.take(PAGE_SIZE)
            if self.block in self.fds:
                if flags & FLAG_PAGE:
                    self.run.add(self.fds[self.block], addr, data)
                    self.result.pages_written += 1
                elif data != b"\0":
                    self.run.flush()
                    os.pwrite(self.fds[self.block], data * PAGE_SIZE, addr)
                continue
            out.write(struct.pack(">Q", word))
            if name is not None:
                out.write(bytes([len(name)]) + name)
            out.write(data)

    def _block_list(self, r: _Reader, out: BinaryIO, total: int) -> None:
        left = total
        while left > 0:
            name = r.name()
            size = r.be64()
            out.write(bytes([len(name)]) + name + struct.pack(">Q", size))
            if self.ignore_shared:
                out.write(r.take(8))  # the block's guest address
            block = name.decode()
            self.result.blocks[block] = size
            if block in self.extract and block not in self.fds:
                fd = os.open(self.extract[block], os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                self.fds[block] = fd
                os.ftruncate(fd, size)
            left -= size
        if left != 0:
            raise StreamError("the RAM block list does not add up to the RAM size")


def _section_header(r: _Reader, out: BinaryIO, kind: int) -> tuple[int, str]:
    section_id = r.be32()
    out.write(bytes([kind]) + struct.pack(">I", section_id))
    if kind in (SECTION_PART, SECTION_END):
        return section_id, ""
    name = r.name()
    rest = r.take(8)  # instance id, version id
    out.write(bytes([len(name)]) + name + rest)
    return section_id, name.decode(errors="replace")


def _footer(r: _Reader, out: BinaryIO, section_id: int) -> None:
    if r.peek8() != FOOTER:
        return
    r.u8()
    if r.be32() != section_id:
        raise StreamError("a section footer names another section")
    out.write(bytes([FOOTER]) + struct.pack(">I", section_id))


def split(stream: Path, state: Path, extract: dict[str, Path]) -> SplitResult:
    """Read ``stream``; write the pages of the blocks in ``extract`` (block id → file) into
    those files and everything else to ``state``. Every block in ``extract`` must be in the
    stream (else ``StreamError``: the snapshot would not be restorable)."""
    result = SplitResult()
    ram = _RamSection(extract, result)
    try:
        with open(stream, "rb") as raw, open(state, "wb") as out:
            if os.fstat(raw.fileno()).st_size == 0:
                raise StreamError("the migration stream ends early")
            mapped = mmap.mmap(raw.fileno(), 0, prot=mmap.PROT_READ)
            try:
                _split(_Reader(memoryview(mapped)), out, ram, result)
            finally:
                ram.close()
                with contextlib.suppress(BufferError):  # (a view still held by an error's traceback)
                    mapped.close()
    finally:
        ram.close()
    missing = set(extract) - set(result.blocks)
    if missing:
        raise StreamError(f"RAM block(s) {', '.join(sorted(missing))} are not in the stream")
    return result


def _split(r: _Reader, out: BinaryIO, ram: _RamSection, result: SplitResult) -> None:
    if r.be32() != MAGIC or r.be32() != VERSION:
        raise StreamError("not a QEMU migration stream (version 3)")
    out.write(struct.pack(">II", MAGIC, VERSION))
    ram.ignore_shared = _configuration(r, out)
    ram_id = None
    while True:
        kind = r.u8()
        if kind not in (SECTION_START, SECTION_PART, SECTION_END):
            out.write(bytes([kind]))
            break
        section_id, name = _section_header(r, out, kind)
        if kind == SECTION_START:
            if name != "ram" or ram_id is not None:
                raise StreamError(f"iterable section {name!r} is not supported (only ram)")
            ram_id = section_id
        elif section_id != ram_id:
            raise StreamError(f"section {section_id} continues before it started")
        ram.records(r, out)
        _footer(r, out, section_id)
        if kind == SECTION_END:
            kind = None
            break
    if ram_id is None or kind is not None:
        raise StreamError("the stream has no complete ram section")
    out.write(r.data[r.pos:])  # the devices' sections, as they are
    result.state_bytes = out.tell()
