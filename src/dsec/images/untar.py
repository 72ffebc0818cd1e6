"""A layer tar applied into an empty directory by GNU tar, each member checked by Python first.

Applying a pulled base of 12,000 members member by member in Python (``tarfile``) took about
2.4 s of the 4.5 s a pull of 32 task images spends on its critical path; GNU tar writes the same
members in C beside it. Python still reads the tar's headers (``tarheaders``, strictly: what it
does not read as both ``tarfile`` and GNU tar do is not taken) and is the one feeding tar's stdin:
the bytes of a member's header reach tar only once the member has been checked, so tar never
sees a member that was not. A member this way does not take
(``NotPlain``) stops it: tar is stopped, the directory emptied and the caller applies the layer
its own way (``sources.apply_layer``), which then applies or refuses it exactly as it always has.

Taken only into an empty directory (nothing on disk to write through), as root (owners are
restored), and only members that give the same tree both ways:

- names inside the root (``store._check_member``: no ``..``, no absolute names, symlinks that do
  not resolve outside, no device nodes; a refused member is ``NotPlain``, and the Python way
  refuses it with its own message);
- regular files, directories, symlinks, and hard links to a regular file named before; never a
  whiteout (``.wh.*``), a FIFO, a sparse file or a GNU volume/multi-volume header;
- each path named once (a directory made on the way to a member may be named later), never
  below a symlink or a file of the layer, never a directory made on the way below a setgid
  directory (tar sets a directory's mode once its members are written, ``tarfile`` at once: the
  kernel's inherited group would differ).

GNU tar leaves a symlink whose target is absolute or holds ``..`` as a placeholder file until the
end; nothing goes through it since no member goes below a symlink. After tar: the times
``tarfile`` sets differently (a hard link's header applied to its inode, a file's fractional pax
time as a float) set as ``tarfile`` sets them, the root's mode and owner as they were (a ``./``
member names it), and the caller settles directory and symlink times (``_settle_times``), so the
tree, so the layer digest, is the one the Python way makes.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from typing import BinaryIO

from . import tarheaders
from .inflate import Inflated, is_gzip
from .store import LayerBuildError, _check_member

log = logging.getLogger("dsec.images")

WHITEOUT_PREFIX = ".wh."
_CHUNK = 1 << 20
_PIPE_SIZE = 1 << 20  # (the default pipe-max-size): fewer wake-ups of tar
_F_SETPIPE_SZ = 1031
_END = bytes(2 * tarfile.BLOCKSIZE)  # the end-of-archive marker
_TAR_ARGS = ("--extract", "--file=-", "--numeric-owner", "--same-owner", "--same-permissions",
             "--no-xattrs", "--no-acls", "--no-selinux", "--warning=no-timestamp")


class NotPlain(Exception):
    """A member (or a stream) the GNU tar way does not take; the caller applies the layer its own way."""


@functools.cache
def _gnu_tar() -> str | None:
    path = shutil.which("tar")
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return path if out.startswith("tar (GNU tar)") else None


def usable(dest: str) -> bool:
    """Whether the GNU tar way may apply a layer into ``dest``: as root, GNU tar there, and
    ``dest`` empty."""
    if os.geteuid() != 0 or _gnu_tar() is None:
        return False
    with os.scandir(dest) as it:
        return next(it, None) is None


@dataclass
class _Plan:
    """What the check of the members found, for the post-pass."""

    times: dict[str, int] = field(default_factory=dict)          # directories and symlinks named
    # Hard links (their header's owner, mode, time) and files with fractional times, in order.
    fixes: list[tuple[str, tarfile.TarInfo]] = field(default_factory=list)
    named: dict[str, int] = field(default_factory=dict)          # normalized name → its type
    made: set[str] = field(default_factory=set)                  # directories made on the way
    setgid: set[str] = field(default_factory=set)                # directories named with the setgid bit


_DIR, _FILE, _LINK = 0, 1, 2


def _check(member: tarfile.TarInfo, root: str, plan: _Plan) -> None:
    """``NotPlain`` unless the member gives the same tree through GNU tar (module docstring)."""
    try:
        _check_member(member, root)  # (str: it joins and compares strings only)
    except LayerBuildError as exc:
        raise NotPlain(str(exc)) from None
    raw = member.name
    name = os.path.normpath(raw)
    if member.type == tarfile.DIRTYPE:
        kind = _DIR
    elif member.type in (tarfile.REGTYPE, tarfile.AREGTYPE) and member.sparse is None:
        kind = _FILE
    elif member.type == tarfile.SYMTYPE:
        kind = _LINK
    elif member.type == tarfile.LNKTYPE:
        target = os.path.normpath(member.linkname)
        if plan.named.get(target) != _FILE:
            raise NotPlain(f"hard link {raw!r} -> {member.linkname!r} is not to a file named before")
        kind = _FILE
    else:
        raise NotPlain(f"member {raw!r} of type {member.type!r}")
    if name in (".", "/"):  # (GNU tar sets the root's owner and mode, put back after it)
        if kind != _DIR or member.mode & stat.S_ISGID:
            raise NotPlain(f"member {raw!r} names the root as a non-directory or a setgid one")
        return
    if raw.endswith("/") and kind != _DIR:
        raise NotPlain(f"member {raw!r} ends in '/'")
    head, _, base = name.rpartition("/")
    if base.startswith(WHITEOUT_PREFIX):
        raise NotPlain(f"whiteout {raw!r}")
    if name in plan.named or (name in plan.made and kind != _DIR):
        raise NotPlain(f"member {raw!r} is named twice")
    # Its directories: each named as a directory, or made on the way (under no setgid one).
    parent = head
    while parent and parent not in plan.made:
        seen = plan.named.get(parent)
        if seen is not None:
            if seen != _DIR:
                raise NotPlain(f"member {raw!r} is below a non-directory")
            break
        up = parent.rpartition("/")[0]
        if up in plan.setgid:
            raise NotPlain(f"member {raw!r} makes a directory below the setgid directory {up!r}")
        plan.made.add(parent)
        parent = up
    plan.made.discard(name)
    plan.named[name] = kind
    path = f"{root}/{name}"
    if kind == _DIR or member.type == tarfile.SYMTYPE:
        plan.times[path] = int(member.mtime)
        if kind == _DIR and member.mode & stat.S_ISGID:
            plan.setgid.add(name)
    elif member.type == tarfile.LNKTYPE or member.mtime != int(member.mtime):
        plan.fixes.append((path, member))


class _Feed:
    """What ``tarheaders`` reads, passed on to tar's stdin in order. Bytes read (a member's
    headers) are held until the next seek, which comes only once the caller has taken the
    member; bytes skipped by a seek (the member's data) go at once. Gathered into writes of
    ``_CHUNK`` bytes: a write a member woke tar 12,000 times for a base."""

    def __init__(self, src: BinaryIO | Inflated, out: int) -> None:
        self._src, self._out = src, out
        self._held = bytearray()
        self._pending = bytearray()
        self._pos = 0  # bytes read from ``src``; the held ones are the last of them

    def read(self, n: int = -1) -> bytes:
        data = self._src.read(n)
        self._pos += len(data)
        self._held += data
        return data

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != 0 or offset < self._pos:
            raise NotPlain("the tar is read backwards")
        self._release(self._pos)
        while self._pos < offset:
            data = self._src.read(min(offset - self._pos, _CHUNK))
            if not data:
                break
            self._pending += data
            self._pos += len(data)
            if len(self._pending) >= _CHUNK:
                self._flush()
        return self._pos

    def _release(self, upto: int) -> None:
        """The held bytes before stream position ``upto`` passed on; the rest dropped."""
        keep = len(self._held) - (self._pos - upto)
        if keep > 0:
            self._pending += memoryview(self._held)[:keep]
        self._held.clear()

    def _flush(self) -> None:
        view = memoryview(self._pending)
        try:
            while view:
                view = view[os.write(self._out, view):]
        finally:
            view.release()
        self._pending.clear()

    def end(self, upto: int) -> None:
        """The members before ``upto`` passed on, then the end-of-archive marker."""
        self._release(upto)
        self._pending += _END
        self._flush()


def _feed(fileobj: BinaryIO, root: str, stdin: int) -> _Plan:
    plan = _Plan()
    inflated = Inflated(fileobj) if is_gzip(fileobj) else None
    with inflated or contextlib.nullcontext():
        feed = _Feed(inflated or fileobj, stdin)
        end = 0
        try:
            for member, end in tarheaders.members(feed.read, feed.seek):
                _check(member, root, plan)
        except tarheaders.Unread as exc:
            raise NotPlain(str(exc)) from None
        feed.end(end)
    return plan


def apply(fileobj: BinaryIO, dest: str) -> dict[str, int] | None:
    """Apply the layer tar (plain or gzip) ``fileobj`` (at its start) into the empty directory
    ``dest`` (resolved) with GNU tar: the times of the directories and symlinks it named, for
    the caller to settle. None when this way does not take it (``NotPlain``, or tar or the
    stream failed): ``dest`` is left empty and ``fileobj`` at its start again."""
    tar_bin = _gnu_tar()
    if tar_bin is None:
        return None
    start = fileobj.tell()
    top = os.lstat(dest)
    plan = None
    # (tar's complaints go to a file: a pipe nobody reads while tar is fed could fill and stall it)
    with tempfile.TemporaryFile() as complaints:
        proc = subprocess.Popen([tar_bin, *_TAR_ARGS, f"--directory={dest}"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=complaints, env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"})
        assert proc.stdin is not None
        try:
            with contextlib.suppress(OSError):
                fcntl.fcntl(proc.stdin.fileno(), _F_SETPIPE_SZ, _PIPE_SIZE)
            try:
                plan = _feed(fileobj, dest, proc.stdin.fileno())
            except (NotPlain, tarfile.TarError, EOFError, OSError, ValueError, UnicodeError) as exc:
                log.debug("layer applied the Python way: %s", exc)
            finally:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            if plan is None:
                proc.kill()
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if plan is not None and proc.returncode != 0:
            complaints.seek(0)
            log.debug("layer applied the Python way: tar exited %s: %s", proc.returncode,
                      complaints.read(2000).decode(errors="replace").strip())
            plan = None
    if plan is not None:
        try:
            _post_pass(plan)
        except OSError as exc:
            log.debug("layer applied the Python way: %s", exc)
            plan = None
    os.chown(dest, top.st_uid, top.st_gid)
    os.chmod(dest, stat.S_IMODE(top.st_mode))
    if plan is None:
        _empty(dest)
        fileobj.seek(start)
        return None
    return plan.times


def set_like_tarfile(target: int | str, member: tarfile.TarInfo) -> None:
    """Owner (as root), mode and time of the written member ``target`` (a path or descriptor) set
    as ``tarfile`` sets them, a failure of any passed over as ``tarfile`` passes it over."""
    if os.geteuid() == 0:
        with contextlib.suppress(OSError):
            os.chown(target, member.uid, member.gid)
    with contextlib.suppress(OSError):
        os.chmod(target, member.mode)
    with contextlib.suppress(OSError):
        os.utime(target, (member.mtime, member.mtime))


def _post_pass(plan: _Plan) -> None:
    """What ``tarfile`` sets otherwise than GNU tar, set as ``tarfile`` sets it, in the members'
    order: a hard link's header (owner, mode, time) on the inode it shares, a time as a float."""
    for path, member in plan.fixes:
        if member.type == tarfile.LNKTYPE:
            set_like_tarfile(path, member)
        else:
            with contextlib.suppress(OSError):
                os.utime(path, (member.mtime, member.mtime))


def _empty(dest: str) -> None:
    """Everything under ``dest`` removed (tar's work, for the other way to start afresh); never
    following a link."""
    with os.scandir(dest) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
