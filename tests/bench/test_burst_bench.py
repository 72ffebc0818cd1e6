"""``dsec bench burst`` at a tiny size: the eager peer pulls the layered task images from a
registry on loopback into one layer-sharing store (the base once) and runs them, the goals are
judged against it, and nothing is left behind (no podman image, mount, registry or cgroup)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from dsec_bench import burst

pytestmark = [pytest.mark.slow, pytest.mark.root]


@pytest.mark.disk_quiet  # bytes written are the disk's: the host VM rows' writes would count
def test_eager_pulls_layered_images_from_a_loopback_registry(tmp_path: Path, python_image, test_store) -> None:
    if missing := burst.missing_tools("registry") + burst.missing_tools("podman"):
        pytest.skip(f"missing here: {missing}")
    console = Console(file=open(os.devnull, "w"), width=200)
    state = tmp_path / "state"
    code = burst.main(state, console, count=4, images=2, base="python", podman=False,
                      base_store=str(test_store), concurrency=4)
    res = json.loads((state / burst.RESULTS_FILE).read_text())
    assert code == 0, res["errors"]
    arms = {a["name"].split()[0]: a for a in res["arms"]}
    assert set(arms) == {"DSec", "eager"} and arms["eager"]["name"] == "eager (pull, then crun)"
    assert arms["eager"]["tasks_ok"] == 4 and arms["DSec"]["tasks_ok"] == 4
    # The base was pulled once: its blob staged and applied (about 1.5× the tar), where two
    # unshared images would write it twice over (about 4×); the disk is shared, hence the slack.
    assert arms["eager"]["bytes_written"] < 3 * res["inputs"]["base_tar_mb"] * 1e6
    goals = {g["goal"]: g for g in res["summary"]["goals"]}
    assert set(goals) == {"completion ≥ 2× faster than eager", "≥ 70% fewer bytes written than eager"}
    assert all(g["met"] is not None for g in goals.values())
    assert res["leftovers"] == {"dsec": [], "peers": []}
    assert not [p for p in Path("/run").iterdir() if p.name.startswith("dsec-burst-")]
    ps = subprocess.run(["pgrep", "-f", f"docker-registry serve {state}"], capture_output=True, text=True)
    assert ps.stdout.strip() == ""
