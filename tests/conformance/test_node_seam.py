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
    DesktopUnavailable,
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


@pytest.fixture(scope="module")
def node_process(tmp_path_factory) -> subprocess.Popen:
    """One ``dsec.edge.simnodes`` process for the module's remote nodes: each test still gets a
    fresh node of its own in it (``{"add": …}`` on its standard input), over its own store and
    state; the process's start (mostly imports, about 0.6 s of CPU) is paid once, not per test."""
    scratch = tmp_path_factory.mktemp("simnodes")
    (scratch / "token").write_text(TOKEN)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsec.edge.simnodes", "--store", str(scratch / "store"), "--state",
         str(scratch / "nodes"), "--token-file", str(scratch / "token")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout.readline() == b"ready\n", "the simulated nodes' process exited at start"
        yield proc
    finally:
        proc.stdin.close()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


async def node_command(proc: subprocess.Popen, command: dict) -> dict:
    """One command to the simulated nodes' process, and its answer (within 30 s)."""
    proc.stdin.write(json.dumps(command).encode() + b"\n")
    proc.stdin.flush()
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
    assert line, f"the simulated nodes' process exited (code {proc.poll()})"
    return json.loads(line)


async def test_the_node_process_answers_what_it_cannot_do_and_serves_on(node_process, tmp_path):
    """A line of the simulated nodes' process's standard input it cannot act on is answered
    with the error, and it goes on adding and removing nodes."""
    assert (await node_command(node_process, {"remove": "n7"}))["error"] == "ValueError: node n7 is not served here"
    assert (await node_command(node_process, {"add": "n7"}))["error"] == "KeyError: 'store'"
    assert (await node_command(node_process, {"nothing": 1}))["error"] == "ValueError: neither add nor remove"
    node_process.stdin.write(b"not json\n")
    node_process.stdin.flush()
    assert (await asyncio.to_thread(node_process.stdout.readline)).startswith(b'{"error": "JSONDecodeError')
    place = {"store": str(tmp_path / "store"), "state": str(tmp_path / "nodes")}
    added = await node_command(node_process, {"add": "n7", **place})
    assert (await node_command(node_process, {"add": "n7", **place}))["error"] == "ValueError: node n7 is served already"
    edge = RemoteEdge("n7", added["url"], TOKEN)
    try:
        assert (await edge.node_info()).node == "n7"
    finally:
        await edge.close()
    assert await node_command(node_process, {"remove": "n7"}) == {"removed": "n7"}
    gone = RemoteEdge("n7", added["url"], TOKEN)
    try:
        with pytest.raises(NodeUnreachable):  # its endpoint closed with it
            async with asyncio.timeout(5):
                await gone.node_info()
    finally:
        await gone.close()


@pytest.fixture(params=["in-process", "remote"])
async def node(request, tmp_path) -> EdgeAPI:
    config = {"max_sandboxes": 8, "reaper_interval_s": 0.05, "batch_commit_s": 0.5}
    store = LayerStore(tmp_path / "store")
    tiny_image(store, tmp_path)
    if request.param == "in-process":
        edge = Edge(EdgeConfig(node_dir=tmp_path / "n0", pool_min=0, pool_max=0, **config), FakeBackend(), store)
        await edge.start()
        yield edge
        await edge.close()
        return
    proc = request.getfixturevalue("node_process")
    added = await node_command(proc, {"add": "n0", "store": str(tmp_path / "store"), "state": str(tmp_path / "nodes"),
                                      "edge_config": config})
    assert added.get("node") == "n0", added
    edge = RemoteEdge("n0", added["url"], TOKEN)
    try:
        yield edge
    finally:
        await edge.close()
        assert await node_command(proc, {"remove": "n0"}) == {"removed": "n0"}


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


