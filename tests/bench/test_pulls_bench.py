"""``dsec bench pulls`` end to end at a tiny size: a few task images over the busybox base in a
loopback registry, pulled by DSec (the base converted once) and by skopeo into a
containers-storage of the run's own; nothing left behind (its mounts, its runroot, the registry)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from dsec import _sys
from dsec_bench import pulls

pytestmark = [pytest.mark.slow, pytest.mark.root]


def test_pulls_bench_pulls_both_ways_and_cleans_up(tmp_path: Path) -> None:
    console = Console(file=open(os.devnull, "w"), width=200)
    code = pulls.main(tmp_path / "state", console, images=3, files=20, base="busybox", concurrency=2)
    res = json.loads((tmp_path / "state.json").read_text())
    assert code == 0, res
    assert res["dsec"]["images"] == 3 and res["dsec"]["base_layers"] == 1 and res["dsec"]["distinct_layers"] == 4
    assert res["peer"]["images"] == 3 and res["ratio"] > 0
    assert res["dsec"]["cpu_s"] > 0 and res["peer"]["cpu_s"] > 0
    assert not (tmp_path / "state").exists()
    assert not [t for t in _sys.mounted_targets() if str(tmp_path) in t or "dsec-bench-pulls" in t]
    assert not list(Path("/run").glob("dsec-bench-pulls-*"))
