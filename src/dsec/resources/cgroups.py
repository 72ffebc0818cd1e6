"""cgroups on v1 (this machine), hybrid, and pure v2 (most hosts).

A sandbox's cgroup is ``/<parent>/<cid>`` (one parent per node state dir, ``dsec`` for the
default one). This module makes it with its limits, moves the sandbox's init into it, changes
the limits of a live sandbox by writing the cgroup files directly (no process spawn), freezes
and thaws it, and finds leftovers. It also fixes up a hybrid host so that crun can run there at
all (the benchmarks' bare crun and podman manage their own cgroups).

crun is told not to manage cgroups (``--cgroup-manager=disabled``). On v1 it would make the
container's cgroup in every hierarchy the host mounts (ten here, with the named and the unified
ones) and move the container into each; DSec uses four (``SANDBOX_CONTROLLERS``; FnCall's
workers add ``cpuacct``).
That was a large share of crun's CPU per container on a v1 host.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shlex
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .. import _sys

CGROUP_ROOT = Path("/sys/fs/cgroup")
DEFAULT_PARENT = "dsec"
CPU_PERIOD_US = 100_000
# What a sandbox's cgroup is for on v1: its limits (memory, cpu, pids) and pause (freezer).
# Devices are not among them: no sandbox holds CAP_MKNOD (and in a
# user namespace the kernel refuses device nodes anyway), so its /dev has only what crun puts there.
SANDBOX_CONTROLLERS = ("memory", "cpu", "pids", "freezer")
# The v2 controllers a sandbox's parent hands down to it.
_V2_CONTROLLERS = ("memory", "cpu", "pids")


def parent_for(state_dir: Path) -> str:
    """The parent cgroup of one state dir's sandboxes: ``dsec`` for the default state dir,
    ``dsec-<hash>`` for others, so servers (and tests) never share a subtree."""
    resolved = str(Path(state_dir).resolve())
    if resolved == "/var/lib/dsec":
        return DEFAULT_PARENT
    return f"{DEFAULT_PARENT}-{hashlib.sha1(resolved.encode()).hexdigest()[:10]}"


@dataclass(frozen=True)
class Limits:
    """``cpu_cores`` is a weight (cpu.shares / cpu.weight): the sandbox's share of a busy node.
    ``cpu_cap`` is an optional hard cap (CFS quota). A best-effort sandbox gets the smallest
    weight and an idle-class cgroup (``cpu.idle``), and its processes run under SCHED_IDLE."""

    memory_mb: int
    cpu_cores: float
    pids: int
    cpu_cap: float | None = None
    best_effort: bool = False

    @property
    def memory_bytes(self) -> int:
        return self.memory_mb << 20

    @property
    def cpu_quota_us(self) -> int:
        """CFS quota per period; -1 without a cap."""
        if self.cpu_cap is None:
            return -1
        return max(1000, int(self.cpu_cap * CPU_PERIOD_US))

    @property
    def cpu_shares(self) -> int:
        return 2 if self.best_effort else max(2, min(262_144, int(self.cpu_cores * 1024)))

    @property
    def cpu_weight(self) -> int:
        return 1 if self.best_effort else max(1, min(10_000, int(self.cpu_cores * 100)))


@functools.cache
def is_v2() -> bool:
    """Pure cgroup v2: /sys/fs/cgroup itself is the unified hierarchy."""
    return (CGROUP_ROOT / "cgroup.controllers").exists()


def version() -> str:
    if is_v2():
        return "v2"
    return "hybrid" if (CGROUP_ROOT / "unified").is_dir() else "v1"


def fix_hybrid_hugetlb() -> bool:
    """crun refuses to run when a controller (hugetlb, here) sits alone on the v2 tree of a
    hybrid host ("cgroups in hybrid mode not supported"). Mounting it on a v1 hierarchy moves
    it there. Returns True when a mount was made."""
    unified = CGROUP_ROOT / "unified" / "cgroup.controllers"
    if is_v2() or not unified.exists():
        return False
    if "hugetlb" not in unified.read_text().split():
        return False
    target = CGROUP_ROOT / "hugetlb"
    target.mkdir(exist_ok=True)
    from .._sys import mount

    mount("cgroup", str(target), "cgroup", 0, "hugetlb")
    _hierarchies.cache_clear()
    return True


def _v1_dir(controller: str, parent: str, cid: str) -> Path:
    return CGROUP_ROOT / controller / parent / cid


def _write(path: str | Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def apply_limits(parent: str, cid: str, limits: Limits) -> None:
    """Set memory, CPU and pids limits of a running sandbox's cgroup."""
    for path, value in _limit_writes(parent, cid, limits, fresh=False):
        _write(path, value)


