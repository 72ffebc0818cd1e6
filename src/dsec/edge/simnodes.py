"""Simulated nodes: edges over the in-memory fake backend, each behind its own node endpoint,
many in one process. For testing and measuring the control plane across the real remote seam
(``tests/conformance/test_node_seam.py``, ``dsec bench cluster``) without a kernel.

    python -m dsec.edge.simnodes --store DIR --state DIR --token-file F n0 n1 …

prints one JSON line per node (``{"node": …, "url": …}``) once all serve, then ``ready``, and
serves until its standard input closes or it gets SIGTERM; then it closes every edge and exits.
The store gets a tiny image, ``tiny``, if it has none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


async def run(nodes: list[str], store_dir: Path, state_dir: Path, token: str, host: str,
              edge_config: dict) -> None:
    store = LayerStore(store_dir)
    tiny_image(store, state_dir)
    edges, servers = [], []
    try:
        for node in nodes:
            config = EdgeConfig(node_dir=state_dir / node, node=node, pool_min=0, pool_max=0, **edge_config)
            edge = Edge(config, FakeBackend(), store)
            await edge.start()
            edges.append(edge)
            server = NodeServer(edge, token, host)
            servers.append(server)
            print(json.dumps({"node": node, "url": await server.start()}), flush=True)
        print("ready", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_reader(sys.stdin.fileno(), lambda: sys.stdin.buffer.read1(4096) or stop.set())
        await stop.wait()
    finally:
        await asyncio.gather(*(s.close() for s in servers), return_exceptions=True)
        await asyncio.gather(*(e.close() for e in edges), return_exceptions=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsec.edge.simnodes")
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--token-file", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--edge-config", default="{}", help="EdgeConfig overrides, as JSON")
    parser.add_argument("nodes", nargs="+")
    ns = parser.parse_args(argv)
    asyncio.run(run(ns.nodes, ns.store, ns.state, ns.token_file.read_text().strip(), ns.host,
                    json.loads(ns.edge_config)))


if __name__ == "__main__":
    main()
