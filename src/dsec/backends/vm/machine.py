"""QEMU processes: the accelerator probe, launching a VM, and making sure one is gone.

A VM's QEMU runs daemonized (``-daemonize``, its own session), so it outlives an edge restart
like a container's init does; its pid, QMP socket, agent socket and console log live in the
VM's directory. ``launch`` returns only once QEMU has set the machine up (the daemonizing parent
exits then), so a bad command line is an error at once, with QEMU's own message.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from libdsec import BackendError

from ... import settings
from .assets import GuestAssets

log = logging.getLogger("dsec.backends.vm")

QEMU = shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64"
SETPRIV = shutil.which("setpriv")  # util-linux: sets a parent-death signal, then execs
PROBE_TIMEOUT_S = 20.0
# TCG's translation cache per VM, in MiB. Once full it is flushed and refilled, so every VM ends
# up holding all of it: 64 MiB was a quarter of an idle 256 MB microVM's host memory. At 32 a
# boot costs about the same CPU and a re-run of a large Python import 25-55% more (retranslation;
# docs/BENCHMARKS.md, MicroVM).
TCG_TB_MB = 32


@functools.cache
def qemu_version() -> str:
    """QEMU's version, asked once per process (it cannot change under a running server)."""
    try:
        out = subprocess.run([QEMU, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.split("\n", 1)[0].removeprefix("QEMU emulator version ").strip()


def tsc_khz() -> int | None:
    """The host's TSC rate: under TCG the guest reads it, and a microvm guest that has to
    calibrate it sometimes hangs (it gets ``tsc_early_khz``)."""
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/tsc_freq_khz").read_text())
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


def probe_accel(assets: GuestAssets, cache_dir: Path) -> str:
    """``kvm`` if a KVM guest really boots our kernel to its init here, else ``tcg``.

    /dev/kvm may exist and still not run a stock kernel (a PVM host), so the probe boots one.
    The answer is kept per host kernel and guest kernel; DSEC_VM_ACCEL=kvm|tcg overrides it."""
    if (forced := settings.current().vm_accel) is not None:
        return forced
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    cache = cache_dir / f"accel-{platform.release()}-{assets.kernel_version}.json"
    try:
        return json.loads(cache.read_text())["accel"]
    except (OSError, ValueError, KeyError):
        pass
    with tempfile.TemporaryDirectory(dir=cache_dir) as work:
        console = Path(work, "console.log")
        # The probe's QEMU dies with the thread that runs it: a server stopped (or killed)
        # during a probe that hangs, as KVM on a PVM host does, would otherwise leave it
        # spinning for good (a test run that started servers in turn left 24 behind).
        die_with_us = [SETPRIV, "--pdeathsig", "KILL"] if SETPRIV else []
        cmd = [*die_with_us, QEMU, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
               "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "128M",
               "-kernel", str(assets.kernel), "-initrd", str(assets.initramfs),
               "-append", "console=ttyS0 quiet panic=-1 dsec.mode=probe", "-serial", f"file:{console}"]
        try:
            subprocess.run(cmd, capture_output=True, timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        booted = console.exists() and "dsec-probe-ok" in console.read_text(errors="replace")
    accel = "kvm" if booted else "tcg"
    cache.write_text(json.dumps({"accel": accel, "probed_at": time.time()}))
    log.info("accelerator probe: %s", "KVM boots a guest" if booted else "KVM did not boot a guest: TCG")
    return accel


def accel_args(accel: str, tcg_tb_mb: int | None = None) -> list[str]:
    """``tcg_tb_mb``: the translation cache of this VM (default ``TCG_TB_MB``); a guest that runs
    a whole userland (a full VM running a test suite) retranslates far less with a few hundred."""
    if accel == "kvm":
        return ["-accel", "kvm", "-cpu", "host"]
    # A bounded translation cache: the default (1 GiB) would be each VM's to fill.
    return ["-accel", f"tcg,tb-size={tcg_tb_mb or TCG_TB_MB}"]


def pid_alive(pid: int) -> bool:
    """True while ``pid`` is a live (not zombie) QEMU."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and "qemu-system" in exe


async def launch(argv: list[str], vm_dir: Path, timeout: float = 30.0, cgroup_procs: Path | None = None) -> int:
    """Start a daemonizing QEMU; returns the daemon's pid. With ``cgroup_procs``, QEMU starts
    in that cgroup (a shell joins it and execs QEMU), so all its memory is charged there."""
    pidfile = vm_dir / "qemu.pid"
    join = ["/bin/sh", "-c", 'echo $$ >"$0" && exec "$@"', str(cgroup_procs)] if cgroup_procs else []
    proc = await asyncio.create_subprocess_exec(
        *join, QEMU, *argv, "-daemonize", "-pidfile", str(pidfile),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise BackendError(f"QEMU did not start within {timeout:g}s") from None
    if proc.returncode != 0:
        raise BackendError(f"QEMU failed to start: {out.decode(errors='replace').strip()[-800:]}")
    try:
        return int(pidfile.read_text())
    except (OSError, ValueError) as exc:
        raise BackendError(f"QEMU started but wrote no pid file: {exc}") from exc


async def kill(pid: int, timeout: float = 10.0) -> None:
    """SIGKILL a QEMU and wait until it is gone (reaping it if we are its subreaper)."""
    if pid <= 0:
        return
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if not pid_alive(pid):
            return
        if time.monotonic() > deadline:
            log.warning("QEMU %d did not exit within %ss of SIGKILL", pid, timeout)
            return
        await asyncio.sleep(0.01)


def rss_bytes(pid: int, field: str = "VmRSS") -> int | None:
    """A process's resident memory from /proc/PID/status: all of it (``VmRSS``), or one part
    (``RssAnon``: its own pages, the ones that can go to swap; ``RssFile``: mapped files)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def pss_bytes(pid: int) -> int | None:
    """Proportional set size: shared pages (layers in the page cache, KSM) split between users."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process has used so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