def _limit_writes(parent: str, cid: str, limits: Limits, fresh: bool) -> list[tuple[str, str]]:
    """The cgroup files to write for ``limits``, in order. On a ``fresh`` cgroup only what
    differs from its defaults (no quota, a 100 ms period, not idle-class, memory+swap
    unlimited). ``cpu.idle`` (kernel 5.15+): the kernel refuses a weight while a group is idle, so
    the flag is cleared first and set last."""
    writes = memory_writes(parent, cid, limits.memory_bytes, fresh)
    if is_v2():
        d = cpu = pids = f"{CGROUP_ROOT}/{parent}/{cid}"
        if limits.cpu_cap is not None or not fresh:
            quota = "max" if limits.cpu_cap is None else str(limits.cpu_quota_us)
            writes.append((f"{d}/cpu.max", f"{quota} {CPU_PERIOD_US}"))
        weight = ("cpu.weight", limits.cpu_weight)
    else:
        cpu, pids = (f"{CGROUP_ROOT}/{c}/{parent}/{cid}" for c in ("cpu", "pids"))
        if not fresh:
            writes.append((f"{cpu}/cpu.cfs_period_us", str(CPU_PERIOD_US)))
        if limits.cpu_cap is not None or not fresh:
            writes.append((f"{cpu}/cpu.cfs_quota_us", str(limits.cpu_quota_us)))
        weight = ("cpu.shares", limits.cpu_shares)
    has_idle = _has(cpu, "cpu.idle")
    if has_idle and not fresh:
        writes.append((f"{cpu}/cpu.idle", "0"))
    writes.append((f"{cpu}/{weight[0]}", str(weight[1])))
    if has_idle and limits.best_effort:
        writes.append((f"{cpu}/cpu.idle", "1"))
    writes.append((f"{pids}/pids.max", str(limits.pids)))
    return writes


def memory_writes(parent: str, cid: str, memory_bytes: int, fresh: bool) -> list[tuple[str, str]]:
    """The cgroup files that set a memory limit with no swap beyond it, in order. On v1 memory
    ≤ memory+swap at every step, so raising a ``fresh=False`` cgroup's limit writes memsw first."""
    if is_v2():
        d = f"{CGROUP_ROOT}/{parent}/{cid}"
        writes = [(f"{d}/memory.max", str(memory_bytes))]
        if _has(d, "memory.swap.max"):
            writes.append((f"{d}/memory.swap.max", "0"))
        return writes
    mem = f"{CGROUP_ROOT}/memory/{parent}/{cid}"
    writes = [(f"{mem}/memory.limit_in_bytes", str(memory_bytes))]
    if _has(mem, "memory.memsw.limit_in_bytes"):
        memsw = f"{mem}/memory.memsw.limit_in_bytes"
        writes.append((memsw, str(memory_bytes)))
        if not fresh and int(Path(memsw).read_text()) < memory_bytes:
            writes.reverse()
    return writes


