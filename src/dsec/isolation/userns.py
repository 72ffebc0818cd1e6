"""The user namespace of a container sandbox: root inside is an unprivileged uid outside.

Every container sandbox runs in a user namespace that maps ids 0..65535 inside to
``SANDBOX_ID_BASE``..``+65535`` on the host (crun's ``uidMappings``/``gidMappings``). Root in
a sandbox thus holds its capabilities only over its own namespaces: to the host kernel it is uid
1073741824, which owns nothing outside the sandbox.

The shared EROFS layers stay as they are on disk (owned by 0). Each sandbox's overlay stacks
*idmapped* clones of the node's layer mounts (``open_tree`` + ``mount_setattr(MOUNT_ATTR_IDMAP)``:
kernel ≥ 5.12, and EROFS supports it here), so on-disk uid 0 reads as the sandbox's root and the
layers are never copied or chowned. The clones are detached mounts, held by fds
(the overlay keeps private references to its lower layers). The writable upper (tmpfs) holds host ids
shifted by the base; ``shifted_view`` shows it shifted back, which is what ``pack_diff`` packs.

Each live sandbox has a range of its own (``IdRanges``): no two sandboxes share a host uid, and
a host uid names its sandbox (the kernel's seccomp audit records carry it, see
dsec.isolation.events). Ranges are reused after a sandbox ends; the user namespace fds that
describe them are made once per range (by a clone of the server that runs no program) and the
last 256 used are kept, and so are the idmapped clones of each layer for a range (``LayerMounts.idmapped``): detached
mounts, in no mount table, that the overlay takes as its lower layers by their fds. Before
Linux 6.15 overlayfs takes no detached mount as a layer: there each clone is attached to a
directory of the node first (``detached_layers``, ``attach_clone``). Before 6.3 a tmpfs cannot be
idmapped, and ``shifted_view`` copies instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .. import _sys, settings

SANDBOX_ID_BASE = 1 << 30
SANDBOX_ID_COUNT = 65536

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442
_OPEN_TREE_CLONE = 1
_AT_EMPTY_PATH = 0x1000
_AT_FDCWD = -100
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_IDMAP = 0x100000


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(rc: int, what: str) -> int:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return rc


@dataclass(frozen=True)
class IdMap:
    """ids ``0..count-1`` inside are ``base..base+count-1`` on the host."""

    base: int = SANDBOX_ID_BASE
    count: int = SANDBOX_ID_COUNT

    def host(self, inside_id: int) -> int:
        if not 0 <= inside_id < self.count:
            raise ValueError(f"id {inside_id} is outside the sandbox's range 0..{self.count - 1}")
        return self.base + inside_id

    def oci(self) -> dict:
        """The OCI ``linux.uidMappings``/``gidMappings`` entries."""
        m = [{"containerID": 0, "hostID": self.base, "size": self.count}]
        return {"uidMappings": m, "gidMappings": m}


def _make_userns_fd(inside: int, outside: int, count: int) -> int:
    """An fd of a new user namespace mapping ``inside..`` to ``outside..`` (it only ever
    describes an idmapped mount): ``_cloned_userns_fd`` where it can (x86-64), else one
    ``unshare --user`` spawn."""
    if _SYS_GETPID is not None:
        try:
            return _cloned_userns_fd(inside, outside, count)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
                raise
    return _spawned_userns_fd(inside, outside, count)


# A process made by clone(2) in a new user namespace that shares this one's memory and runs only
# ``syscall(SYS_getpid)`` on a stack of its own, then exits (glibc's ``syscall`` is a plain
# wrapper: no lock, no thread state). Its namespace is mapped and opened while it is a zombie
# (its credentials, which hold the namespace, live until it is reaped). No program is run: an
# ``unshare --user sh`` spawn cost 2.0 ms of CPU a new id range in a loop (2.9 ms in a server's
# fork profile: two execs, a dynamic link, a shell), the clone 0.55-0.75 ms. And nothing
# outlives a server killed meanwhile: a zombie is reaped by whoever inherits it, where a clone
# kept running until its maps were written would live on, holding the server's memory.
_SYS_GETPID = 39 if os.uname().machine == "x86_64" else None
_CLONE_VM = 0x00000100
_CLONE_NEWUSER = 0x10000000
_CHILD_STACK_BYTES = 16 << 10
_libc.clone.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
_libc.clone.restype = ctypes.c_int


def _cloned_userns_fd(inside: int, outside: int, count: int) -> int:
    """``_make_userns_fd`` by a clone of this process in a new user namespace (see above): once
    it has exited (waited for, not reaped), its maps are written and its namespace's fd opened,
    then it is reaped. Signals are blocked in the calling thread across the clone, so the child
    starts with all of them blocked: none of this process's handlers can run in it."""
    stack = ctypes.create_string_buffer(_CHILD_STACK_BYTES)  # alive until the child has exited
    top = (ctypes.addressof(stack) + _CHILD_STACK_BYTES) & ~15
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = _libc.clone(ctypes.cast(_libc.syscall, ctypes.c_void_p), top,
                          _CLONE_VM | _CLONE_NEWUSER | signal.SIGCHLD, _SYS_GETPID)
        err = ctypes.get_errno()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if pid < 0:
        raise OSError(err, f"clone of a user namespace: {os.strerror(err)}")
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # a zombie now, its namespace still held
        del stack
        return _mapped_userns_fd(pid, inside, outside, count)
    finally:
        with contextlib.suppress(ChildProcessError):  # (reaped by a wait of all children elsewhere)
            os.waitpid(pid, 0)


