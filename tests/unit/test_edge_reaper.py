"""The TTL reaper (dsec.edge.reaper): which sandboxes are due, and the reaper at work over the fake
backend. The TTLs of paused sandboxes through pause and resume are in test_edge_resources.py."""

from __future__ import annotations

import asyncio

from dsec.backends.base import Handle
from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from dsec.edge.lifecycle import Record
from dsec.edge.reaper import expired
from dsec.images.store import Image
from libdsec.protocol import DSecContainerRunArgs, ExecRequest, SandboxStatus


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image="tiny", **kw)


def record(name: str, status: SandboxStatus, last_active: float, calls: int = 0, paused_at: float | None = None,
           ttl: float = 10) -> Record:
    image = Image(name="tiny", layers=("sha256-0",))
    return Record(id=f"n0-{name}", kind="container", handle=Handle(cid=name, image="tiny", layers=image.layers),
                  args=args(ttl_running_stop=ttl), image=image, status=status, created_at=0.0,
                  last_active=last_active, calls=calls, paused_at=paused_at)


def test_what_is_due():
    now = 1000.0
    records = [
        record("idle", SandboxStatus.running, last_active=now - 11),
        record("recent", SandboxStatus.running, last_active=now - 9),
        record("busy", SandboxStatus.running, last_active=now - 11, calls=1),  # a call in flight
        record("creating", SandboxStatus.creating, last_active=now - 11),
        record("stopping", SandboxStatus.stopping, last_active=now - 11),
        # A paused sandbox is exempt from its run TTL, not from the paused one.
        record("paused", SandboxStatus.paused, last_active=now - 11, paused_at=now - 50),
        record("long-paused", SandboxStatus.paused, last_active=now - 11, paused_at=now - 61),
    ]
    due = {r.handle.cid: reason for r, reason in expired(records, now, paused_ttl_s=60)}
    assert due == {"idle": "idle for over ttl_running_stop=10s", "long-paused": "paused for over paused_ttl_s=60s"}


async def test_ttl_stops_idle_sandbox_but_not_a_busy_one(edge):
    idle = await edge.create(args(ttl_running_stop=1))
    busy = await edge.create(args(ttl_running_stop=1))
    await edge.exec(busy.id, ExecRequest(command="sleep 1.5"))
    await asyncio.sleep(0.3)
    info = await edge.get(idle.id)
    assert info.status is SandboxStatus.stopped and "ttl_running_stop" in info.reason
    assert (await edge.get(busy.id)).status is SandboxStatus.running


async def test_the_reaper_outlives_a_stop_that_fails(tmp_path, store):
    """A TTL stop that fails with an error of the backend's own (not DSec's) is logged, and the
    reaper goes on stopping the sandboxes due after it."""
    backend = FakeBackend()
    real_destroy = backend.destroy
    wedged: set[str] = set()

    async def destroy(handle):
        if handle.cid in wedged:
            raise RuntimeError("the runtime is wedged")
        await real_destroy(handle)

    backend.destroy = destroy
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", reaper_interval_s=0.05, pool_min=0, pool_max=0), backend, store)
    await edge.start()
    try:
        first = await edge.create(args(ttl_running_stop=1))
        wedged.add(edge._records[first.id].handle.cid)
        await asyncio.sleep(0.5)
        second = await edge.create(args(ttl_running_stop=1))
        for _ in range(60):
            if (await edge.get(second.id)).status is not SandboxStatus.running:
                break
            await asyncio.sleep(0.05)
        got = await edge.get(first.id)
        assert got.status is SandboxStatus.failed and "wedged" in got.reason
        got = await edge.get(second.id)
        assert got.status is SandboxStatus.stopped and "ttl_running_stop" in got.reason
    finally:
        await edge.close()
