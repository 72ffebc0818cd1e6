"""crun as the container backend runs it: the command line (the node's state root, cgroups left
to DSec) and a run whose output is kept in a file.

Stateless: the backend holds the sealed copy of crun it runs (``procs.sealed_copy``) and its
state root, and passes them in.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..procs import spawn_wait

CRUN = shutil.which("crun") or "/usr/bin/crun"
CHRT = shutil.which("chrt") or "/usr/bin/chrt"


def argv(root: Path, *args: str) -> list[str]:
    """A crun command line on the state root ``root``."""
    # DSec makes the sandbox's cgroup itself (see dsec.resources.cgroups).
    return [CRUN, "--root", str(root), "--cgroup-manager=disabled", *args]


async def run(exe: str, root: Path, *args: str, timeout: float = 30.0, log: Path | None = None,
              stdin: int | None = None) -> tuple[int, str]:
    """Run crun (the executable ``exe``); returns (exit code, output). Output goes to a file,
    ``log`` or an anonymous one: ``run --detach`` hands its stdio to the sandbox's init, which
    keeps it open (its stdin, ``stdin`` here, is the init's channel)."""
    if log is not None:
        out = os.open(log, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    else:
        out = os.memfd_create("crun-output", os.MFD_CLOEXEC)
    try:
        # `run --detach` forks a process that outlives this crun (see procs.OrphanReaper).
        orphans = 1 if args[0] == "run" and "--detach" in args else 0
        rc = await spawn_wait([exe, *argv(root, *args)[1:]], stdin, out, timeout, orphans)
        if rc is None:
            return -1, f"crun {args[0]} timed out after {timeout}s"
        return rc, os.pread(out, 1 << 20, 0).decode(errors="replace").strip()
    finally:
        os.close(out)
