"""The node seam's conformance suite: every call the apiserver makes on a node (``EdgeAPI``),
run against both implementations — the edge in-process, and a ``RemoteEdge`` reaching an edge
in another process over its own HTTP endpoint — with the same answers and the same errors.
The edges run over the fake backend: this is the control plane's contract, not the kernel's."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from dsec.backends.fake import FakeBackend
from dsec.edge.api import EdgeAPI, NodeUnreachable
from dsec.edge.edge import Edge, EdgeConfig
from dsec.edge.remote import RemoteEdge
from dsec.edge.simnodes import tiny_image
from dsec.images.store import LayerStore
from libdsec import (
    CapacityExceeded,
    ImageNotFound,
    InvalidRequest,
    LimitOutOfRange,
    SandboxFileNotFound,
    SandboxLost,
    SandboxNotFound,
    SandboxStateError,
)
from libdsec.protocol import DSecContainerRunArgs, DSecMicroVMRunArgs, ExecRequest, SandboxStatus

TOKEN = "node-secret"


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image="tiny", **{"memory_limit_mb": 64, **kw})


@asynccontextmanager
async def simulated_nodes(tmp_path: Path, nodes: list[str], edge_config: dict | None = None):
    """Edges in a process of their own (``dsec.edge.simnodes``): {node: url}."""
    (tmp_path / "token").write_text(TOKEN)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dsec.edge.simnodes", "--store", str(tmp_path / "store"), "--state",
        str(tmp_path / "nodes"), "--token-file", str(tmp_path / "token"), "--edge-config",
        json.dumps(edge_config or {}), *nodes,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    urls = {}
    try:
        async with asyncio.timeout(30):
            while (line := (await proc.stdout.readline()).decode().strip()) != "ready":
                assert line, "the simulated nodes exited at start"
                entry = json.loads(line)
                urls[entry["node"]] = entry["url"]
        yield urls, proc
    finally:
        if proc.returncode is None:
            proc.stdin.close()
            try:
                async with asyncio.timeout(15):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


@pytest.fixture(params=["in-process", "remote"])
async def node(request, tmp_path) -> EdgeAPI:
    config = {"max_sandboxes": 8, "reaper_interval_s": 0.05}
    store = LayerStore(tmp_path / "store")
    tiny_image(store, tmp_path)
    if request.param == "in-process":
        edge = Edge(EdgeConfig(node_dir=tmp_path / "n0", pool_min=0, pool_max=0, **config), FakeBackend(), store)
        await edge.start()
        yield edge
        await edge.close()
        return
    async with simulated_nodes(tmp_path, ["n0"], config) as (urls, _):
        edge = RemoteEdge("n0", urls["n0"], TOKEN)
        yield edge
        await edge.close()


async def test_lifecycle_and_calls(node):
    info = await node.create(args(), "container", "team")
    assert info.status is SandboxStatus.running and info.node == "n0" and info.project == "team"
    assert (await node.get(info.id)).id == info.id
    assert [i.id for i in await node.list()] == [info.id]
    result = await node.exec(info.id, ExecRequest(command="echo hi"))
    assert (result.exit_code, result.stdout) == (0, "hi\n")
    await node.write_file(info.id, "/tmp/f", b"\x00bytes\xff", 0o600)
    assert await node.read_file(info.id, "/tmp/f") == b"\x00bytes\xff"
    paused = await node.pause(info.id)
    assert paused.sandbox.status is SandboxStatus.paused
    with pytest.raises(SandboxStateError, match="paused already"):
        await node.pause(info.id)
    assert (await node.resume(info.id)).status is SandboxStatus.running
    assert await node.security_events(info.id) == []
    await node.set_network_rules(info.id, {})
    stopped = await node.stop(info.id, "done with it")
    assert (stopped.status, stopped.reason) == (SandboxStatus.stopped, "done with it")
    assert (await node.stop(info.id)).status is SandboxStatus.stopped  # a second stop: nothing to do
    assert await node.list() == []


async def test_errors_cross_as_the_same_types(node):
    with pytest.raises(SandboxNotFound, match="no sandbox n0-0123456789abcdef on node n0"):
        await node.get("n0-0123456789abcdef")
    with pytest.raises(ImageNotFound):
        await node.create(DSecContainerRunArgs(container_image="nope"))
    with pytest.raises(LimitOutOfRange, match="memory_limit_mb"):
        await node.create(args(memory_limit_mb=1))
    with pytest.raises(InvalidRequest, match="kind 'microvm' is not served"):
        await node.create(DSecMicroVMRunArgs(container_image="tiny", memory_limit_mb=64), "microvm")
    info = await node.create(args())
    with pytest.raises(SandboxFileNotFound):
        await node.read_file(info.id, "/no/such/file")
    with pytest.raises(InvalidRequest, match="takes no memory snapshots"):
        await node.snapshot(info.id)
    with pytest.raises(InvalidRequest, match="does not serve fncall"):
        from libdsec.protocol import DSecFnCallArgs
        await node.fncall(DSecFnCallArgs(code="print(1)"))
    await node.stop(info.id)
    with pytest.raises(SandboxStateError, match="stopped"):
        await node.exec(info.id, ExecRequest(command="true"))


async def test_batch_streams_and_is_all_or_none(node):
    got = [(i, info.id) async for i, info in node.create_batch(args(), 5, "container", "root")]
    assert sorted(i for i, _ in got) == list(range(5)) and len({sid for _, sid in got}) == 5
    with pytest.raises(CapacityExceeded, match="is full"):  # 5 held, 8 at most
        async for _ in node.create_batch(args(), 4):
            pass
    for _ in range(100):  # the failed batch's sandboxes are stopped as it unwinds
        if len(await node.list()) == 5:
            break
        await asyncio.sleep(0.02)
    assert sorted(i.id for i in await node.list()) == sorted(sid for _, sid in got)
    for _, sid in got:
        await node.stop(sid)


async def test_a_batch_given_up_early_is_undone(node):
    events = node.create_batch(args(), 6)
    await anext(events)
    await events.aclose()
    for _ in range(200):
        if not await node.list():
            break
        await asyncio.sleep(0.02)
    assert await node.list() == []


async def test_node_report_layer_use_and_the_store(node):
    report = await node.node_info()
    assert report.node == "n0" and report.max_sandboxes == 8 and report.sandboxes == 0
    info = await node.create(args())
    use = await node.layer_use()
    assert use.images == ["tiny"] and len(use.layers) == 1
    assert (await node.node_info()).committed_memory_mb == 64
    images = await node.list_images()
    assert [i.name for i in images] == ["tiny"]
    assert (await node.inspect_image("tiny")).layers == use.layers
    with pytest.raises(ImageNotFound):
        await node.inspect_image("nope")
    with pytest.raises(Exception, match="in use"):
        await node.remove_image("tiny", frozenset(use.images))
    assert await node.gc_layers(frozenset(use.layers)) == []
    await node.stop(info.id)


# -- a node that misbehaves ----------------------------------------------------------------------


@asynccontextmanager
async def bad_node(behaviour: str):
    """A server on loopback that answers garbage, never answers, or closes mid-answer."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if behaviour == "garbage":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nnot json!!!")
        elif behaviour == "html-error":
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 10\r\n\r\n<h1>x</h1>")
        elif behaviour == "half":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"id\":")
            await writer.drain()
            writer.close()
            return
        elif behaviour == "hang":
            await asyncio.sleep(3600)
        await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield RemoteEdge("n9", f"http://127.0.0.1:{port}", TOKEN, call_timeout_s=0.5)
    finally:
        server.close()


