"""``dsec bench cluster`` end to end at a tiny size: both arms come up, every phase runs
through the same code as at full size and reports its figures, and nothing is left behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from dsec_bench.cluster import main


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.slow  # (9 s: the fake backend, but a benchmark's whole run at a small size)
def test_both_arms_run_every_phase_and_clean_up(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    console = Console(file=open(os.devnull, "w"), width=200)
    code = main(console, nodes=4, processes=2, batch=200, singles=200, in_flight=16, paced_rate=400, paced_s=0.25,
                crun_count=0, results=results)
    res = json.loads(results.read_text())
    assert code == 0, res["errors"]
    assert res["backend"] == "fake backend"  # both arms: it is cited wherever a figure is
    for name in ("remote", "embedded"):
        arm = res["arms"][name]
        assert arm["batch"]["per_s"] > 0 and 1.0 <= arm["batch"]["spread"] < 2.0
        assert arm["singles"]["per_s"] > 0 and arm["singles"]["p99_ms"] >= arm["singles"]["p50_ms"] > 0
        assert arm["paced"]["count"] == 100 and arm["paced"]["p99_ms"] > 0
        assert arm["paced_half"]["rate"] == arm["singles"]["per_s"] / 2 and arm["paced_half"]["p99_ms"] > 0
        assert arm["singles"]["cpu_us_all"] > 0 and arm["batch"]["cpu_bound_per_s"] > 0
        assert arm["batch_stop"]["count"] == 200 and arm["singles_stop"]["count"] == 200
        assert arm["left_running"] == 0
        assert arm["batch"]["cpu_s"]["apiserver"] > 0
    assert res["arms"]["remote"]["processes"] == {"simnodes": 2, "apiserver": 1}
    assert [g["met"] is not None for g in res["summary"]["goals"]] == [True] * 5
    assert not Path(res["work_dir"]).exists()
    assert _processes_naming(res["work_dir"]) == []


@pytest.mark.slow
@pytest.mark.root
def test_the_crun_arms_make_real_containers_on_real_nodes_and_leave_nothing(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    console = Console(file=open(os.devnull, "w"), width=200)
    code = main(console, nodes=2, processes=1, batch=20, singles=20, in_flight=4, paced_rate=0, crun_nodes=2,
                crun_count=12, crun_in_flight=4, results=results)
    res = json.loads(results.read_text())
    assert code == 0, res["errors"]
    remote, embedded = res["arms"]["crun-remote"], res["arms"]["crun-embedded"]
    assert remote["processes"] == {"node": 2, "apiserver": 1} and embedded["processes"] == {"apiserver": 1}
    for arm in (remote, embedded):
        assert arm["batch"]["per_s"] > 0 and arm["singles"]["p99_ms"] >= arm["singles"]["p50_ms"] > 0
        assert arm["batch_stop"]["count"] == 12 and arm["singles_stop"]["count"] == 12
        assert arm["left_running"] == 0 and "paced" not in arm
    # Both real nodes made containers (the spread is over the two), their crun's CPU counted.
    assert remote["batch"]["min_per_node"] >= 1 and remote["batch"]["cpu_s"]["node"] > 0
    assert not Path(res["work_dir"]).exists()
    assert _processes_naming(res["work_dir"]) == []
