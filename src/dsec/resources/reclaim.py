"""Pushing a sandbox's memory out of RAM: all of it when it is paused, some of it when it idles.

Anonymous and tmpfs pages go to swap (zram here: compressed, still in RAM but smaller; see
scripts/setup-host.sh), clean file pages are dropped. With no swap only the file pages go.

- cgroup v2: ``memory.reclaim`` asks the kernel to reclaim so many bytes from the cgroup, cold
  pages first (its LRU order).
- cgroup v1 has no such file. ``memory.force_empty`` reclaims everything it can (used on a
  frozen sandbox: nothing in it runs to touch the pages again), and lowering
  ``memory.limit_in_bytes`` for a moment makes the kernel reclaim down to the new limit, coldest
  pages first (used on a running one, by the cold-memory reclaimer); the limit is restored at once.

Freezing and thawing are in ``cgroups`` (``freeze``, ``thaw``, ``frozen``).
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

from . import cgroups

_PUSH_ROUNDS = 20
# Below this a frozen sandbox's memory is its kernel objects: nothing more to push.
_PUSH_DONE_BYTES = 1 << 20


def _memory_dir(parent: str, cid: str) -> Path:
    return cgroups.CGROUP_ROOT / parent / cid if cgroups.is_v2() else cgroups.CGROUP_ROOT / "memory" / parent / cid


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def swap_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("SwapTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def usage(parent: str, cid: str) -> int | None:
    return cgroups.memory_usage_bytes(parent, cid)


def _flush_stats(d: Path) -> None:
    """Reading memory.stat flushes the cgroup's LRU statistics. Reclaim decides from them
    whether to move active pages to the inactive list (only inactive ones are reclaimed); with
    stale figures (pages written a moment ago) it sees nothing to deactivate and gives up."""
    try:
        (d / "memory.stat").read_bytes()
    except OSError:
        pass


def push_out(parent: str, cid: str) -> int | None:
    """Reclaim all the memory the kernel can take from a (frozen) sandbox's cgroup. Returns the
    usage afterwards."""
    d = _memory_dir(parent, cid)
    _flush_stats(d)
    if cgroups.is_v2():
        for _ in range(4):
            current = _read_int(d / "memory.current")
            if not current:
                break
            try:
                cgroups._write(d / "memory.reclaim", str(current))
            except OSError as exc:
                if exc.errno != errno.EAGAIN:  # EAGAIN: reclaimed less than asked; look again
                    raise
    else:
        # force_empty gives up after a few rounds without progress, which happens now and then
        # while pages are still on their way to swap: try again while it gets somewhere.
        stalled = 0
        for _ in range(_PUSH_ROUNDS):
            before = usage(parent, cid) or 0
            if before <= _PUSH_DONE_BYTES:
                break
            cgroups._write(d / "memory.force_empty", "0")
            if (usage(parent, cid) or 0) >= before - _PUSH_DONE_BYTES:
                stalled += 1
                if stalled == 3:
                    break
                time.sleep(0.005)
                _flush_stats(d)
    return usage(parent, cid)


def reclaim(parent: str, cid: str, nbytes: int) -> int:
    """Reclaim about ``nbytes`` from a running sandbox, coldest pages first. Returns the bytes
    its usage went down by (0 when the kernel could not take any)."""
    d = _memory_dir(parent, cid)
    before = usage(parent, cid) or 0
    if nbytes <= 0 or before <= 0:
        return 0
    _flush_stats(d)
    if cgroups.is_v2():
        try:
            cgroups._write(d / "memory.reclaim", str(nbytes))
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                raise
    else:
        limit_file = d / "memory.limit_in_bytes"
        limit = _read_int(limit_file)
        if limit is None:
            return 0
        target = max(1 << 20, before - nbytes)
        try:
            cgroups._write(limit_file, str(target))
        except OSError as exc:
            if exc.errno != errno.EBUSY:  # EBUSY: could not get down to the target; fine
                raise
        finally:
            cgroups._write(limit_file, str(limit))
    return max(0, before - (usage(parent, cid) or 0))


def swapped_bytes(parent: str, cid: str) -> int | None:
    """Bytes of the sandbox's memory in swap (v1 memory.stat ``swap``; v2 ``memory.swap.current``)."""
    d = _memory_dir(parent, cid)
    if cgroups.is_v2():
        return _read_int(d / "memory.swap.current")
    try:
        for line in (d / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "swap":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def zram_stats() -> dict[str, int]:
    """/sys/block/zram*/mm_stat summed: original and compressed bytes, and RAM used."""
    total = {"orig_data_size": 0, "compr_data_size": 0, "mem_used_total": 0}
    for dev in Path("/sys/block").glob("zram*"):
        try:
            fields = (dev / "mm_stat").read_text().split()
        except OSError:
            continue
        for i, key in enumerate(("orig_data_size", "compr_data_size", "mem_used_total")):
            total[key] += int(fields[i])
    return total
