"""Boots the Debian 12 host VMs of ``test_debian12_vm.py`` and brings back what their runs left,
one row after another, in a process of its own: ``python hostvm_runner.py CONTROL_DIR``.

The suite starts it at its first test, so the VMs (about 12 minutes of TCG) run while the rest of
the suite does, at a lower CPU priority (``nice`` ``BACKGROUND_NICE``: the VMs take the CPU the
other tests leave idle, and do not slow them); the rows' tests run last and wait for it. Once
one of them waits, it touches ``CONTROL_DIR/foreground`` and the VMs' threads get the normal
priority back (nothing else runs then). ``CONTROL_DIR/rows.json`` names the rows
(``[{"row", "package", "checkout", "env", "results"}]``); each row's outcome is
``CONTROL_DIR/<row>.json`` (``{"results": dir, "kernel_version", "progress": [...]}`` or with
``"error"``: a traceback), written when the row is over. SIGTERM ends the run: the VM is destroyed
first (the runner's own ``finally``), as when a row ends.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

GUEST_MEMORY_MB = 6144
GUEST_CPUS = 2.0
# A whole userland under TCG: the default 32 MiB translation cache retranslates all the time.
TCG_TB_MB = 512
BOOT_TIMEOUT_S = 600.0
# What the guest's steps may take: about 10 minutes on a quiet 2-core machine, twice that loaded.
RUN_TIMEOUT_S = 30 * 60.0
RESULTS = "/var/lib/dsec-hostvm"
# The runner's (and so its QEMUs') nice value while other tests run: a quarter of a CPU's time
# where a test wants it too (10, a tenth, left a loaded machine's guest half-way through the bench
# after 30 minutes).
BACKGROUND_NICE = 5
RESULT_FILES = ("host.txt", "times.txt", "pytest.log", "pytest.rc", "junit.xml", "demo.log", "demo.rc",
                "bench.log", "bench.rc", "bench-lifecycle.json", "bench-serve.log", "done")

DIAGNOSE = ("systemctl is-system-running; systemctl list-jobs --no-pager; "
            "systemctl status --no-pager dsec-hostvm dsec-agent 2>&1 | head -40; "
            "journalctl -b --no-pager 2>&1 | tail -80")


async def _diagnose(backend, handle) -> str:
    """What systemd says in the guest (through the agent: a confined command, enough to read)."""
    from dsec.backends.base import ExecContext
    from libdsec.protocol import ExecRequest

    try:
        r = await backend.exec(handle, ExecRequest(command=DIAGNOSE, timeout=120),
                               ExecContext(uid=0, gid=0, workdir="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}))
    except Exception as exc:  # noqa: BLE001 - the guest's own state is what is reported
        return f"(cannot ask the guest: {exc})"
    return r.stdout + r.stderr


def _stale_vm(vm_dir: Path) -> None:
    """Remove what a killed run left of its VM: its QEMU (by the pid file, checked against the
    process's command line) and its directory."""
    try:
        pid = int((vm_dir / "qemu.pid").read_text())
        if str(vm_dir) in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
            os.kill(pid, signal.SIGKILL)
            while Path(f"/proc/{pid}").exists():
                time.sleep(0.1)
    except (OSError, ValueError):
        pass
    shutil.rmtree(vm_dir, ignore_errors=True)


class Priority:
    """The VM at a low CPU priority until the suite waits for it (``foreground`` touched), then at
    the normal one. Its QEMU runs in a session of its own, so with the scheduler's autogroups
    (``kernel.sched_autogroup_enabled``) its threads' nice values weigh only against each other:
    the session's autogroup gets the nice value (``/proc/PID/autogroup``), and the threads too
    (for a kernel without autogroups); on cgroup v2, where the QEMU's cgroup parent has the cpu
    controller, that parent's ``cpu.weight`` goes from 100 to 25 (about nice 5's share)."""

    def __init__(self, control: Path):
        self.flag = control / "foreground"
        self.raised = False
        self.lowered_pid = None

    def check(self, vm_dir: Path, cgroup_dir: Path) -> bool:
        """True when the VM has just got the normal priority back."""
        if self.raised:
            return False
        try:
            pid = int((vm_dir / "qemu.pid").read_text())
        except (OSError, ValueError):
            return False
        if self.flag.exists():
            self.raised = True
            os.setpriority(os.PRIO_PROCESS, 0, 0)  # this runner's next row, and what it starts
            self._set(pid, cgroup_dir, 0, "100")
            return True
        if self.lowered_pid != pid:
            self.lowered_pid = pid
            self._set(pid, cgroup_dir, BACKGROUND_NICE, "25")
        return False

    @staticmethod
    def _set(pid: int, cgroup_dir: Path, nice: int, weight: str) -> None:
        for path, value in ((Path(f"/proc/{pid}/autogroup"), str(nice)), (cgroup_dir / "cpu.weight", weight)):
            try:
                path.write_text(value)
            except OSError:
                pass  # no autogroups, or no cpu controller there
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                except OSError:
                    pass  # a thread that has just ended
        except OSError:
            pass


async def _boot_and_collect(row: dict, cache: Path, node_dir: Path, assets_dir: Path, store, layers: tuple[str, ...],
                            checkout: bytes, priority: Priority, progress: list[str]) -> dict[str, bytes]:
    from dsec.backends.base import SandboxSpec
    from dsec.backends.vm.fullvm import FullVMBackend
    from dsec.resources.cgroups import Limits
    from guest_root import CHECKOUT_TAR

    # The node's disks (the guest root's, about a GB, and the empty one each VM's own starts
    # as) stay in the cache for the next run; a base disk of other layers is removed.
    backend = FullVMBackend(node_dir, store, assets_dir, boot_timeout_s=BOOT_TIMEOUT_S, tcg_tb_mb=TCG_TB_MB)
    spec = SandboxSpec(image="debian12-host", layers=layers, env={},
                       limits=Limits(memory_mb=GUEST_MEMORY_MB, cpu_cores=GUEST_CPUS, pids=4096))
    got: dict[str, bytes] = {}
    handle = None
    vm_dir = backend.vm_dir("hostvm")
    try:
        t0 = time.monotonic()
        _stale_vm(vm_dir)
        disk = await backend.base_disk(layers)
        for old in backend.disks_dir.glob("*.raw"):
            if old != disk and not old.name.startswith("upper-"):
                old.unlink()
        handle = await backend.create("hostvm", spec)
        progress.append(f"hostvm: booted to the agent in {time.monotonic() - t0:.0f}s")
        t0 = time.monotonic()
        await backend.write_file(handle, CHECKOUT_TAR, checkout, 0o600, 0, 0)
        await backend.write_file(handle, f"{RESULTS}/go", b"", 0o600, 0, 0)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        started = False
        from dsec.resources import cgroups

        cgroup_dir = cgroups.CGROUP_ROOT / backend.cgroup_parent
        bench_go = False
        while time.monotonic() < deadline:
            if priority.check(vm_dir, cgroup_dir):
                # The deadlines are for a guest at the normal priority (a hang, not a starved
                # background VM): they count from now at the latest.
                deadline = max(deadline, time.monotonic() + RUN_TIMEOUT_S)
                t0 = max(t0, time.monotonic())
            if not priority.raised:
                # (in the background the guest's bench waits for the suite: no deadline yet)
                deadline = max(deadline, time.monotonic() + RUN_TIMEOUT_S)
            elif not bench_go:
                # The guest's bench (a measurement, with its own timeouts) runs only now that no
                # test of the suite runs beside the VM.
                await backend.write_file(handle, f"{RESULTS}/bench-go", b"", 0o600, 0, 0)
                bench_go = True
            try:
                await backend.read_file(handle, f"{RESULTS}/done", 16)
                break
            except Exception:  # noqa: BLE001 - not there yet
                await asyncio.sleep(5)
            if not started:
                try:
                    await backend.read_file(handle, f"{RESULTS}/host.txt", 1 << 16)  # a few hundred bytes
                    started = True
                except Exception:  # noqa: BLE001
                    # The runner should have started by now (7 minutes after boot: a loaded host is slow).
                    if time.monotonic() - t0 > 420:
                        got["diagnosis"] = (await _diagnose(backend, handle)).encode()
                        break
        else:
            got["diagnosis"] = (await _diagnose(backend, handle)).encode()
        for name in RESULT_FILES:
            try:
                got[name] = await backend.read_file(handle, f"{RESULTS}/{name}", 8 << 20)
            except Exception:  # noqa: BLE001 - a step that did not run
                pass
        got["console.log"] = (vm_dir / "console.log").read_bytes()[-200_000:]
    finally:
        if handle is not None:
            await backend.destroy(handle)
        await backend.close()
        backend.release_unused()
    return got


def run_row(row: dict, control: Path, priority: Priority) -> dict:
    from dsec.backends.vm.assets import AssetCache
    from dsec.images.store import LayerStore
    from guest_root import base_layer

    package = row["package"]
    test_store = Path(row["test_store"])
    cache = test_store.parent / "hostvm"
    cache.mkdir(parents=True, exist_ok=True)
    progress: list[str] = []
    lock = open(cache / ".lock", "w")  # one run at a time on the cache (a second one waits)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        # Another kernel: assets of its own (a root keeps the kernel it first got) and a node of its
        # own (each keeps the disk of its root); the debootstrap tree and the layer store are shared.
        assets_dir = Path(os.environ["DSEC_VM_ASSETS"] + (f"-{package}" if package else ""))
        node_dir = cache / (f"node-{package}" if package else "node")
        assets = AssetCache(assets_dir, kernel_package=package).ensure()
        t0 = time.monotonic()
        store = LayerStore(cache / "store")
        layers = (base_layer(cache, store, assets.kernel.parent, test_store),)
        progress.append(f"hostvm: guest root on {assets.kernel_version} ready in {time.monotonic() - t0:.0f}s")
        results = Path(row["results_base"]) / f"hostvm-results-{assets.kernel_version}"
        results.mkdir(exist_ok=True)
        checkout = Path(row["checkout"]).read_bytes()
        got = asyncio.run(_main_task(_boot_and_collect(row, cache, node_dir, assets_dir, store, layers, checkout,
                                                       priority, progress)))
    finally:
        lock.close()
    for name, data in got.items():
        (results / name).write_bytes(data)
    return {"results": str(results), "kernel_version": assets.kernel_version, "progress": progress}


terminated = False


async def _main_task(coro):
    """``coro``, cancelled on SIGTERM (its ``finally`` destroys the VM; no row runs after it).
    Outside a VM's run SIGTERM ends the process at once: there is nothing of a VM to undo."""
    task = asyncio.ensure_future(coro)

    def terminate() -> None:
        global terminated
        terminated = True
        task.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminate)
    return await task


def main(control: Path) -> None:
    rows = json.loads((control / "rows.json").read_text())
    priority = Priority(control)
    for row in rows:
        if terminated:
            break
        try:
            outcome = run_row(row, control, priority)
        except BaseException:  # noqa: BLE001 - the row's test reports it
            outcome = {"error": traceback.format_exc()}
        partial = control / f"{row['row']}.json.partial"
        partial.write_text(json.dumps(outcome))
        partial.rename(control / f"{row['row']}.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
