"""dsec.edge.files.TarChecker: a tar checked as it streams past, in chunks of any size."""

from __future__ import annotations

import asyncio
import io
import os
import random
import tarfile

import pytest

from libdsec._tarcheck import TarChecker
from libdsec import InvalidRequest


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


async def _through(data: bytes, piece: int | None, limit: int = 1 << 30) -> bytes:
    rng = random.Random(piece)

    async def chunks():
        at = 0
        while at < len(data):
            n = piece or rng.randint(1, 3000)
            yield data[at:at + n]
            at += n

    out = bytearray()
    async for chunk in TarChecker(limit).checked(chunks()):
        out += chunk
    return bytes(out)


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
@pytest.mark.parametrize("piece", [1, 511, 512, 1 << 16, None])
def test_a_good_tar_passes_whole_and_unchanged(fmt, piece):
    long = "d/" + "n" * 150 if fmt != tarfile.USTAR_FORMAT else "d/" + "n" * 90
    data = _tar([_file("a.txt", b"hello"), _file(long, os.urandom(5000)), _link("l", "a.txt"),
                 _link("h", "a.txt", tarfile.LNKTYPE), _file("empty", b"")], fmt)
    out = asyncio.run(_through(data, piece))
    assert out == data
    with tarfile.open(fileobj=io.BytesIO(out)) as tar:
        assert [m.name for m in tar] == ["a.txt", long, "l", "h", "empty"]


@pytest.mark.parametrize("bad, message", [
    (_file("/etc/evil", b"x"), "AbsolutePath"),
    (_file("../evil", b"x"), "OutsideDestination"),
    (_file("a/" + "x" * 120 + "/../../../evil", b"x"), "'..' component"),  # (a pax long name)
    (_link("out", "/etc/passwd"), "AbsoluteLink"),
    (_link("up", "../../x"), "LinkOutsideDestination"),
])
@pytest.mark.parametrize("piece", [7, None])
def test_a_bad_member_is_refused_before_any_of_it_passes(bad, message, piece):
    good = _file("first.txt", b"A" * 700)
    data = _tar([good, bad])
    out = bytearray()

    async def run():
        async def chunks():
            for at in range(0, len(data), piece or 4096):
                yield data[at:at + (piece or 4096)]
        async for chunk in TarChecker(1 << 30).checked(chunks()):
            out.extend(chunk)

    with pytest.raises(InvalidRequest, match=message):
        asyncio.run(run())
    # What passed is (some of) the good member (its header, its data padded to a block), and
    # nothing of the bad one's headers.
    assert data[:512 + 1024].startswith(bytes(out))
    if piece == 7:
        assert len(out) == 512 + 1024


def test_a_device_node_and_garbage_and_a_short_tar_are_refused():
    dev = tarfile.TarInfo("dev")
    dev.type = tarfile.CHRTYPE
    with pytest.raises(InvalidRequest, match="SpecialFile"):
        asyncio.run(_through(_tar([(dev, None)]), None))
    with pytest.raises(InvalidRequest, match="not a tar"):
        asyncio.run(_through(b"garbage" * 100, None))
    with pytest.raises(InvalidRequest, match="ends inside a header"):
        asyncio.run(_through(_tar([_file("a", b"x")])[:300], None))


def test_the_limit_counts_every_byte():
    data = _tar([_file("big", os.urandom(20000))])
    with pytest.raises(InvalidRequest, match="over the node's limit"):
        asyncio.run(_through(data, 4096, limit=10000))