def _spawned_userns_fd(inside: int, outside: int, count: int) -> int:
    """``_make_userns_fd`` by an ``unshare --user`` process, for where a clone cannot."""
    child = subprocess.Popen(["unshare", "--user", "sh", "-c", "read _"], stdin=subprocess.PIPE)
    try:
        mine = os.stat("/proc/self/ns/user").st_ino
        deadline = time.monotonic() + 5
        while os.stat(f"/proc/{child.pid}/ns/user").st_ino == mine:
            if time.monotonic() > deadline or child.poll() is not None:
                raise OSError(f"unshare --user did not start (exit {child.returncode})")
            time.sleep(0.002)
        return _mapped_userns_fd(child.pid, inside, outside, count)
    finally:
        with contextlib.suppress(BrokenPipeError):
            child.stdin.close()
        child.wait()


def _mapped_userns_fd(pid: int, inside: int, outside: int, count: int) -> int:
    """Map the ids of the user namespace process ``pid`` is in (it has no map yet), and open it."""
    line = f"{inside} {outside} {count}\n"
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(line)
    return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)


_USERNS_FDS: OrderedDict[tuple[int, int, int], int] = OrderedDict()
_USERNS_FDS_KEPT = 256  # fds held at most; a range used again after eviction costs one spawn
# Over the kept fds, the ones being made, and each use of one: an fd is closed (evicted) only
# while no thread is using it. Never held over a spawn.
_USERNS_LOCK = threading.Lock()
_USERNS_MAKING: dict[tuple[int, int, int], threading.Event] = {}  # set once made (or failed)
_T = TypeVar("_T")


def _with_userns_fd(inside: int, outside: int, count: int, use: Callable[[int], _T]) -> _T:
    """``use(fd)`` of the user namespace fd of the mapping (``_make_userns_fd``), made once and
    kept for the ranges used last. The spawn that makes one costs a process start (a few ms, far
    more on a loaded host) and runs with no lock held, so that the creates of a node make theirs
    at once; a second caller for the same mapping waits for that one. ``use`` runs under
    ``_USERNS_LOCK`` (a syscall or two: no other thread's eviction closes the fd under it)."""
    key = (inside, outside, count)
    while True:
        with _USERNS_LOCK:
            fd = _USERNS_FDS.get(key)
            if fd is not None:
                _USERNS_FDS.move_to_end(key)
                return use(fd)
            making = _USERNS_MAKING.get(key)
            if making is None:
                making = _USERNS_MAKING[key] = threading.Event()
                break
        making.wait()  # (made: kept now; or failed: this caller tries itself)
    try:
        made = _make_userns_fd(inside, outside, count)
    except BaseException:
        with _USERNS_LOCK:
            del _USERNS_MAKING[key]
            making.set()
        raise
    with _USERNS_LOCK:
        del _USERNS_MAKING[key]
        making.set()
        _USERNS_FDS[key] = made
        try:
            return use(made)
        finally:
            while len(_USERNS_FDS) > _USERNS_FDS_KEPT:  # (the oldest: never the one just used)
                os.close(_USERNS_FDS.popitem(last=False)[1])


