"""pack_diff: a sandbox's changes become a layer; restore and branch from it."""

from __future__ import annotations

import pytest

from libdsec import DSecContainerRunArgs, InvalidRequest

pytestmark = [pytest.mark.slow, pytest.mark.root]


async def test_round_trip_keeps_deletions_and_replaced_dirs_and_scrubs_residue(client):
    args = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=64)
    async with await client.run_container(args) as sandbox:
        setup = await sandbox.run_shell(
            "set -e; echo kept > /root/result.txt; rm /bin/vi; rm -rf /etc; mkdir /etc; echo new > /etc/only;"
            "echo junk > /tmp/junk; echo 'cat secret' > /root/.ash_history; mkdir -p /srv/a; echo 1 > /srv/a/f"
        )
        assert setup.exit_code == 0, setup.stderr
        snap = await sandbox.pack_diff()
        assert {"/tmp/junk", "/root/.ash_history"} <= set(snap.scrubbed)
        assert snap.image.startswith("snap-") and snap.layers[-1] == snap.layer
        # The packed sandbox keeps running and is not frozen.
        assert (await sandbox.run_shell("echo alive")).stdout == "alive\n"

    restored = await client.run_container(DSecContainerRunArgs(container_image=snap.image, memory_limit_mb=64))
    async with restored:
        check = await restored.run_shell(
            "cat /root/result.txt; ls /etc; test -e /bin/vi || echo vi-gone; test -e /tmp/junk || echo no-junk;"
            "test -e /root/.ash_history || echo no-history; cat /srv/a/f"
        )
        assert check.stdout.split() == ["kept", "only", "vi-gone", "no-junk", "no-history", "1"]
    info = await client.inspect_image(snap.image)
    assert info.roles[-1] == "snapshot" and info.parent == "busybox"
    await client.remove_image(snap.image)


async def test_branches_are_independent(client):
    base = await client.run_container(DSecContainerRunArgs(container_image="busybox"))
    async with base:
        await base.run_shell("echo step-k > /state")
        snap = await base.pack_diff(name="branch-point-test")
    try:
        branches = await client.run_containers(DSecContainerRunArgs(container_image=snap.image), count=3)
        for i, b in enumerate(branches):
            await b.run_shell(f"echo {i} >> /state")
        outputs = [(await b.run_shell("cat /state")).stdout.split() for b in branches]
        assert outputs == [["step-k", str(i)] for i in range(3)]
        for b in branches:
            await b.stop()
        with pytest.raises(InvalidRequest, match="exists"):
            other = await client.run_container(DSecContainerRunArgs(container_image="busybox"))
            async with other:
                await other.pack_diff(name="branch-point-test")
    finally:
        await client.remove_image(snap.image)


async def test_image_in_use_cannot_be_removed(client):
    sandbox = await client.run_container(DSecContainerRunArgs(container_image="busybox"))
    async with sandbox:
        snap = await sandbox.pack_diff()
        user = await client.run_container(DSecContainerRunArgs(container_image=snap.image))
        with pytest.raises(InvalidRequest, match="in use"):
            await client.remove_image(snap.image)
        await user.stop()
    await client.remove_image(snap.image)
