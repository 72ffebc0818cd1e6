"""``dsec bench harness`` end to end at a tiny size: a task's Dockerfile built by DSec and by
podman over the same base, rebuilt from the cache, and started to a first answer both ways;
Harbor's oracle over two tasks on DSec's environment and on Harbor's docker one (when Harbor's
venv and dockerd are here; else the arm is skipped, naming why); nothing left behind (the
server's own check, podman's images removed, the peer's dockerd and its directory gone)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from dsec_bench import harness

pytestmark = [pytest.mark.slow, pytest.mark.root]


def test_harness_bench_builds_rebuilds_and_starts_both_ways(tmp_path: Path, python_image, test_store) -> None:
    console = Console(file=open(os.devnull, "w"), width=200)
    code = harness.main(tmp_path / "state", console, store_dir=test_store, files=20, build_rounds=1,
                        rebuild_rounds=2, start_rounds=2, podman_start_rounds=1, harbor_concurrency=2,
                        harbor_task_names=("copy-tree", "workdir-default"))
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
    if "harbor_skipped" in res:
        assert res["harbor_skipped"].startswith(("no Harbor venv", "dockerd not found", "no docker CLI")), res
    else:
        assert res["harbor"]["dsec"]["trials"] == res["harbor"]["docker"]["trials"] == 2
        assert res["harbor"]["ratio"] > 0
        assert not Path(res["harbor"]["docker"]["dockerd_dir"]).exists()  # the peer's dockerd and its directory gone
