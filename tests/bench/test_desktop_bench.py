"""``dsec bench desktop`` end to end at a tiny size: each figure measured, both peers answered,
the ratios from them, and nothing left behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from dsec_bench import desktop

pytestmark = [pytest.mark.slow, pytest.mark.root]


def test_desktop_bench_measures_each_figure_against_its_peers(tmp_path: Path, desktop_image, test_store) -> None:
    console = Console(file=open(os.devnull, "w"), width=200)
    state = tmp_path / "state"
    code = desktop.main(state, console, store=test_store, width=800, height=600, samples=5, peer_samples=3,
                        creates=2)
    res = json.loads((state / desktop.RESULTS_FILE).read_text())
    assert code == 0 and res["errors"] == [] and res["leftovers"] == [], res
    d, c, x = res["dsec"], res["crun_exec"], res["dsec_exec"]
    assert 0 < d["screenshot_p50_ms"] and 0 < d["move_p50_ms"] and 0 < d["press_p50_ms"] and d["png_bytes"] > 1000
    assert 0 < c["scrot_p50_ms"] and 0 < c["xdotool_move_p50_ms"] and 0 < x["scrot_p50_ms"]
    assert res["ratios"]["screenshot_crun_exec_over_dsec"] == pytest.approx(c["scrot_p50_ms"] / d["screenshot_p50_ms"])
    assert 0 < res["create_to_first_screenshot_p50_s"] < 60
    # The peer: podman exec on a podman container of the same image, in the same run.
    pm = res["podman_exec"]
    assert 0 < pm["scrot_p50_ms"] and 0 < pm["xdotool_move_p50_ms"] and 0 < pm["xdotool_key_p50_ms"]
    assert res["ratios"]["screenshot_podman_exec_over_dsec"] == pytest.approx(pm["scrot_p50_ms"] / d["screenshot_p50_ms"])
    assert res["ratios"]["press_podman_exec_over_dsec"] == pytest.approx(pm["xdotool_key_p50_ms"] / d["press_p50_ms"])
    assert set(res["goals"]) == {"screenshot_p50_le_25ms", "screenshot_ge_4x_podman", "input_p50_le_5ms",
                                 "input_ge_10x_podman"}
