"""DSec on a stock Debian 12 host, tested inside a full VM that DSec boots itself.

The VM is the full-VM backend's (``dsec.backends.vm.fullvm``): Debian 12's cloud kernel (6.1,
the package every DSec VM boots) and a root made by ``guest_root`` (debootstrap'ed bookworm,
systemd, pure cgroup v2, AppArmor on, the Python packages DSec imports, the test images). Once
the guest agent answers, this test writes the checkout into the guest (``guest_root.checkout_tar``)
and the guest's ``dsec-hostvm.service`` runs its ``guest_run.sh``: the container, loop-device,
pause/reclaim, CPU, security and FnCall test subsets, a small ``dsec demo`` and ``dsec bench
lifecycle`` on the loop-device path with podman and crun beside it. This test waits for it
through the agent, reads the results back, and fails if any step did. The in-guest counts and
the bench's figures are printed (with or without ``-s``); everything is left in
``<basetemp>/hostvm-results-<kernel>``. A second row boots the newest Debian cloud kernel the packages
offer (``linux-image-X.Y-cloud-amd64``, 6.12 today) on a root made the same way and runs the test
subsets.

The debootstrap tree, the guest root's layer and the full-VM disks are cached under
``/var/lib/dsec-test/hostvm`` (made by this test on a fresh machine; docs/HOSTS.md). Under TCG
(this machine's KVM does not boot stock kernels) the guest's steps take about 10 minutes on a
quiet 2-core machine (tests 3, demo 0.5, bench 5): one run in every ``make test``, marked
``hostvm`` (and ``slow``; ``-m "not hostvm"`` leaves it out). ``DSEC_HOSTVM_STEPS`` (tests
demo bench) and ``DSEC_HOSTVM_TESTS`` (pytest arguments) narrow it.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.hostvm]

GUEST_MEMORY_MB = 6144
GUEST_CPUS = 2.0
# A whole userland under TCG: the default 32 MiB translation cache retranslates all the time.
TCG_TB_MB = 512
BOOT_TIMEOUT_S = 600.0
# What the guest's steps may take: about 10 minutes on a quiet 2-core machine, twice that loaded.
RUN_TIMEOUT_S = 30 * 60.0
RESULTS = "/var/lib/dsec-hostvm"


def _summary(junit: str) -> dict[str, list[str]]:
    """Test ids by outcome from pytest's junit XML."""
    import xml.etree.ElementTree as ET

    out: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    for case in ET.fromstring(junit).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            out["failed"].append(name)
        elif case.find("skipped") is not None:
            out["skipped"].append(name)
        else:
            out["passed"].append(name)
    return out


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


def newest_kernel_package() -> str | None:
    """The newest Debian cloud kernel the packages offer, by its meta package
    (``linux-image-6.12-cloud-amd64``), or None when apt knows none."""
    try:
        names = subprocess.run(["apt-cache", "pkgnames", "linux-image-"], capture_output=True, text=True,
                               timeout=60).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = [(tuple(int(x) for x in m.group(1).split(".")), n) for n in names
             if (m := re.fullmatch(r"linux-image-(\d+\.\d+)-cloud-amd64", n))]
    return max(found)[1] if found else None


# The rows: the Debian 12 kernel every DSec VM boots, with every step; and the newest Debian
# kernel the packages offer, on a root made the same way, with the test subsets only (the time
# the job has).
@pytest.mark.parametrize("row", ["kernel-debian12", "kernel-newest"])
def test_debian12_host_vm(row, tmp_path_factory, test_store, python_image, capsys):
    if shutil.which("debootstrap") is None or shutil.which("qemu-system-x86_64") is None:
        pytest.skip("needs debootstrap and qemu-system-x86")
    package, steps = None, None
    if row == "kernel-newest":
        package = newest_kernel_package()
        if package is None:
            pytest.skip("apt offers no versioned cloud kernel (linux-image-X.Y-cloud-amd64)")
        steps = "tests"
    cache = Path(test_store).parent / "hostvm"
    cache.mkdir(parents=True, exist_ok=True)
    lock = open(cache / ".lock", "w")  # one run at a time on the cache (a second one waits)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        _run_in_vm(tmp_path_factory, test_store, cache, capsys, package, steps)
    finally:
        lock.close()


def _stale_vm(vm_dir: Path) -> None:
    """Remove what a killed run of this test left of its VM: its QEMU (by the pid file, checked
    against the process's command line) and its directory."""
    try:
        pid = int((vm_dir / "qemu.pid").read_text())
        if str(vm_dir) in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
            os.kill(pid, signal.SIGKILL)
            while Path(f"/proc/{pid}").exists():
                time.sleep(0.1)
    except (OSError, ValueError):
        pass
    shutil.rmtree(vm_dir, ignore_errors=True)


