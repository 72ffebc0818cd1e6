"""``dsec bench tti`` end to end at a tiny size: every mode of every system answers, the
figures and scores come out as ComputeSDK computes them, and nothing is left behind."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from dsec_bench import tti

pytestmark = [pytest.mark.slow, pytest.mark.root]


def test_score_and_percentiles_are_computesdks():
    assert tti.score(200, 200, 200, 1.0) == pytest.approx(98.0)
    assert tti.score(20_000, 20_000, 20_000, 1.0) == 0.0
    assert tti.score(1000, 2000, 4000, 0.5) == pytest.approx((0.6 * 90 + 0.25 * 80 + 0.15 * 60) * 0.5)
    s = tti.summary([i / 1000 for i in range(1, 101)], [], 100)
    assert (s["median_ms"], s["p95_ms"], s["p99_ms"], s["success"]) == (50.5, 95.0, 99.0, 1.0)
    assert tti.summary([], ["boom"], 3) == {"n": 3, "ok": 0, "success": 0.0, "failures": ["boom"]}


def test_tti_bench_every_mode_of_every_system(tmp_path: Path, python_image, test_store) -> None:
    console = Console(file=open(os.devnull, "w"), width=200)
    code = tti.main(tmp_path / "state", console, iterations=3, stagger_ms=20, store_dir=test_store)
    res = json.loads((tmp_path / "state.json").read_text())
    assert code == 0, res["errors"]
    systems = ["dsec", "e2b"] + (["podman"] if os.path.exists(tti.PODMAN) else [])
    for system in systems:
        for mode in tti.MODES:
            s = res[system][mode]
            assert s["ok"] == 3 and s["success"] == 1.0 and 0 < s["min_ms"] <= s["median_ms"] <= s["p99_ms"], (system, mode)
    if "podman" in systems:
        left = subprocess.run([tti.PODMAN, "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True).stdout
        assert "dsec-bench-tti" not in left, left
