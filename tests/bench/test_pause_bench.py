"""``dsec bench pause`` end to end at a tiny size: a job of a few sandboxes filled, paused as one
call, the first call to some of them (auto-resume), the rest resumed as one call, every
sandbox's content read back intact; nothing left behind (the server's own check). A size that
does not fit in the host's memory is refused before anything starts, naming the figures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from dsec_bench import job_pause

pytestmark = [pytest.mark.slow, pytest.mark.root]


def test_pause_bench_pauses_a_job_and_gets_it_back(tmp_path: Path) -> None:
    console = Console(file=open(os.devnull, "w"), width=200)
    code = job_pause.main(tmp_path / "state", console, count=6, mb=4, probes=2)
    res = json.loads((tmp_path / "state.json").read_text())
    assert code == 0, res["errors"]
    assert res["pause"]["paused"] == 6 and res["pause"]["failed"] == 0
    assert res["pause"]["cgroups_after_mib"] < res["pause"]["cgroups_before_mib"]
    # The probes resumed on their first call; the one call resumed the other four.
    assert res["resume"]["resumed"] == 4 and res["resume"]["already_running"] == 2
    assert res["read_back"]["intact"] == 6
    assert set(res["goals"]) == {"pause_s", "returned", "resume_s", "auto_resume"}


def test_a_job_too_big_for_the_host_is_refused_first(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        code = job_pause.main(tmp_path / "state", Console(file=f, width=300), count=100_000, mb=64)
    assert code == 2
    text = out.read_text()
    assert "100000 sandboxes × 64 MiB need about" in text and "--count" in text
    assert not (tmp_path / "state").exists()
