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
RESOLVE_NO_SYMLINKS = 0x04
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


FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give back the space of ``length`` bytes at ``offset`` of a file (its size kept)."""
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE): {os.strerror(err)}")


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


# glibc's posix_spawn_file_actions_t is 80 bytes on 64-bit targets; room to spare.
_FILE_ACTIONS_BYTES = 256


def read_small(path: str, size: int = 1 << 16) -> bytes:
    """A small file (of procfs, cgroupfs, a pid file) in one read(2), with no file object: a text
    ``open().read()`` costs 5 system calls and ~32 us of CPU here, this 3 and ~15 us, and
    a sandbox's lifecycle reads ~9 such files on the event loop."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command's name: state [0], ppid [1], process
    group [2], session [3] … (OSError once the process is gone)."""
    return read_small(f"/proc/{pid}/stat").decode(errors="replace").rsplit(")", 1)[1].split()


def spawn_env(env: dict[str, str] | os._Environ) -> ctypes.Array:
    """An environment for ``posix_spawn``, encoded once (a caller that spawns often keeps it)."""
    encoded = [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()]
    return (ctypes.c_char_p * (len(encoded) + 1))(*encoded, None)


def posix_spawn(path: str, argv: list[str], env: ctypes.Array,
                stdin: int | None, stdout: int, stderr: int) -> int:
    """posix_spawn (glibc: a vfork) with the GIL released: ``os.posix_spawn`` holds it until
    the child has exec'd, which on a busy machine is milliseconds in which no other thread of
    ours runs. ``env`` from ``spawn_env``; ``stdin`` None is /dev/null. Returns the child's pid."""
    actions = ctypes.create_string_buffer(_FILE_ACTIONS_BYTES)
    _check_rc(_libc.posix_spawn_file_actions_init(actions), "posix_spawn_file_actions_init")
    try:
        if stdin is None:
            _check_rc(_libc.posix_spawn_file_actions_addopen(actions, 0, b"/dev/null", os.O_RDONLY, 0), "addopen")
        else:
            _check_rc(_libc.posix_spawn_file_actions_adddup2(actions, stdin, 0), "adddup2")
        _check_rc(_libc.posix_spawn_file_actions_adddup2(actions, stdout, 1), "adddup2")
        _check_rc(_libc.posix_spawn_file_actions_adddup2(actions, stderr, 2), "adddup2")
        args = [os.fsencode(a) for a in argv]
        c_argv = (ctypes.c_char_p * (len(args) + 1))(*args, None)
        pid = ctypes.c_int()
        rc = _libc.posix_spawn(ctypes.byref(pid), os.fsencode(path), actions, None, c_argv, env)
        if rc != 0:
            raise OSError(rc, f"posix_spawn {path}: {os.strerror(rc)}")
        return pid.value
    finally:
        _libc.posix_spawn_file_actions_destroy(actions)


def _check_rc(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(rc, f"{what}: {os.strerror(rc)}")


CLONE_NEWNET = 0x40000000


def setns(fd: int, nstype: int) -> None:
    """setns(2) for the calling thread alone (``os.setns`` is Python 3.12's)."""
    if _libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")