@pytest.mark.parametrize("behaviour, message", [
    ("garbage", "not a SandboxInfo"), ("html-error", "not the node protocol"),
    ("half", "did not answer"), ("hang", "did not answer"),
])
async def test_a_misbehaving_node_is_unreachable_not_a_hang(behaviour, message):
    async with bad_node(behaviour) as edge:
        with pytest.raises(NodeUnreachable, match=message) as info:
            async with asyncio.timeout(5):
                await edge.get("n9-0123456789abcdef")
        assert isinstance(info.value, SandboxLost) and "node n9" in str(info.value)
        await edge.close()


async def test_a_vanished_node_is_unreachable_at_once(tmp_path):
    tiny_image(LayerStore(tmp_path / "store"), tmp_path)
    async with simulated_nodes(tmp_path, ["n0"]) as (urls, proc):
        edge = RemoteEdge("n0", urls["n0"], TOKEN)
        info = await edge.create(args())
        proc.kill()
        await proc.wait()
        with pytest.raises(NodeUnreachable, match="node n0"):
            async with asyncio.timeout(5):
                await edge.exec(info.id, ExecRequest(command="true"))
        await edge.close()


async def test_the_node_token_is_required(tmp_path):
    tiny_image(LayerStore(tmp_path / "store"), tmp_path)
    async with simulated_nodes(tmp_path, ["n0"]) as (urls, _):
        edge = RemoteEdge("n0", urls["n0"], "wrong")
        from libdsec import Unauthenticated
        with pytest.raises(Unauthenticated, match="node token"):
            await edge.node_info()
        await edge.close()


async def test_node_stats(node):
    info = await node.create(args(), "container", "team")
    await node.exec(info.id, ExecRequest(command="echo hi"))
    await node.pause(info.id)
    with pytest.raises(LimitOutOfRange):
        await node.create(args(memory_limit_mb=1))
    stats = await node.node_stats()
    assert stats.info.node == "n0" and stats.info.sandboxes == 1
    assert stats.creates == {"container": 1} and stats.create_seconds["container"].count == 1
    assert stats.command_seconds["container"].count == 1
    assert stats.admission_refusals == {"limit": 1} and stats.pauses == 1
    assert [(c.status, c.kind.value, c.project, c.count) for c in stats.sandboxes] == [
        (SandboxStatus.paused, "container", "team", 1)]
    await node.stop(info.id)
    assert (await node.node_stats()).sandboxes == []
