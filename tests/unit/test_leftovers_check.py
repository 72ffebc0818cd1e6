"""``dsec.local.leftovers`` does not count the process that asks, nor what started it: a
benchmark run as ``timeout 600 dsec bench … --state-dir DIR`` named its own ``timeout`` as
left behind (its command line names the state dir) and failed."""

from __future__ import annotations

import subprocess
import sys


def test_the_asking_process_and_its_ancestors_are_not_leftovers(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    code = "import sys; from pathlib import Path; from dsec.local import leftovers; print(leftovers(Path(sys.argv[1]), settle_s=0))"
    # The shell in between names the state dir on its command line, as `timeout` did.
    out = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$0" "$1"; : {state}', code, str(state)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_another_process_naming_the_state_dir_is_a_leftover(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    stray = subprocess.Popen(["sh", "-c", f"sleep 30; : {state}/x"])
    try:
        from dsec.local import leftovers

        found = leftovers(state, settle_s=0)
    finally:
        stray.kill()
        stray.wait()
    assert any(str(stray.pid) in f for f in found), found
