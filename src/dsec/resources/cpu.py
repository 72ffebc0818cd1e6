"""CPU scheduling features of this host: SCHED_IDLE for best-effort sandboxes, and core
scheduling (``prctl(PR_SCHED_CORE)``) for latency-sensitive ones, where the kernel has it."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
from pathlib import Path

PR_SCHED_CORE = 62
PR_SCHED_CORE_GET = 0
PIDTYPE_PID = 0

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


@functools.cache
def core_scheduling() -> str:
    """``"supported"``, or ``"unsupported: <why>"``. Asks the kernel for this process's core
    scheduling cookie: a kernel without CONFIG_SCHED_CORE does not know the prctl (EINVAL)."""
    cookie = ctypes.c_ulong(0)
    rc = _libc.prctl(PR_SCHED_CORE, PR_SCHED_CORE_GET, 0, PIDTYPE_PID, ctypes.byref(cookie))
    if rc != 0:
        err = ctypes.get_errno()
        if err == errno.EINVAL:
            return "unsupported: kernel built without CONFIG_SCHED_CORE (prctl PR_SCHED_CORE: EINVAL)"
        if err == errno.ENODEV:
            return "unsupported: no SMT on this machine (prctl PR_SCHED_CORE: ENODEV)"
        return f"unsupported: prctl PR_SCHED_CORE failed: {os.strerror(err)}"
    smt = Path("/sys/devices/system/cpu/smt/active")
    if smt.exists() and smt.read_text().strip() == "0":
        return "supported (SMT is off here, so it isolates nothing)"
    return "supported"


@functools.cache
def sched_idle() -> bool:
    """SCHED_IDLE is available (it is on every Linux since 2.6.23; the check is for the API)."""
    return hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_setscheduler")


def set_idle(pid: int, idle: bool) -> None:
    """Put ``pid`` under SCHED_IDLE (best effort) or back under SCHED_OTHER. Children it forks
    afterwards inherit the policy."""
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    os.sched_setscheduler(pid, policy, os.sched_param(0))


def policy_of(pid: int) -> str:
    policy = os.sched_getscheduler(pid)
    return {os.SCHED_OTHER: "other", os.SCHED_IDLE: "idle", os.SCHED_BATCH: "batch",
            os.SCHED_FIFO: "fifo", os.SCHED_RR: "rr"}.get(policy, str(policy))
