"""A Ray cluster tried as a new user tries it: ``dsec serve --ray ADDR --state-dir NEW`` with no
``--store-dir`` (the default store is made), Ray nodes of one machine with no ``dsec-node`` label
(``ray.cluster_utils.Cluster``, as docs/CLUSTER.md suggests for a first try: each gets a name of
its own, kept across an apiserver restart), and a node whose edge cannot start (said by
``/v1/nodes?all=true`` and ``dsec info``, and joined once the cause is gone)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from dsec.local import LocalServer
from libdsec import DSecClient, DSecContainerRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.cluster]

ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32, cpu_cores_limit=0.1)
NODE_ARGS = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}


@pytest.fixture(scope="module")
def ray_cluster(ray_base):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False, "object_store_memory": 80 << 20,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
    })
    try:
        yield cluster
    finally:
        cluster.shutdown()  # then ray_base resets the nodes and checks nothing is left


@pytest.fixture(scope="module")
def server(ray_base, ray_cluster):
    """``dsec serve --ray ADDR --state-dir DIR``, and nothing else: DIR is new (its ``nodes/`` is
    where ray_base looks for what the nodes left)."""
    server = LocalServer(ray_base, extra_args=("--ray", ray_cluster.address, "--fncall-max", "1",
                                               "--fncall-workers", "1", "--pool-max", "2"), start_timeout_s=120)
    try:
        yield server.start()
    finally:
        server.stop_sandboxes()
        server.stop()


async def nodes_until(client: DSecClient, done, what: str, within_s: float = 90):
    deadline = time.monotonic() + within_s
    while True:
        nodes = await client.node_info(include_unready=True)
        if done(nodes):
            return nodes
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: nodes {[(n.node, n.state, n.problem) for n in nodes]}")
        await asyncio.sleep(0.25)


def ready(nodes) -> set[str]:
    return {n.node for n in nodes if n.state == "ready"}


def dsec_info(server: LocalServer) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsec", "info"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token,
                               "COLUMNS": "200"})


async def test_unlabelled_nodes_of_one_machine_each_get_a_name_and_the_default_store_is_made(
        ray_base, ray_cluster, server):
    ray_cluster.add_node(resources={"dsec_edge": 1}, **NODE_ARGS)
    async with DSecClient(server.endpoint, token=server.token) as client:
        (first,) = ready(await nodes_until(client, lambda n: len(ready(n)) == 1, "the first node joins"))
        ray_cluster.add_node(resources={"dsec_edge": 1}, **NODE_ARGS)
        names = ready(await nodes_until(client, lambda n: len(ready(n)) == 2, "the second node joins"))
        assert first in names, names  # the first keeps the name it had alone
        # The store was made where the state dir says (no --store-dir), and holds what the
        # nodes built in it; every node's edge reads it.
        assert (ray_base / "store").is_dir() and not (ray_base / "store").is_symlink()
        made = await client.run_containers(ARGS, count=6)
        assert {s.info.node for s in made} == names
        for s in made:
            assert (await s.run_shell("echo hi")).stdout == "hi\n"
        info = dsec_info(server)
        assert info.returncode == 0 and all(name in info.stdout for name in names), info.stdout + info.stderr
    # An apiserver restart finds each node's edge under the name it had.
    server.stop()
    server.start()
    async with DSecClient(server.endpoint, token=server.token) as client:
        again = ready(await nodes_until(client, lambda n: len(ready(n)) == 2, "the nodes are found again"))
        assert again == names
        assert {s.id for s in made} <= {i.id for i in await client.list_sandboxes()}
        for s in made:
            await (await client.get_sandbox(s.id)).stop()


async def test_a_node_whose_edge_cannot_start_is_said_and_joins_once_fixed(ray_base, ray_cluster, server):
    in_the_way = ray_base / "nodes" / "bad"
    in_the_way.parent.mkdir(exist_ok=True)
    in_the_way.write_text("a file where the node's state dir should be\n")
    try:
        ray_cluster.add_node(resources={"dsec_edge": 1}, labels={"dsec-node": "bad"}, **NODE_ARGS)
        async with DSecClient(server.endpoint, token=server.token) as client:
            nodes = await nodes_until(client, lambda n: any(x.node == "bad" and x.state == "failed" for x in n),
                                      "the node's failure is said")
            (bad,) = [n for n in nodes if n.node == "bad"]
            assert "File exists" in bad.problem and str(in_the_way) in bad.problem, bad.problem
            assert "bad" not in {n.node for n in await client.node_info()}  # not among those serving
            info = dsec_info(server)
            assert info.returncode == 0, info.stdout + info.stderr
            assert "bad: its edge did not start:" in info.stdout and "File exists" in info.stdout, info.stdout
            in_the_way.unlink()
            await nodes_until(client, lambda n: "bad" in ready(n), "the node joins once its cause is gone")
            sandbox = await client.run_container(ARGS)
            await sandbox.stop()
    finally:
        if in_the_way.is_file():
            in_the_way.unlink()
