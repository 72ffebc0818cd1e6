"""Read-only loop devices for EROFS layers, on kernels that cannot mount a file (before 6.12).

``attached(path)`` gives a ``/dev/loopN`` backed by ``path`` (read-only, direct I/O where the
backing filesystem allows it) for the ``with`` block, in which the caller mounts it. The device
is set to *autoclear*: the kernel detaches it when its last opener lets go, so once the block
has closed our descriptor a device lives exactly as long as its mount (the EROFS superblock
holds it open), and a process that dies between attach and mount leaves nothing behind.

``detach_backed_by(directory)`` is the sweep for ``dsec reset`` and crash recovery: every loop
device whose backing file is under ``directory`` is asked to detach (``LOOP_CLR_FD``). The
kernel detaches an unused one at once and only marks a busy one (still mounted somewhere, even
in a sandbox's mount namespace) for autoclear, so the sweep never pulls a device from under a
mount. The ioctls are LOOP_CTL_GET_FREE and LOOP_CONFIGURE (Linux 5.8).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

LOOP_CONTROL = Path("/dev/loop-control")
SYS_BLOCK = Path("/sys/block")

_LOOP_CLR_FD = 0x4C01
_LOOP_CONFIGURE = 0x4C0A
_LOOP_CTL_GET_FREE = 0x4C82
LO_FLAGS_READ_ONLY = 1
LO_FLAGS_AUTOCLEAR = 4
LO_FLAGS_DIRECT_IO = 16
_ATTACH_TRIES = 16  # another process may take the free device between GET_FREE and CONFIGURE


class _LoopInfo64(ctypes.Structure):
    _fields_ = [
        ("lo_device", ctypes.c_uint64), ("lo_inode", ctypes.c_uint64), ("lo_rdevice", ctypes.c_uint64),
        ("lo_offset", ctypes.c_uint64), ("lo_sizelimit", ctypes.c_uint64), ("lo_number", ctypes.c_uint32),
        ("lo_encrypt_type", ctypes.c_uint32), ("lo_encrypt_key_size", ctypes.c_uint32),
        ("lo_flags", ctypes.c_uint32), ("lo_file_name", ctypes.c_char * 64),
        ("lo_crypt_name", ctypes.c_char * 64), ("lo_encrypt_key", ctypes.c_char * 32),
        ("lo_init", ctypes.c_uint64 * 2),
    ]


class _LoopConfig(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_uint32), ("block_size", ctypes.c_uint32), ("info", _LoopInfo64),
                ("reserved", ctypes.c_uint64 * 8)]


def _device_node(name: str) -> Path:
    """``/dev/<name>``, made from its sysfs numbers when devtmpfs has not made it (yet)."""
    node = Path("/dev") / name
    deadline = time.monotonic() + 1.0
    while not node.exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    if not node.exists():
        major, minor = (int(x) for x in (SYS_BLOCK / name / "dev").read_text().split(":"))
        with contextlib.suppress(FileExistsError):
            os.mknod(node, stat.S_IFBLK | 0o660, os.makedev(major, minor))
    return node


def _configure(dev_fd: int, backing_fd: int, backing: Path, flags: int) -> None:
    config = _LoopConfig(fd=backing_fd, block_size=0)
    config.info.lo_flags = flags
    config.info.lo_file_name = os.fsencode(backing)[:63]
    fcntl.ioctl(dev_fd, _LOOP_CONFIGURE, bytes(config))


@contextlib.contextmanager
def attached(backing: Path, control: Path = LOOP_CONTROL) -> Iterator[str]:
    """The path of a free loop device backed by ``backing``, read-only and autoclear; valid in
    the ``with`` block (mount it there). OSError when the host has no loop devices."""
    backing = Path(backing)
    backing_fd = os.open(backing, os.O_RDONLY | os.O_CLOEXEC)
    try:
        ctl = os.open(control, os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(_ATTACH_TRIES):
                name = f"loop{fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)}"
                node = _device_node(name)
                dev_fd = os.open(node, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    flags = LO_FLAGS_READ_ONLY | LO_FLAGS_AUTOCLEAR
                    try:
                        _configure(dev_fd, backing_fd, backing, flags | LO_FLAGS_DIRECT_IO)
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:
                            raise
                        # A backing filesystem without direct I/O (some kernels say so instead
                        # of falling back to the page cache themselves).
                        _configure(dev_fd, backing_fd, backing, flags)
                except OSError as exc:
                    os.close(dev_fd)
                    if exc.errno == errno.EBUSY:  # taken meanwhile: ask for another
                        continue
                    raise OSError(exc.errno, f"attach {backing} to /dev/{name}: {os.strerror(exc.errno)}") from None
                break
            else:
                raise OSError(errno.EBUSY, f"no free loop device for {backing} after {_ATTACH_TRIES} tries")
        finally:
            os.close(ctl)
    finally:
        os.close(backing_fd)
    try:
        yield str(node)
    finally:
        os.close(dev_fd)  # from here the device lives as long as what holds it open (its mount)


def backing_file(name: str, sys_block: Path = SYS_BLOCK) -> str | None:
    """The file behind loop device ``name`` (``loop3``), None when it is not attached."""
    try:
        text = (sys_block / name / "loop" / "backing_file").read_text().rstrip("\n")
    except OSError:
        return None
    return text.removesuffix(" (deleted)")


def backed_by(directory: Path, sys_block: Path = SYS_BLOCK) -> dict[str, str]:
    """Attached loop devices whose backing file is under ``directory``: name -> backing file."""
    prefix = str(Path(directory).resolve()) + "/"
    found = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(sys_block):
            if entry.startswith("loop") and (path := backing_file(entry, sys_block)) and path.startswith(prefix):
                found[entry] = path
    return found


def detach(name: str) -> None:
    """Ask the kernel to detach ``/dev/<name>``: at once when nothing holds it, else (busy) on
    its last close. Gone already is fine."""
    try:
        fd = os.open(Path("/dev") / name, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        fcntl.ioctl(fd, _LOOP_CLR_FD)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # not attached (any more)
            raise
    finally:
        os.close(fd)


def detach_backed_by(directory: Path) -> list[str]:
    """``detach`` every loop device backed by a file under ``directory``; their names."""
    names = sorted(backed_by(directory))
    for name in names:
        detach(name)
    return names
