"""``dsec bench rollout`` and ``dsec bench joblog`` end to end at a tiny size: the task set is
built as workspace layers over python, every episode's verdict (from a clean copy) matches the
script's ground truth on both ways — a forged ``python3`` included — and nothing is left
behind; the job-log bench's log holds (and a resume answers) every recorded call."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from dsec_bench import joblog, rollout
from dsec.images.store import LayerStore

pytestmark = [pytest.mark.slow, pytest.mark.root]


def test_plans_cover_both_verdicts_and_three_to_ten_commands():
    task = rollout.TaskSpec(0, "t", 2, 1)
    plans = [rollout.plan(n, task, 8) for n in range(200)]
    assert {right for _, right in plans} == {True, False}
    assert any(any("/usr/local/bin/python3" in s.text for s in steps) for steps, _ in plans)
    assert sum(any(s.kind == "branch" for s in steps) for steps, _ in plans) == 25


def test_rollout_both_ways_with_every_verdict_right(tmp_path: Path, python_image, test_store) -> None:
    console = Console(file=open(os.devnull, "w"), width=200)
    tasks = rollout.build_task_set(LayerStore(test_store), 32)
    assert len({t.image for t in tasks}) == 32
    code = rollout.main(tmp_path / "state", console, store_dir=test_store, episodes=16, podman_episodes=2,
                        concurrency=8, branch_every=4)
    res = json.loads((tmp_path / "state.json").read_text())
    assert code == 0, res["errors"]
    assert res["dsec"]["accuracy"] == 1.0 and res["dsec"]["episodes"] == 16 and res["dsec"]["branched"] == 4
    assert 0 < res["dsec"]["solved"] < 16
    if "podman" in res:
        assert res["podman"]["accuracy"] == 1.0 and res["ratio"] > 0


def test_joblog_bench(tmp_path: Path, test_store) -> None:
    console = Console(file=open(os.devnull, "w"), width=200)
    state = tmp_path / "state"
    state.mkdir()
    (state / "store").symlink_to(test_store)
    code = joblog.main(state, console, lifecycles=16, rounds=2, concurrency=4)
    res = json.loads((tmp_path / "state.json").read_text())
    assert code == 0, res["errors"]
    assert res["log_entries"] == res["log_entries_expected"] == res["resume"]["answered"]
    assert res["ratio_recorded_over_unrecorded"] > 0
    assert res["recorded"]["server_cpu_ms_per_lifecycle"] > 0 and res["unrecorded"]["server_cpu_ms_per_lifecycle"] > 0
