"""``Sandbox.fork`` on the SDK's side and its wire models: the request checked before it is sent,
the answer turned into sandboxes (or, one entry per child, their errors), the sync twin's the
same. Over httpx.MockTransport; the real forks are in tests/integration/test_fork.py."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import ValidationError

from libdsec import BackendError, CapacityExceeded, DSecClient, InvalidRequest, SyncDSecClient
from libdsec.protocol import MAX_FORK_COUNT, ForkRequest, ForkResult, SandboxInfo
from sdk_answers import INFO

PARENT = INFO["id"]
CHILD = {**INFO, "id": "n0-00000000000000c1"}


def test_the_request_model_bounds_the_count_and_the_ttl():
    assert ForkRequest().count == 1 and ForkRequest().all_or_none is True
    for count in (0, -3, MAX_FORK_COUNT + 1):
        with pytest.raises(ValidationError, match="count"):
            ForkRequest(count=count)
    with pytest.raises(ValidationError, match="finite"):
        ForkRequest(ttl_running_stop=float("inf"))
    with pytest.raises(ValidationError, match="extra"):
        ForkRequest.model_validate({"count": 1, "memory": True})


def test_a_child_is_a_sandbox_or_an_error():
    result = ForkResult.model_validate({"parent": PARENT, "kind": "memory", "snapshot": "s0123456789abcdef",
                                        "children": [{"sandbox": CHILD}, {"error": {"code": "capacity_exceeded",
                                                                                    "message": "full"}}],
                                        "frozen_s": 0.2, "fork_s": 1.0})
    assert isinstance(result.children[0].sandbox, SandboxInfo) and result.children[1].error.code == "capacity_exceeded"
    with pytest.raises(ValidationError):
        ForkResult.model_validate({**result.model_dump(), "kind": "disk"})


def _server(seen: list, answer: dict):
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, json.loads(request.content or b"{}")))
        return httpx.Response(200, json=answer if request.url.path.endswith("/fork") else INFO)
    return httpx.MockTransport(handler)


ANSWER = {"parent": PARENT, "kind": "filesystem", "layer": "sha256-" + "0" * 64, "frozen_s": 0.1, "fork_s": 0.4,
          "children": [{"sandbox": CHILD}, {"error": {"code": "backend_error", "message": "crun failed"}}]}


async def test_the_sdk_sends_the_fork_and_hands_back_each_child():
    seen: list = []
    async with DSecClient("http://a", token="t", transport=_server(seen, ANSWER)) as client:
        parent = await client.get_sandbox(PARENT)
        children = await parent.fork(2, all_or_none=False, ttl_running_stop=30)
        assert seen[-1] == ("POST", f"/v1/sandboxes/{PARENT}/fork",
                            {"count": 2, "all_or_none": False, "ttl_running_stop": 30.0})
        child, failed = children
        assert child.id == CHILD["id"] and child.fork_result.kind == "filesystem"
        assert child.fork_result.parent == PARENT
        assert isinstance(failed, BackendError) and failed.message == "crun failed"
        # Checked before anything is sent.
        for count in (0, MAX_FORK_COUNT + 1):
            with pytest.raises(InvalidRequest, match="count"):
                await parent.fork(count)
        assert len(seen) == 2  # (the get, the fork)


def test_the_sync_twin_forks_the_same():
    seen: list = []
    answer = {**ANSWER, "children": [{"sandbox": CHILD},
                                     {"error": {"code": "capacity_exceeded", "message": "node full"}}]}
    with SyncDSecClient("http://a", token="t", transport=_server(seen, answer)) as client:
        parent = client.get_sandbox(PARENT)
        child, failed = parent.fork(2, all_or_none=False)
        assert type(child).__name__ == "SyncSandbox" and child.fork_result.kind == "filesystem"
        assert isinstance(failed, CapacityExceeded)
        assert seen[-1][1] == f"/v1/sandboxes/{PARENT}/fork"



async def test_the_edge_refuses_before_it_touches_the_parent(edge):
    """On the fake backend (no identities to give, no layers to pack): each refusal names its
    problem, and the parent runs on."""
    from libdsec import DSecContainerRunArgs, LimitOutOfRange, SandboxStateError

    info = await edge.create(DSecContainerRunArgs(container_image="tiny"))
    for count in (0, -1, MAX_FORK_COUNT + 1):
        with pytest.raises(LimitOutOfRange, match=f"1 to {MAX_FORK_COUNT} children, not {count}"):
            await edge.fork(info.id, count)
    with pytest.raises(InvalidRequest, match="cannot be forked here: its children could not be given an identity"):
        await edge.fork(info.id, 2)
    await edge.pause(info.id)
    with pytest.raises(SandboxStateError, match=f"cannot fork: sandbox {info.id} is paused"):
        await edge.fork(info.id, 2)
    await edge.resume(info.id)
    assert [s.id for s in await edge.list()] == [info.id]
    await edge.stop(info.id)
    with pytest.raises(SandboxStateError, match=f"cannot fork: sandbox {info.id} is stopped"):
        await edge.fork(info.id, 2)
