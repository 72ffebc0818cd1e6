"""Directory watches in a node's sandboxes, by inotify: what changes in a watched directory (or
its tree) is reported as ``FsEvent``s, as E2B's envd reports it, with no polling.

The node watches from the host. A container's files are reached through its own root
(``HostPaths.open_path``: resolved in the sandbox, no symlink followed), and the kernel's
inotify watch is set on that directory's inode: the sandbox's writes go through the same
overlay, so they raise the events, whoever makes them. One inotify instance serves every watch
of the edge (a descriptor, not one per watch); the same directory watched twice is one kernel
watch shared by both. Events are read as the kernel queues them (the loop's reader) and also
on every ``events`` call, so a change made before the call is in its answer.

What an event says, as envd's fsnotify does: ``create`` (a name made, or moved in), ``write``
(contents changed), ``remove``, ``rename`` (a name moved away; its new name comes as a
``create``), ``chmod`` (mode or owner). Names are relative to the watched directory. A
recursive watch adds the directories made below it as they come; what is in a new directory
by the time its watch is set is told as made (and, a file with bytes, written), since its
own events came before the watch.

Bounds: ``MAX_PER_SANDBOX`` open watches a sandbox, ``MAX_DIRS`` directories a recursive watch,
``MAX_QUEUED`` events held for a watch that nobody reads (past it, the oldest go and the
answer counts them in ``dropped``). A watch ends when its directory is removed or moved, or
its sandbox stops; its last events are still answered once, with ``ended``.

Lifecycle: watches live in the edge's process. ``close_sandbox`` drops a sandbox's, ``close``
every one; after an edge restart a watch id is unknown (``SessionClosed``), as a PTY's is.
"""

from __future__ import annotations

import asyncio
import errno
import os
import posixpath
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncinotify import InitFlags, Inotify, Mask, Watch

from libdsec import CapacityExceeded, InvalidRequest, SandboxFileNotFound, SessionClosed
from libdsec.protocol import FsEvent, WatchEvents, WatchInfo

MAX_PER_SANDBOX = 256
MAX_DIRS = 8192
MAX_QUEUED = 10_000

_MASK = (Mask.CREATE | Mask.DELETE | Mask.MODIFY | Mask.ATTRIB | Mask.MOVED_FROM | Mask.MOVED_TO
         | Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.ONLYDIR | Mask.EXCL_UNLINK)
# (the kernel's bit, the event's type), in the order one event's bits are told
_TYPES = ((Mask.CREATE, "create"), (Mask.MOVED_TO, "create"), (Mask.DELETE, "remove"), (Mask.MODIFY, "write"),
          (Mask.ATTRIB, "chmod"), (Mask.MOVED_FROM, "rename"))
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC

# opens a directory of the sandbox (an absolute path in it) as a read-only fd, no symlink followed
OpenDir = Callable[[str], int]


@dataclass(eq=False)
class _Watch:
    sandbox_id: str
    id: int
    path: str
    recursive: bool
    open_dir: OpenDir
    dirs: dict[Watch, str] = field(default_factory=dict)  # kernel watch -> directory relative to path
    queued: deque[FsEvent] = field(default_factory=deque)
    dropped: int = 0
    ended: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, kind: str, name: str) -> None:
        if self.queued and self.queued[-1].type == kind and self.queued[-1].name == name:
            return  # as the kernel does: one event for the same change, twice, unread between
        if len(self.queued) >= MAX_QUEUED:
            self.queued.popleft()
            self.dropped += 1
        self.queued.append(FsEvent(type=kind, name=name))
        self.changed.set()


