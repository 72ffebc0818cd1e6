"""``dsec bench fncall`` at a tiny size: latency is taken at the client, end to end, one call a
request and batched, the floor in rounds beside the snippet, and the goals are judged on those
figures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from dsec_bench import fncall

pytestmark = [pytest.mark.slow, pytest.mark.root]


def test_latency_is_the_clients_both_ways(tmp_path: Path, python_image, test_store) -> None:
    console = Console(file=open(os.devnull, "w"), width=200)
    state = tmp_path / "state"
    code = fncall.main(state, test_store, console, calls=100, latency_calls=64, peer_calls=16, in_flight=8,
                       workers=0, strict=False, fusion=False, sequential_min=16, rounds=2)
    assert code == 0
    res = json.loads((state / fncall.RESULTS_FILE).read_text())
    dsec = res["dsec"]
    for phase in ("latency", "latency_batched", "sequential", "sequential_batched"):
        rt, worker = dsec[phase]["round_trip"], dsec[phase]["worker"]
        # At the client: HTTP and the queue included, so never below the worker's own figure.
        assert rt["p50_ms"] >= worker["p50_ms"] > 0, phase
    assert dsec["sequential_batched"]["per_request"] == 8 and dsec["sequential_batched"]["in_flight"] == 8
    # The floor is measured in rounds beside the snippet, and its share judged on their median.
    shares = dsec["floor_share_rounds"]
    assert len(shares) == 2 and len(dsec["throughput"]["rounds_calls_per_s"]) == 2
    assert res["summary"]["floor_share"] == pytest.approx(sorted(shares)[0] / 2 + sorted(shares)[1] / 2)
    goals = res["summary"]["goals"]
    assert len(goals) == 7 and all("at the client" in g for g in list(goals)[3:])
    assert goals["≥ 95% of the fork-per-call floor (calls/s, median of rounds)"] is (res["summary"]["floor_share"] >= 0.95)
    judged = dsec["sequential"]["round_trip"]["p50_ms"] <= fncall.GOAL_P50_MS
    assert goals["p50 ≤ 2 ms at the client, a call a request, 1 in flight"] is judged
    assert res["left_behind"] == []
