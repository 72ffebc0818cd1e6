"""ramsplit on hand-built QEMU migration streams: pages of the chosen RAM blocks land in their
files, everything else (other blocks, device sections) is left in the stream byte for byte, and
a stream it does not understand is an error, not a half-written snapshot. (tests/vm proves it
on the streams QEMU really writes: clones restored from the split files.)"""

from __future__ import annotations

import struct

import pytest

from dsec.backends.vm import ramsplit
from dsec.backends.vm.ramsplit import FLAG_CONTINUE, FLAG_EOS, FLAG_MEM_SIZE, FLAG_PAGE, FLAG_ZERO, PAGE_SIZE

P = PAGE_SIZE


def name(s: str) -> bytes:
    return bytes([len(s)]) + s.encode()


def rec(offset: int, flags: int, block: str | None = None, data: bytes = b"") -> bytes:
    return struct.pack(">Q", offset | flags | (0 if block else FLAG_CONTINUE)) + (name(block) if block else b"") + data


def page(fill: int) -> bytes:
    return bytes([fill]) * P


EOS = struct.pack(">Q", FLAG_EOS)
HEADER = struct.pack(">II", ramsplit.MAGIC, ramsplit.VERSION)
CONFIG = (bytes([ramsplit.CONFIGURATION]) + struct.pack(">I", 7) + b"microvm"
          + bytes([ramsplit.SUBSECTION]) + name("configuration/capabilities") + struct.pack(">I", 1)
          + struct.pack(">I", 1) + name("x-ignore-shared"))
BLOCKS = [("ram0", 4 * P, 0), ("pc.bios", P, 0xFFFE0000), ("layer0", 2 * P, 8 * P)]
MEM_SIZE = struct.pack(">Q", sum(b[1] for b in BLOCKS) | FLAG_MEM_SIZE) + b"".join(
    name(n) + struct.pack(">QQ", size, addr) for n, size, addr in BLOCKS)
DEVICES = (bytes([ramsplit.SECTION_FULL]) + struct.pack(">I", 3) + name("timer") + struct.pack(">II", 0, 2)
           + b"\x01\x02\x03" + bytes([ramsplit.FOOTER]) + struct.pack(">I", 3) + bytes([ramsplit.EOF]) + b"vmdesc")


def section(kind: int, body: bytes, sid: int = 2) -> bytes:
    head = bytes([kind]) + struct.pack(">I", sid)
    if kind == ramsplit.SECTION_START:
        head += name("ram") + struct.pack(">II", 0, 4)
    return head + body + EOS + bytes([ramsplit.FOOTER]) + struct.pack(">I", sid)


def stream(ram0_records: bool = True) -> bytes:
    """A stream as QEMU writes one; without ``ram0_records``, the same with ram0's pages gone."""
    part = b""
    if ram0_records:
        part += rec(0, FLAG_PAGE, "ram0", page(0xA1)) + rec(2 * P, FLAG_PAGE, None, page(0xA2))
        part += rec(1 * P, FLAG_ZERO, None, b"\0")
    part += rec(0, FLAG_PAGE, "pc.bios", page(0xB0))
    end = rec(3 * P, FLAG_PAGE, "ram0", page(0xA3)) if ram0_records else b""
    return (HEADER + CONFIG + section(ramsplit.SECTION_START, MEM_SIZE) + section(ramsplit.SECTION_PART, part)
            + section(ramsplit.SECTION_END, end) + DEVICES)


def test_ram_block_pages_go_to_their_file_the_rest_stays(tmp_path):
    src, state, ram0 = tmp_path / "stream", tmp_path / "state", tmp_path / "ram0.ram"
    src.write_bytes(stream())
    result = ramsplit.split(src, state, {"ram0": ram0})
    assert result.blocks == {n: size for n, size, _ in BLOCKS}
    assert result.pages_written == 3
    assert ram0.read_bytes() == page(0xA1) + page(0) + page(0xA2) + page(0xA3)
    assert state.read_bytes() == stream(ram0_records=False)
    assert result.state_bytes == state.stat().st_size
    # What is left is a stream the splitter (and so QEMU's loader) reads again as it is.
    again = tmp_path / "again"
    ramsplit.split(state, again, {})
    assert again.read_bytes() == state.read_bytes()


@pytest.mark.parametrize("damage, message", [
    (lambda s: s[:len(s) // 2], "ends early"),
    (lambda s: s.replace(struct.pack(">Q", 0 | FLAG_PAGE) + name("pc.bios"),
                         struct.pack(">Q", 0 | 0x40) + name("pc.bios")), "flags 0x40"),
    (lambda s: b"XXXX" + s[4:], "not a QEMU migration stream"),
    (lambda s: s.replace(name("ram") + struct.pack(">II", 0, 4), name("blk") + struct.pack(">II", 0, 4)),
     "'blk' is not supported"),
])
def test_streams_it_does_not_understand_are_errors(tmp_path, damage, message):
    src = tmp_path / "stream"
    src.write_bytes(damage(stream()))
    with pytest.raises(ramsplit.StreamError, match=message):
        ramsplit.split(src, tmp_path / "state", {"ram0": tmp_path / "ram0.ram"})


def test_a_block_missing_from_the_stream_is_an_error(tmp_path):
    src = tmp_path / "stream"
    src.write_bytes(stream())
    with pytest.raises(ramsplit.StreamError, match="ramtail"):
        ramsplit.split(src, tmp_path / "state", {"ram0": tmp_path / "ram0.ram", "ramtail": tmp_path / "t.ram"})


def test_long_runs_gaps_and_a_page_sent_again_land_where_they_belong(tmp_path):
    # Pages are written a run of consecutive ones at a time (at most IOV_MAX a write): a run
    # longer than that, one broken by a gap, a page of one byte repeated, and a page sent twice
    # (the later copy wins, as QEMU's loader would have it).
    pages = ramsplit.IOV_MAX + 5
    size = (pages + 8) * P
    mem = struct.pack(">Q", size | FLAG_MEM_SIZE) + name("ram0") + struct.pack(">QQ", size, 0)
    part = rec(0, FLAG_PAGE, "ram0", page(1))
    for i in range(1, pages):
        part += rec(i * P, FLAG_PAGE, None, page(i % 251))
    part += rec((pages + 2) * P, FLAG_PAGE, None, page(0xC2))  # after a gap of two
    part += rec((pages + 3) * P, FLAG_ZERO, None, b"\x07")  # a page of one byte, not zero
    part += rec(5 * P, FLAG_PAGE, None, page(0xEE))  # sent again
    src = tmp_path / "stream"
    src.write_bytes(HEADER + CONFIG + section(ramsplit.SECTION_START, mem) + section(ramsplit.SECTION_PART, part)
                    + section(ramsplit.SECTION_END, b"") + DEVICES)
    ram0 = tmp_path / "ram0.ram"
    result = ramsplit.split(src, tmp_path / "state", {"ram0": ram0})
    assert result.pages_written == pages + 2
    want = bytearray(page(1) + b"".join(page(i % 251) for i in range(1, pages)) + page(0) * 2 + page(0xC2)
                     + page(7) + page(0) * 4)
    want[5 * P:6 * P] = page(0xEE)
    assert ram0.read_bytes() == bytes(want)
