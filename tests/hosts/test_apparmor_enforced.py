"""AppArmor as a host that has it enforces it: the container sandboxes run under the
``dsec-sandbox`` profile, a refusal reaches the caller as EACCES, and the edge records it as an
``apparmor.denied`` event. Runs where the kernel has AppArmor on (inside the Debian 12 VM of
test_debian12_vm.py); skipped on this development host, which has none."""

from __future__ import annotations

import asyncio

import pytest

from dsec.isolation import apparmor
from libdsec import DSecContainerRunArgs

pytestmark = [
    pytest.mark.slow, pytest.mark.root,
    pytest.mark.skipif(apparmor.kernel_support() is not None, reason=f"no AppArmor here: {apparmor.kernel_support()}"),
]


async def test_sandboxes_run_under_the_profile(client):
    info = (await client.node_info())[0]
    assert info.apparmor == "enforce"
    async with await client.run_container(DSecContainerRunArgs(container_image="busybox")) as sb:
        label = await sb.run_shell("cat /proc/self/attr/current; cat /proc/1/attr/current")
        assert label.stdout.splitlines() == ["dsec-sandbox (enforce)"] * 2, label


async def test_a_refusal_is_a_security_event(client):
    async with await client.run_container(DSecContainerRunArgs(container_image="busybox")) as sb:
        # Masked (an empty file over it) and, under the profile, refused outright: the red team's
        # read that crashed a kernel.
        r = await sb.run_shell("cat /proc/kpagecgroup; echo rc=$?")
        assert "rc=1" in r.stdout and "Permission denied" in r.stderr, r
        found: list[str] = []
        for _ in range(40):
            found = [e.detail for e in await sb.security_events() if e.kind == "apparmor.denied"]
            if found:
                break
            await asyncio.sleep(0.1)
        assert any("/proc/kpagecgroup" in d and "'cat'" in d for d in found), found
