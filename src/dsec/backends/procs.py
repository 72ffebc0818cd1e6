"""Process plumbing for backends that run host processes (crun, the commands crun exec starts):
kill a process tree or a session, wait on pidfds, spawn-and-wait without an asyncio
subprocess, and reap the orphans ``crun run --detach`` leaves to the server (its subreaper).
Nothing here knows about containers but the cgroup check that guards pid reuse."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import functools
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from .. import _sys

log = logging.getLogger("dsec.backends.procs")


async def outlast_cancel(future: asyncio.Future) -> bool:
    """Wait until ``future`` is done, even when the caller is cancelled meanwhile (the work of
    a thread cannot be stopped, and what it made must be seen to). True when a cancellation
    came: the caller raises ``CancelledError`` once it has dealt with the result."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant (found through /proc children lists)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def wait_exit(fd: int, timeout: float, tick: Callable[[], None] = lambda: None) -> bool:
    """Wait until the process of pidfd ``fd`` has exited (zombie or reaped), at most
    ``timeout`` seconds; True if it did. Past 0.2 s ``tick`` runs every 50 ms (a pid
    namespace's init cannot finish dying while a zombie of the namespace waits on us, the
    subreaper, to be reaped). The caller closes ``fd``."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
    deadline = time.monotonic() + timeout
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(exited), min(0.2, timeout))
        while not exited.done() and time.monotonic() < deadline:
            tick()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(exited), 0.05)
        return exited.done()
    finally:
        loop.remove_reader(fd)


@functools.cache
def sealed_copy(path: str) -> str:
    """A path that runs ``path`` from a sealed in-memory copy of it, made once (``path`` itself
    when the copy cannot be made). crun guards against a container overwriting the host's
    binary through /proc/self/exe (CVE-2019-5736) by copying itself to a sealed memfd and
    executing that copy, on every run: a bind mount, a second exec and a second load of its
    libraries. Started from a copy sealed like its own, it sees it is
    one and goes on (crun's cloned_binary.c: a fully sealed memfd may be shared). The copy is
    this process's; a crun upgraded on disk is used from the next server start."""
    fd = -1
    try:
        fd = os.memfd_create("crun", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        with open(path, "rb") as src, os.fdopen(fd, "wb", closefd=False) as dst:
            shutil.copyfileobj(src, dst)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        log.warning("no sealed copy of %s (%s): it copies itself on every run", path, exc)
        return path
    # posix_spawn resolves the path before close-on-exec descriptors close.
    return f"/proc/self/fd/{fd}"


class OrphanReaper:
    """``crun run --detach`` forks a process that outlives the crun we started, in a process
    group crun made: that orphan comes to us, the subreaper (dsec.server), and would stay a
    zombie, one a sandbox, until the server exits. A tenth of a second after crun runs, the
    zombie children we have are looked at, oldest first, without reaping them (WNOWAIT): one
    in a process group neither its own (sandbox inits, sessions we started) nor ours (what we
    spawned and wait for) is such an orphan, and is reaped. Any other zombie is left to its
    waiter; should one stay in the way, a sweep of all children newer than the first crun
    since (in a thread) takes its place.

    The orphans still owed (one a ``run --detach``) keep the looks going, less and less often,
    while they live: on a slow machine (kernel 6.1 under TCG) one outlived the look a tenth of
    a second on, and no crun ran after it to look again. Past a few looks a thread counts the
    orphans still alive among our children, and that count is what is owed."""

    def __init__(self) -> None:
        self.floor: int | None = None  # the lowest crun pid since the last look
        self.due = False
        self.blocked = 0
        self.owed = 0  # orphans of crun runs not reaped yet, as far as we know
        self.waits = 0  # looks in a row that found them alive still

    def after(self, pid: int, orphans: int = 0) -> None:
        """crun ``pid`` has exited, leaving ``orphans`` processes to us."""
        self.owed += orphans
        self.waits = 0
        self.floor = pid if self.floor is None else min(self.floor, pid)
        self._look_in(0.1)

    def _look_in(self, delay: float) -> None:
        if not self.due:
            self.due = True
            asyncio.get_running_loop().call_later(delay, self._look)

    def _look(self) -> None:
        self.due = False
        floor, self.floor = self.floor or 0, None
        reaped, in_the_way = _reap_waitable_orphans()
        self.owed = max(0, self.owed - reaped)
        if in_the_way:
            self.blocked += 1
            if self.blocked < 5:  # its waiter reaps it soon
                self.floor = floor if self.floor is None else min(self.floor, floor)
                self._look_in(0.1)
                return
            self.blocked = 0
            sweep = asyncio.get_running_loop().run_in_executor(None, _reap_orphans_above, floor)
            sweep.add_done_callback(self._swept)
            return
        self.blocked = 0
        if not self.owed:
            return
        self.waits += 1
        if self.waits < 6:  # 0.2, 0.4, 0.8, 1.6, 2 s
            self._look_in(min(0.1 * 2 ** self.waits, 2.0))
        else:
            count = asyncio.get_running_loop().run_in_executor(None, _living_orphans)
            count.add_done_callback(self._counted)

    def _swept(self, sweep: asyncio.Future) -> None:
        if not sweep.cancelled() and sweep.exception() is None:
            self.owed = max(0, self.owed - sweep.result())
        if self.owed:
            self._look_in(0.1)

    def _counted(self, count: asyncio.Future) -> None:
        if count.cancelled() or count.exception() is not None:
            return
        self.owed = count.result()
        if self.owed:
            self._look_in(2.0)


def children() -> set[int]:
    """Our child processes, those of every thread (no scan of all /proc)."""
    children: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
            children.update(int(c) for c in f.read().split())
    return children


def _orphan_state(pid: int, mine: int) -> str | None:
    """The state (``Z``, ``S`` …) of child ``pid`` if it is an orphan (see OrphanReaper: a
    process group neither its own nor ``mine``), else None."""
    try:
        fields = _sys.proc_stat(pid)
        return fields[0] if int(fields[2]) not in (pid, mine) else None
    except (OSError, IndexError, ValueError):
        return None


def _reap_waitable_orphans() -> tuple[int, bool]:
    """Reap orphaned zombie children (see OrphanReaper) while they come first: how many, and
    whether another zombie is in the way."""
    mine = os.getpgrp()
    reaped = 0
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped, False
        if info is None:
            return reaped, False
        if _orphan_state(info.si_pid, mine) is None:
            return reaped, True
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, os.WNOHANG)
            reaped += 1


def _reap_orphans_above(floor: int) -> int:
    """Reap orphaned zombies newer than ``floor`` among all our children; how many."""
    mine = os.getpgrp()
    reaped = 0
    for pid in children():
        if pid > floor and _orphan_state(pid, mine) == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
                reaped += 1
    return reaped


def _living_orphans() -> int:
    """How many orphans (see OrphanReaper) among our children have not exited yet."""
    mine = os.getpgrp()
    return sum(_orphan_state(pid, mine) not in (None, "Z") for pid in children())


ORPHANS = OrphanReaper()


@functools.cache
def spawn_env() -> ctypes.Array:
    """The server's environment for crun, encoded once (the server does not change it)."""
    return _sys.spawn_env(os.environ)


async def spawn_wait(argv: list[str], stdin: int | None, out: int, timeout: float,
                     orphans: int = 0) -> int | None:
    """Run ``argv`` with ``stdin`` (None: /dev/null) and stdout and stderr to ``out``; its exit
    code, or None when it was killed past ``timeout``. ``orphans``: how many processes it
    leaves to us, the subreaper, to reap once they exit (see OrphanReaper). posix_spawn (a vfork) and a pidfd:
    cheaper on the event loop than an asyncio subprocess, which sets up pipes, transports and
    a child watcher for each of the crun runs every sandbox costs.

    The spawn runs in a thread, without the GIL (``_sys.posix_spawn``): the parent of a vfork
    waits until the child has exec'd, and on a busy machine that wait was a third of the event
    loop's time. It is waited for even when the call is cancelled (the child takes ``stdin``
    and ``out``, which the caller closes once this returns), and what it started is killed."""
    spawning = asyncio.get_running_loop().run_in_executor(
        None, _sys.posix_spawn, argv[0], argv, spawn_env(), stdin, out, out)
    cancelled = await outlast_cancel(spawning)
    pid = spawning.result()  # or the spawn's OSError
    reaped = False
    try:
        if cancelled:
            raise asyncio.CancelledError
        fd = os.pidfd_open(pid)
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
        try:
            await asyncio.wait_for(exited, timeout)
        except TimeoutError:
            return None
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        _, status = os.waitpid(pid, 0)
        reaped = True
        ORPHANS.after(pid, orphans)
        return os.waitstatus_to_exitcode(status)
    finally:
        if not reaped:  # timed out or cancelled: it must not outlive the call, nor stay a zombie
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


async def wait_process(proc: asyncio.subprocess.Process, timeout: float) -> int:
    """``proc``'s exit code once it has exited; TimeoutError past ``timeout``. Unlike
    ``proc.wait()`` (Python < 3.12), it does not also wait until every process that inherited
    the pipes (a command's background children) has closed them."""
    if proc.returncode is None:
        try:
            # Not reaped yet (the child watcher reaps on this loop), so the pid is still ours.
            fd = os.pidfd_open(proc.pid)
        except ProcessLookupError:
            fd = -1
        if fd >= 0:
            loop = asyncio.get_running_loop()
            exited = loop.create_future()
            loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
            try:
                await asyncio.wait_for(exited, timeout)
            finally:
                loop.remove_reader(fd)
                os.close(fd)
    for turn in range(100_000):  # the child watcher sets the code a loop turn or two later
        if proc.returncode is not None:
            return proc.returncode
        await asyncio.sleep(0 if turn < 20 else 0.001)
    raise TimeoutError(f"process {proc.pid} exited but was not reaped")


def session_of(pid: int) -> int:
    return int(_sys.proc_stat(pid)[3])


def kill_session_of(pidfile: Path, cid: str) -> None:
    """SIGKILL the session of the command in ``pidfile`` in sandbox ``cid``. crun exec gives
    each command a session of its own; what the command starts in the background stays in it
    (unless it calls setsid), even when a double fork takes it out of the process tree."""
    try:
        pid = int(pidfile.read_text())
        sid = session_of(pid) if pid_in_cgroup(pid, cid) else 0
    except (OSError, ValueError, IndexError):
        return
    if sid <= 1:
        return
    # Again until none is left: a process may fork while the others are being killed.
    for _ in range(20):
        killed = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                session = session_of(int(entry))
            except (OSError, IndexError, ValueError):
                continue
            if session == sid and pid_in_cgroup(int(entry), cid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry), signal.SIGKILL)
                    killed += 1
        if not killed:
            return


def pid_in_cgroup(pid: int, cid: str) -> bool:
    """True while ``pid`` is a live process in sandbox ``cid``'s cgroup (guards pid reuse)."""
    try:
        if f"/{cid}\n".encode() not in _sys.read_small(f"/proc/{pid}/cgroup"):
            return False
        return _sys.proc_stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False
