"""Named snapshots of real containers (crun, EROFS layers) through ``dsec serve``: taken, listed,
started from by id and by name, kept across a server crash, removed only when unused, and
every bad request a 4xx naming its problem."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from dsec.local import LocalServer, leftovers
from libdsec import (
    DSecClient, DSecContainerRunArgs, InvalidRequest, SnapshotConflict, SnapshotNotFound,
)

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.usefixtures("no_sandbox_outlives_the_test")]


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(**{"container_image": "busybox", "memory_limit_mb": 64, **kw})


async def test_a_container_snapshot_starts_sandboxes_after_its_source_is_gone(client, request):
    name = f"episode-{request.node.name[:20].lower().replace('_', '-')}-{id(client) % 10_000}"
    async with await client.run_container(args()) as source:
        made = await source.run_shell("mkdir -p /work && echo step-7 > /work/state.txt && rm /bin/vi")
        assert made.exit_code == 0, made
        snap = await source.snapshot(name=name)  # a container: filesystem by default
        assert (snap.mode, snap.kind, snap.name, snap.sandbox_id, snap.source_image) == (
            "filesystem", "container", name, source.id, "busybox")
        assert snap.layer and snap.size_bytes > 0
        with pytest.raises(InvalidRequest, match="a container sandbox takes no full snapshots"):
            await source.snapshot("full")
        with pytest.raises(SnapshotConflict, match=f"snapshot name '{name}' is taken by snapshot {snap.id}"):
            await source.snapshot("filesystem", name=name)
    try:
        assert snap.id in {s.id for s in await client.list_snapshots()}
        assert (await client.get_snapshot(name)).id == snap.id
        by_id = await client.run_container(DSecContainerRunArgs(snapshot=snap.id, memory_limit_mb=64))
        by_name = await client.run_container(DSecContainerRunArgs(snapshot=name, memory_limit_mb=64))
        try:
            for child in (by_id, by_name):
                assert child.info.snapshot == snap.id
                r = await child.run_shell("cat /work/state.txt; test -e /bin/vi && echo vi-back")
                assert r.stdout == "step-7\n", r
            await by_id.write_file("/work/state.txt", b"changed in one child\n")
            assert await by_name.read_file("/work/state.txt") == b"step-7\n"
            with pytest.raises(SnapshotConflict, match=f"in use by the sandboxes started from it.*{by_id.id}"):
                await client.remove_snapshot(name)
        finally:
            await by_id.stop()
            await by_name.stop()
    finally:
        removed = await client.remove_snapshot(name)
    assert removed.id == snap.id
    with pytest.raises(SnapshotNotFound, match=f"no snapshot '{name}'"):
        await client.get_snapshot(name)
    with pytest.raises(SnapshotNotFound, match=f"no snapshot '{snap.id}'"):
        await client.run_container(DSecContainerRunArgs(snapshot=snap.id))


async def test_bad_snapshot_requests_are_4xx_naming_the_problem(client, server):
    headers = {"authorization": f"Bearer {server.token}"}
    async with await client.run_container(args()) as source, \
            httpx.AsyncClient(base_url=server.endpoint, headers=headers) as http:
        for body, status, said in [
            ({"name": "Not-Lower"}, 422, "invalid snapshot name 'Not-Lower'"),
            ({"name": "s0123456789abcdef"}, 422, "has the form of a snapshot id"),
            ({"mode": "memory"}, 422, "mode"),
            ({"mode": "full"}, 422, "takes no full snapshots"),
        ]:
            r = await http.post(f"/v1/sandboxes/{source.id}/snapshot", json=body)
            assert r.status_code == status and said in r.json()["error"]["message"], r.text
        for path, status, code in [("/v1/snapshots/no-such-snapshot", 404, "snapshot_not_found"),
                                   ("/v1/snapshots/Bad..Name", 422, "invalid_request")]:
            r = await http.get(path)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
            r = await http.delete(path)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
        r = await http.post("/v1/sandboxes", json={"snapshot": "no-such-snapshot"})
        assert r.status_code == 404 and "no snapshot 'no-such-snapshot'" in r.json()["error"]["message"]
        r = await http.post("/v1/sandboxes", json={"memory_limit_mb": 64})
        assert r.status_code == 422 and "container_image is required" in r.text
        assert (await source.run_shell("echo still serving")).stdout == "still serving\n"


async def test_a_snapshot_survives_a_server_crash(new_state_dir):
    """kill -9 of the server: the snapshot is in the layer store, found and started from after."""
    state = new_state_dir("dsec-snap-restart")
    server = LocalServer(state).start()
    try:
        async with DSecClient(server.endpoint, token=server.token) as client:
            async with await client.run_container(args()) as source:
                await source.run_shell("echo kept > /root/kept.txt")
                snap = await source.snapshot("filesystem")
        port = server.port
        server.kill()
        server = LocalServer(state, port=port).start()
        async with DSecClient(server.endpoint, token=server.token) as client:
            assert (await client.get_snapshot(snap.id)).created_at == snap.created_at
            async with await client.run_container(DSecContainerRunArgs(snapshot=snap.id, memory_limit_mb=64)) as child:
                assert await child.read_file("/root/kept.txt") == b"kept\n"
            await client.remove_snapshot(snap.id)
            assert snap.id not in {s.id for s in await client.list_snapshots()}
    finally:
        server.stop()
    await asyncio.sleep(0)
    assert not leftovers(state), leftovers(state)
