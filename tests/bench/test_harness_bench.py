"""``dsec bench harness`` end to end at a tiny size: a task's Dockerfile built by DSec and by
podman over the same base, rebuilt from the cache, and started to a first answer both ways;
nothing left behind (the server's own check, and podman's images removed)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from dsec.bench import harness

pytestmark = [pytest.mark.slow, pytest.mark.root]


def test_harness_bench_builds_rebuilds_and_starts_both_ways(tmp_path: Path, python_image, test_store) -> None:
    console = Console(file=open(os.devnull, "w"), width=200)
    code = harness.main(tmp_path / "state", console, store_dir=test_store, files=20, build_rounds=1,
                        rebuild_rounds=2, start_rounds=3, podman_start_rounds=1)
    res = json.loads((tmp_path / "state.json").read_text())
    assert code == 0, res["errors"]
    for arm in ("build", "rebuild", "start"):
        assert res["dsec"][arm]["p50_ms"] > 0
    assert res["goals"]["rebuild"], res["dsec"]["rebuild"]  # answered from the store
    if os.path.exists(harness.PODMAN):
        assert res["podman"]["build"]["n"] == 1 and res["podman"]["start"]["n"] == 1
        images = subprocess.run([harness.PODMAN, "images", "--format", "{{.Repository}}"], capture_output=True,
                                text=True).stdout
        assert "dsec-bench" not in images, images
