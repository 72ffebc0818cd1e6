"""E2B's ``lifecycle`` and ``beta_pause`` on DSec, driven by this environment's ``e2b`` SDK against
a real ``dsec serve``: ``on_timeout="pause"`` pauses at the timeout (DSec's ``on_ttl="pause"``),
``auto_resume`` false leaves it paused until ``connect`` (true: a call resumes it), the sandbox's
info says its lifecycle, and a filesystem-only pause is refused with a 400 naming it."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("e2b")

from e2b import Sandbox, SandboxException, SandboxState  # noqa: E402


pytestmark = [pytest.mark.slow, pytest.mark.root]


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
        with pytest.raises(SandboxException, match="filesystem-only pause"):
            Sandbox.create(template=e2b_env, timeout=30, lifecycle={"on_timeout": {"action": "pause",
                                                                                   "mode": "filesystem"}})
        sb.connect()
        with pytest.raises(SandboxException, match="filesystem-only pause"):
            sb.pause(mode="filesystem")
        assert sb.get_info().state == SandboxState.RUNNING
    finally:
        sb.kill()
