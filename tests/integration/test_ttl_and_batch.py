"""TTL expiry and batch creation against a real ``dsec serve``."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from dsec.local import serving
from libdsec import (
    CapacityExceeded,
    DSecClient,
    DSecContainerRunArgs,
    InvalidRequest,
    SandboxStateError,
    SandboxStatus,
)

pytestmark = [pytest.mark.slow, pytest.mark.root]


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(**{"container_image": "busybox", "memory_limit_mb": 32, **kw})


async def wait_status(client, sandbox_id: str, status: SandboxStatus, within_s: float):
    deadline = time.monotonic() + within_s
    while True:
        sandbox = await client.get_sandbox(sandbox_id)
        if sandbox.status is status or time.monotonic() > deadline:
            return sandbox
        await asyncio.sleep(0.1)


async def wait_none_running(client, within_s: float = 15) -> set[str]:
    deadline = time.monotonic() + within_s
    while (ids := {s.id for s in await client.list_sandboxes()}) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return ids


async def test_ttl_expiry(client):
    """An idle sandbox stops by itself; one in use, or busy with a long command, does not."""
    idle, active, busy = await asyncio.gather(*(client.run_container(args(ttl_running_stop=2)) for _ in range(3)))

    async def keep_active():
        end = time.monotonic() + 4
        while time.monotonic() < end:  # 4 s of calls, each gap well under the TTL
            assert (await active.run_shell("true")).exit_code == 0
            await asyncio.sleep(0.2)

    long_call = busy.run_shell("sleep 4; echo done", timeout=30)  # longer than the TTL
    _, result = await asyncio.gather(keep_active(), long_call)
    assert result.stdout == "done\n"
    stopped = await wait_status(client, idle.id, SandboxStatus.stopped, within_s=10)
    assert stopped.status is SandboxStatus.stopped
    assert "ttl_running_stop=2" in stopped.info.reason and "idle" in stopped.info.reason
    assert (await client.get_sandbox(active.id)).status is SandboxStatus.running
    assert (await client.get_sandbox(busy.id)).status is SandboxStatus.running
    with pytest.raises(SandboxStateError, match="ttl_running_stop"):
        await idle.run_shell("true")
    # Left alone now, the other two expire as well.
    for sandbox in (active, busy):
        assert (await wait_status(client, sandbox.id, SandboxStatus.stopped, within_s=10)).status is SandboxStatus.stopped
    assert await wait_none_running(client, 1) == set()


async def test_batch(client):
    progress: list[tuple[int, int]] = []
    sandboxes = await client.run_containers(args(env={"ROLE": "worker"}), count=10,
                                            progress=lambda done, total: progress.append((done, total)))
    try:
        assert progress == [(i, 10) for i in range(1, 11)]
        assert len({s.id for s in sandboxes}) == 10
        assert all(s.status is SandboxStatus.running for s in sandboxes)
        listed = {s.id for s in await client.list_sandboxes()}
        assert {s.id for s in sandboxes} <= listed
        # Each is its own sandbox: a file written in one is not in another.
        await sandboxes[0].write_file("/tmp/mine", "0")
        results = await asyncio.gather(*(s.run_shell("echo $ROLE; cat /tmp/mine 2>/dev/null") for s in sandboxes))
        assert [r.stdout for r in results] == ["worker\n0"] + ["worker\n"] * 9
    finally:
        await asyncio.gather(*(s.stop() for s in sandboxes))
    assert await wait_none_running(client, 1) == set()


async def test_batch_with_a_bad_user_makes_nothing(client):
    with pytest.raises(InvalidRequest, match="unknown user"):
        await client.run_containers(args(init_user="ghost"), count=5)
    assert await wait_none_running(client) == set()


@pytest.fixture(scope="module")
def cold_server(new_state_dir):
    """A server with no warm pool and room for 3 sandboxes: every create goes to crun."""
    with serving(new_state_dir("dsec-cold"), "--pool-max", "0", "--max-sandboxes", "3") as srv:
        yield srv


@pytest.fixture
async def cold(cold_server):
    async with DSecClient(cold_server.endpoint, token=cold_server.token) as c:
        yield c
        assert await wait_none_running(c) == set()


async def test_cold_batch_up_to_capacity(cold):
    sandboxes = await cold.run_containers(args(), count=3)
    try:
        assert len(sandboxes) == 3
        with pytest.raises(CapacityExceeded, match="full"):
            await cold.run_container(args())
    finally:
        await asyncio.gather(*(s.stop() for s in sandboxes))


async def test_batch_over_capacity_is_all_or_nothing(cold):
    """The node admits 3 of 8: the batch fails, and the 3 it had started are stopped too,
    although the failure is known before any of them is up."""
    with pytest.raises(CapacityExceeded, match="full"):
        await cold.run_containers(args(), count=8)
    assert await wait_none_running(cold) == set()
    # The node is whole again.
    sandboxes = await cold.run_containers(args(), count=3)
    await asyncio.gather(*(s.stop() for s in sandboxes))


async def test_batch_abandoned_by_the_client_is_undone(cold_server, cold):
    """The client goes away right after asking for a batch: the server stops what it made."""
    body = json.dumps({"args": args().model_dump(mode="json"), "count": 3}).encode()

    async def attempts() -> int:  # creates the node began: the ones that ran and the ones undone early
        node = (await cold.stats()).nodes[0]
        return sum(node.creates.values()) + sum(node.create_failures.values())

    before = await attempts()
    for _ in range(3):
        reader, writer = await asyncio.open_connection("127.0.0.1", cold_server.port)
        writer.write(b"POST /v1/sandboxes:batch HTTP/1.1\r\nhost: dsec\r\ncontent-type: application/json\r\n"
                     + f"authorization: Bearer {cold_server.token}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                     + body)
        await writer.drain()
        writer.close()  # gone before the first sandbox is up
        await writer.wait_closed()
        assert await wait_none_running(cold) == set()
    # (and the batches did start: were nothing begun, nothing would be running either)
    assert await attempts() > before