def lift_swap(parent: str, cid: str, lifted: bool) -> bool:
    """On v2, let a (paused) sandbox's memory go to swap, up to its memory limit, or (``lifted``
    False) stop it again. A sandbox runs with ``memory.swap.max`` 0 there: v2 counts swap apart
    from memory, so 0 is what holds it to its limit (v1's memory+swap limit equal to the memory
    limit does the same and still lets a push-out swap, so v1 needs nothing). Pages already in
    swap stay there after a resume; only new ones are kept from it. Returns whether a file was
    written (False on v1, or with no swap accounting).

    Where zswap is on, a paused sandbox's pages also skip its pool (``memory.zswap.max`` 0):
    the pool is RAM, and a pause is there to give RAM back, so they go straight to the swap
    device; a resumed sandbox may use the pool again (its cold pages, pushed out while it runs,
    are what the pool is for). v1 has no such file: there zswap keeps what it compresses of a
    paused sandbox in RAM (docs/OPERATIONS.md, swap)."""
    if not is_v2():
        return False
    d = f"{CGROUP_ROOT}/{parent}/{cid}"
    if not _has(d, "memory.swap.max"):
        return False
    value = "0"
    if lifted:
        with open(f"{d}/memory.max") as f:
            value = f.read().strip()
    _write(f"{d}/memory.swap.max", value)
    if _has(d, "memory.zswap.max"):
        _write(f"{d}/memory.zswap.max", "0" if lifted else "max")
    return True


def read_key(path: str, key: bytes) -> int | None:
    """The value of ``key`` in a flat-keyed cgroup file (None if it cannot be read). Read after
    every command: plain system calls, not a text file object."""
    try:
        data = _sys.read_small(path, 1 << 14)
    except OSError:
        return None
    for line in data.split(b"\n"):
        name, _, value = line.partition(b" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def oom_kills(parent: str, cid: str) -> int | None:
    """How many processes the kernel's OOM killer took in the sandbox's cgroup."""
    if is_v2():
        return read_key(f"{CGROUP_ROOT}/{parent}/{cid}/memory.events", b"oom_kill")
    return read_key(f"{CGROUP_ROOT}/memory/{parent}/{cid}/memory.oom_control", b"oom_kill")


def cpu_idle(parent: str, cid: str) -> bool | None:
    """Whether the sandbox's cgroup is idle-class (best effort); None if the kernel cannot say."""
    d = (CGROUP_ROOT / parent / cid) if is_v2() else _v1_dir("cpu", parent, cid)
    try:
        return (d / "cpu.idle").read_text().strip() == "1"
    except OSError:
        return None


def make_memory_cgroup(parent: str, cid: str) -> Path:
    """A cgroup with the memory controller for a process the backend starts itself (a VM's
    QEMU; crun makes a container's); returns its ``cgroup.procs``. No limit is set: a VM's
    memory is fixed by its machine, and the cgroup is there to account for it and reclaim it."""
    d = CGROUP_ROOT / parent / cid if is_v2() else _v1_dir("memory", parent, cid)
    for _ in range(10):
        d.parent.mkdir(exist_ok=True)
        if is_v2():
            for level in (CGROUP_ROOT, d.parent):
                if "memory" not in (level / "cgroup.subtree_control").read_text().split():
                    _write(level / "cgroup.subtree_control", "+memory")
        try:
            d.mkdir(exist_ok=True)
            break
        except FileNotFoundError:
            continue  # the empty parent was just removed (``remove_parent``): make it again
    return d / "cgroup.procs"


def memory_usage_bytes(parent: str, cid: str) -> int | None:
    path = (CGROUP_ROOT / parent / cid / "memory.current") if is_v2() else (_v1_dir("memory", parent, cid) / "memory.usage_in_bytes")
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


@functools.cache
def sandbox_hierarchies(controllers: tuple[str, ...] = SANDBOX_CONTROLLERS) -> tuple[Path, ...]:
    """Where a sandbox's cgroup is made: the v2 root, or the v1 hierarchies of
    ``controllers``, each once (``cpu`` and ``cpuacct`` often share one)."""
    if is_v2():
        return (CGROUP_ROOT,)
    found: dict[Path, Path] = {}
    for controller in controllers:
        path = CGROUP_ROOT / controller
        if path.is_dir():
            found.setdefault(path.resolve(), path)
    return tuple(found.values())


# Held while sandbox cgroups are made and while their parent is removed: creates run in threads,
# and on v2 a parent just made hands its controllers down (``cgroup.subtree_control``) only after
# its mkdir, so a sandbox cgroup made by another thread in between would have none of them (no
# ``memory.max``, and ``_has`` would remember ``cpu.idle`` as missing).
_MAKING = threading.Lock()


def _make_parent(parent: str, controllers: tuple[str, ...]) -> None:
    """The parent cgroups, and on v2 the controllers handed down through them."""
    for h in sandbox_hierarchies(controllers):
        (h / parent).mkdir(exist_ok=True)
    if is_v2():
        for level in (CGROUP_ROOT, CGROUP_ROOT / parent):
            enabled = (level / "cgroup.subtree_control").read_text().split()
            available = (level / "cgroup.controllers").read_text().split()
            missing = [c for c in _V2_CONTROLLERS if c in available and c not in enabled]
            if missing:
                _write(level / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))