async def test_clean_copy_and_tampering(node):
    info = await node.create(args(), "container", "team")
    await node.write_file(info.id, "/testbed/a.py", b"work", 0o644)
    await node.write_file(info.id, "/root/.bash_history", b"ls", 0o644)
    await node.write_file(info.id, "/usr/bin/python3", b"forged", 0o755)
    result = await node.clean_copy(info.id, ["/testbed/", "/root"])
    copy = result.sandbox
    assert copy.id != info.id and copy.status is SandboxStatus.running and copy.project == "team"
    assert (result.source, result.keep, result.files, result.bytes) == (info.id, ["/root", "/testbed"], 1, 4)
    assert result.scrubbed == ["/root/.bash_history"] and result.tampered == ["/usr/bin/python3"]
    assert await node.read_file(copy.id, "/testbed/a.py") == b"work"
    with pytest.raises(SandboxFileNotFound):
        await node.read_file(copy.id, "/usr/bin/python3")
    events = await node.security_events(info.id)
    assert [(e.kind, e.detail) for e in events] == [("file.tampered", "system files replaced or added: /usr/bin/python3")]
    with pytest.raises(InvalidRequest, match="keep path '/nope' does not exist"):
        await node.clean_copy(info.id, ["/nope"])
    with pytest.raises(InvalidRequest, match="contains '..'"):
        await node.clean_copy(info.id, ["/testbed/../etc"])
    await node.pause(info.id)
    with pytest.raises(SandboxStateError, match=f"cannot make a clean copy of: sandbox {info.id} is paused"):
        await node.clean_copy(info.id, ["/testbed"])
    await node.stop(info.id)
    with pytest.raises(SandboxStateError, match="is stopped"):
        await node.clean_copy(info.id, ["/testbed"])
    await node.stop(copy.id)


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
    with pytest.raises(InvalidRequest, match="a container sandbox takes no full snapshots"):
        await node.snapshot(info.id, "full")
    with pytest.raises(InvalidRequest, match="does not serve fncall"):
        from libdsec.protocol import DSecFnCallArgs
        await node.fncall(DSecFnCallArgs(code="print(1)"))
    await node.stop(info.id)
    with pytest.raises(SandboxStateError, match="stopped"):
        await node.exec(info.id, ExecRequest(command="true"))


async def test_desktop_calls_cross_the_seam(node):
    from libdsec.protocol import DesktopInput, DesktopLaunchRequest, DesktopSpec

    info = await node.create(args())  # made without a desktop
    calls = {
        "screenshot": lambda sid: node.desktop_screenshot(sid, "png"),
        "info": node.desktop_info,
        "input": lambda sid: node.desktop_input(sid, DesktopInput(action="click", x=1, y=1)),
        "windows": node.desktop_windows,
        "focus": lambda sid: node.desktop_focus(sid, 7),
        "launch": lambda sid: node.desktop_launch(sid, DesktopLaunchRequest(app="mousepad")),
        "stream": node.desktop_stream,
        "accessibility_tree": lambda sid: node.desktop_accessibility_tree(sid, 100_000),
    }
    for name, call in calls.items():
        with pytest.raises(DesktopUnavailable, match=f"sandbox {info.id} has no desktop"):
            await call(info.id)
        with pytest.raises(SandboxNotFound):
            await call("n0-0123456789abcdef")
    with pytest.raises(InvalidRequest, match="screenshot format 'gif'"):
        await node.desktop_screenshot(info.id, "gif")
    with pytest.raises(InvalidRequest, match="kind 'microvm' is not served"):  # (no VMs here)
        await node.create(DSecMicroVMRunArgs(container_image="tiny", memory_limit_mb=64, desktop=DesktopSpec()),
                          "microvm")
    await node.stop(info.id)


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


async def test_a_held_batch_is_kept_when_committed_and_stopped_when_not(node):
    kept = [info.id async for _, info in node.create_batch(args(), 3, "container", "root", "b-kept")]
    await node.commit_batch("b-kept")
    dropped = [info.id async for _, info in node.create_batch(args(), 2, "container", "root", "b-dropped")]
    for _ in range(200):  # not committed within batch_commit_s: stopped
        if sorted(i.id for i in await node.list()) == sorted(kept):
            break
        await asyncio.sleep(0.02)
    assert sorted(i.id for i in await node.list()) == sorted(kept)
    assert "not committed" in ((await node.get(dropped[0])).reason or "")
    with pytest.raises(SandboxLost, match="b-dropped"):
        await node.commit_batch("b-dropped")
    with pytest.raises(SandboxLost, match="never-made"):
        await node.commit_batch("never-made")
    for sid in kept:
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


