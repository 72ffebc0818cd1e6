"""``dsec bench density`` at a tiny size: the fill stops at a limit (here the safety cap) and
says so, pause is judged on heap-like content by what the host loses, each figure names the
swap set-up it needs, and nothing is left behind."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
from rich.console import Console

from dsec_bench import density


def test_heap_like_content_is_neither_zeros_nor_all_random() -> None:
    heap = density.heap_like(1 << 20)
    assert len(heap) == 1 << 20 and heap == density.heap_like(1 << 20)
    ratio = len(zlib.compress(heap, 1)) / len(heap)
    # Text and structures compress, the random quarter does not: well between the two ends.
    assert 0.35 < ratio < 0.8, ratio
    assert heap.count(0) < len(heap) // 4


def test_swap_setup_is_read() -> None:
    setup = density.swap_setup()
    assert set(setup) >= {"zram", "disk", "zswap", "text"} and setup["text"]


@pytest.mark.slow
@pytest.mark.root
def test_density_fills_to_a_limit_and_judges_the_host(tmp_path: Path, test_store) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "store").symlink_to(test_store)
    console = Console(file=open(os.devnull, "w"), width=220)
    code = density.main(state, console, max_count=12, step=6, probe=2, batch=4, peer_count=4, pause_count=2,
                        pause_mb=8, text_count=1, random_count=1, cold_count=1, cold_wait_s=2, time_limit_s=1200,
                        settle_scale=0.2)
    res = json.loads((state / density.RESULTS_FILE).read_text())
    assert code == 0, res["errors"]
    idle = res["idle"]
    assert idle["count"] >= 12 and idle["stopped_by"] == "cap: --max-count 12" and not idle["limit_hit"]
    goals = density._goals(res)
    assert goals["idle_count"] is None  # a cap is not a limit: how many fit was not found
    assert goals["idle_mib"] == (idle["host_mib_per_sandbox"] <= density.GOAL_IDLE_MIB)
    heap = res["pause_heap"]
    assert heap["count"] == 2 and heap["intact_after_resume"] == 2
    share = heap["returned_share"]  # None when the host's other work hid 16 MiB of fill
    assert goals["pause_returned"] == (None if share is None else share >= density.GOAL_PAUSE_RETURNED)
    assert res["machine"]["swap"]["text"]
    assert res["leftovers"] == []
