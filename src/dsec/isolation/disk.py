"""The disk limit of a container sandbox's writable layer.

Each sandbox's bundle directory (``config.json``, the overlay ``upper`` and ``work``) is a tmpfs
of its own, so a sandbox that fills its disk gets ENOSPC at its own cap and never fills the
node's shared tmpfs or disk. Its pages are also charged to the sandbox's memory cgroup (the
writer pays): past the memory limit a write would end in the OOM killer, not ENOSPC. So the cap
is half the memory limit (``cap_for``), leaving the rest to processes: a pre-created sandbox
starts at ``INITIAL_BYTES`` and ``resize_bundle`` sets the cap when the sandbox gets its limits.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import _sys

INITIAL_BYTES = 64 << 20
_MS_REMOUNT = 0x20


def cap_for(memory_bytes: int) -> int:
    """The disk cap of a sandbox with this memory limit."""
    return max(INITIAL_BYTES // 4, memory_bytes // 2)


def mount_bundle(bundle: Path, size_bytes: int = INITIAL_BYTES) -> None:
    bundle.mkdir(parents=True, exist_ok=True)
    if not os.path.ismount(bundle):
        _sys.mount("dsec-disk", str(bundle), "tmpfs", _sys.MS_NODEV | _sys.MS_NOSUID,
                   f"size={size_bytes},mode=0711")


def resize_bundle(bundle: Path, size_bytes: int) -> None:
    if os.path.ismount(bundle):
        _sys.mount("dsec-disk", str(bundle), "tmpfs", _MS_REMOUNT | _sys.MS_NODEV | _sys.MS_NOSUID,
                   f"size={size_bytes}")


def unmount_bundle(bundle: Path) -> None:
    # Until nothing is mounted there (EINVAL) or it is gone (ENOENT); a few tmpfs deep at most.
    for _ in range(8):
        try:
            _sys.umount(str(bundle), _sys.MNT_DETACH)
        except OSError:
            break
