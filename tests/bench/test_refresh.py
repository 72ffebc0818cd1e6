"""``dsec bench all``: the glance table is rebuilt from the benchmarks' results, misses shown as
misses, a benchmark whose peer is missing says what to install, and only the table changes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from dsec_bench import refresh

DOC = Path(__file__).resolve().parents[2] / "docs" / "BENCHMARKS.md"


def _bench(name: str) -> refresh.Bench:
    return next(b for b in refresh.QUICK if b.name == name)


def test_every_benchmark_has_a_quick_mode_in_the_budget() -> None:
    from dsec_bench.cli import app

    commands = {c.name for c in app.registered_commands} - {"all"}
    assert {b.name for b in refresh.QUICK} == commands
    assert sum(b.estimate_s for b in refresh.QUICK) <= refresh.BUDGET_S


def test_the_table_is_rewritten_and_nothing_else(tmp_path: Path) -> None:
    doc = tmp_path / "BENCHMARKS.md"
    shutil.copy(DOC, doc)
    before = doc.read_text()
    outcomes = [
        refresh.Outcome(_bench("joblog"), "ran", 40, 0, row=refresh._row_joblog(
            {"recorded": {"lifecycles_per_s": 80.0}, "unrecorded": {"lifecycles_per_s": 100.0},
             "ratio_recorded_over_unrecorded": 0.8})),
        refresh.Outcome(_bench("cluster-ray"), "skipped", why="ray missing here (pip install ray)"),
        refresh.Outcome(_bench("burst"), "failed", 3, 1, why="exit 1: boom"),
    ]
    refresh.rewrite_glance(doc, refresh.glance_table(outcomes), "_Quick runs (`dsec bench all --quick`) at commit x._")
    after = doc.read_text()
    assert "| [joblog](#job-log) | recorded 80.0 lifecycles/s (median round) | unrecorded 100.0/s (0.80×) | ≥ 0.90× **missed** |" in after
    assert "**skipped**: ray missing here (pip install ray)" in after and "**failed**: exit 1: boom" in after
    assert after.count("_Quick runs") == 1
    head, tail = before.split("## The machine", 1)
    assert after.endswith("## The machine" + tail) and after.startswith(head[:head.index("## At a glance")])
    # A second run replaces the first's preface and table, not adds to them.
    refresh.rewrite_glance(doc, refresh.glance_table(outcomes[:1]), "_Quick runs (`dsec bench all --quick`) at commit y._")
    again = doc.read_text()
    assert again.count("_Quick runs") == 1 and "commit y" in again and "boom" not in again
    # Some benchmarks only: their rows change, the others stay.
    rows = refresh.glance_table([refresh.Outcome(_bench("joblog"), "skipped", why="no time")])
    refresh.rewrite_glance(doc, rows, "_Some runs (`dsec bench all` of joblog) at commit z._", partial=True)
    merged = doc.read_text()
    assert "| [joblog](#job-log) | **skipped**: no time |" in merged and "recorded 80.0" not in merged
    assert "_Some runs" in merged and "_Quick runs" not in merged
    assert merged.count("\n| [") == again.count("\n| [")


def test_a_missing_peer_is_named_with_how_to_install(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(refresh, "have", lambda what: what != "bwrap")
    console = Console(file=open(os.devnull, "w"), width=200)
    doc = tmp_path / "BENCHMARKS.md"
    shutil.copy(DOC, doc)
    lifecycle = next(line for line in doc.read_text().splitlines() if line.startswith("| [lifecycle](#lifecycle) |"))
    assert refresh.main(console, state_root=tmp_path / "all", doc=doc, quick=True, only=["fncall"], skip=[]) == 0
    text = doc.read_text()
    assert "| [fncall](#fncall) | **skipped**: bwrap missing here (apt-get install bubblewrap) |" in text
    assert lifecycle in text.splitlines()  # the other rows stay


@pytest.mark.slow
@pytest.mark.root
def test_all_quick_runs_a_benchmark_and_writes_its_row(tmp_path: Path) -> None:
    console = Console(file=open(os.devnull, "w"), width=200)
    doc = tmp_path / "BENCHMARKS.md"
    shutil.copy(DOC, doc)
    code = refresh.main(console, state_root=tmp_path / "all", doc=doc, quick=True, only=["pause"], skip=[])
    text = doc.read_text()
    assert code == 0, (tmp_path / "all" / "pause.log").read_text()[-2000:]
    row = next(line for line in text.splitlines() if line.startswith("| [pause](#pausing-a-job-pause)"))
    assert "met" in row or "missed" in row, row


def test_the_vm_benchmarks_rows_judge_their_goals() -> None:
    """microvm and vm-pause write their results, and their rows say each goal: judged where the
    run measured it, "not measured" where its size could not."""
    vm = refresh._row_microvm({"restore_s": 0.326, "boot_s": 3.572, "restore_speedup": 10.96, "idle": 1,
                               "shared_mb": 178.0, "private_mb": 209.0, "memory_saving": 0.15, "many": 2,
                               "many_answering": 2})
    assert vm == ("restore to a shell 326 ms; 1 idle microVMs on pmem/DAX + KSM hold 178 MiB; 2 of 2 clones answering",
                  "cold boot 3572 ms (11.0×); private copies 209 MiB (15% less)",
                  "≥ 10× met; ≥ 40% less memory **missed**; ≥ 50 idle microVMs not measured (2 at this size)")
    paused = refresh._row_vm_pause({"paused": {"held": 149 << 20}, "stopped": {"held": 333 << 20}, "swap_total": 1,
                                    "count": 2, "intact": 2, "resume_latency_ms": 76.4})
    assert paused[1:] == ("QMP `stop` 333 MiB (55.3% less)", "≥ 50% less met; all intact met")
    assert refresh._row_vm_pause({"paused": {"held": 1}, "stopped": {"held": 2}, "swap_total": 0, "count": 2,
                                  "intact": 1})[2] == "≥ 50% less not measured; all intact **missed**"
