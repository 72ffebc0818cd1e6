"""Thin wrappers over the Linux system calls the standard library does not expose."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 0x2

_SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10


PR_SET_CHILD_SUBREAPER = 36


def set_child_subreaper() -> None:
    """Orphans among our descendants (a sandbox's init, once ``crun run -d`` exits) become
    our children, so we reap them at once instead of waiting on the host's init."""
    if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str | None = None) -> None:
    rc = _libc.mount(
        source.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags),
        data.encode() if data is not None else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} {source} on {target}: {os.strerror(err)}")


def umount(target: str, flags: int = 0) -> None:
    if _libc.umount2(target.encode(), ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2): with RESOLVE_IN_ROOT every path and symlink resolves inside ``dirfd``."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    # EAGAIN: a rename or mount anywhere on the host raced a ".." under RESOLVE_IN_ROOT and the
    # kernel could not prove it safe; the man page says to try again (busy hosts see it often).
    for _ in range(1000):
        fd = _libc.syscall(_SYS_OPENAT2, dirfd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err != errno.EAGAIN:
            break
    raise OSError(err, os.strerror(err), path)


def mounted_targets() -> set[str]:
    """Mount points of this mount namespace, from /proc/self/mountinfo."""
    targets = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            targets.add(fields[4].encode().decode("unicode_escape"))
    return targets
