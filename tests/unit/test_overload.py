"""Overload: the node's work gate (admission.WorkGate) refuses past its bounded queue with
``Overloaded`` (429 and Retry-After through the apiserver, on the lean routes and FastAPI's), and
the SDK sends again, with backoff, the calls that are safe to repeat and no others."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

import httpx
import pytest

import libdsec
from dsec.apiserver.app import Cluster
from dsec.app import create_app
from dsec.edge.admission import WorkGate
from libdsec._client import may_repeat
from libdsec.protocol import KEY_HEADER
from libdsec.protocol import (
    DSecContainerRunArgs, ExecEvent, ExecRequest, ExecResult, NodeInfo, SandboxInfo, SandboxStatus,
)

TOKEN = "s3cret"
SID = "n0-0123456789abcdef"


# -- the gate ----------------------------------------------------------------------------------


async def test_gate_runs_its_slots_queues_the_next_and_refuses_past_the_queue():
    gate = WorkGate("commands", "n0", running=2, queued=2, wait_s=5)
    release = asyncio.Event()
    order: list[int] = []

    async def work(i: int) -> int:
        async with gate.slot():
            order.append(i)
            await release.wait()
        return i

    tasks = [asyncio.create_task(work(i)) for i in range(4)]
    await asyncio.sleep(0.05)
    assert (gate.running, gate.queued) == (2, 2) and order == [0, 1]
    started = time.monotonic()
    with pytest.raises(libdsec.Overloaded, match=r"node n0 is overloaded: 2 commands running and 2 waiting") as err:
        async with gate.slot():
            pass
    assert time.monotonic() - started < 0.5, "a refusal past the queue is at once"
    assert err.value.retry_after > 0 and err.value.status == 429 and gate.refused == 1
    release.set()
    assert await asyncio.gather(*tasks) == [0, 1, 2, 3]
    assert order == [0, 1, 2, 3], "the queue is served in order"
    assert (gate.running, gate.queued) == (0, 0)


async def test_gate_refuses_a_call_that_waited_its_longest():
    gate = WorkGate("creates", "n0", running=1, queued=4, wait_s=0.2)
    hold = asyncio.Event()

    async def holder() -> None:
        async with gate.slot():
            await hold.wait()

    task = asyncio.create_task(holder())
    await asyncio.sleep(0.01)
    started = time.monotonic()
    with pytest.raises(libdsec.Overloaded, match=r"no slot for creates within 0.2 s"):
        async with gate.slot():
            pass
    assert 0.15 < time.monotonic() - started < 1.0
    hold.set()
    await task
    assert (gate.running, gate.queued) == (0, 0)
    async with gate.slot():  # free again
        assert gate.running == 1


async def test_a_cancelled_waiter_gives_back_its_place_and_a_handed_slot():
    gate = WorkGate("commands", "n0", running=1, queued=4, wait_s=5)
    hold = asyncio.Event()

    async def holder() -> None:
        async with gate.slot():
            await hold.wait()

    first = asyncio.create_task(holder())
    await asyncio.sleep(0.01)
    waiting = asyncio.create_task(holder())
    await asyncio.sleep(0.01)
    assert gate.queued == 1
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert gate.queued == 0
    hold.set()
    await first
    assert gate.running == 0
    # A batch's parts (queue=False) wait even when the queue is full; check() refuses at once.
    full = WorkGate("creates", "n0", running=1, queued=0, wait_s=5)
    hold.clear()
    task = asyncio.create_task(_hold(full, hold))
    await asyncio.sleep(0.01)
    with pytest.raises(libdsec.Overloaded):
        full.check()
    part = asyncio.create_task(_enter(full, queue=False))
    await asyncio.sleep(0.01)
    assert full.queued == 1
    hold.set()
    await asyncio.gather(task, part)
    assert full.running == 0


async def _hold(gate: WorkGate, event: asyncio.Event) -> None:
    async with gate.slot():
        await event.wait()


async def _enter(gate: WorkGate, queue: bool) -> None:
    async with gate.slot(queue=queue):
        pass


def test_gate_settings_are_checked():
    with pytest.raises(ValueError, match="running=0"):
        WorkGate("creates", "n0", running=0, queued=1, wait_s=1)


# -- the retry rule ------------------------------------------------------------------------------


def _keyed(key: str | None) -> dict[str, str]:
    return {KEY_HEADER: key} if key is not None else {}


@pytest.mark.parametrize(("method", "path", "headers", "refused", "expected"), [
    ("POST", "/v1/sandboxes", None, True, False),  # a plain create: never
    ("POST", "/v1/sandboxes", None, False, False),
    ("POST", "/v1/sandboxes", _keyed(None), True, False),
    ("POST", "/v1/sandboxes", _keyed("k1"), True, True),  # with an idempotency key: yes
    ("POST", "/v1/sandboxes", _keyed("k1"), False, True),
    ("POST", "/v1/microvms", _keyed(""), True, False),
    ("POST", "/v1/vms", _keyed("k"), False, True),
    ("POST", "/v1/sandboxes:batch", _keyed(None), True, False),
    ("POST", "/v1/sandboxes:batch", _keyed("k"), True, True),
    ("POST", f"/v1/sandboxes/{SID}/clean_copy", None, True, False),
    ("POST", f"/v1/sandboxes/{SID}/exec", None, True, True),  # refused before it ran
    ("POST", f"/v1/sandboxes/{SID}/exec", None, False, False),  # may have run
    ("GET", f"/v1/sandboxes/{SID}", None, False, True),
    ("PUT", f"/v1/sandboxes/{SID}/files", None, False, True),
    ("DELETE", f"/v1/sandboxes/{SID}", None, False, True),
])
def test_what_the_sdk_sends_again(method, path, headers, refused, expected):
    assert may_repeat(method, path, headers, refused) is expected


# -- through the apiserver -----------------------------------------------------------------------


class BusyEdge:
    """A fake edge whose commands and creates go through real gates: the first ``busy`` of each
    are held until ``release`` is set."""

    node = "n0"

    def __init__(self, running: int = 1, queued: int = 0) -> None:
        self.commands = WorkGate("commands", "n0", running, queued, wait_s=5)
        self.creates = WorkGate("creates", "n0", running, queued, wait_s=5)
        self.release = asyncio.Event()
        self.ran = 0
        self.made = 0

    def _info(self) -> SandboxInfo:
        now = datetime.now(timezone.utc)
        return SandboxInfo(id=SID, node="n0", image="busybox", status=SandboxStatus.running, created_at=now,
                           last_active_at=now, memory_limit_mb=64, cpu_cores_limit=1, ttl_running_stop=60,
                           init_user="root", workdir="/")

    async def exec(self, sandbox_id, request: ExecRequest):
        async with self.commands.slot():
            await self.release.wait()
            self.ran += 1
            return ExecResult(exit_code=0, stdout=request.command, stderr="", duration_s=0.0)

    async def exec_stream(self, sandbox_id, request: ExecRequest):
        async with self.commands.slot():
            await self.release.wait()
            self.ran += 1
            yield ExecEvent(event="exit", result=ExecResult(exit_code=0, stdout="", stderr="", duration_s=0.0))

    async def create(self, args, kind="container", project="root"):
        async with self.creates.slot():
            await self.release.wait()
            self.made += 1
            return self._info()

    async def get(self, sandbox_id):
        return self._info()

    async def node_info(self):
        return NodeInfo(node="n0", cgroup_version="v1", runtime="fake", sandboxes=0, memory_total_mb=4096,
                        cpu_cores=4)


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def _http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://api", headers={"authorization": f"Bearer {TOKEN}"})


@pytest.mark.parametrize("route", ["exec", "exec:stream"])  # the lean path, and FastAPI's
async def test_a_call_past_the_queue_is_429_with_retry_after(route):
    edge = BusyEdge()
    app = create_app(Cluster([edge]), TOKEN)
    async with _http(app) as http:
        held = asyncio.create_task(http.post(f"/v1/sandboxes/{SID}/{route}", json={"command": "a"}))
        await _until(lambda: edge.commands.running)
        refused = await asyncio.wait_for(http.post(f"/v1/sandboxes/{SID}/{route}", json={"command": "b"}), 2)
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "overloaded" and "node n0 is overloaded" in error["message"]
        assert 0 < error["retry_after"] <= 30
        edge.release.set()
        assert (await held).status_code == 200
    assert edge.ran == 1


async def test_the_sdk_retries_refused_commands_until_they_run():
    edge = BusyEdge(running=2, queued=0)
    app = create_app(Cluster([edge]), TOKEN)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with libdsec.DSecClient("http://api", token=TOKEN, transport=transport, retries=20,
                                  retry_backoff_s=0.01, retry_max_wait_s=0.1) as client:
        sandbox = await client.get_sandbox(SID)
        calls = [asyncio.create_task(sandbox.run_shell(f"echo {i}")) for i in range(8)]
        await asyncio.sleep(0.2)  # the first two hold the slots; the rest are refused and retry
        assert edge.commands.refused >= 6
        edge.release.set()
        results = await asyncio.wait_for(asyncio.gather(*calls), 30)
    assert [r.stdout for r in results] == [f"echo {i}" for i in range(8)]
    assert edge.ran == 8, "each command ran once"


async def test_the_sdk_does_not_retry_a_plain_create_and_gives_up_after_its_retries():
    edge = BusyEdge(running=1, queued=0)
    app = create_app(Cluster([edge]), TOKEN)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with libdsec.DSecClient("http://api", token=TOKEN, transport=transport, retries=3,
                                  retry_backoff_s=0.01, retry_max_wait_s=0.05) as client:
        first = asyncio.create_task(client.run_container(DSecContainerRunArgs(container_image="busybox")))
        await _until(lambda: edge.creates.running or first.done())
        with pytest.raises(libdsec.Overloaded, match="overloaded"):
            await client.run_container(DSecContainerRunArgs(container_image="busybox"))
        assert edge.creates.refused == 1, "a plain create is not sent again"
        sandbox = await client.get_sandbox(SID)
        running = asyncio.create_task(sandbox.run_shell("held"))
        await _until(lambda: edge.commands.running)
        with pytest.raises(libdsec.Overloaded):
            await sandbox.run_shell("refused")
        assert edge.commands.refused == 4, "sent once and again 3 times, then the refusal is raised"
        edge.release.set()
        await asyncio.gather(first, running)
    assert edge.made == 1


async def test_the_sdk_retries_reset_connections_only_for_calls_safe_to_repeat():
    """A connection reset under a GET is sent again; under an exec (it may have run) it is not."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.method)
        if len(seen) <= 2:
            raise httpx.ReadError("connection reset by peer")
        now = datetime.now(timezone.utc).isoformat()
        return httpx.Response(200, json={
            "id": SID, "node": "n0", "image": "busybox", "status": "running", "created_at": now,
            "last_active_at": now, "memory_limit_mb": 64, "cpu_cores_limit": 1, "ttl_running_stop": 60,
            "init_user": "root", "workdir": "/"})

    async with libdsec.DSecClient("http://api", token=TOKEN, transport=httpx.MockTransport(handler),
                                  retry_backoff_s=0.01) as client:
        sandbox = await client.get_sandbox(SID)
        assert sandbox.id == SID and seen == ["GET", "GET", "GET"]
        seen.clear()
        with pytest.raises(libdsec.ServerUnavailable, match="connection reset"):
            await sandbox.run_shell("true")
        assert seen == ["POST"]
    async with libdsec.DSecClient("http://api", token=TOKEN, transport=httpx.MockTransport(handler),
                                  retries=0) as client:
        seen.clear()
        with pytest.raises(libdsec.ServerUnavailable):
            await client.get_sandbox(SID)
        assert seen == ["GET"]


