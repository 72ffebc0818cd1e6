"""Simulated nodes: edges over the in-memory fake backend, each behind its own node endpoint,
many in one process. For testing and measuring the control plane across the real remote seam
(``tests/conformance/test_node_seam.py``, ``dsec bench cluster``) without a kernel.

    python -m dsec.edge.simnodes --store DIR --state DIR --token-file F n0 n1 …

prints one JSON line per node (``{"node": …, "url": …}``) once all serve, then ``ready``, and
serves until its standard input closes or it gets SIGTERM; then it closes every edge and exits.
The store gets a tiny image, ``tiny``, if it has none.

Nodes also come and go while it serves, one JSON line on standard input each, answered by one
line on standard output: ``{"add": NODE, "store": DIR, "state": DIR, "edge_config": {…}}`` a
fresh node over a store of its own (``{"node": …, "url": …}``), ``{"remove": NODE}`` its
edge closed (``{"removed": NODE}``); a line it cannot act on is answered ``{"error": …}``. A
suite that wants a fresh node per test then pays the process's start (mostly imports: about
0.6 s of CPU) once, and each node's a few milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from ..backends.fake import FakeBackend
from ..images.store import Image, LayerStore
from .edge import Edge, EdgeConfig
from .server import NodeServer


def tiny_image(store: LayerStore, scratch: Path) -> None:
    if store.has_image("tiny"):
        return
    root = scratch / "tiny-rootfs"
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    store.put_image(Image(name="tiny", layers=(store.add_dir(root),), env={"PATH": "/bin"}))


class _Nodes:
    """The edges this process serves, each behind its own node endpoint."""

    def __init__(self, token: str, host: str) -> None:
        self.token, self.host = token, host
        self.serving: dict[str, tuple[Edge, NodeServer]] = {}

    async def add(self, node: str, store: LayerStore, state_dir: Path, edge_config: dict) -> str:
        if node in self.serving:
            raise ValueError(f"node {node} is served already")
        tiny_image(store, state_dir)
        config = EdgeConfig(node_dir=state_dir / node, node=node, pool_min=0, pool_max=0, **edge_config)
        edge = Edge(config, FakeBackend(), store)
        await edge.start()
        server = NodeServer(edge, self.token, self.host)
        try:
            url = await server.start()
        except BaseException:
            await edge.close()
            raise
        self.serving[node] = (edge, server)
        return url

    async def remove(self, node: str) -> None:
        if node not in self.serving:
            raise ValueError(f"node {node} is not served here")
        edge, server = self.serving.pop(node)
        try:
            await server.close()
        finally:
            await edge.close()

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for _, s in self.serving.values()), return_exceptions=True)
        await asyncio.gather(*(e.close() for e, _ in self.serving.values()), return_exceptions=True)
        self.serving.clear()

    async def command(self, line: bytes) -> dict:
        """One line of standard input acted on; the line that answers it."""
        try:
            command = json.loads(line)
            if "add" in command:
                url = await self.add(command["add"], LayerStore(Path(command["store"])), Path(command["state"]),
                                     command.get("edge_config", {}))
                return {"node": command["add"], "url": url}
            if "remove" in command:
                await self.remove(command["remove"])
                return {"removed": command["remove"]}
            raise ValueError("neither add nor remove")
        except (ValueError, KeyError, TypeError, OSError) as e:  # (json's and pydantic's are ValueErrors)
            return {"error": f"{type(e).__name__}: {e}"}


async def run(nodes: list[str], store_dir: Path, state_dir: Path, token: str, host: str,
              edge_config: dict) -> None:
    store = LayerStore(store_dir)
    served = _Nodes(token, host)
    try:
        for node in nodes:
            print(json.dumps({"node": node, "url": await served.add(node, store, state_dir, edge_config)}), flush=True)
        loop = asyncio.get_running_loop()
        stdin = asyncio.StreamReader()

        def readable() -> None:
            if data := os.read(sys.stdin.fileno(), 65536):
                stdin.feed_data(data)
            else:
                loop.remove_reader(sys.stdin.fileno())
                stdin.feed_eof()

        loop.add_reader(sys.stdin.fileno(), readable)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        print("ready", flush=True)  # (its signal handlers set: a SIGTERM from now on closes the edges)
        commands = asyncio.create_task(_follow(stdin, served, stop))
        try:
            await stop.wait()
        finally:
            commands.cancel()
    finally:
        await served.close()


async def _follow(stdin: asyncio.StreamReader, served: _Nodes, closed: asyncio.Event) -> None:
    """Acts on standard input's lines; sets ``closed`` when it closes."""
    while line := await stdin.readline():
        if line.strip():
            print(json.dumps(await served.command(line)), flush=True)
    closed.set()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsec.edge.simnodes")
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--token-file", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--edge-config", default="{}", help="EdgeConfig overrides, as JSON")
    parser.add_argument("nodes", nargs="*", help="nodes to serve from the start")
    ns = parser.parse_args(argv)
    asyncio.run(run(ns.nodes, ns.store, ns.state, ns.token_file.read_text().strip(), ns.host,
                    json.loads(ns.edge_config)))


if __name__ == "__main__":
    main()