def make_sandbox_cgroup(parent: str, cid: str, limits: Limits | None,
                        controllers: tuple[str, ...] = SANDBOX_CONTROLLERS) -> None:
    """Make a sandbox's cgroup with its limits (none without ``limits``); nothing is left
    behind when it fails. Only the limits that differ from a fresh cgroup's are written (four
    writes on v1 for most): little kernel work, and no wait (no RCU grace period). Safe to call
    from several threads at once."""
    made = []
    try:
        with _MAKING:
            for h in sandbox_hierarchies(controllers):
                d = f"{h}/{parent}/{cid}"
                try:
                    os.mkdir(d)
                except FileNotFoundError:  # first sandbox, or the empty parent was just removed
                    _make_parent(parent, controllers)
                    os.mkdir(d)
                made.append(d)
        for path, value in () if limits is None else _limit_writes(parent, cid, limits, fresh=True):
            _write(path, value)
    except BaseException:
        for d in made:
            with contextlib.suppress(OSError):
                os.rmdir(d)
        raise


_HAS: dict[str, bool] = {}


def _has(d: str, name: str) -> bool:
    """Whether cgroup file ``name`` exists; asked of one sandbox's cgroup, true of all (the
    kernel's configuration decides it: swap accounting, v2's swap files)."""
    known = _HAS.get(name)
    if known is None:
        known = _HAS[name] = os.path.exists(f"{d}/{name}")
    return known


def enter(parent: str, cid: str, pid: int, controllers: tuple[str, ...] = SANDBOX_CONTROLLERS) -> None:
    """Move process ``pid`` (a sandbox's init, before it starts anything) into the sandbox's
    cgroup: what it forks from then on is born there."""
    for h in sandbox_hierarchies(controllers):
        _write(f"{h}/{parent}/{cid}/cgroup.procs", str(pid))


def join_argv(parent: str, cid: str, argv: list[str],
              controllers: tuple[str, ...] = SANDBOX_CONTROLLERS, oom_score_adj: int | None = None) -> list[str]:
    """``argv`` run by a shell that first moves itself into the sandbox's cgroup, so that the
    command is born there (``crun exec`` does not join a cgroup crun did not make), with
    ``oom_score_adj`` if given (inherited: ``crun exec`` does not set one)."""
    steps = [f"echo 0 > {shlex.quote(str(h / parent / cid / 'cgroup.procs'))}" for h in sandbox_hierarchies(controllers)]
    if oom_score_adj is not None:
        steps.append(f"echo {int(oom_score_adj)} > /proc/self/oom_score_adj")
    return ["/bin/sh", "-c", f"{' && '.join(steps)} && exec \"$@\"", "dsec-join", *argv]