async def test_images_answer_in_pages(node, tmp_path):
    from dsec.images.store import Image

    store = LayerStore(tmp_path / "store")  # the nodes' store, shared
    tiny = store.get_image("tiny")
    for i in range(5):
        store.put_image(Image(name=f"ws-{i}", layers=tiny.layers, roles=("workspace",)))
    names = lambda images: [i.name for i in images]  # noqa: E731
    assert names(await node.list_images()) == ["tiny", "ws-0", "ws-1", "ws-2", "ws-3", "ws-4"]
    assert names(await node.list_images(limit="2")) == ["tiny", "ws-0"]
    assert names(await node.list_images(limit="2", after="ws-0")) == ["ws-1", "ws-2"]
    assert names(await node.list_images(prefix="ws-", role="workspace", after="ws-3")) == ["ws-4"]
    assert names(await node.list_images(role="base")) == ["tiny"]
    with pytest.raises(InvalidRequest, match="bad limit"):
        await node.list_images(limit="0")
    with pytest.raises(InvalidRequest, match="bad role"):
        await node.list_images(role="nope")


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
    # Stopped, and no warm pool (pool_max=0) holds a sandbox of it: nothing holds the layer.
    assert (await node.layer_use()).layers == []


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


async def test_a_streamed_command_crosses_the_seam(node):
    info = await node.create(args())
    try:
        events = [e async for e in node.exec_stream(info.id, ExecRequest(command="echo hi; echo oops >&2; exit 3"))]
        assert [e.event for e in events] == ["started", "stdout", "stderr", "exit"]
        assert (events[1].data, events[2].data) == ("hi\n", "oops\n")
        assert events[-1].result.exit_code == 3 and events[-1].result.stdout == "hi\n"
        # An error after the start is the last event; one before it is raised.
        events = [e async for e in node.exec_stream(info.id, ExecRequest(command="sleep 5", timeout=0.2))]
        assert events[-1].event == "error" and events[-1].error["code"] == "command_timeout"
        with pytest.raises(SandboxNotFound):
            await anext(node.exec_stream("n0-0123456789abcdef", ExecRequest(command="true")))
        # Left early: closed, the node serves on.
        stream = node.exec_stream(info.id, ExecRequest(command="sleep 2"))
        assert (await anext(stream)).event == "started"
        await stream.aclose()
        assert (await node.exec(info.id, ExecRequest(command="echo on"))).stdout == "on\n"
    finally:
        await node.stop(info.id)


async def test_process_calls_cross_the_seam(node):
    """(The fake runs no shell: what crosses here is the calls and their errors.)"""
    from libdsec import ProcessNotFound
    from libdsec.protocol import ProcessStreamRequest, StartProcessRequest

    info = await node.create(args())
    try:
        with pytest.raises(InvalidRequest, match="cannot start the background process"):
            await node.start_process(info.id, StartProcessRequest(command="sleep 5"))
        assert await node.list_processes(info.id) == []
        with pytest.raises(ProcessNotFound, match="no background process 42"):
            await node.get_process(info.id, 42)
        with pytest.raises(ProcessNotFound):
            await anext(node.stream_process(info.id, 42, ProcessStreamRequest()))
        with pytest.raises(SandboxNotFound):
            await node.list_processes("n0-0123456789abcdef")
    finally:
        await node.stop(info.id)


