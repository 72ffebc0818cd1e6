"""E2B's ``lifecycle`` and ``beta_pause`` on DSec, driven by this environment's ``e2b`` SDK against
a real ``dsec serve``: ``on_timeout="pause"`` pauses at the timeout (DSec's ``on_ttl="pause"``),
``auto_resume`` false leaves it paused until ``connect`` (true: a call resumes it), the sandbox's
info says its lifecycle; a filesystem-only pause (``mode="filesystem"``, at the timeout too)
keeps the files and a connect boots it afresh over them (DSec's ``pause(mode="filesystem")``),
and ``on_resume="reboot"`` of a sandbox paused whole is refused with a 400 naming it."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("e2b")

from e2b import Sandbox, SandboxException, SandboxState  # noqa: E402


pytestmark = [pytest.mark.slow, pytest.mark.root]

PROCESSES = r"cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\0' ' '"  # (the image has no ps)


@pytest.fixture(scope="module")
def e2b_env(e2b_settings, python_image):
    return python_image


def wait_state(sb: Sandbox, state: SandboxState, within_s: float = 15) -> None:
    deadline = time.monotonic() + within_s
    while sb.get_info().state != state and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sb.get_info().state == state


def test_on_timeout_pause_without_auto_resume_waits_for_connect(e2b_env, server):
    sb = Sandbox.create(template=e2b_env, timeout=2, lifecycle={"on_timeout": "pause", "auto_resume": False})
    try:
        info = sb.get_info()
        assert info.lifecycle == {"on_timeout": "pause", "auto_resume": False}
        sb.files.write("/root/kept.txt", "before the timeout")
        boot_id = sb.files.read("/proc/sys/kernel/random/boot_id")  # (a /proc/sys file reads too)
        wait_state(sb, SandboxState.PAUSED)  # paused, not killed
        assert not sb.is_running()
        with pytest.raises(Exception, match="auto_resume=False"):  # a call does not wake it
            sb.commands.run("true")
        assert sb.get_info().state == SandboxState.PAUSED
        again = sb.connect(timeout=300)
        assert again.get_info().state == SandboxState.RUNNING and again.is_running()
        assert again.files.read("/root/kept.txt") == "before the timeout"
        assert again.files.read("/proc/sys/kernel/random/boot_id") == boot_id  # resumed, not booted afresh
    finally:
        sb.kill()


def test_on_timeout_pause_with_auto_resume_wakes_on_a_call(e2b_env):
    sb = Sandbox.create(template=e2b_env, timeout=2, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        assert sb.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        wait_state(sb, SandboxState.PAUSED)
        sb.set_timeout(300)
        assert sb.commands.run("echo awake").stdout == "awake\n"  # resumed by the call
        assert sb.get_info().state == SandboxState.RUNNING
    finally:
        sb.kill()


def test_beta_pause_and_the_default_lifecycle(e2b_env):
    sb = Sandbox.create(template=e2b_env, timeout=300)
    try:
        assert sb.get_info().lifecycle == {"on_timeout": "kill", "auto_resume": True}
        assert sb.beta_pause() is True
        assert sb.beta_pause() is False  # already paused (E2B's 409)
        assert sb.get_info().state == SandboxState.PAUSED
        with pytest.raises(SandboxException, match="on_resume='reboot'"):
            sb.connect(on_resume="reboot")
        assert sb.get_info().state == SandboxState.PAUSED
        sb.connect()
        assert sb.get_info().state == SandboxState.RUNNING
    finally:
        sb.kill()


def test_a_filesystem_only_pause_keeps_the_files_and_connect_boots_it_afresh(e2b_env):
    sb = Sandbox.create(template=e2b_env, timeout=300)
    try:
        sb.files.write("/root/kept.txt", "on disk")
        boot_id = sb.files.read("/proc/sys/kernel/random/boot_id")
        sb.commands.run("sleep 1000 >/dev/null 2>&1 &")
        assert "sleep 1000" in sb.commands.run(PROCESSES).stdout
        assert sb.pause(mode="filesystem")
        assert not sb.is_running()
        info = sb.get_info()
        assert (info.state, info.lifecycle["on_timeout"]) == (SandboxState.PAUSED, "kill")
        with pytest.raises(Exception, match="keeping its files only"):  # traffic does not wake it
            sb.commands.run("true")
        again = sb.connect()
        assert again.sandbox_id == sb.sandbox_id and again.is_running()
        assert again.files.read("/root/kept.txt") == "on disk"
        assert again.files.read("/proc/sys/kernel/random/boot_id") != boot_id  # booted afresh
        assert "sleep 1000" not in again.commands.run(PROCESSES).stdout
        again.connect(on_resume="reboot")  # running: a no-op
    finally:
        sb.kill()


def test_on_timeout_pause_filesystem_only(e2b_env, e2b_settings):
    # (E2B's SDK refuses auto_resume with it before asking: the API is asked directly.)
    answer = httpx.post(f"{e2b_settings['E2B_API_URL']}/sandboxes", headers={"X-API-Key": e2b_settings["E2B_API_KEY"]},
                        json={"templateID": e2b_env, "timeout": 30, "autoPause": True, "autoPauseMemory": False,
                              "autoResume": {"enabled": True}})
    assert answer.status_code == 400 and "autoResume cannot be combined" in answer.json()["message"]
    sb = Sandbox.create(template=e2b_env, timeout=2, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    try:
        assert sb.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        sb.files.write("/root/kept.txt", "before the timeout")
        boot_id = sb.files.read("/proc/sys/kernel/random/boot_id")
        wait_state(sb, SandboxState.PAUSED)
        again = sb.connect(timeout=300)
        assert again.files.read("/root/kept.txt") == "before the timeout"
        assert again.files.read("/proc/sys/kernel/random/boot_id") != boot_id
    finally:
        sb.kill()


def test_a_network_option_dsec_cannot_honour_is_refused_by_name(e2b_env, e2b_settings):
    answer = httpx.post(f"{e2b_settings['E2B_API_URL']}/sandboxes", headers={"X-API-Key": e2b_settings["E2B_API_KEY"]},
                        json={"templateID": e2b_env, "timeout": 30,
                              "network": {"maskRequestHost": "custom-host.example.com:${PORT}"}})
    assert answer.status_code == 400 and "maskRequestHost" in answer.json()["message"]
