"""``dsec bench fork`` end to end at a tiny size: a container parent with a few changed files
forked into a few children by DSec, and committed and run as many times by podman (when it is
here); each child holds the parent's files; nothing left behind (the server's own check,
podman's images and containers removed). The microVM arm likewise: a parent holding memory
forked into two children, against two cold boots."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from dsec_bench import fork

pytestmark = [pytest.mark.slow, pytest.mark.root]


def test_fork_bench_forks_and_runs_the_peer(tmp_path: Path) -> None:
    console = Console(file=open(os.devnull, "w"), width=200)
    code = fork.main(tmp_path / "state", console, children=3, changed_mb=1, files=40, concurrency=2)
    res = json.loads((tmp_path / "state.json").read_text())
    assert code == 0, res["errors"]
    assert res["dsec"]["kind"] == "filesystem" and res["dsec"]["checked"]
    assert 0 < res["dsec"]["frozen_s"] <= res["dsec"]["fork_s"] <= res["dsec"]["all_answering_s"]
    if os.path.exists(fork.PODMAN):
        assert res["podman"]["checked"] and res["podman_over_dsec"] > 0
        seen = subprocess.run([fork.PODMAN, "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True).stdout
        images = subprocess.run([fork.PODMAN, "images", "--format", "{{.Repository}}"], capture_output=True,
                                text=True).stdout
        assert "dsec-bench" not in seen and "dsec-bench" not in images, (seen, images)


def test_microvm_fork_bench_forks_and_boots_the_peer(tmp_path_factory) -> None:
    """The microVM arm at a tiny size: a parent holding 16 MiB forked into 2 children (its
    process alive in each), 2 cold boots beside it, and the memory of all against one VM's.
    A short directory: a VM's agent socket lives under the state dir, and a socket's path holds
    107 bytes (the test's own tmp_path under the suite's basetemp is too long for it)."""
    from dsec_bench import fork_microvm

    work = tmp_path_factory.mktemp("fvm")
    console = Console(file=open(os.devnull, "w"), width=200)
    code = fork_microvm.main(work / "state", console, children=2, touched_mb=16)
    res = json.loads((work / "state.json").read_text())
    assert code == 0, res["errors"]
    d = res["dsec"]
    assert d["kind"] == "memory" and d["checked"] and res["cold"]["checked"]
    assert d["holder_kib"] >= 16 * 1024 - 512
    assert 0 < d["frozen_s"] <= d["fork_s"] <= d["all_answering_s"]
    assert d["qemu_processes"] == 3 and d["one_vm_pss"] > 16 << 20 and d["all_vms_pss"] > d["one_vm_pss"]
    assert res["cold_over_fork"] > 0 and res["memory_over_one_vm"] > 1
