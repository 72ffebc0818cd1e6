"""The apiserver with projects, quotas and placement, over real edges on the fake backend, driven
through the SDK in-process: tokens and what they see, quota errors that name the limit, project
management rules (over each project store: SQLite and PostgreSQL), and creates spread over
several nodes with retries when an edge refuses."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

import libdsec
from dsec.apiserver.app import Cluster
from dsec.app import create_app
from dsec.apiserver.projects import open_project_store
from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from libdsec import (
    CapacityExceeded,
    DSecClient,
    InvalidRequest,
    ProjectNotFound,
    QuotaExceeded,
    SandboxNotFound,
    SandboxStatus,
    Unauthenticated,
)
from libdsec.protocol import DSecContainerRunArgs

ROOT_TOKEN = "root-token"


async def start_edges(tmp_path, store, names, **config):
    edges = []
    for name in names:
        per = config.get(name, {})
        edge = Edge(EdgeConfig(node_dir=tmp_path / name, node=name, pool_min=0, pool_max=0, **per), FakeBackend(), store)
        await edge.start()
        edges.append(edge)
    return edges


@pytest.fixture
async def world(tmp_path, store, project_db):
    edges = await start_edges(tmp_path, store, ["n0"])
    projects = open_project_store(project_db)
    cluster = Cluster(edges, projects=projects, rng=random.Random(0))
    app = create_app(cluster, ROOT_TOKEN)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)

    def client(token: str = ROOT_TOKEN) -> DSecClient:
        return DSecClient("http://api", token=token, transport=transport)

    yield client, cluster
    for edge in edges:
        await edge.close()
    projects.close()


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image="tiny", **{"memory_limit_mb": 64, **kw})


async def test_a_project_token_sees_only_its_subtree(world):
    client, _ = world
    async with client() as root:
        await root.create_project("a")
        await root.create_project("b")
        await root.create_project("a1", parent="a")
        token_a = await root.create_project_token("a")
        token_a1 = await root.create_project_token("a1")
        token_b = await root.create_project_token("b")
        mine = await root.run_container(args())
    async with client(token_a) as a, client(token_a1) as a1, client(token_b) as b:
        in_a = await a.run_container(args())
        in_a1 = await a1.run_container(args())
        assert (in_a.info.project, in_a1.info.project) == ("a", "a1")
        assert {s.id for s in await a.list_sandboxes()} == {in_a.id, in_a1.id}
        assert {s.id for s in await a1.list_sandboxes()} == {in_a1.id}
        assert await b.list_sandboxes() == []
        # The parent reaches its child's sandbox; others' answer as if they did not exist.
        assert (await (await a.get_sandbox(in_a1.id)).run_shell("echo hi")).stdout == "hi\n"
        for other, sid in ((b, in_a.id), (a1, in_a.id), (a, mine.id)):
            with pytest.raises(SandboxNotFound, match=f"no sandbox {sid}"):
                await other.get_sandbox(sid)
        foreign = libdsec.Sandbox(b, in_a.info)
        for call in (lambda: foreign.run_shell("true"), lambda: foreign.read_file("/etc/passwd"),
                     lambda: foreign.write_file("/x", "y"), foreign.pause, foreign.resume, foreign.stop):
            with pytest.raises(SandboxNotFound):
                await call()
        assert (await a.get_sandbox(in_a.id)).info.status is SandboxStatus.running
        # Projects: each token sees its own and below.
        assert [p.path for p in await a.list_projects()] == ["root/a", "root/a/a1"]
        assert [p.path for p in await b.list_projects()] == ["root/b"]
        with pytest.raises(ProjectNotFound):
            await b.get_project("a")
        await in_a.stop()
        await in_a1.stop()
    async with client() as root:
        assert {s.id for s in await root.list_sandboxes()} == {mine.id}
        await (await root.get_sandbox(mine.id)).stop()


async def test_quota_errors_name_the_limit(world):
    client, _ = world
    async with client() as root:
        await root.create_project("team", sandboxes=3, memory_mb=512)
        token = await root.create_project_token("team")
    async with client(token) as team:
        made = [await team.run_container(args(memory_limit_mb=200)) for _ in range(2)]
        with pytest.raises(QuotaExceeded, match=r"asks for 200 MB more but the memory_mb quota of 'team' is 512 MB "
                                                r"\(400 MB in use\)"):
            await team.run_container(args(memory_limit_mb=200))
        with pytest.raises(QuotaExceeded, match="sandboxes quota of 'team' is 3"):
            await team.run_containers(args(memory_limit_mb=16), count=2)
        assert len(await team.list_sandboxes()) == 2  # the refused batch made nothing
        await made[0].stop()
        await team.run_container(args(memory_limit_mb=200))  # freed quota is usable again
        info = await team.get_project("team")
        assert info.usage.sandboxes == 2 and info.usage.memory_mb == 400 and info.quota.sandboxes == 3


async def test_delegation_through_the_api(world):
    client, _ = world
    async with client() as root:
        await root.create_project("team", cpu_cores=8)
        token = await root.create_project_token("team")
    async with client(token) as team:
        await team.create_project("x", cpu_cores=6)
        with pytest.raises(QuotaExceeded, match="handed 11 cores"):
            await team.create_project("y", cpu_cores=5)
        await team.create_project("y", cpu_cores=2)
        info = await team.get_project("team")
        assert info.handed_out.cpu_cores == 8 and info.children == ["x", "y"]
        # Quota handed out is reserved: the team itself has none left for its own sandboxes.
        with pytest.raises(QuotaExceeded, match="6 cores handed|8 cores handed"):
            await team.run_container(args(cpu_cores_limit=1))
        # Best effort commits no CPU, so it still fits.
        await team.run_container(args(cpu_cores_limit=1, best_effort=True))
        with pytest.raises(InvalidRequest, match="own token"):
            await team.set_project_quota("team", cpu_cores=100)
        await team.set_project_quota("x", cpu_cores=5)
        with pytest.raises(ProjectNotFound):
            await team.create_project("z", parent="root")
        with pytest.raises(ProjectNotFound):
            await team.set_project_quota("root", cpu_cores=1)


async def test_remove_projects_and_their_tokens(world):
    client, _ = world
    async with client() as root:
        await root.create_project("a")
        token = await root.create_project_token("a")
        async with client(token) as a:
            sandbox = await a.run_container(args())
            with pytest.raises(InvalidRequest, match="own token"):
                await a.remove_project("a")
        with pytest.raises(InvalidRequest, match="still has 1 sandboxes"):
            await root.remove_project("a")
        await (await root.get_sandbox(sandbox.id)).stop()
        await root.remove_project("a")
        with pytest.raises(ProjectNotFound):
            await root.remove_project("a")
        with pytest.raises(InvalidRequest, match="root project cannot be removed"):
            await root.remove_project("root")
    async with client(token) as gone:
        with pytest.raises(Unauthenticated):
            await gone.list_sandboxes()


@pytest.mark.parametrize("body", [{"name": "Bad"}, {"name": "x", "quota": {"memory_mb": -5}},
                                  {"name": "x", "quota": {"sandboxes": 10**12}}, {"name": "x", "extra": 1}])
async def test_bad_project_requests(world, body):
    client, cluster = world
    async with client() as root:
        response = await root._transport.request("POST", "/v1/projects", params=None, body=json.dumps(body).encode(),
                                                 content_type="application/json", timeout=10, headers=None)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] in ("invalid_request", "limit_out_of_range")
    assert "x" not in cluster.projects.tree()


async def test_creates_spread_over_nodes_and_retry_when_an_edge_refuses(tmp_path, store):
    edges = await start_edges(tmp_path, store, ["n0", "n1", "n2", "n3"], n0={"max_sandboxes": 0})
    refused = []
    real_create = edges[0].create

    async def counting_create(*a, **kw):
        refused.append(1)
        return await real_create(*a, **kw)

    edges[0].create = counting_create
    real_info = edges[0].node_info

    async def stale_info():  # n0 looks empty and roomy, but refuses everything
        info = await real_info()
        return info.model_copy(update={"max_sandboxes": 4096})

    edges[0].node_info = stale_info
    projects = open_project_store()
    cluster = Cluster(edges, projects=projects, rng=random.Random(3))
    transport = httpx.ASGITransport(app=create_app(cluster, ROOT_TOKEN), raise_app_exceptions=False)
    try:
        async with DSecClient("http://api", token=ROOT_TOKEN, transport=transport) as client:
            made = [await client.run_container(args()) for _ in range(30)]
            nodes = [s.info.node for s in made]
            assert "n0" not in nodes and refused, "n0 was chosen and refused, and the create went elsewhere"
            assert max(nodes.count(n) for n in ("n1", "n2", "n3")) <= 12  # spread, not piled on one node
            batch = await client.run_containers(args(), count=30)
            assert {s.info.node for s in batch} <= {"n1", "n2", "n3"}
            assert sorted(s.id for s in await client.list_sandboxes()) == sorted(s.id for s in made + batch)
    finally:
        for edge in edges:
            await edge.close()


async def test_a_batch_larger_than_the_cluster_fails_whole(tmp_path, store):
    edges = await start_edges(tmp_path, store, ["n0", "n1"], n0={"max_sandboxes": 3}, n1={"max_sandboxes": 3})
    cluster = Cluster(edges, rng=random.Random(1))
    transport = httpx.ASGITransport(app=create_app(cluster, ROOT_TOKEN), raise_app_exceptions=False)
    try:
        async with DSecClient("http://api", token=ROOT_TOKEN, transport=transport) as client:
            with pytest.raises(CapacityExceeded, match="is full"):
                await client.run_containers(args(), count=7)
            assert await client.list_sandboxes() == []
            six = await client.run_containers(args(), count=6)
            assert sorted(s.info.node for s in six) == ["n0"] * 3 + ["n1"] * 3
    finally:
        for edge in edges:
            await edge.close()


async def test_node_info_and_sizes_out_of_range_still_come_from_the_edge(world):
    client, _ = world
    async with client() as root:
        node = (await root.node_info())[0]
        assert node.cpu_overcommit > 16 * node.memory_overcommit / 4 and node.max_sandboxes
        with pytest.raises(libdsec.LimitOutOfRange, match="memory_limit_mb=100000000 is out of range"):
            await root.run_container(args(memory_limit_mb=10**8))
        with pytest.raises(libdsec.LimitOutOfRange, match="memory_limit_mb=-64 is out of range"):
            await root.run_containers(args(memory_limit_mb=-64), count=2)
        with pytest.raises(CapacityExceeded, match="cannot admit"):
            await root.run_containers(args(memory_limit_mb=node.memory_total_mb), count=100)
        assert await root.list_sandboxes() == []


class CountingReports:
    """An edge that counts the reports it is asked for."""

    def __init__(self, edge: Edge) -> None:
        self._edge, self.node, self.reports = edge, edge.node, 0

    async def node_info(self):
        self.reports += 1
        await asyncio.sleep(0.005)  # a node across the network takes a while to answer
        return await self._edge.node_info()

    def __getattr__(self, name):
        return getattr(self._edge, name)


async def test_a_burst_in_a_project_with_a_quota_fills_it_exactly_sharing_the_nodes_reports(tmp_path, store):
    """200 creates at once against a cap of 50, over 4 nodes: exactly 50 land, the others are
    refused by the quota, and the quota checks share the nodes' reports (not 4 reports each)."""
    edges = [CountingReports(e) for e in await start_edges(tmp_path, store, ["n0", "n1", "n2", "n3"])]
    with open_project_store() as projects:
        cluster = Cluster(edges, projects=projects, rng=random.Random(0))
        transport = httpx.ASGITransport(app=create_app(cluster, ROOT_TOKEN), raise_app_exceptions=False)
        async with DSecClient("http://api", token=ROOT_TOKEN, transport=transport) as root:
            await root.create_project("team", sandboxes=50)
            token = await root.create_project_token("team")
        async with DSecClient("http://api", token=token, transport=transport) as team:
            for e in edges:
                e.reports = 0
            results = await asyncio.gather(*(team.run_container(args()) for _ in range(200)), return_exceptions=True)
            made = [r for r in results if not isinstance(r, BaseException)]
            assert len(made) == 50
            assert all(isinstance(r, QuotaExceeded) for r in results if isinstance(r, BaseException))
            assert len(await team.list_sandboxes()) == 50
            # A burst shares gatherings: far fewer than one per create (and per node).
            assert max(e.reports for e in edges) < 40
            # Stopped sandboxes free the quota again.
            await asyncio.gather(*(s.stop() for s in made[:10]))
            again = await asyncio.gather(*(team.run_container(args()) for _ in range(20)), return_exceptions=True)
            assert sum(not isinstance(r, BaseException) for r in again) == 10
        for e in edges:
            await e._edge.close()


async def test_a_clean_copy_counts_against_its_sources_project(world):
    client, _ = world
    async with client() as root:
        await root.create_project("grading", sandboxes=2)
        token = await root.create_project_token("grading")
        await root.create_project("other")
        other = await root.create_project_token("other")
    async with client(token) as team, client(other) as stranger:
        source = await team.run_container(args())
        await source.write_file("/testbed/a", "work")
        copy = await source.clean_copy(["/testbed"])
        assert copy.info.project == "grading" and await copy.read_file("/testbed/a") == b"work"
        with pytest.raises(QuotaExceeded, match="sandboxes quota of 'grading' is 2"):
            await source.clean_copy(["/testbed"])
        with pytest.raises(SandboxNotFound):  # another project cannot copy it either
            await libdsec.Sandbox(stranger, source.info).clean_copy(["/testbed"])
        await copy.stop()
        await source.stop()
