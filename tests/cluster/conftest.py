"""What both Ray modules share: the base directory of a module's Ray cluster, with Ray's
environment set for it, and the teardown that checks its nodes left nothing behind."""

from __future__ import annotations

import asyncio
import os

import pytest

from dsec.local import leftovers


@pytest.fixture(scope="module")
def ray_base(tmp_path_factory):
    """A directory for one module's Ray cluster: Ray's temporary files in ``ray/``, the nodes'
    state dirs in ``nodes/`` (``--node-state-dir``). Meanwhile Ray runs without auth or usage
    stats, and the servers without VMs. After the module (its cluster and servers stopped by
    then): every node reset (the sandboxes of a killed node outlive its edge, as after a
    crash), the environment as it was, and nothing of any node left behind."""
    base = tmp_path_factory.mktemp("ray")
    (base / "ray").mkdir()
    saved_env = dict(os.environ)
    os.environ.update({"RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(base / "ray"), "DSEC_VMS": "0",
                       "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        yield base
    finally:
        from dsec.node import reset_node

        nodes = base / "nodes"
        node_dirs = sorted(p for p in nodes.iterdir() if p.is_dir()) if nodes.is_dir() else []
        for node_dir in node_dirs:
            asyncio.run(reset_node(node_dir))
        left = [x for d in node_dirs for x in leftovers(d)]
        os.environ.clear()
        os.environ.update(saved_env)  # the next modules' servers run VMs again, and so on
        assert not left, f"left behind: {left}"