def freeze(parent: str, cid: str, timeout: float = 10.0) -> bool:
    """Freeze every process of a sandbox; True once they all are, False if it was frozen
    already. Blocks until then: call it from a thread. Raises OSError if the cgroup is gone and
    TimeoutError if a task would not freeze in time (it is thawed again)."""
    if is_v2():
        d = CGROUP_ROOT / parent / cid
        if (d / "cgroup.freeze").read_text().strip() == "1":
            return False
        _write(d / "cgroup.freeze", "1")
        done = lambda: "frozen 1" in (d / "cgroup.events").read_text().splitlines()  # noqa: E731
    else:
        state = CGROUP_ROOT / "freezer" / parent / cid / "freezer.state"
        if state.read_text().strip() == "FROZEN":
            return False
        _write(state, "FROZEN")
        done = lambda: state.read_text().strip() == "FROZEN"  # noqa: E731
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while not done():
        if time.monotonic() > deadline:
            thaw(parent, cid)
            raise TimeoutError(f"the processes of {cid} did not freeze within {timeout:g}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return True


def thaw(parent: str, cid: str) -> None:
    """Thaw a frozen sandbox's cgroup (no-op when it is not frozen or gone)."""
    if is_v2():
        path = CGROUP_ROOT / parent / cid / "cgroup.freeze"
        value = "0"
    else:
        path = CGROUP_ROOT / "freezer" / parent / cid / "freezer.state"
        value = "THAWED"
    try:
        if _sys.read_small(str(path)).strip() in (b"0", b"THAWED"):
            return
        _write(path, value)
    except OSError:
        pass


def kill_all(parent: str, cid: str, timeout: float = 5.0) -> int:
    """SIGKILL every process left in a sandbox's cgroup and wait until none but zombies (which
    their parent reaps) is; returns how many were killed. For remains whose runtime state is
    lost (crun's state dir or the bundle gone after a crash), where ``crun kill`` finds nothing
    to kill. Thaw a frozen one first. Blocks: call it from a thread."""
    d = CGROUP_ROOT / parent / cid if is_v2() else _v1_dir("memory", parent, cid)
    killed = 0
    deadline = time.monotonic() + timeout
    while True:
        try:
            pids = [int(p) for p in (d / "cgroup.procs").read_text().split() if not _zombie(int(p))]
        except FileNotFoundError:
            return killed
        if not pids:
            return killed
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pids)} process(es) of {cid} outlived SIGKILL for {timeout:g}s")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.01)


def _zombie(pid: int) -> bool:
    try:
        return _sys.proc_stat(pid)[0] == "Z"
    except (OSError, IndexError):
        return True  # gone


def frozen(parent: str, cid: str) -> bool:
    if is_v2():
        path = CGROUP_ROOT / parent / cid / "cgroup.freeze"
        return path.exists() and path.read_text().strip() == "1"
    path = CGROUP_ROOT / "freezer" / parent / cid / "freezer.state"
    return path.exists() and path.read_text().strip() != "THAWED"


@functools.cache
def _hierarchies() -> tuple[Path, ...]:
    """The mounted cgroup hierarchies (v1 controllers, named and unified ones), or the v2 root.
    Read once: the set only changes at set-up, which clears it (fix_hybrid_hugetlb)."""
    if is_v2():
        return (CGROUP_ROOT,)
    return tuple(sorted(p for p in CGROUP_ROOT.iterdir() if p.is_dir() and not p.is_symlink()))


def _parent_dirs(parent: str) -> list[Path]:
    return [h / parent for h in _hierarchies() if (h / parent).is_dir()]


def sandbox_cgroup_dirs(parent: str) -> list[Path]:
    """Every per-sandbox cgroup directory under ``parent``, on any hierarchy."""
    return [d for p in _parent_dirs(parent) if p.is_dir() for d in p.iterdir() if d.is_dir()]


def remove_cgroup(parent: str, cid: str, controllers: tuple[str, ...] | None = None) -> None:
    """Remove a sandbox's (empty) cgroups; tolerates ones already gone. Every hierarchy is
    tried, unless ``controllers`` names the only ones the sandbox was given (one this process
    made, ``make_sandbox_cgroup``): a sandbox made by an older DSec (crun's cgroups) may have
    one in each, and on a v1 host each of the others is a failed lookup (7 of 11 here)."""
    for h in _hierarchies() if controllers is None else sandbox_hierarchies(controllers):
        try:
            os.rmdir(f"{h}/{parent}/{cid}")
        except FileNotFoundError:
            pass


def remove_parent(parent: str) -> None:
    """Remove the parent cgroups once no sandbox cgroup is left under them."""
    with _MAKING:
        for d in _parent_dirs(parent):
            try:
                d.rmdir()
            except OSError:
                pass