async def test_a_port_connection_crosses_the_seam(node):
    """``connect_port``: a byte stream both ways, each side's end passed on (a half-close), many
    at once; nothing listening, a bad port, a stopped sandbox: their errors. (The fake's ports
    are the node's loopback's: the test serves one.)"""
    import socket

    from libdsec import PortUnreachable

    async def reverse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()  # to the end of what was sent
        writer.write(data[::-1])
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(reverse, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    info = await node.create(args())
    try:
        async def once(size: int) -> None:
            reader, writer = await node.connect_port(info.id, port)
            blob = os.urandom(size)
            writer.write(blob)
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 30) == blob[::-1]
            writer.close()

        await asyncio.gather(once(3 << 20), *(once(100) for _ in range(20)))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        with pytest.raises(PortUnreachable, match=f"port {free}"):  # (502 on the wire)
            await node.connect_port(info.id, free)
        with pytest.raises(InvalidRequest, match="outside 1-65535"):
            await node.connect_port(info.id, 70000)
        await node.stop(info.id)
        with pytest.raises((SandboxStateError, SandboxNotFound)):
            await node.connect_port(info.id, port)
        with pytest.raises(SandboxNotFound):
            await node.connect_port("n0-0123456789abcdef", port)
    finally:
        await node.stop(info.id)
        listener.close()
        await listener.wait_closed()


async def test_pty_calls_cross_the_seam(node):
    """A PTY on the fake's terminal: typed, echoed, resized, read, ended; and its errors."""
    from libdsec import SessionClosed
    from libdsec.protocol import OpenPtyRequest

    info = await node.create(args())
    try:
        pty = await node.open_pty(info.id, OpenPtyRequest(cols=100, rows=30))
        assert (pty.cols, pty.rows) == (100, 30)
        first = node.pty_stream(info.id, pty.id)
        assert (await anext(first)).event == "started"
        await node.pty_input(info.id, pty.id, b"echo one\r")
        text = ""
        while "echo one" not in text:
            text += (await anext(first)).data
        # A second stream takes over (a client that came back); the first ends, saying so.
        stream = node.pty_stream(info.id, pty.id)
        assert (await anext(stream)).event == "started"
        ended = [e async for e in first]
        assert ended[-1].event == "error" and "another stream" in ended[-1].error["message"], ended
        await node.pty_input(info.id, pty.id, b"stty size\r")
        await node.resize_pty(info.id, pty.id, 120, 40)
        await node.pty_input(info.id, pty.id, b"stty size\recho hi\rexit 7\r")
        seen = ""
        async for event in stream:
            if event.event == "stdout":
                seen += event.data
            else:
                break
        assert event.event == "exit" and event.result.exit_code == 7
        assert "30 100\r\n" in seen and "40 120\r\n" in seen and "hi\r\n" in seen
        with pytest.raises(SandboxStateError, match="exited .exit code 7"):
            await node.pty_input(info.id, pty.id, b"x")
        await node.close_pty(info.id, pty.id)
        await node.close_pty(info.id, pty.id)  # again: nothing happens
        with pytest.raises(SessionClosed, match="no open PTY"):
            await node.pty_input(info.id, pty.id, b"x")
        with pytest.raises(SessionClosed):
            await anext(node.pty_stream(info.id, pty.id))
        with pytest.raises(SandboxNotFound):
            await node.open_pty("n0-0123456789abcdef", OpenPtyRequest())
        # A sandbox that stops takes its PTYs with it.
        other = await node.open_pty(info.id, OpenPtyRequest())
    finally:
        await node.stop(info.id)
    with pytest.raises(SessionClosed):
        await node.resize_pty(info.id, other.id, 80, 24)


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


async def test_tree_streams_cross_the_seam(node):
    """(The fake runs no tar: what crosses here is the calls and their errors.)"""
    async def chunks():
        yield b"\0" * 1024

    with pytest.raises(SandboxNotFound):
        await anext(node.download_tree_tar("n0-0123456789abcdef", "/tmp"))
    with pytest.raises(SandboxNotFound):
        await node.upload_tree("n0-0123456789abcdef", "/tmp", chunks())
    info = await node.create(args())
    try:
        with pytest.raises(InvalidRequest, match="must be absolute"):
            await anext(node.download_tree_tar(info.id, "relative"))
        with pytest.raises(InvalidRequest, match="must be absolute"):
            await node.upload_tree(info.id, "relative", chunks())
    finally:
        await node.stop(info.id)
