"""The dsec-sandbox AppArmor profile's text, the audit-record parsing and the start-up checks,
against a stand-in securityfs (this host has no AppArmor; tests/hosts runs the real one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.isolation import apparmor

DENIED = ('audit: type=1400 audit(1764650000.123:45): apparmor="DENIED" operation="open" class="file" '
          'profile="dsec-sandbox" name="/proc/kpagecgroup" pid=4242 comm="grep" requested_mask="r" '
          'denied_mask="r" fsuid=1073741824 ouid=0')


def test_profile_text():
    text = apparmor.profile_text()
    assert "profile dsec-sandbox flags=(attach_disconnected,mediate_deleted) {" in text
    for rule in ("audit deny mount,", "audit deny remount,", "audit deny pivot_root,", "audit deny @{PROC}/sys/** w,",
                 "audit deny /sys/** wkl,", "audit deny @{PROC}/kpagecgroup rwklx,", "audit deny /dev/.dsec-init wkl,",
                 "signal (send, receive) peer=dsec-sandbox,"):
        assert rule in text
    # A plain deny is not logged: every refusal must become an event.
    assert not [line for line in text.splitlines() if line.strip().startswith("deny ")]
    assert "#include" not in text  # self-contained: loads whatever /etc/apparmor.d holds
    assert text.count("{") == text.count("}")


def test_parse_denial():
    d = apparmor.parse_denial(DENIED)
    assert d == apparmor.Denial(operation="open", name="/proc/kpagecgroup", requested="r", pid=4242,
                                comm="grep", fsuid=1073741824)
    assert apparmor.describe(d) == "open /proc/kpagecgroup (r) denied to 'grep'"
    mount = apparmor.parse_denial('type=1400 audit(1.2:3): apparmor="DENIED" operation="mount" '
                                  'info="failed flags match" error=-13 profile="dsec-sandbox" name="/mnt/" '
                                  'pid=7 comm="mount" fstype="tmpfs" srcname="tmpfs" flags="rw"')
    assert mount is not None and mount.operation == "mount" and mount.fsuid is None and mount.requested == "rw"
    assert apparmor.parse_denial(DENIED.replace("dsec-sandbox", "docker-default")) is None
    assert apparmor.parse_denial(DENIED.replace('"DENIED"', '"ALLOWED"')) is None
    assert apparmor.parse_denial("type=1326 audit(1.2:3): auid=0 uid=0 pid=1 syscall=165") is None


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    """A securityfs and module parameters with AppArmor on, and an apparmor_parser that records
    what it was given and 'loads' it in the mode the test sets."""
    params, sfs, bin_dir = tmp_path / "params", tmp_path / "security", tmp_path / "bin"
    for d in (params, sfs / "apparmor", bin_dir):
        d.mkdir(parents=True)
    (params / "enabled").write_text("Y\n")
    (params / "mode").write_text("enforce\n")
    (sfs / "lsm").write_text("lockdown,capability,landlock,yama,apparmor\n")
    profiles = sfs / "apparmor" / "profiles"
    profiles.write_text("")
    parser = bin_dir / "apparmor_parser"
    parser.write_text(f"#!/bin/sh\ncat > {tmp_path}/given\necho \"dsec-sandbox ($(cat {tmp_path}/loadmode))\" > {profiles}\n")
    parser.chmod(0o755)
    (tmp_path / "loadmode").write_text("enforce")
    monkeypatch.setattr(apparmor, "_PARAMETERS", params)
    monkeypatch.setattr(apparmor, "SECURITYFS", sfs)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("DSEC_APPARMOR", raising=False)
    yield tmp_path
    apparmor._loaded, apparmor._status = None, "unknown"


def test_loads_the_profile(fake_host: Path):
    assert "loaded (enforce)" in apparmor.ensure_loaded()
    assert (fake_host / "given").read_text() == apparmor.profile_text()
    assert apparmor.loaded_profile() == "dsec-sandbox" and apparmor.status() == "enforce"


def test_complain_mode_refuses_to_start(fake_host: Path):
    (fake_host / "params" / "mode").write_text("complain\n")
    with pytest.raises(apparmor.AppArmorError, match="complain mode .* DSEC_APPARMOR=0"):
        apparmor.ensure_loaded()
    assert apparmor.loaded_profile() is None
    (fake_host / "params" / "mode").write_text("enforce\n")
    (fake_host / "loadmode").write_text("complain")  # e.g. aa-complain set the profile itself
    with pytest.raises(apparmor.AppArmorError, match="loaded in complain mode"):
        apparmor.ensure_loaded()


def test_absent_or_off(fake_host: Path, monkeypatch):
    (fake_host / "params" / "enabled").write_text("N\n")
    assert "unsupported: the kernel has no AppArmor" in apparmor.ensure_loaded()
    assert apparmor.status().startswith("unsupported:") and apparmor.loaded_profile() is None
    (fake_host / "params" / "enabled").write_text("Y\n")
    monkeypatch.setenv("DSEC_APPARMOR", "0")
    assert apparmor.ensure_loaded() == "AppArmor: unsupported: turned off (DSEC_APPARMOR=0)"


def test_this_host_reports_it_absent():
    if apparmor.kernel_support() is None:
        pytest.skip("this host has AppArmor")
    assert apparmor.status().startswith("unsupported: ")
