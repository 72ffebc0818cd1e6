"""DSec on a stock Debian 12 host, tested inside a full VM that DSec boots itself.

The VM is the full-VM backend's (``dsec.backends.vm.fullvm``): Debian 12's cloud kernel (6.1,
the package every DSec VM boots) and a root made by ``guest_root`` (debootstrap'ed bookworm,
systemd, pure cgroup v2, AppArmor on, the Python packages DSec imports, the test images). Once
the guest agent answers, this test writes the checkout into the guest (``guest_root.checkout_tar``)
and the guest's ``dsec-hostvm.service`` runs its ``guest_run.sh``: the container, loop-device,
pause/reclaim, CPU, security and FnCall test subsets, a small ``dsec demo`` and the throughput
rounds of ``dsec bench lifecycle`` on the loop-device path with podman and crun beside it. This test waits for it
through the agent, reads the results back, and fails if any step did. The in-guest counts and
the bench's figures are printed (with or without ``-s``); everything is left in
``<basetemp>/hostvm-results-<kernel>``. A second row boots the newest Debian cloud kernel the packages
offer (``linux-image-X.Y-cloud-amd64``, 6.12 today) on a root made the same way and runs the test
subsets but the loop-device one (layers on loop devices are the path of kernels before 6.12).

The debootstrap tree, the guest root's layer and the full-VM disks are cached under
``/var/lib/dsec-test/hostvm`` (made by this test on a fresh machine; docs/HOSTS.md). Under TCG
(this machine's KVM does not boot stock kernels) the guest's steps take about 10 minutes on a
quiet 2-core machine (tests 3, demo 0.5, bench 1): one run in every ``make test``, marked
``hostvm`` (and ``slow``; ``-m "not hostvm"`` leaves it out). ``DSEC_HOSTVM_STEPS`` (tests
demo bench) and ``DSEC_HOSTVM_TESTS`` (pytest arguments) narrow it.

The VMs do not hold the suite up: the root conftest's ``hostvm_background`` starts both rows at
the run's first test, one after the other (the newest kernel's first: the Debian 12 row's bench,
which waits for the suite to wait, comes last), in a process of their own (``hostvm_runner.py``, at
``nice`` 5: they take the CPU the other tests leave idle; the runner's deadlines count
from the moment the suite waits at the latest), and these tests, moved to the end of
the run, wait for their row (the VMs back at the normal priority from then on) and judge what it
left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostvm_runner import BACKGROUND_NICE, RUN_TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.hostvm]

HERE = Path(__file__).parent
# The rows, in the order they run: the newest Debian kernel the packages offer, on a root made
# the same way, with the test subsets only (the time the job has); and the Debian 12 kernel every
# DSec VM boots, with every step. Its bench runs only once the suite waits (nothing else beside
# it), so that row goes last: nothing else is left for the suite's end.
ROWS = ("kernel-newest", "kernel-debian12")
# What a row may take from the run's start, base layer and boot included (the runner's own
# deadlines, hostvm_runner.RUN_TIMEOUT_S and BOOT_TIMEOUT_S, end it well before).
WAIT_S = 3 * 3600.0


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


class BackgroundRows:
    """The rows' VMs, run by ``hostvm_runner.py`` in a process of its own from the suite's first
    test on (the root conftest's ``hostvm_background`` starts it with ``start``); ``wait(row)``
    is a row's outcome, ``stop()`` ends what still runs (its VM destroyed)."""

    def __init__(self, control: Path, proc: subprocess.Popen | None, skipped: dict[str, str]):
        self.control, self.proc, self.skipped = control, proc, skipped

    @classmethod
    def start(cls, rows: list[str], tmp_path_factory, test_store: Path) -> BackgroundRows:
        from guest_root import checkout_tar

        control = tmp_path_factory.mktemp("hostvm-control")
        if shutil.which("debootstrap") is None or shutil.which("qemu-system-x86_64") is None:
            return cls(control, None, dict.fromkeys(rows, "needs debootstrap and qemu-system-x86"))
        skipped, todo = {}, []
        for row in rows:
            package, steps = None, None
            if row == "kernel-newest":
                package = newest_kernel_package()
                if package is None:
                    skipped[row] = "apt offers no versioned cloud kernel (linux-image-X.Y-cloud-amd64)"
                    continue
                steps = "tests"
            env = {k: os.environ[k] for k in ("DSEC_HOSTVM_STEPS", "DSEC_HOSTVM_TESTS") if k in os.environ}
            if steps is not None:
                env.setdefault("DSEC_HOSTVM_STEPS", steps)
                env["DSEC_HOSTVM_LOOP"] = "0"  # (loop devices are for kernels before 6.12: the Debian 12 row's)
            checkout = control / f"{row}-checkout.tar"
            checkout.write_bytes(checkout_tar(env))
            todo.append({"row": row, "package": package, "checkout": str(checkout), "test_store": str(test_store),
                         "results_base": str(tmp_path_factory.getbasetemp())})
        if not todo:
            return cls(control, None, skipped)
        (control / "rows.json").write_text(json.dumps(todo))
        import dsec

        src = str(Path(dsec.__file__).resolve().parents[1])
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "hostvm_runner.py"), str(control)],
            stdin=subprocess.DEVNULL, stdout=open(control / "runner.log", "wb"), stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (src, os.environ.get("PYTHONPATH"))))},
            preexec_fn=lambda: os.nice(BACKGROUND_NICE))
        return cls(control, proc, skipped)

    def wait(self, row: str) -> dict:
        """The row's outcome (``hostvm_runner``'s), once it is over; the VMs run at the normal
        priority from now on (the suite waits for them)."""
        if row in self.skipped:
            pytest.skip(self.skipped[row])
        (self.control / "foreground").touch()
        outcome = self.control / f"{row}.json"
        deadline = time.monotonic() + WAIT_S
        while not outcome.exists():
            over = self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline
            if over and not outcome.exists():  # (a runner that has just written it and ended is fine)
                log = (self.control / "runner.log").read_text(errors="replace")[-5000:]
                raise AssertionError(f"the hostvm runner ended (or overran) before row {row} was over: {log}")
            time.sleep(2)
        return json.loads(outcome.read_text())

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # (a VM running is destroyed first)
        try:
            self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.parametrize("row", ROWS)
def test_debian12_host_vm(row, hostvm_background, capsys):
    ran = hostvm_background.wait(row)
    print("\n" + "\n".join(ran.get("progress", [])))
    assert "error" not in ran, f"the row's VM could not run: {ran['error'][-6000:]}"
    results = Path(ran["results"])
    got = {p.name: p.read_bytes() for p in results.iterdir()}
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
