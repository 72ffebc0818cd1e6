"""The apiserver's cluster as nodes come and go (over in-process edges on the fake backend):
ids of nodes it never had, lost nodes (``SandboxLost``, out of quotas and placement), a node that
does not answer a create, and a node coming back with the stops a failed batch owes it."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from dsec.apiserver.app import Cluster
from dsec.app import create_app
from dsec.apiserver.projects import open_project_store
from dsec.backends.fake import FakeBackend
from dsec.edge.api import NodeUnreachable
from dsec.edge.edge import Edge, EdgeConfig
from libdsec import DSecClient, DSecContainerRunArgs, QuotaExceeded, Sandbox, SandboxLost, SandboxNotFound

TOKEN = "root-token"


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image="tiny", **{"memory_limit_mb": 64, **kw})


class Unreachable:
    """An edge whose node does not answer (every call raises NodeUnreachable)."""

    def __init__(self, edge: Edge) -> None:
        self.node, self._edge = edge.node, edge

    def __getattr__(self, name):
        async def fail(*a, **kw):
            raise NodeUnreachable(f"node {self.node} did not answer {name}")
        if name == "create_batch":
            async def gen(*a, **kw):
                raise NodeUnreachable(f"node {self.node} did not answer a batch")
                yield
            return gen
        return fail


@pytest.fixture
async def world(tmp_path, store):
    edges = []
    for name in ("n0", "n1", "n2"):
        edge = Edge(EdgeConfig(node_dir=tmp_path / name, node=name, pool_min=0, pool_max=0), FakeBackend(), store)
        await edge.start()
        edges.append(edge)
    projects = open_project_store()
    cluster = Cluster(edges, projects=projects, rng=random.Random(5))
    transport = httpx.ASGITransport(app=create_app(cluster, TOKEN), raise_app_exceptions=False)
    client = DSecClient("http://api", token=TOKEN, transport=transport)
    await client.open()
    yield client, cluster, {e.node: e for e in edges}
    await client.close()
    for edge in edges:
        await edge.close()
    projects.close()


async def test_an_id_of_a_node_never_in_the_cluster(world):
    client, _, _ = world
    with pytest.raises(SandboxNotFound, match="node 'zz' is not in this cluster"):
        await client.get_sandbox("zz-0123456789abcdef")


async def test_a_lost_node_answers_sandbox_lost_and_leaves_quotas_and_placement(world):
    client, cluster, edges = world
    await client.create_project("team", sandboxes=4)
    token = await client.create_project_token("team")
    transport = cluster_transport(cluster)
    async with DSecClient("http://api", token=token, transport=transport) as team:
        made = [await team.run_container(args()) for _ in range(4)]
        with pytest.raises(QuotaExceeded):
            await team.run_container(args())
        victim = made[0].info.node
        on_victim = [s for s in made if s.info.node == victim]
        cluster.mark_lost(victim, "its Ray node died")
        with pytest.raises(SandboxLost, match=f"its node {victim} left the cluster"):
            await on_victim[0].run_shell("echo hi")
        assert {i.node for i in await client.list_sandboxes()} <= set(edges) - {victim}
        # Its sandboxes hold no quota any more, and new ones go to the other nodes.
        again = [await team.run_container(args()) for _ in range(len(on_victim))]
        assert victim not in {s.info.node for s in again}
        # It comes back with its sandboxes.
        cluster.add_edge(edges[victim])
        assert (await on_victim[0].run_shell("echo back")).stdout == "back\n"


def cluster_transport(cluster: Cluster) -> httpx.ASGITransport:
    return httpx.ASGITransport(app=create_app(cluster, TOKEN), raise_app_exceptions=False)


async def test_a_create_skips_a_node_that_does_not_answer(world):
    client, cluster, edges = world
    cluster.edges["n1"] = Unreachable(edges["n1"])
    nodes = {(await client.run_container(args())).info.node for _ in range(20)}
    assert nodes <= {"n0", "n2"} and nodes


async def test_a_batch_failing_with_a_lost_node_is_stopped_there_when_it_returns(world):
    client, cluster, edges = world
    made = await client.run_containers(args(), count=6)
    victim = made[0].info.node
    ids = [s.id for s in made if s.info.node == victim]
    cluster.mark_lost(victim, "test")
    await cluster.stop_ids([s.id for s in made], "batch create failed")
    assert len(await edges[victim].list()) == len(ids)  # could not be reached: owed
    cluster.add_edge(edges[victim])
    for _ in range(100):
        if not await edges[victim].list():
            break
        await asyncio.sleep(0.01)
    assert await edges[victim].list() == []
    assert await client.list_sandboxes() == []


async def test_the_stops_owed_to_a_lost_node_outlive_the_apiserver(world, tmp_path):
    """An apiserver that restarts while a node is lost still stops, once the node is back, what
    the failed batch made there (the stops are kept in the project store)."""
    client, cluster, edges = world
    made = await client.run_containers(args(), count=6)
    victim = made[0].info.node
    on_victim = {s.id for s in made if s.info.node == victim}
    db = tmp_path / "projects.db"
    with open_project_store(db) as projects:
        first = Cluster(list(edges.values()), projects=projects)
        first.mark_lost(victim, "test")
        await first.stop_ids([s.id for s in made], "batch create failed")
        assert {i.id for i in await edges[victim].list()} == on_victim
    # A new apiserver over the same store; the node joins it.
    with open_project_store(db) as projects:
        assert set(await projects.owed_stops(victim)) == on_victim
        second = Cluster([e for n, e in edges.items() if n != victim], projects=projects)
        second.add_edge(edges[victim])
        for _ in range(200):
            if not await edges[victim].list() and not await projects.owed_stops(victim):
                break
            await asyncio.sleep(0.01)
        assert await edges[victim].list() == []
        assert await projects.owed_stops(victim) == {}


async def until_gone(edge: Edge, sandbox_ids: set[str]) -> None:
    for _ in range(200):
        if not sandbox_ids & {i.id for i in await edge.list()}:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"still on node {edge.node}: {sandbox_ids & {i.id for i in await edge.list()}}")


async def test_a_stop_that_cannot_reach_the_node_is_made_when_it_is_back(world):
    """A stop of a lost node's sandbox, and one whose node breaks off in the middle of it (its
    answer lost: it may have been made), answer SandboxLost; the stops are kept, and made when
    the node is back: what its owner stopped does not come back running."""
    client, cluster, edges = world
    made = await client.run_containers(args(), count=6)
    victim = made[0].info.node
    on_victim = [s for s in made if s.info.node == victim]
    kept = next(s for s in made if s.info.node != victim)
    cluster.mark_lost(victim, "test")
    with pytest.raises(SandboxLost, match=f"the stop is kept, and made when node {victim} is back"):
        await on_victim[0].stop()
    # Another node answers; the call breaks off in the middle.
    broken = kept.info.node
    cluster.edges[broken] = Unreachable(edges[broken])
    with pytest.raises(SandboxLost, match="did not answer stop; the stop is kept"):
        await kept.stop()
    assert set(await cluster.projects.owed_stops(victim)) == {on_victim[0].id}
    assert set(await cluster.projects.owed_stops(broken)) == {kept.id}
    cluster.add_edge(edges[victim])
    cluster.add_edge(edges[broken])
    await until_gone(edges[victim], {on_victim[0].id})
    await until_gone(edges[broken], {kept.id})
    assert await cluster.projects.owed_stops(victim) == {} and await cluster.projects.owed_stops(broken) == {}
    # The sandboxes not stopped came back running with their node.
    rest = [s for s in made if s.id not in {on_victim[0].id, kept.id}]
    assert {i.id for i in await client.list_sandboxes()} == {s.id for s in rest}
    assert (await rest[0].run_shell("echo back")).stdout == "back\n"


async def test_a_projects_stop_of_a_lost_nodes_sandbox_is_made_when_back_if_it_is_theirs(world):
    """Whose a lost node's sandbox is, only the node knows: a project's stop is owed with the
    project, and made when the node is back only if the sandbox is that project's."""
    client, cluster, edges = world
    for name in ("team", "other"):
        await client.create_project(name, sandboxes=8)
    transport = cluster_transport(cluster)
    async with (DSecClient("http://api", token=await client.create_project_token("team"), transport=transport) as team,
                DSecClient("http://api", token=await client.create_project_token("other"), transport=transport) as other):
        made = await team.run_containers(args(), count=6)
        victim = made[0].info.node
        mine, not_theirs = [s for s in made if s.info.node == victim][:2]
        cluster.mark_lost(victim, "test")
        with pytest.raises(SandboxLost, match=f"made when node {victim} is back .if the sandbox is project team's"):
            await mine.stop()
        # Another project names an id it learned: owed too, but the node will not stop it.
        with pytest.raises(SandboxLost, match="project other's"):
            await Sandbox(other, not_theirs.info).stop()
        assert {sid: owed.project for sid, owed in (await cluster.projects.owed_stops(victim)).items()} == {
            mine.id: "team", not_theirs.id: "other"}
        # Other calls of a lost node's sandbox owe nothing.
        with pytest.raises(SandboxLost):
            await not_theirs.run_shell("true")
        cluster.add_edge(edges[victim])
        await until_gone(edges[victim], {mine.id})
        for _ in range(200):
            if not await cluster.projects.owed_stops(victim):
                break
            await asyncio.sleep(0.01)
        assert await cluster.projects.owed_stops(victim) == {}
        assert (await not_theirs.run_shell("echo mine")).stdout == "mine\n"
        for s in made:
            await s.stop()


async def test_an_e2b_kill_of_a_lost_nodes_sandbox_is_owed_the_same_way(world):
    client, cluster, edges = world
    await client.create_project("team", sandboxes=8)
    key = await client.create_project_token("team")
    async with DSecClient("http://api", token=key, transport=cluster_transport(cluster)) as team:
        made = await team.run_containers(args(), count=3)
    victim = made[0].info.node
    cluster.mark_lost(victim, "test")
    async with httpx.AsyncClient(transport=cluster_transport(cluster), base_url="http://api") as http:
        answer = await http.delete(f"/e2b/sandboxes/{made[0].id}", headers={"X-API-Key": key})
    assert answer.status_code == 410 and "the stop is kept" in answer.text, answer.text
    assert (await cluster.projects.owed_stops(victim))[made[0].id].project == "team"
    cluster.add_edge(edges[victim])
    await until_gone(edges[victim], {made[0].id})
    for s in made[1:]:
        await Sandbox(client, s.info).stop()
