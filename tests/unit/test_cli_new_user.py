"""What a new user found running the README's and docs/CLUSTER.md's commands as printed: ``dsec
stop ID`` of a lost node's sandbox never kept the stop (it looked the sandbox up first, and the
look-up failed), and ``dsec image rm``/``gc`` took no account of the sandboxes running (they read
records where the edge no longer keeps them, and no cluster node's)."""

from __future__ import annotations

import asyncio
import json
import random
import shutil

import httpx
import pytest
from typer.testing import CliRunner

from dsec.apiserver.app import Cluster
from dsec.app import create_app
from dsec.apiserver.projects import open_project_store
from dsec.backends.fake import FakeBackend
from dsec.cli import app
from dsec.cli_images import node_usage
from dsec.edge.edge import Edge, EdgeConfig
from dsec.edge.journal import RecordJournal
from libdsec import DSecClient, DSecContainerRunArgs, SandboxLost

TOKEN = "root-token"


@pytest.fixture
async def world(tmp_path, store):
    edges = []
    for name in ("n0", "n1"):
        edge = Edge(EdgeConfig(node_dir=tmp_path / name, node=name, pool_min=0, pool_max=0), FakeBackend(), store)
        await edge.start()
        edges.append(edge)
    projects = open_project_store()
    cluster = Cluster(edges, projects=projects, rng=random.Random(3))
    transport = httpx.ASGITransport(app=create_app(cluster, TOKEN), raise_app_exceptions=False)
    async with DSecClient("http://api", token=TOKEN, transport=transport) as client:
        yield client, cluster, {e.node: e for e in edges}
    for edge in edges:
        await edge.close()
    projects.close()


async def test_a_stop_by_id_of_a_lost_nodes_sandbox_is_kept_and_made_when_it_is_back(world):
    client, cluster, edges = world
    made = await client.run_containers(DSecContainerRunArgs(container_image="tiny", memory_limit_mb=64), count=4)
    victim = made[0]
    cluster.mark_lost(victim.info.node, "its Ray node died")
    with pytest.raises(SandboxLost, match="the stop is kept"):
        await client.stop_sandbox(victim.id)  # no look-up first: that is what failed
    cluster.add_edge(edges[victim.info.node])
    for _ in range(200):
        if victim.id not in {s.id for s in await client.list_sandboxes()}:
            break
        await asyncio.sleep(0.01)
    assert victim.id not in {s.id for s in await client.list_sandboxes()}
    for s in made[1:]:
        assert (await client.stop_sandbox(s.id)).status.value == "stopped"
    assert (await client.stop_sandbox(made[1].id)).status.value == "stopped"  # a second stop: as it was


def test_dsec_stop_goes_on_past_an_id_that_fails(monkeypatch):
    stopped = []

    class Client:
        def __init__(self, *a, **kw): ...

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc): ...

        async def stop_sandbox(self, sandbox_id):
            if sandbox_id.startswith("n2-"):
                raise SandboxLost(f"sandbox {sandbox_id} is lost; the stop is kept, and made when node n2 is back")
            stopped.append(sandbox_id)
            return type("Info", (), {"status": type("S", (), {"value": "stopped"})()})()

    monkeypatch.setattr("dsec.cli.DSecClient", Client)
    result = CliRunner().invoke(app, ["stop", "n1-0000000000000001", "n2-0000000000000002", "n1-0000000000000003"])
    assert result.exit_code == 1
    assert stopped == ["n1-0000000000000001", "n1-0000000000000003"]
    assert "the stop is kept" in " ".join(result.output.split())


def test_image_rm_and_gc_see_the_sandboxes_of_every_node_under_the_state_dir(tmp_path):
    def running(records, name, layers):
        records.mkdir(parents=True)
        journal = RecordJournal(records)
        journal.load()
        journal.put(f"x-{name}", json.dumps({"image": {"name": name, "layers": layers}}))
        journal.close()

    running(tmp_path / "node" / "run" / "records", "python", ["sha256-a"])
    running(tmp_path / "nodes" / "a1" / "node" / "run" / "records", "task", ["sha256-b", "sha256-c"])
    (tmp_path / "nodes" / "a2" / "node" / "layers" / "sha256-d").mkdir(parents=True)  # a warm pool's mount
    try:
        refs, layers = node_usage(tmp_path)
        assert refs == {"python", "task"} and layers == {"sha256-a", "sha256-b", "sha256-c", "sha256-d"}
    finally:  # (the suite's own check takes a run dir left with records for a node left running)
        shutil.rmtree(tmp_path / "node")
        shutil.rmtree(tmp_path / "nodes")
