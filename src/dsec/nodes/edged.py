"""One node's edge as a daemon of its own: the edge on a state dir, served on its node endpoint.

    python -m dsec.nodes.edged --state-dir DIR --node NAME --store DIR --host ADDR [--config JSON]

reads the node token from its standard input's first line, prints ``{"url": …}`` once it
serves, and runs until SIGTERM (then it closes the edge, leaving running sandboxes to be
adopted by the next edge on that state dir) or until its parent dies (``PR_SET_PDEATHSIG``,
set by whoever starts it).

Why a process of its own and not the Ray actor's: Ray cleans up after a worker by killing its
process group and its children; a node's sandboxes must outlive its edge (an edge restart
re-adopts them), so the edge runs in a session of its own, and is the subreaper of its
sandboxes' inits itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

from .. import settings
from ..edge.server import NodeServer
from ..node import NodeConfig, build_node_edge


async def run(config: NodeConfig, store_dir: Path, host: str, token: str) -> None:
    edge = await build_node_edge(config, store_dir)
    server = NodeServer(edge, token, host=host)
    try:
        url = await server.start()
        print(json.dumps({"url": url}), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        await stop.wait()
    finally:
        await server.close()
        await edge.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsec.nodes.edged")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--config", default="{}", help='{"edge": {...}, "fncall": {...} or null}')
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings.load()  # every DSEC_* variable read and checked once, as `dsec serve` does
    except settings.SettingsError as exc:
        print(f"error: node {ns.node}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    token = sys.stdin.readline().strip()
    extra = json.loads(ns.config)
    config = NodeConfig(state_dir=ns.state_dir, node=ns.node, edge=extra.get("edge", {}),
                          fncall=extra.get("fncall", {}))
    try:
        asyncio.run(run(config, ns.store, ns.host, token))
    except Exception as exc:  # noqa: BLE001 - said to whoever started it, on stderr
        print(f"error: node {ns.node}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
