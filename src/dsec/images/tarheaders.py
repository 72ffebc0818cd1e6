"""A strict reader of the tar headers real image layers use, for ``untar``'s check of each member.

``tarfile`` reads a header in about 40 µs (its general parser: every format, every field); a
base of 12,000 members spent half a second there on the critical path. This reads only what
Docker, BuildKit, Go's ``archive/tar``, GNU tar and ``tarfile`` write for files, directories and
links (ustar and GNU headers, pax extended headers of the common keywords, GNU long names) and
reads it as both ``tarfile`` and GNU tar do; anything else (a bad checksum, base-256 or empty
numbers, a global pax header, sparse or device members, a GNU header with a prefix, an unknown
pax keyword, a header cut short) is ``Unread``: the caller does not take that layer its fast
way, and the Python way (``tarfile``) reads it as it always has.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Callable, Iterator

BLOCK = tarfile.BLOCKSIZE
_ZERO = bytes(BLOCK)
_USTAR = b"ustar\x0000"
_GNU = b"ustar  \x00"
_MEMBER_TYPES = frozenset((tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE))
_OCTAL = re.compile(rb" *([0-7]+) *\Z")
_DIGITS = re.compile(rb"[0-9]+\Z")
_TIME = re.compile(rb"[0-9]+(?:\.[0-9]+)?\Z")
# Pax keywords read (the rest of a member's pax header, if any, makes it ``Unread``). xattrs are
# read by neither way (``tarfile`` never sets them, GNU tar is run with ``--no-xattrs``).
_PAX_IGNORED = ("atime", "ctime", "uname", "gname", "SCHILY.dev", "SCHILY.ino", "SCHILY.nlink")
_PAX_XATTR = "SCHILY.xattr."


class Unread(Exception):
    """A header this reader does not read as both ``tarfile`` and GNU tar surely do."""


def _octal(field: bytes) -> int:
    m = _OCTAL.match(field.split(b"\x00", 1)[0])  # (both ways read up to the first NUL)
    if m is None:
        raise Unread(f"numeric field {field!r}")
    return int(m.group(1), 8)


def _name(raw: bytes) -> str:
    return raw.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes) -> dict[str, bytes]:
    """The records ``LEN KEY=VALUE\\n`` of a pax header's data (its padding NULs left out)."""
    out: dict[str, bytes] = {}
    pos, end = 0, len(data)
    while pos < end and data[pos] != 0:
        space = data.find(b" ", pos, pos + 20)
        if space < 0 or _DIGITS.match(data[pos:space]) is None:
            raise Unread("a pax record's length")
        length = int(data[pos:space])
        record = data[space + 1:pos + length]
        if pos + length > end or not record.endswith(b"\n") or b"=" not in record:
            raise Unread("a pax record")
        key, _, value = record[:-1].partition(b"=")
        name = key.decode("utf-8", "strict") if key.isascii() else ""
        if not name or name in out:
            raise Unread(f"pax keyword {key!r}")
        out[name] = value
        pos += length
    return out


def _apply_pax(member: tarfile.TarInfo, pax: dict[str, bytes]) -> None:
    for key, value in pax.items():
        if key in ("path", "linkpath") and b"\x00" in value:
            raise Unread(f"pax {key} with a NUL")  # (GNU tar would read up to it, tarfile past it)
        if key == "path":
            member.name = value.decode("utf-8", "surrogateescape")
        elif key == "linkpath":
            member.linkname = value.decode("utf-8", "surrogateescape")
        elif key in ("size", "uid", "gid"):
            if _DIGITS.match(value) is None:
                raise Unread(f"pax {key} {value!r}")
            setattr(member, key, int(value))
        elif key == "mtime":
            if _TIME.match(value) is None:
                raise Unread(f"pax mtime {value!r}")
            member.mtime = float(value) if b"." in value else int(value)
        elif key not in _PAX_IGNORED and not key.startswith(_PAX_XATTR):
            raise Unread(f"pax keyword {key!r}")


def _header(block: bytes) -> tarfile.TarInfo:
    stored = _octal(block[148:156])
    if stored != sum(block[:148]) + sum(block[156:]) + 256:
        raise Unread("a header's checksum")
    magic = block[257:265]
    if magic == _USTAR:
        prefix = block[345:500].split(b"\x00", 1)[0]
    elif magic == _GNU and block[345] == 0:  # (there, GNU tar keeps times, not a prefix)
        prefix = b""
    else:
        raise Unread(f"header magic {magic!r}")
    member = tarfile.TarInfo()
    member.type = block[156:157]
    name = _name(block[0:100])
    if member.type == tarfile.DIRTYPE:
        name = name.rstrip("/")
    member.name = f"{_name(prefix)}/{name}" if prefix else name
    member.mode = _octal(block[100:108])
    member.uid = _octal(block[108:116])
    member.gid = _octal(block[116:124])
    member.size = _octal(block[124:136])
    member.mtime = _octal(block[136:148])
    member.linkname = _name(block[157:257])
    return member


def members(read: Callable[[int], bytes], skip_to: Callable[[int], object]) -> Iterator[tuple[tarfile.TarInfo, int]]:
    """Each member of the tar ``read`` reads, with the stream position its data ends at (padded):
    ``skip_to(position)`` is called before the next header is read (the caller has taken the
    member by then). Ends at the end-of-archive block (at the last position yielded, or 0)."""
    pos = 0
    while True:
        block = read(BLOCK)
        if len(block) != BLOCK:
            raise Unread("a header cut short")
        if block == _ZERO:
            return
        pos += BLOCK
        pax: dict[str, bytes] | None = None
        long: dict[bytes, str] = {}
        while True:
            member = _header(block)
            kind = member.type
            if kind in (tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
                if pax is not None or kind in long or (kind == tarfile.XHDTYPE and long):
                    raise Unread("extended headers of more than one kind")
                padded = -(-member.size // BLOCK) * BLOCK
                data = read(padded)
                if len(data) != padded:
                    raise Unread("an extended header cut short")
                pos += padded
                if kind == tarfile.XHDTYPE:
                    pax = _pax(data[:member.size])
                else:
                    long[kind] = _name(data[:member.size])
                block = read(BLOCK)
                if len(block) != BLOCK or block == _ZERO:
                    raise Unread("an extended header with no member")
                pos += BLOCK
                continue
            break
        if kind not in _MEMBER_TYPES:
            raise Unread(f"member type {kind!r}")
        if tarfile.GNUTYPE_LONGNAME in long:
            member.name = long[tarfile.GNUTYPE_LONGNAME]
        if tarfile.GNUTYPE_LONGLINK in long:
            member.linkname = long[tarfile.GNUTYPE_LONGLINK]
        if pax is not None:
            _apply_pax(member, pax)
        if kind in (tarfile.REGTYPE, tarfile.AREGTYPE):
            if member.name.endswith("/"):
                raise Unread(f"file {member.name!r} named as a directory")
        elif member.size:
            raise Unread(f"member {member.name!r} of type {kind!r} with data")
        pos += -(-member.size // BLOCK) * BLOCK
        yield member, pos
        skip_to(pos)