class Watches:
    """The directory watches of one edge (module docstring)."""

    def __init__(self) -> None:
        self._inotify: Inotify | None = None
        self._users: dict[Watch, list[_Watch]] = {}  # kernel watch -> the watches that use it
        self._open: dict[tuple[str, int], _Watch] = {}
        # Ids start anywhere: a watch id kept from before an edge restart names no new watch.
        self._next = secrets.randbelow(900_000_000)

    # -- the calls ---------------------------------------------------------------------------

    def open(self, sandbox_id: str, path: str, recursive: bool, open_dir: OpenDir) -> WatchInfo:
        """Watch ``path`` (a directory, absolute) in the sandbox; ``SandboxFileNotFound`` if it
        is not there, ``InvalidRequest`` if it is not a directory."""
        if sum(1 for sid, _ in self._open if sid == sandbox_id) >= MAX_PER_SANDBOX:
            raise CapacityExceeded(f"sandbox {sandbox_id} has {MAX_PER_SANDBOX} watches open already: "
                                   "close one (or stop watching) first")
        fd = self._open_dir(open_dir, path, path)
        self._next += 1
        watch = _Watch(sandbox_id, self._next, path, recursive, open_dir)
        try:
            self._add(watch, fd, "")
        except BaseException:
            self._drop(watch)
            raise
        finally:
            os.close(fd)
        self._open[(sandbox_id, watch.id)] = watch
        return WatchInfo(id=watch.id, path=path, recursive=recursive)

    async def events(self, sandbox_id: str, watch_id: int, wait: float = 0.0) -> WatchEvents:
        """The events since the last call (waiting up to ``wait`` seconds for a first one). An
        ended watch answers its last events with ``ended`` once, then is gone."""
        watch = self._watch(sandbox_id, watch_id)
        self._read()
        if not watch.queued and not watch.ended and wait > 0:
            watch.changed.clear()
            try:
                async with asyncio.timeout(wait):
                    await watch.changed.wait()
            except TimeoutError:
                pass
            self._read()
        events, dropped = list(watch.queued), watch.dropped
        watch.queued.clear()
        watch.dropped = 0
        watch.changed.clear()
        if watch.ended:
            self.close(sandbox_id, watch_id)
        return WatchEvents(events=events, dropped=dropped, ended=watch.ended)

    def close(self, sandbox_id: str, watch_id: int) -> None:
        self._drop(self._watch(sandbox_id, watch_id))

    def close_sandbox(self, sandbox_id: str) -> None:
        for key in [key for key in self._open if key[0] == sandbox_id]:
            self._drop(self._open[key])

    def close_all(self) -> None:
        """Every watch, and the inotify descriptor with the last."""
        for watch in list(self._open.values()):
            self._drop(watch)

    def count(self) -> int:
        return len(self._open)

    # -- inside ------------------------------------------------------------------------------

    def _watch(self, sandbox_id: str, watch_id: int) -> _Watch:
        watch = self._open.get((sandbox_id, watch_id))
        if watch is None:
            raise SessionClosed(f"watch {watch_id} is not open in sandbox {sandbox_id} "
                                "(closed, ended, its sandbox stopped, or the node's edge restarted)")
        return watch

    @staticmethod
    def _open_dir(open_dir: OpenDir, path: str, shown: str) -> int:
        try:
            return open_dir(path)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise SandboxFileNotFound(f"path '{shown}' does not exist") from None
            if exc.errno == errno.ENOTDIR:
                raise InvalidRequest(f"path '{shown}' is not a directory") from None
            if exc.errno == errno.ELOOP:
                raise InvalidRequest(f"path '{shown}' has a symlink on its way: watch the path it points to") from None
            raise InvalidRequest(f"cannot watch '{shown}': {exc.strerror}") from None

    def _kernel(self) -> Inotify:
        if self._inotify is None:
            self._inotify = Inotify(flags=InitFlags.CLOEXEC | InitFlags.NONBLOCK, cache_size=256, sync_timeout=0)
            asyncio.get_running_loop().add_reader(self._inotify.fd, self._read)
        return self._inotify

    def _stop_reading(self) -> None:
        try:
            asyncio.get_running_loop().remove_reader(self._inotify.fd)
        except RuntimeError:  # (no loop running: closed at exit)
            pass

    def _add(self, watch: _Watch, fd: int, rel: str, tell: bool = False) -> None:
        """Watch the directory ``fd`` (``rel`` below the watch's path) and, for a recursive
        watch, every directory below it. ``tell``: the directory is new, and what is in it by
        now was made before its watch was set: told as made (and written, a file with bytes)."""
        if len(watch.dirs) >= MAX_DIRS:
            raise CapacityExceeded(f"watch of {watch.path} would take more than {MAX_DIRS} directories: "
                                   "watch a smaller tree")
        try:
            kernel = self._kernel().add_watch(f"/proc/self/fd/{fd}", _MASK)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise CapacityExceeded("the node's inotify watches are all in use (fs.inotify.max_user_watches)") from None
            raise InvalidRequest(f"cannot watch '{posixpath.join(watch.path, rel)}': {exc.strerror}") from None
        watch.dirs[kernel] = rel
        users = self._users.setdefault(kernel, [])
        if watch not in users:
            users.append(watch)
        if not watch.recursive:
            return
        subdirs = []
        with os.scandir(fd) as entries:
            for entry in entries:
                name = posixpath.join(rel, entry.name) if rel else entry.name
                is_dir = entry.is_dir(follow_symlinks=False)
                if is_dir:
                    subdirs.append((entry.name, name))
                if tell:
                    watch.put("create", name)
                    if not is_dir and entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_size:
                        watch.put("write", name)
        for entry, name in subdirs:
            self._add_below(watch, fd, entry, name, tell)

    def _add_below(self, watch: _Watch, parent: int, entry: str, rel: str, tell: bool) -> None:
        try:
            fd = os.open(entry, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
        except OSError:
            return  # gone, or not a directory any more: its events tell
        try:
            self._add(watch, fd, rel, tell)
        finally:
            os.close(fd)

    def _drop(self, watch: _Watch) -> None:
        self._open.pop((watch.sandbox_id, watch.id), None)
        watch.ended = True
        watch.changed.set()
        for kernel in list(watch.dirs):
            self._release(watch, kernel)
        if not self._open and self._inotify is not None:
            self._stop_reading()
            self._inotify.close()
            self._inotify = None
            self._users.clear()

    def _release(self, watch: _Watch, kernel: Watch) -> None:
        watch.dirs.pop(kernel, None)
        users = self._users.get(kernel)
        if users is None:
            return
        if watch in users:
            users.remove(watch)
        if not users:
            del self._users[kernel]
            if self._inotify is not None:
                try:
                    self._inotify.rm_watch(kernel)
                except OSError:
                    pass  # the kernel dropped it already (its directory went)

    def _read(self) -> None:
        """Every event the kernel holds, to the watches it concerns."""
        if self._inotify is None:
            return
        while True:
            try:
                event = self._inotify.sync_get()
            except BlockingIOError:
                return
            if event is None:
                return
            if Mask.Q_OVERFLOW in event.mask:
                for watch in self._open.values():
                    watch.dropped += 1
                    watch.changed.set()
                continue
            kernel = event.watch
            if kernel is None:
                continue
            for watch in list(self._users.get(kernel, ())):
                self._tell(watch, kernel, event)

    def _tell(self, watch: _Watch, kernel: Watch, event) -> None:
        rel = watch.dirs.get(kernel)
        if rel is None:
            return
        mask = event.mask
        if Mask.IGNORED in mask or Mask.DELETE_SELF in mask or Mask.MOVE_SELF in mask:
            if rel == "":  # the watched directory itself went
                watch.ended = True
                watch.changed.set()
            self._release(watch, kernel)
            return
        name = str(event.name) if event.name is not None else ""
        full = posixpath.join(rel, name) if rel and name else (name or rel)
        for bit, kind in _TYPES:
            if bit in mask:
                watch.put(kind, full)
        if watch.recursive and Mask.ISDIR in mask and (Mask.CREATE in mask or Mask.MOVED_TO in mask):
            try:
                fd = self._open_dir(watch.open_dir, posixpath.join(watch.path, full), full)
            except (InvalidRequest, SandboxFileNotFound):
                return  # gone again already
            try:
                self._add(watch, fd, full, tell=True)
            except CapacityExceeded:
                watch.dropped += 1
            finally:
                os.close(fd)
