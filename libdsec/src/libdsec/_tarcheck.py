"""A tar checked as it streams past (``TarChecker``), by the node on its way into a sandbox and
by the SDK on its way out of one: each member is refused (``InvalidRequest`` naming it) if it
could land outside its tree or is not a plain file, directory or link — the refusals of
Python's ``data`` extraction filter, decided from the names alone (``check``) — before any of
it is passed on."""

from __future__ import annotations

import posixpath
import tarfile
from collections.abc import AsyncIterator

from ._errors import InvalidRequest

_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
_SPECIAL = (tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE)


def _outside(path: str) -> bool:
    normal = posixpath.normpath(path)
    return normal == ".." or normal.startswith("../")


def check(name: str, kind: bytes, linkname: str) -> None:
    """``InvalidRequest`` naming the member if it could land outside its tree or is not a
    plain file, directory or link; the names of the ``data`` filter's errors."""
    def refuse(why: str, detail: str) -> InvalidRequest:
        return InvalidRequest(f"refused tar member {name!r}: {why}: {detail}")

    if name.startswith("/"):
        raise refuse("AbsolutePath", "names in the tar must be relative to the directory it is unpacked in")
    if ".." in name.split("/"):
        raise refuse("OutsideDestination", "it has a '..' component")
    if kind in _REGULAR or kind == tarfile.DIRTYPE:
        return
    if kind in _SPECIAL:
        raise refuse("SpecialFile", "device nodes and FIFOs are not taken")
    if kind == tarfile.SYMTYPE:
        if linkname.startswith("/"):
            raise refuse("AbsoluteLink", f"it links to {linkname!r}")
        if _outside(posixpath.join(posixpath.dirname(name), linkname)):
            raise refuse("LinkOutsideDestination", f"it links to {linkname!r}, outside the tree")
        return
    if kind == tarfile.LNKTYPE:
        if linkname.startswith("/"):
            raise refuse("AbsoluteLink", f"it links to {linkname!r}")
        if _outside(linkname) or ".." in linkname.split("/"):
            raise refuse("LinkOutsideDestination", f"it links to {linkname!r}, outside the tree")
        return
    raise refuse("SpecialFile", f"members of type {kind!r} are not taken")


def check_member(member: tarfile.TarInfo) -> None:
    check(member.name, member.type, member.linkname)


_BLOCK = 512
_ZEROS = bytes(_BLOCK)
_META = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_MAX_META = 1 << 20


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _number(field: bytes) -> int:
    if field[0] & 0x80:  # base-256 (GNU, sizes past 8 GiB)
        value = int.from_bytes(field[1:], "big")
        return -value if field[0] & 0x40 else value
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


class TarChecker:
    """Checks a tar as it streams past, passing on only what was checked: a member's header
    (with the pax or GNU long-name headers before it) goes on once ``check`` accepted it, then
    its data as it comes. So a refused member is never seen by the ``tar x`` the stream feeds
    (members before it may be unpacked already). Memory: a header and its extended headers (at
    most 1 MiB), never a member's data. ``limit``: bytes in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self._buf = bytearray()
        self._held: list[bytes] = []  # extended headers, until their member is checked
        self._pax: dict[str, str] = {}
        self._long: dict[bytes, str] = {}
        self._data = 0  # bytes of a checked member's data still to pass
        self._ended = False

    async def checked(self, chunks) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            self.total += len(chunk)
            if self.total > self.limit:
                raise InvalidRequest(f"tar of over {self.limit} bytes is over the node's limit")
            out = self._feed(chunk)
            if out:
                yield out
        if self._buf or self._held:
            raise InvalidRequest("not a tar archive (uncompressed): it ends inside a header")

    def _feed(self, chunk: bytes) -> bytes:
        if self._data >= len(chunk) and not self._buf:  # (the common case: data passing through)
            self._data -= len(chunk)
            return chunk
        buf = self._buf
        buf += chunk
        view = memoryview(buf)
        out: list[bytes | memoryview] = []
        at, end = 0, len(buf)
        try:
            while at < end:
                if self._data:
                    n = min(self._data, end - at)
                    out.append(view[at:at + n])
                    at += n
                    self._data -= n
                    continue
                if self._ended:
                    out.append(view[at:end])
                    at = end
                    break
                if end - at < _BLOCK:
                    break
                block = bytes(view[at:at + _BLOCK])
                if block == _ZEROS:  # the end of the archive: what follows is padding
                    self._ended = True
                    out.append(view[at:at + _BLOCK])
                    at += _BLOCK
                    continue
                kind, size = self._header(block)
                padded = -(-size // _BLOCK) * _BLOCK
                if kind in _META:
                    if padded > _MAX_META:
                        raise InvalidRequest(f"refused tar: an extended header of {size} bytes")
                    if end - at < _BLOCK + padded:
                        break
                    self._meta(kind, bytes(view[at + _BLOCK:at + _BLOCK + size]))
                    self._held.append(bytes(view[at:at + _BLOCK + padded]))
                    at += _BLOCK + padded
                    continue
                name, linkname, size = self._names(block, kind, size)
                check(name, kind, linkname)
                out.extend(self._held)
                self._held.clear()
                out.append(block)
                at += _BLOCK
                # (as tarfile reads a tar: only regular files have data after their header)
                self._data = -(-size // _BLOCK) * _BLOCK if kind in _REGULAR else 0
            return b"".join(out)
        finally:
            out.clear()
            view.release()
            del buf[:at]

    @staticmethod
    def _header(block: bytes) -> tuple[bytes, int]:
        try:
            stored = _number(block[148:156])
            size = _number(block[124:136])
        except ValueError:
            raise InvalidRequest("not a tar archive (uncompressed): a header that is not one") from None
        if stored != sum(block[:148]) + 256 + sum(block[156:]):
            raise InvalidRequest("not a tar archive (uncompressed): a header's checksum is wrong")
        return block[156:157], size

    def _names(self, block: bytes, kind: bytes, size: int) -> tuple[str, str, int]:
        name, linkname = _text(block[:100]), _text(block[157:257])
        if block[257:265] == b"ustar\x0000" and (prefix := _text(block[345:500])):
            name = prefix + "/" + name
        name = self._long.get(tarfile.GNUTYPE_LONGNAME, self._pax.get("path", name))
        linkname = self._long.get(tarfile.GNUTYPE_LONGLINK, self._pax.get("linkpath", linkname))
        if "size" in self._pax:
            try:
                size = int(self._pax["size"])
            except ValueError:
                raise InvalidRequest(f"refused tar member {name!r}: a malformed pax size") from None
        self._pax.clear()
        self._long.clear()
        if kind == tarfile.DIRTYPE:
            name = name.rstrip("/") or name
        return name, linkname, size

    def _meta(self, kind: bytes, data: bytes) -> None:
        if kind in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
            self._long[kind] = _text(data)
            return
        records: dict[str, str] = {}
        at = 0
        while at < len(data):
            space = data.find(b" ", at)
            try:
                length = int(data[at:space])
            except ValueError:
                raise InvalidRequest("not a tar archive (uncompressed): a malformed pax header") from None
            if length <= 0 or space < 0:
                raise InvalidRequest("not a tar archive (uncompressed): a malformed pax header")
            key, _, value = data[space + 1:at + length - 1].partition(b"=")
            records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
            at += length
        if kind == tarfile.XGLTYPE:
            if {"path", "linkpath", "size"} & records.keys():
                raise InvalidRequest("refused tar: a global pax header naming paths or sizes")
            return
        self._pax.update(records)
