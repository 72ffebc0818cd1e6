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


@pytest.mark.skipif(not os.access("/dev/kvm", os.R_OK | os.W_OK), reason="no /dev/kvm: the probe boots nothing")
def test_the_probe_qemu_dies_with_its_server(tmp_path, test_store):
    assets = AssetCache(Path(os.environ["DSEC_VM_ASSETS"])).ensure()
    cache = tmp_path / "probe-cache"
    cache.mkdir()
    code = ("import sys; from pathlib import Path; from dsec.backends.vm.assets import GuestAssets; "
            "from dsec.backends.vm.machine import probe_accel; "
            "a = GuestAssets(kernel=Path(sys.argv[1]), initramfs=Path(sys.argv[2]), kernel_version=sys.argv[3]); "
            "print(probe_accel(a, Path(sys.argv[4])))")
    child = subprocess.Popen([sys.executable, "-c", code, str(assets.kernel), str(assets.initramfs),
                              assets.kernel_version, str(cache)], stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60  # (a fresh interpreter's imports: seconds on a busy machine)
        while not qemu_pids(str(cache)) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if child.poll() is not None:
            pytest.skip(f"the probe ended before it could be killed (KVM boots guests here: {child.stdout.read()!r})")
        assert qemu_pids(str(cache)), "the probe started no QEMU within 60 s"
        child.send_signal(signal.SIGKILL)  # as a server killed in the middle of its probe
        child.wait()
        deadline = time.monotonic() + 5
        while (left := qemu_pids(str(cache))) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"the probe's QEMU outlived its process: {left}"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pid in qemu_pids(str(cache)):
            os.kill(pid, signal.SIGKILL)
