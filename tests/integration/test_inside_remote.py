"""Trees and large files streamed through a remote node's endpoint (``RemoteEdge`` to a real
``dsec.nodes.edged`` on containers): the request bodies and the answers both stream."""

from __future__ import annotations

import asyncio
import io
import json
import os
import secrets
import sys
import tarfile

import pytest

from libdsec import InvalidRequest
from libdsec.protocol import DSecContainerRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root]


async def _chunks(data: bytes, piece: int = 1 << 16):
    for at in range(0, len(data), piece):
        yield data[at:at + piece]
        await asyncio.sleep(0)


async def test_trees_and_files_stream_through_a_remote_node(new_state_dir, test_store):
    from dsec.edge.remote import RemoteEdge

    state = new_state_dir("edged")
    token = secrets.token_hex(16)
    env = {**os.environ, "DSEC_VMS": "0"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dsec.nodes.edged", "--state-dir", str(state), "--node", "n0", "--store", str(test_store),
        "--config", json.dumps({"edge": {"pool_min": 0, "pool_max": 0}, "fncall": None}),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env)
    try:
        proc.stdin.write(token.encode() + b"\n")
        await proc.stdin.drain()
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert line, "the node's edge exited at start"
        node = RemoteEdge("n0", json.loads(line)["url"], token)
        try:
            info = await node.create(DSecContainerRunArgs(container_image="busybox", memory_limit_mb=512), "container", "t")
            try:
                big = os.urandom(40 << 20)
                buf = io.BytesIO()
                with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
                    member = tarfile.TarInfo("d/" + "long" * 40 + ".bin")
                    member.size = len(big)
                    tar.addfile(member, io.BytesIO(big))
                await node.upload_tree(info.id, "/tmp/t", _chunks(buf.getvalue()))
                got = bytearray()
                async for chunk in node.download_tree_tar(info.id, "/tmp/t"):
                    got += chunk
                with tarfile.open(fileobj=io.BytesIO(bytes(got))) as tar:
                    names = {m.name: m for m in tar}
                    data = tar.extractfile(names["./d/" + "long" * 40 + ".bin"]).read()
                assert data == big
                # One file each way, and a hostile tar refused naming its member; the node serves on.
                await node.write_file_stream(info.id, "/tmp/f/one.bin", _chunks(big), 0o640)
                back = bytearray()
                async for chunk in node.read_file_stream(info.id, "/tmp/f/one.bin"):
                    back += chunk
                assert bytes(back) == big
                evil = io.BytesIO()
                with tarfile.open(fileobj=evil, mode="w") as tar:
                    link = tarfile.TarInfo("out")
                    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
                    tar.addfile(link)
                with pytest.raises(InvalidRequest, match="refused tar member 'out': AbsoluteLink"):
                    await node.upload_tree(info.id, "/tmp/evil", _chunks(evil.getvalue() + bytes(1 << 20)))
                from libdsec.protocol import ExecRequest, OpenWatchRequest
                assert (await node.exec(info.id, ExecRequest(command="echo on"))).stdout == "on\n"
                # A directory watch through the node's endpoint, waiting on the node for its events.
                watch = await node.open_watch(info.id, OpenWatchRequest(path="/tmp/f", recursive=True))
                waiting = asyncio.create_task(node.watch_events(info.id, watch.id, 10.0))
                await asyncio.sleep(0.2)
                await node.exec(info.id, ExecRequest(command="mkdir /tmp/f/sub && echo x > /tmp/f/sub/new"))
                told = [(e.type, e.name) for e in (await waiting).events]
                told += [(e.type, e.name) for e in (await node.watch_events(info.id, watch.id)).events]
                assert told[0] == ("create", "sub") and ("write", "sub/new") in told, told
                await node.close_watch(info.id, watch.id)
            finally:
                await node.stop(info.id)
        finally:
            await node.close()
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()