def test_retry_settings_are_checked():
    with pytest.raises(libdsec.InvalidRequest, match="must not be negative"):
        libdsec.DSecClient("http://api", retries=-1)


async def test_the_sdk_retries_a_create_that_carries_its_idempotency_key():
    """Refused twice, then made: the same request, with the same key, each time."""
    keys: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers.get("idempotency-key"))
        if len(keys) <= 2:
            return httpx.Response(429, headers={"retry-after": "1"}, json={"error": {
                "code": "overloaded", "message": "node n0 is overloaded", "retry_after": 0.01}})
        now = datetime.now(timezone.utc).isoformat()
        return httpx.Response(200, json={
            "id": SID, "node": "n0", "image": "busybox", "status": "running", "created_at": now,
            "last_active_at": now, "memory_limit_mb": 64, "cpu_cores_limit": 1, "ttl_running_stop": 60,
            "init_user": "root", "workdir": "/"})

    async with libdsec.DSecClient("http://api", token=TOKEN, transport=httpx.MockTransport(handler),
                                  retry_backoff_s=0.01, retry_max_wait_s=0.05) as client:
        sandbox = await client.run_container(DSecContainerRunArgs(container_image="busybox"), key="episode-17")
        assert sandbox.id == SID and keys == ["episode-17"] * 3
        keys.clear()
        with pytest.raises(libdsec.Overloaded):
            await client.run_container(DSecContainerRunArgs(container_image="busybox"))
        assert keys == [None], "a create without a key is sent once"
