"""dsec.resources.ksm against a stand-in for /sys/kernel/mm/ksm (the real one is node-wide:
the microVM benchmark measures what it does)."""

from __future__ import annotations

import pytest

from dsec.resources import ksm


@pytest.fixture
def fake_ksm(tmp_path, monkeypatch):
    for key, value in {"run": "0", "pages_to_scan": "100", "sleep_millisecs": "20", "use_zero_pages": "0",
                       "full_scans": "7", "pages_sharing": "12", "pages_shared": "3"}.items():
        (tmp_path / key).write_text(value + "\n")
    monkeypatch.setattr(ksm, "KSM", tmp_path)
    monkeypatch.setattr(ksm, "SAVED", tmp_path / "saved" / "ksm-host.json")
    return tmp_path


def test_enable_sets_the_platform_rate_and_starts_it(fake_ksm):
    before = ksm.read()
    assert before == {"run": "0", "pages_to_scan": "100", "sleep_millisecs": "20", "use_zero_pages": "0"}
    assert ksm.enable()
    assert ksm.read() == {"run": "1", **ksm.SETTINGS}
    assert ksm.full_scans() == 7
    assert ksm.stats() == {"pages_shared": 3, "pages_sharing": 12, "full_scans": 7}
    ksm.write(before)
    assert ksm.read() == before


def test_no_ksm_or_no_permission_is_a_warning_not_an_error(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(ksm, "KSM", tmp_path / "absent")
    assert not ksm.available()
    assert not ksm.enable()
    assert "no KSM" in caplog.text
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "run").mkdir()  # writing it fails (a directory): like a read-only sysfs
    monkeypatch.setattr(ksm, "KSM", tmp_path / "ro")
    assert not ksm.enable()
    assert "cannot set KSM" in caplog.text


async def test_the_microvm_backend_gives_the_host_its_settings_back(fake_ksm, tmp_path):
    """A node turns KSM on for its microVMs, and a stopping edge (nothing left running) puts
    the host's settings back as it found them."""
    from dsec.backends.vm.microvm import MicroVMBackend

    backend = MicroVMBackend(tmp_path / "node", None, tmp_path / "assets", use_ksm=True)
    before = ksm.read()
    await backend._start_ksm()
    assert ksm.read() == {"run": "1", **ksm.SETTINGS}
    backend.release_unused()
    assert ksm.read() == before


def test_settings_left_by_a_run_that_died_are_given_back(fake_ksm):
    """A run that dies with KSM on leaves the host's settings saved: the next run takes those
    (not DSec's rate it finds) and gives them back."""
    host = ksm.read()
    assert ksm.take() == host
    ksm.enable()  # ... and the run dies here
    assert ksm.take() == host  # the next run
    ksm.give_back(ksm.take())
    assert ksm.read() == host
    assert not ksm.SAVED.exists()
    assert ksm.take() == host  # a clean slate: the settings now
