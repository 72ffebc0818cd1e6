"""A session's command served without a command of ours in the sandbox (``Capability.HOST_PATHS``).

A session (``dsec.edge.processes``) is a shell reading its FIFO ``in`` (held open in the
sandbox by its supervisor), which holds a second FIFO, ``done``, open on fd 4 and writes
"CODE END NONCE" there after each command. A backend that can open the sandbox's paths from the
node (containers) lets the node speak to that shell itself, with no exec and no fork in the
sandbox but the command's own:

1. the command goes to a new file ``c.NONCE`` (the node writes it, owned by the sandbox's root);
2. ``done`` is opened for reading (non-blocking: the shell holds it, so what it writes waits in
   the pipe even before this reader came), and one line is written to ``in`` (under PIPE_BUF:
   atomic) telling the shell to source the file with ``/dev/null`` as stdin, the files ``o`` and
   ``e`` as stdout and stderr, and fd 4 closed to it, then to write ``rc.NONCE`` (what an
   interrupt waits for, as before) and the FIFO's line;
3. the reader waits on the loop for its nonce's line (no polling, no sleep); lines of a command
   whose waiter went away are skipped; end of file says the shell is gone (no writer is left);
4. ``o`` and ``e`` are read (up to the output cap), then removed with the command's files.

Every path is opened without following a symlink (all of them are writable by the session's
user) and checked for its type (a FIFO, a regular file), so a sandbox that replaced one gets its
command refused, never a node that writes or waits where it should not. ``run`` returns None
where this does not apply (a session from before the FIFO, a backend without the ability): the
caller runs the command as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
import time

from libdsec import CommandTimeout, DSecError, SandboxStateError
from libdsec.protocol import ExecRequest, ExecResult

from ..backends.base import Capability, Handle
from .processes import BASE

_LINE = ". {t}/c.{n} </dev/null >{t}/o 2>{t}/e 4>&-\n__dsec_rc=$?; echo \"$__dsec_rc END\" > {t}/rc.{n}; echo \"$__dsec_rc END {n}\" >&4\n"


_INLINE_READ = 1 << 20
# A session's FIFO without a writer for this long (its shell gone, its exit not recorded: killed
# from inside) ends the wait.
_NO_WRITER_S = 3.0


class Dead(Exception):
    """The session's shell is gone (its ``exit`` is there, or its FIFO has no writer left)."""


class Missing(Exception):
    """No session of that pid in the sandbox."""


def applies(backend) -> bool:
    return Capability.HOST_PATHS in backend.capabilities


def _open(backend, handle: Handle, path: str, flags: int, kind: int | None) -> int:
    fd = backend.open_path(handle, path, flags)
    if kind is not None and stat.S_IFMT(os.fstat(fd).st_mode) != kind:
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not what a session keeps there")
    return fd


def _read_capped(backend, handle: Handle, path: str, cap: int) -> tuple[bytes, int]:
    try:
        fd = _open(backend, handle, path, os.O_RDONLY | os.O_NONBLOCK, stat.S_IFREG)
    except FileNotFoundError:
        return b"", 0
    try:
        size = os.fstat(fd).st_size
        kept = bytearray()
        while len(kept) < min(size, cap):
            piece = os.pread(fd, min(size, cap) - len(kept), len(kept))
            if not piece:
                break
            kept += piece
        return bytes(kept), size
    finally:
        os.close(fd)


def _exists(backend, handle: Handle, path: str) -> bool:
    try:
        os.close(_open(backend, handle, path, os.O_PATH, None))
        return True
    except FileNotFoundError:
        return False


async def _line_of(fd: int, nonce: str, timeout: float) -> int:
    """The exit code on the FIFO line of ``nonce``; ``Dead`` at end of file."""
    loop = asyncio.get_running_loop()
    buffered = b""
    deadline = loop.time() + timeout
    while True:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            ready = loop.create_future()
            loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
            try:
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError
                await asyncio.wait_for(ready, left)
            finally:
                loop.remove_reader(fd)
            continue
        if not data:
            raise Dead
        buffered += data
        *lines, buffered = buffered.split(b"\n")
        for line in lines:
            fields = line.decode(errors="replace").split()
            if len(fields) == 3 and fields[1] == "END" and fields[2] == nonce:
                return int(fields[0])


