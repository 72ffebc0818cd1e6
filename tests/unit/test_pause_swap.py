"""A paused sandbox's swap on cgroup v2: swap lifted to its memory limit and zswap's RAM pool
skipped while paused, both put back on resume (``cgroups.lift_swap``), on a tree of files laid
out as v2 lays a sandbox's cgroup (this host's memory controller is v1; the Debian 12 host VM
rows run the real thing under the pause tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.resources import cgroups


@pytest.fixture
def v2_tree(tmp_path, monkeypatch):
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    d = tmp_path / "dsec-x" / "c1"
    d.mkdir(parents=True)
    (d / "memory.max").write_text("268435456\n")
    (d / "memory.swap.max").write_text("0\n")
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(cgroups, "is_v2", lambda: True)  # (cached for the host it runs on)
    monkeypatch.setattr(cgroups, "_HAS", {})
    # A cgroup file takes each write as its whole new value; a plain file needs truncating.
    monkeypatch.setattr(cgroups, "_write", lambda path, value: Path(path).write_text(value))
    return d


def test_pause_lifts_swap_and_skips_zswap_then_resume_puts_both_back(v2_tree):
    (v2_tree / "memory.zswap.max").write_text("max\n")
    assert cgroups.lift_swap("dsec-x", "c1", True)
    assert (v2_tree / "memory.swap.max").read_text().strip() == "268435456"
    assert (v2_tree / "memory.zswap.max").read_text().strip() == "0"
    assert cgroups.lift_swap("dsec-x", "c1", False)
    assert (v2_tree / "memory.swap.max").read_text().strip() == "0"
    assert (v2_tree / "memory.zswap.max").read_text().strip() == "max"


def test_a_kernel_without_zswap_files_only_lifts_swap(v2_tree):
    assert cgroups.lift_swap("dsec-x", "c1", True)
    assert not (v2_tree / "memory.zswap.max").exists()
    assert (v2_tree / "memory.swap.max").read_text().strip() == "268435456"
