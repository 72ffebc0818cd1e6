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


def test_desktop_density_holds_idle_desktops_and_measures_each_against_podman(tmp_path: Path, desktop_image,
                                                                                 test_store) -> None:
    console = Console(file=open(os.devnull, "w"), width=200)
    state = tmp_path / "state"
    code = desktop.main(state, console, store=test_store, width=1280, height=800, density=3, density_only=True,
                        density_batch=2, density_settle_s=3.0, density_reserve_gib=2.0)
    res = json.loads((state / desktop.RESULTS_FILE).read_text())
    assert code == 0 and res["errors"] == [] and res["leftovers"] == [], res
    assert "ratios" not in res  # (the latency arms were not run)
    d, pm = res["density"]["dsec"], res["density"]["podman"]
    # Every desktop held, then answered a screenshot of the whole 1280x800 screen.
    assert d["count"] == 3 and d["stopped_by"] == "asked: 3" and not d["limit_hit"], d
    assert d["screenshots_ok"] == 3 and d["screenshot_failures"] == [] and d["screenshot_p50_ms"] > 0
    assert d["sessions_up"] == 3 and pm["sessions_up"] == 3  # (each session whole before the reading)
    # What their cgroups are charged: an idle desktop is tens of MiB, most of it anonymous memory.
    assert 10 < d["cgroup_anon_mib_per_desktop"] < d["cgroup_charged_mib_per_desktop"] < 400, d
    assert d["meminfo_mib_per_desktop"].keys() >= {"AnonPages", "PageTables"}
    # The peer: as many podman desktops of the same session, all running at the top, none left.
    assert pm["count"] == 3 and pm["running_at_top"] == 3 and pm["left_running"] == 0, pm
    assert 10 < pm["cgroup_anon_mib_per_desktop"] < 400, pm
    assert set(res["density"]["goals"]) == {"count_ge_150", "host_mib_per_desktop_le_100", "all_screenshots"}
    assert res["density"]["goals"]["all_screenshots"] and not res["density"]["goals"]["count_ge_150"]



def test_desktop_bench_on_a_microvm_against_a_container(tmp_path_factory, desktop_image, test_store) -> None:
    """``--kind microvm``: one microVM's desktop (created once, then measured) against the same
    image's in a container, in the same run. (A short directory: a VM's agent socket lives under
    the state dir, and a socket's path holds 107 bytes.)"""
    console = Console(file=open(os.devnull, "w"), width=200)
    tmp_path = tmp_path_factory.mktemp("dvm")
    state = tmp_path / "state"
    code = desktop.main(state, console, store=test_store, width=800, height=600, samples=3, creates=1, kind="microvm")
    res = json.loads((state / "bench-desktop-microvm.json").read_text())
    assert code == 0 and res["errors"] == [] and res["leftovers"] == [], res
    vm, ct = res["microvm"], res["container"]
    for m in ("create_p50_s", "create_to_first_screenshot_p50_s", "screenshot_p50_ms", "move_p50_ms", "press_p50_ms"):
        assert 0 < vm[m] and 0 < ct[m], m
        assert res["ratios"][f"{m}_microvm_over_container"] == pytest.approx(vm[m] / ct[m])
    assert vm["create_p50_s"] < vm["create_to_first_screenshot_p50_s"] and "first_create_s" not in vm
    assert "goals" not in res  # (figures, not goals)
    with pytest.raises(ValueError, match="--kind 'qemu': one of container, microvm, fullvm"):
        desktop.main(tmp_path / "other", console, kind="qemu")