def _run_in_vm(tmp_path_factory, test_store, cache: Path, capsys, package: str | None, steps: str | None) -> None:
    from dsec.backends.base import SandboxSpec
    from dsec.backends.vm.assets import AssetCache
    from dsec.backends.vm.fullvm import FullVMBackend
    from dsec.images.store import LayerStore
    from dsec.resources.cgroups import Limits
    from guest_root import CHECKOUT_TAR, base_layer, checkout_tar

    # Another kernel: assets of its own (a root keeps the kernel it first got) and a node of its
    # own (each keeps the disk of its root); the debootstrap tree and the layer store are shared.
    assets_dir = Path(os.environ["DSEC_VM_ASSETS"] + (f"-{package}" if package else ""))
    node_dir = cache / (f"node-{package}" if package else "node")
    assets = AssetCache(assets_dir, kernel_package=package).ensure()
    t0 = time.monotonic()
    store = LayerStore(cache / "store")
    layers = (base_layer(cache, store, assets.kernel.parent, Path(test_store)),)
    env = {k: os.environ[k] for k in ("DSEC_HOSTVM_STEPS", "DSEC_HOSTVM_TESTS") if k in os.environ}
    if steps is not None:
        env.setdefault("DSEC_HOSTVM_STEPS", steps)
    checkout = checkout_tar(env)
    print(f"\nhostvm: guest root on {assets.kernel_version} ready in {time.monotonic() - t0:.0f}s")
    results = Path(tmp_path_factory.getbasetemp()) / f"hostvm-results-{assets.kernel_version}"
    results.mkdir(exist_ok=True)

    async def run() -> dict[str, bytes]:
        # The node's disks (the guest root's, about a GB, and the empty one each VM's own starts
        # as) stay in the cache for the next run; a base disk of other layers is removed.
        backend = FullVMBackend(node_dir, store, assets_dir, boot_timeout_s=BOOT_TIMEOUT_S, tcg_tb_mb=TCG_TB_MB)
        spec = SandboxSpec(image="debian12-host", layers=layers, env={},
                           limits=Limits(memory_mb=GUEST_MEMORY_MB, cpu_cores=GUEST_CPUS, pids=4096))
        got: dict[str, bytes] = {}
        handle = None
        try:
            t0 = time.monotonic()
            _stale_vm(backend.vm_dir("hostvm"))
            disk = await backend.base_disk(layers)
            for old in backend.disks_dir.glob("*.raw"):
                if old != disk and not old.name.startswith("upper-"):
                    old.unlink()
            handle = await backend.create("hostvm", spec)
            print(f"hostvm: booted to the agent in {time.monotonic() - t0:.0f}s")
            t0 = time.monotonic()
            await backend.write_file(handle, CHECKOUT_TAR, checkout, 0o600, 0, 0)
            await backend.write_file(handle, f"{RESULTS}/go", b"", 0o600, 0, 0)
            deadline = time.monotonic() + RUN_TIMEOUT_S
            started = False
            while time.monotonic() < deadline:
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
            for name in ("host.txt", "times.txt", "pytest.log", "pytest.rc", "junit.xml", "demo.log", "demo.rc",
                         "bench.log", "bench.rc", "bench-lifecycle.json", "bench-serve.log", "done"):
                try:
                    got[name] = await backend.read_file(handle, f"{RESULTS}/{name}", 8 << 20)
                except Exception:  # noqa: BLE001 - a step that did not run
                    pass
            got["console.log"] = (backend.vm_dir("hostvm") / "console.log").read_bytes()[-200_000:]
        finally:
            if handle is not None:
                await backend.destroy(handle)
            await backend.close()
            backend.release_unused()
        return got

    got = asyncio.run(run())
    for name, data in got.items():
        (results / name).write_bytes(data)
    text = {k: v.decode(errors="replace") for k, v in got.items()}
    print(text.get("host.txt", ""), text.get("times.txt", ""), sep="\n")
    assert "done" in got, (f"the guest did not finish (within {RUN_TIMEOUT_S:.0f}s); systemd there says:\n"
                           f"{text.get('diagnosis', '')[-6000:]}\nconsole: {text['console.log'][-3000:]}")
    host = text["host.txt"]
    assert "cgroup cgroup2fs" in host and "apparmor enabled: Y" in host and "init /usr/lib/systemd/systemd" in host, host
    failures = []
    if "pytest.rc" in text:
        outcome = _summary(text["junit.xml"]) if "junit.xml" in text else {}
        counts = ", ".join(f"{len(v)} {k}" for k, v in outcome.items())
        with capsys.disabled():  # in the run's output, -s or not
            print(f"\nhostvm: in-guest tests: {counts} ({host.splitlines()[0]})")
        print(f"in-guest tests: {counts}")
        print(text["pytest.log"][-3000:])
        if text["pytest.rc"].strip() != "0" or not outcome.get("passed"):
            failures.append(f"tests (rc {text['pytest.rc'].strip()}): {outcome.get('failed')}")
    if "demo.rc" in text:
        print("demo:", text["demo.log"][-1500:])
        if text["demo.rc"].strip() != "0":
            failures.append(f"dsec demo (rc {text['demo.rc'].strip()})")
    if "bench.rc" in text:
        print("bench:", re.sub(r"\x1b\[[0-9;]*m", "", text["bench.log"])[-4000:])
        if text["bench.rc"].strip() != "0" or "bench-lifecycle.json" not in got:
            failures.append(f"dsec bench lifecycle (rc {text['bench.rc'].strip()})")
        else:
            res = json.loads(text["bench-lifecycle.json"])
            tput = {name: (res.get(name) or {}).get("throughput", {}).get("lifecycles_per_s")
                    for name in ("dsec", "podman", "crun")}
            ratio = res.get("ratios", {}).get("throughput_dsec_over_podman")
            with capsys.disabled():
                print("hostvm: bench lifecycle, layers on loop devices (lifecycles/s): "
                      + ", ".join(f"{k} {v:.2f}" if v else f"{k} no figure" for k, v in tput.items())
                      + (f"; DSec/podman {ratio:.2f}x" if ratio else ""))
            missing = [k for k, v in tput.items() if not v]
            if missing:  # a peer that failed in the guest is a failure here, not a missing row
                failures.append(f"dsec bench lifecycle: no throughput figure for {', '.join(missing)}")
    assert not failures, "; ".join(failures)
