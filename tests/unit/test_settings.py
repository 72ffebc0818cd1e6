"""The server's settings (``dsec.settings``): every ``DSEC_*`` variable the server reads is
declared there, parsed with a message naming a bad one, read once by a server as it starts,
and listed for operators in docs/OPERATIONS.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsec import settings
from dsec.settings import Settings, SettingsError

ROOT = Path(__file__).resolve().parents[2]
# Not the server's: the SDK's (a client's endpoint and token, which the integrations document),
# the local server helper's start bound, and a variable a sandbox's own shell sets.
NOT_SETTINGS = {"DSEC_ENDPOINT", "DSEC_TOKEN", "DSEC_SERVE_START_TIMEOUT_S", "DSEC_PROC_DIR"}


def test_every_variable_the_server_reads_is_a_setting_and_documented():
    named = set()
    for path in (ROOT / "src" / "dsec").rglob("*.py"):
        named |= set(re.findall(r"DSEC_[A-Z0-9_]+", path.read_text()))
    declared = {name for name, _, _ in settings.variables()}
    assert named - NOT_SETTINGS == declared
    operations = (ROOT / "docs" / "OPERATIONS.md").read_text()
    assert [name for name in declared if f"`{name}`" not in operations] == []


def test_no_part_of_the_server_reads_one_from_the_environment_itself():
    reads = re.compile(r"(environ(\.get)?[\[(]|getenv\()\s*[\"']DSEC_")
    found = [f"{p.relative_to(ROOT)}" for p in (ROOT / "src" / "dsec").rglob("*.py")
             if p.name != "settings.py" and p.name != "local.py" and reads.search(p.read_text())]
    assert found == []


def test_defaults_and_values():
    assert Settings.from_env({}) == Settings()
    got = Settings.from_env({"DSEC_VMS": "0", "DSEC_VM_ACCEL": "TCG", "DSEC_JOB_RETENTION_S": "3600",
                             "DSEC_LAYER_ATTACH": " loop ", "DSEC_TRACEMALLOC_FRAMES": "16", "DSEC_METRICS": "",
                             "DSEC_VM_ASSETS": "/tmp/assets"})
    assert (got.vms, got.vm_accel, got.job_retention_s, got.layer_attach, got.tracemalloc_frames, got.metrics,
            got.vm_assets) == (False, "tcg", 3600.0, "loop", 16, True, Path("/tmp/assets"))


def test_every_bad_value_is_named_at_once():
    with pytest.raises(SettingsError) as caught:
        Settings.from_env({"DSEC_VMS": "maybe", "DSEC_LAYER_ATTACH": "block", "DSEC_JOB_RETENTION_S": "-1",
                           "DSEC_TRACEMALLOC_FRAMES": "many"})
    assert str(caught.value) == (
        "DSEC_VMS='maybe': use 1 or 0; DSEC_LAYER_ATTACH='block': use auto, file or loop; "
        "DSEC_JOB_RETENTION_S='-1': give a number of seconds (> 0); "
        "DSEC_TRACEMALLOC_FRAMES='many': give a whole number from 1 to 1000")


def test_loaded_once_then_the_environment_no_longer_counts(monkeypatch):
    monkeypatch.setattr(settings, "_loaded", None)
    monkeypatch.setenv("DSEC_METRICS", "0")
    assert settings.current().metrics is False  # none loaded: the environment as it is now
    settings.load()
    monkeypatch.setenv("DSEC_METRICS", "1")
    assert settings.current().metrics is False  # as it was when the server started


def test_a_server_with_a_bad_variable_does_not_start_and_says_which(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dsec", "serve", "--state-dir", str(tmp_path), "--port", "1"],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "DSEC_VMS": "sometimes",
                               "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'libdsec' / 'src'}"})
    assert proc.returncode != 0
    assert "DSEC_VMS='sometimes': use 1 or 0" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
