"""Whether a container could fork its memory here: CRIU checkpoints a process tree and
restores copies of it, and ``criu check`` says whether this kernel lets it (Debian's CRIU 3.17
fails on recent kernels: vDSO). DSec's container forks carry the filesystem; this says, for the
node's report, why they carry no memory. Asked once per process (a ``criu check`` takes a while)."""

from __future__ import annotations

import functools
import shutil
import subprocess

CHECK_TIMEOUT_S = 20.0


@functools.cache
def memory_fork_status() -> str:
    """``"unsupported: <why>"``: CRIU missing, ``criu check`` failing (its last line), or
    passing while DSec restores no container from a checkpoint yet."""
    criu = shutil.which("criu")
    if criu is None:
        return "unsupported: criu is not installed"
    try:
        done = subprocess.run([criu, "check"], capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unsupported: criu check did not run: {exc}"
    said = (done.stderr or done.stdout).strip().splitlines()
    if done.returncode != 0:
        return "unsupported: criu check failed: " + (said[-1] if said else f"exit {done.returncode}")
    return "unsupported: criu check passes, but DSec restores no container from a checkpoint yet"
