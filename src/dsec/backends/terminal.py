"""The host's end of a sandbox's terminal: the master of a pty pair whose slave a command in the
sandbox holds as its controlling terminal (the container backend's PTYs).

``open_pair(root_pid)`` opens the pair in the sandbox's own devpts (``/proc/PID/root/dev/pts/ptmx``,
the slave got with ``TIOCGPTPEER``, no path looked up): inside, ``tty`` names it ``/dev/pts/N``
as in any terminal there. A sandbox without a devpts of its own gets one of the host's. The
master is read only when the reader asks for more (``Master.read``): the command writes at
its reader's pace, and the terminal's own buffer is all that is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import struct
import termios

TIOCGPTPEER = 0x5441  # (linux/tty.h) the slave of a master, opened without a path
TIOCSPTLCK = 0x40045431
CHUNK = 65536


def set_size(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def get_size(fd: int) -> tuple[int, int]:
    rows, cols, _, _ = struct.unpack("HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))
    return cols, rows


def open_pair(root_pid: int | None, cols: int, rows: int) -> tuple[int, int]:
    """(master, slave), both close-on-exec, sized ``cols`` x ``rows``."""
    master = -1
    if root_pid:
        try:
            master = os.open(f"/proc/{root_pid}/root/dev/pts/ptmx", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
            fcntl.ioctl(master, TIOCSPTLCK, struct.pack("i", 0))
            slave = fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            if master >= 0:
                os.close(master)
            master = -1
    if master < 0:
        master, slave = os.openpty()
        os.set_inheritable(master, False)
        os.set_inheritable(slave, False)
    set_size(master, cols, rows)
    return master, slave


class Master:
    """A pty master in the running loop: ``read`` what the slave's side wrote (``b""`` once
    every holder of the slave closed it), ``write`` what is typed, ``resize``, ``close``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._waiting: set[asyncio.Future] = set()

    async def _ready(self, add, remove) -> None:
        fut = self.loop.create_future()
        add(self.fd, lambda: fut.done() or fut.set_result(None))
        self._waiting.add(fut)
        try:
            await fut
        finally:
            self._waiting.discard(fut)
            if not self.closed:
                remove(self.fd)

    async def read(self) -> bytes:
        while not self.closed:
            try:
                return os.read(self.fd, CHUNK)
            except BlockingIOError:
                await self._ready(self.loop.add_reader, self.loop.remove_reader)
            except OSError as exc:
                if exc.errno == errno.EIO:  # no one holds the slave any more
                    return b""
                raise
        return b""

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.closed:
                raise BrokenPipeError("the terminal is closed")
            try:
                view = view[os.write(self.fd, view):]
            except BlockingIOError:
                # The program does not read its input now: wait until the terminal takes more.
                await self._ready(self.loop.add_writer, self.loop.remove_writer)

    def resize(self, cols: int, rows: int) -> None:
        set_size(self.fd, cols, rows)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(ValueError, OSError):
            self.loop.remove_reader(self.fd)
            self.loop.remove_writer(self.fd)
        os.close(self.fd)
        for fut in self._waiting:  # a reader or writer waiting: it sees the terminal closed
            if not fut.done():
                fut.set_result(None)
