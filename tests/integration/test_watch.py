"""Directory watches through the SDK against a real ``dsec serve`` (crun containers, inotify
from the node): the events envd tells for each change, recursive trees, the watch's end, the
sync twin, and bad input (a missing path, a file, too many watches, a closed watch)."""

from __future__ import annotations

import asyncio

import pytest

from libdsec import (
    CapacityExceeded,
    DSecContainerRunArgs,
    InvalidRequest,
    SandboxFileNotFound,
    SessionClosed,
    SyncDSecClient,
)

pytestmark = [pytest.mark.slow, pytest.mark.root]


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(**{"container_image": "busybox", "memory_limit_mb": 64, **kw})


def told(events) -> list[tuple[str, str]]:
    return [(e.type, e.name) for e in events]


async def test_each_change_is_told_as_envd_tells_it(client):
    async with await client.run_container(args()) as sandbox:
        await sandbox.run_shell("mkdir -p /w")
        async with await sandbox.watch_dir("/w") as watch:
            assert await watch.events() == []
            # A new file written by the SDK: made, owned and moded, written (E2B's three).
            await sandbox.write_file("/w/new.txt", "hello")
            assert told(await watch.events()) == [("create", "new.txt"), ("chmod", "new.txt"), ("write", "new.txt")]
            # Changes made inside, by a command: a rename is the old name's rename and the new one's create.
            result = await sandbox.run_shell("echo hi >> /w/new.txt && mv /w/new.txt /w/moved.txt && "
                                             "chmod 600 /w/moved.txt && rm /w/moved.txt && mkdir /w/d")
            assert result.exit_code == 0, result.stderr
            assert told(await watch.events()) == [
                ("write", "new.txt"), ("rename", "new.txt"), ("create", "moved.txt"), ("chmod", "moved.txt"),
                ("remove", "moved.txt"), ("create", "d")]
            # Not recursive: what happens below d is not told; d's own removal is.
            await sandbox.run_shell("touch /w/d/below && rm -r /w/d")
            assert told(await watch.events()) == [("remove", "d")]
            # Waiting for a first event.
            later = asyncio.create_task(watch.events(wait=10))
            await asyncio.sleep(0.3)
            await sandbox.run_shell("touch /w/late")
            assert ("create", "late") in told(await asyncio.wait_for(later, 15))
            assert await watch.events(wait=0.2) == []  # nothing since: the wait runs out


async def test_a_recursive_watch_follows_new_directories_and_ends_with_its_directory(client):
    async with await client.run_container(args()) as sandbox:
        await sandbox.run_shell("mkdir -p /t/old/deeper")
        watch = await sandbox.watch_dir("/t", recursive=True)
        await sandbox.write_file("/t/old/deeper/f", "x")
        assert told(await watch.events())[:1] == [("create", "old/deeper/f")]
        await sandbox.run_shell("mkdir -p /t/new && echo 1 > /t/new/g")
        assert ("write", "new/g") in told(await watch.events())
        # Iterated as they come, until the directory goes.
        seen = []

        async def follow():
            async for event in watch:
                seen.append((event.type, event.name))

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.3)
        await sandbox.run_shell("rm -r /t")
        await asyncio.wait_for(follower, 30)
        assert ("remove", "new/g") in seen and watch.ended
        assert await watch.events() == []
        await watch.close()
        with pytest.raises(SessionClosed):
            await watch.events()


async def test_bad_watches_are_refused_and_nothing_is_left(client, server):
    async with await client.run_container(args()) as sandbox:
        await sandbox.run_shell("mkdir -p /d && touch /d/file && ln -s /d /link")
        with pytest.raises(SandboxFileNotFound, match="does not exist"):
            await sandbox.watch_dir("/nowhere")
        with pytest.raises(InvalidRequest, match="not a directory"):
            await sandbox.watch_dir("/d/file")
        with pytest.raises(InvalidRequest, match="not a directory"):
            await sandbox.watch_dir("/link")  # (a symlink is not followed)
        with pytest.raises(InvalidRequest, match="absolute"):
            await sandbox.watch_dir("relative")
        watches = [await sandbox.watch_dir("/d") for _ in range(256)]
        with pytest.raises(CapacityExceeded, match="256 watches"):
            await sandbox.watch_dir("/d")
        await asyncio.gather(*(w.close() for w in watches[:10]))
        again = await sandbox.watch_dir("/d")  # room again
        await sandbox.run_shell("touch /d/x")
        assert told(await again.events()) == [("create", "x")]
        with pytest.raises(SessionClosed):
            await watches[0].events()
        stale = watches[-1]
    # Its sandbox stopped: the watch went with it.
    with pytest.raises(SessionClosed, match="not open"):
        await stale.events()


def test_the_sync_twin_watches(server):
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        with client.run_container(args()) as sandbox:
            sandbox.run_shell("mkdir /s")
            with sandbox.watch_dir("/s") as watch:
                sandbox.write_file("/s/a", b"1")
                assert told(watch.events()) == [("create", "a"), ("chmod", "a"), ("write", "a")]
                sandbox.run_shell("rm -r /s")
                assert told(watch.events(wait=5)) == [("remove", "a")] and watch.ended
                assert list(watch) == []  # (ended: a loop over it ends at once)