async def run(backend, handle: Handle, session: int, nonce: str, request: ExecRequest) -> ExecResult | None:
    """Run one whole command in the session's shell from the node; None if that cannot be done
    here (the caller runs it as before). ``Missing``, ``Dead``; ``CommandTimeout`` once
    ``request.timeout`` passed (the command is still running: the caller interrupts it);
    ``SandboxStateError`` if the session's files were replaced (a link, a file for a FIFO)."""
    if not applies(backend):
        return None
    try:
        return await _run(backend, handle, session, nonce, request)
    except OSError as exc:
        if isinstance(exc, DSecError):
            raise
        raise SandboxStateError(f"session {session}: its files in the sandbox ({BASE}) are not as the session keeps "
                                f"them ({exc.strerror or exc}); open a new one") from None


async def _run(backend, handle: Handle, session: int, nonce: str, request: ExecRequest) -> ExecResult | None:
    start = time.perf_counter()
    base = _open(backend, handle, BASE, os.O_PATH | os.O_DIRECTORY, None)
    try:
        try:
            name = os.readlink(str(session), dir_fd=base)
        except FileNotFoundError:
            raise Missing from None
        except OSError:  # not a link: not a session of ours
            raise Missing from None
    finally:
        os.close(base)
    if "/" in name or name in ("", ".", ".."):
        raise Missing
    t = f"{BASE}/{name}"
    if _exists(backend, handle, f"{t}/exit"):
        raise Dead
    try:
        done = _open(backend, handle, f"{t}/done", os.O_RDONLY | os.O_NONBLOCK, stat.S_IFIFO)
    except FileNotFoundError:
        return None  # a session from before the FIFO
    try:
        last = _open(backend, handle, f"{t}/last", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, stat.S_IFREG)
        os.close(last)  # (its mtime: when the last command came, for the idle watchdog)
        command = request.command if request.command.endswith("\n") else request.command + "\n"
        fd = _open(backend, handle, f"{t}/c.{nonce}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IFREG)
        try:
            view = memoryview(command.encode())
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        fd = _open(backend, handle, f"{t}/in", os.O_WRONLY | os.O_NONBLOCK, stat.S_IFIFO)
        try:
            os.write(fd, _LINE.format(t=t, n=nonce).encode())
        finally:
            os.close(fd)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request.timeout
        nobody_since = None
        while True:
            try:
                code = await _line_of(done, nonce, deadline - loop.time())
                break
            except TimeoutError:
                raise CommandTimeout(f"command timed out after {request.timeout:g}s") from None
            except Dead:
                # No writer: the shell is gone, or not yet holding the FIFO (a session just
                # started: it makes the FIFO, then opens it). Gone once its exit is recorded.
                now = loop.time()
                nobody_since = now if nobody_since is None else nobody_since
                if _exists(backend, handle, f"{t}/exit") or now - nobody_since > _NO_WRITER_S:
                    raise
                await asyncio.sleep(0.005)
                os.close(done)
                done = _open(backend, handle, f"{t}/done", os.O_RDONLY | os.O_NONBLOCK, stat.S_IFIFO)
    finally:
        os.close(done)
    cap = request.max_output_bytes
    if cap > _INLINE_READ:  # (a big answer is read off the loop)
        (stdout, out_total), (stderr, err_total) = await asyncio.to_thread(
            lambda: (_read_capped(backend, handle, f"{t}/o", cap), _read_capped(backend, handle, f"{t}/e", cap)))
    else:
        stdout, out_total = _read_capped(backend, handle, f"{t}/o", cap)
        stderr, err_total = _read_capped(backend, handle, f"{t}/e", cap)
    with contextlib.suppress(OSError):
        base = _open(backend, handle, t, os.O_PATH | os.O_DIRECTORY, None)
        try:
            # (o and e too: a streamed command after this one follows them before its shell
            # made them anew, and must not see this one's output)
            for leftover in (f"rc.{nonce}", f"c.{nonce}", "o", "e"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover, dir_fd=base)
        finally:
            os.close(base)
    return ExecResult(exit_code=code, stdout=stdout.decode(errors="replace"), stderr=stderr.decode(errors="replace"),
                      duration_s=time.perf_counter() - start, stdout_truncated=out_total > len(stdout),
                      stderr_truncated=err_total > len(stderr), stdout_bytes=out_total, stderr_bytes=err_total)
