"""The accelerator probe boots a guest under KVM, which hangs on a PVM host until the probe's
timeout: a server stopped or killed meanwhile must not leave that QEMU spinning."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsec.backends.vm.assets import AssetCache

pytestmark = [pytest.mark.slow, pytest.mark.root]


def qemu_pids(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        if state != "Z" and "qemu-system" in cmdline and "setpriv" not in cmdline and marker in cmdline:
            found.append(int(pid))
    return found


PROBE = ("import sys; from pathlib import Path; from dsec.backends.vm import machine; "
         "from dsec.backends.vm.assets import GuestAssets; "
         "machine.QEMU = sys.argv[5] or machine.QEMU; "
         "a = GuestAssets(kernel=Path(sys.argv[1]), initramfs=Path(sys.argv[2]), kernel_version=sys.argv[3]); "
         "print(machine.probe_accel(a, Path(sys.argv[4])))")


def kill_the_probe_once_its_qemu_runs(work: Path, qemu: str = "", skip_unseen: bool = True) -> bool:
    """Start a probe in a process of its own, SIGKILL that process as soon as its QEMU is seen
    (as a server killed in the middle of its probe), and check that no QEMU of it is left.
    True if the QEMU was still running when the probe's process was killed; False if it had
    ended by itself first (a host where ``-accel kvm`` fails at once)."""
    assets = AssetCache(Path(os.environ["DSEC_VM_ASSETS"])).ensure()
    cache = work / "probe-cache"
    cache.mkdir(parents=True)
    child = subprocess.Popen([sys.executable, "-c", PROBE, str(assets.kernel), str(assets.initramfs),
                              assets.kernel_version, str(cache), qemu], stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60  # (a fresh interpreter's imports: seconds on a busy machine)
        while not (seen := qemu_pids(str(cache))) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if not seen and child.poll() is not None:
            if not skip_unseen:
                return False
            pytest.skip(f"the probe ended before its QEMU was seen (KVM boots guests, or fails at once, here: "
                        f"{child.stdout.read()!r})")
        assert seen, "the probe started no QEMU within 60 s"
        running_at_kill = any(qemu_pids(str(cache)))
        child.send_signal(signal.SIGKILL)
        child.wait()
        # Whether it hung or failed at once, none of the probe's QEMUs outlives its process.
        deadline = time.monotonic() + 5
        while (left := qemu_pids(str(cache))) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"the probe's QEMU outlived its process: {left}"
        return running_at_kill
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pid in qemu_pids(str(cache)):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not os.access("/dev/kvm", os.R_OK | os.W_OK), reason="no /dev/kvm: the probe boots nothing")
def test_the_probe_qemu_dies_with_its_server(tmp_path, test_store):
    """The real QEMU: on a host where it hangs (KVM on a PVM host) it must die with the probe; on
    one where it fails at once, it may be gone before the kill, and nothing is left either way."""
    kill_the_probe_once_its_qemu_runs(tmp_path)


def stand_in(tmp_path: Path, body: str) -> str:
    """A stand-in for QEMU, named as QEMU is (so the probe's process table shows it as one)."""
    qemu = tmp_path / "bin" / "qemu-system-x86_64"
    qemu.parent.mkdir()
    qemu.write_text(f"#!{sys.executable}\nimport sys, time\n{body}\n")
    qemu.chmod(0o755)
    return str(qemu)


@pytest.mark.skipif(not os.access("/dev/kvm", os.R_OK | os.W_OK), reason="no /dev/kvm: the probe boots nothing")
def test_a_probe_qemu_that_hangs_dies_with_its_server(tmp_path, test_store):
    """A QEMU that surely hangs (a stand-in that sleeps): the probe's parent-death signal is
    what ends it, on any host."""
    qemu = stand_in(tmp_path, "time.sleep(600)")
    assert kill_the_probe_once_its_qemu_runs(tmp_path, qemu), "the stand-in had ended before the kill"


@pytest.mark.skipif(not os.access("/dev/kvm", os.R_OK | os.W_OK), reason="no /dev/kvm: the probe boots nothing")
def test_a_probe_qemu_that_fails_at_once_leaves_nothing_either(tmp_path, test_store):
    """A host where ``-accel kvm`` fails at once (the stand-in exits within a moment): seen or
    not, gone before the kill or not, the check holds, ten times over."""
    qemu = stand_in(tmp_path, "time.sleep(0.05)\nsys.exit(1)")
    for attempt in range(10):
        kill_the_probe_once_its_qemu_runs(tmp_path / str(attempt), qemu, skip_unseen=False)


def test_the_guest_kernel_boots_at_its_pvh_entry():
    """Debian's cloud kernels carry a PVH entry and scripts/setup-host.sh installs their payloads'
    unpackers (lz4 for 6.1, zstd from 6.12): every VM here boots the unpacked ``vmlinux``."""
    assets = AssetCache(Path(os.environ["DSEC_VM_ASSETS"])).ensure()
    assert assets.kernel.name == "vmlinux", assets
    with open(assets.kernel, "rb") as f:
        assert f.read(4) == b"\x7fELF"