def kept(idmap: IdMap) -> bool:
    """Whether the user namespace fd of ``idmap`` is kept already (``prepare`` has nothing to
    make): a caller can then spare itself the thread it would prepare it in."""
    with _USERNS_LOCK:
        return (0, idmap.base, idmap.count) in _USERNS_FDS


def prepare(idmap: IdMap) -> None:
    """Make the user namespace fd that ``idmapped_clone`` takes for ``idmap``, unless it is kept
    (or being made: then wait for it). Called with no lock held, it spares a caller that clones
    under a lock of its own the spawn; called beside other work (``RootFilesystems.mount``
    makes it while the layers mount), the spawn costs that work no time."""
    _with_userns_fd(0, idmap.base, idmap.count, lambda fd: None)


def idmapped_clone(source: Path, idmap: IdMap) -> int:
    """An fd of a detached idmapped clone of the mount (or directory) ``source``, its ids
    0.. read as ``idmap``'s host ids. Not in any mount table; it goes when the fd is closed
    (and whatever was mounted over it lets go)."""
    return _with_userns_fd(0, idmap.base, idmap.count, lambda fd: _clone(source, fd))


def _clone(source: Path, userns_fd: int) -> int:
    fd = _check(_libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, str(source).encode(),
                              _OPEN_TREE_CLONE | os.O_CLOEXEC), f"open_tree {source}")
    try:
        attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
        _check(_libc.syscall(_SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, ctypes.byref(attr),
                             ctypes.sizeof(attr)), f"idmap {source}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kernel_version() -> tuple[int, int]:
    release = os.uname().release
    try:
        major, minor = release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


@functools.cache
def detached_layers() -> bool:
    """Whether overlayfs takes a detached mount (a clone held only by an fd) as a lower layer:
    from Linux 6.15 ("fs: allow detached mounts in clone_private_mount()"). Before that the
    overlay refuses it (EINVAL), and each clone is attached to a directory first
    (``attach_clone``). ``DSEC_IDMAP_CLONES=attached`` takes the older kernels' path anywhere."""
    setting = settings.current().idmap_clones
    if setting in ("attached", "detached"):
        return setting == "detached"
    return _kernel_version() >= (6, 15)


def attach_clone(fd: int, target: Path) -> None:
    """Attach the detached mount ``fd`` on the directory ``target`` (made here)."""
    target.mkdir(parents=True, exist_ok=True)
    _check(_libc.syscall(_SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, str(target).encode(), _MOVE_MOUNT_F_EMPTY_PATH),
           f"move_mount {target}")


def idmapped_bind(source: Path, target: Path, userns_fd: int) -> None:
    """Mount an idmapped clone of the mount (or directory) ``source`` on ``target``."""
    fd = _clone(source, userns_fd)
    try:
        _check(_libc.syscall(_SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, str(target).encode(),
                             _MOVE_MOUNT_F_EMPTY_PATH), f"move_mount {target}")
    finally:
        os.close(fd)


class IdRanges:
    """Hands out one ``IdMap`` per live sandbox: range ``i`` starts at ``base + i * count``."""

    def __init__(self, base: int = SANDBOX_ID_BASE, count: int = SANDBOX_ID_COUNT, ranges: int = 16384) -> None:
        self.base, self.count, self.ranges = base, count, ranges
        self._used: dict[str, int] = {}

    def take(self, cid: str) -> IdMap:
        if cid in self._used:
            return self.of(cid)
        taken = set(self._used.values())
        index = next((i for i in range(self.ranges) if i not in taken), None)
        if index is None:
            raise OSError(f"all {self.ranges} sandbox id ranges are in use")
        self._used[cid] = index
        return self.of(cid)

    def first(self, n: int) -> list[IdMap]:
        """The maps of the first ``n`` ranges: those a node hands out first (``take`` gives the
        lowest free one)."""
        return [IdMap(self.base + i * self.count, self.count) for i in range(min(n, self.ranges))]

    def of(self, cid: str) -> IdMap | None:
        index = self._used.get(cid)
        return None if index is None else IdMap(self.base + index * self.count, self.count)

    def adopt(self, cid: str, pid: int) -> IdMap | None:
        """Take back the range of a running sandbox (after an edge restart) from its uid_map."""
        try:
            with open(f"/proc/{pid}/uid_map") as f:
                inside, outside, count = (int(x) for x in f.read().split()[:3])
        except (OSError, ValueError):
            return None
        return self.adopt_mapped(cid, inside, outside)

    def adopt_mapped(self, cid: str, inside: int, outside: int) -> IdMap | None:
        """Take back the range of a sandbox whose uid ``inside`` is the host's ``outside`` (a
        halted one's, from its config: it has no process to read a uid_map of)."""
        if inside != 0 or outside < self.base or (outside - self.base) % self.count:
            return None
        self._used[cid] = (outside - self.base) // self.count
        return self.of(cid)

    def release(self, cid: str) -> None:
        self._used.pop(cid, None)

    def owner(self, host_uid: int) -> str | None:
        """The sandbox whose range holds ``host_uid``."""
        index = (host_uid - self.base) // self.count
        return next((cid for cid, i in self._used.items() if i == index), None) if host_uid >= self.base else None


def mount_shifted_overlay(idmap: IdMap, lower_fds: list[int], upper: Path, work: Path, target: Path,
                          flags: int) -> None:
    """Mount an overlay on ``target`` over the idmapped clones ``lower_fds`` (top first, from
    ``idmapped_clone``: they read as owned by the sandbox's ids); ``upper`` and ``work`` are made
    the sandbox root's. The overlay keeps its own references to the clones."""
    for d in (upper, work):
        os.chown(d, idmap.base, idmap.base)
    lowers = ":".join(f"/proc/self/fd/{fd}" for fd in lower_fds)
    _sys.mount("overlay", str(target), "overlay", flags, f"lowerdir={lowers},upperdir={upper},workdir={work}")


@contextlib.contextmanager
def shifted_view(idmap: IdMap, directory: Path, view: Path, copy_dir: Path | None = None) -> Iterator[Path]:
    """``directory`` (host ids base..) mounted on ``view`` with the ids shifted back to 0...

    tmpfs (a sandbox's writable layer) can be idmapped only from Linux 6.3. Before that the
    mount fails (EINVAL), and the view is a copy instead, made under ``copy_dir`` (default: beside
    ``view``; give one on a disk, not on the sandbox's own capped tmpfs), its ids shifted back
    one entry at a time, and removed after."""
    view.mkdir(parents=True, exist_ok=True)
    while os.path.ismount(view):  # the view of a pack that a crash cut short
        _sys.umount(str(view), _sys.MNT_DETACH)
    try:
        _with_userns_fd(idmap.base, 0, idmap.count, lambda nsfd: idmapped_bind(directory, view, nsfd))
    except OSError:
        with contextlib.suppress(OSError):
            view.rmdir()
        with _shifted_copy(idmap, directory, copy_dir or view.parent) as copy:
            yield copy
        return
    try:
        yield view
    finally:
        _sys.umount(str(view), _sys.MNT_DETACH)
        with contextlib.suppress(OSError):
            view.rmdir()


@contextlib.contextmanager
def _shifted_copy(idmap: IdMap, directory: Path, copy_dir: Path) -> Iterator[Path]:
    copy_dir.mkdir(parents=True, exist_ok=True)
    copy = copy_dir / f".shifted-{os.getpid()}-{time.monotonic_ns()}"
    try:
        # cp -a keeps what the layer needs: whiteouts (0/0 character devices), the overlay's
        # xattrs (opaque directories), hard links, modes and times.
        proc = subprocess.run(["cp", "-a", "--", str(directory), str(copy)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise OSError(f"cannot copy {directory} for packing: {proc.stderr.strip()[-300:]}")
        for path in [copy, *copy.rglob("*")]:
            st = path.lstat()
            uid, gid = (i - idmap.base if idmap.base <= i < idmap.base + idmap.count else i for i in (st.st_uid, st.st_gid))
            if (uid, gid) != (st.st_uid, st.st_gid):
                os.lchown(path, uid, gid)
                if not path.is_symlink() and st.st_mode & 0o6000:  # chown clears set-id bits
                    os.chmod(path, st.st_mode & 0o7777)
        yield copy
    finally:
        shutil.rmtree(copy, ignore_errors=True)

