"""An apiserver with no node able to take a create: none joined yet, every one lost, or their
edges did not start. Every create, single or batch, through DSec's API and E2B's, is the typed
"no capacity" refusal (503) naming why, never a 500; ``/v1/nodes?all=true`` says which nodes
are not serving and why; and the server keeps serving once a node is back."""

from __future__ import annotations

import httpx
import pytest

from dsec.apiserver.app import Cluster
from dsec.app import create_app
from dsec.apiserver.projects import open_project_store
from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from libdsec import CapacityExceeded, DSecClient, DSecContainerRunArgs, DSecFnCallArgs

TOKEN = "root-token"
ARGS = DSecContainerRunArgs(container_image="tiny", memory_limit_mb=64)


@pytest.fixture
async def world(tmp_path, store):
    edge = Edge(EdgeConfig(node_dir=tmp_path / "n0", node="n0", pool_min=0, pool_max=0), FakeBackend(), store)
    await edge.start()
    projects = open_project_store()
    cluster = Cluster([], projects=projects)
    transport = httpx.ASGITransport(app=create_app(cluster, TOKEN), raise_app_exceptions=False)
    client = DSecClient("http://api", token=TOKEN, transport=transport)
    await client.open()
    http = httpx.AsyncClient(transport=transport, base_url="http://api")
    yield client, http, cluster, edge
    await http.aclose()
    await client.close()
    await edge.close()
    projects.close()


async def refusals(client: DSecClient, http: httpx.AsyncClient) -> list[str]:
    """Each kind of create's refusal: the single, the batch, FnCall, E2B's, and the routes' own."""
    said = []
    for call in (lambda: client.run_container(ARGS), lambda: client.run_containers(ARGS, count=3),
                 lambda: client.fncall(DSecFnCallArgs(code="print(1)"))):
        with pytest.raises(CapacityExceeded) as refused:
            await call()
        said.append(str(refused.value))
    answer = await http.post("/e2b/sandboxes", json={"templateID": "tiny"}, headers={"X-API-Key": TOKEN})
    assert answer.status_code == 503, answer.text
    assert set(answer.json()) == {"code", "message"}, answer.json()  # E2B's shape
    said.append(answer.json()["message"])
    raw = await http.post("/v1/sandboxes", json=ARGS.model_dump(mode="json"),
                          headers={"Authorization": f"Bearer {TOKEN}"})
    assert raw.status_code == 503 and raw.json()["error"]["code"] == "capacity_exceeded", raw.text
    batch = await http.post("/v1/sandboxes:batch", json={"args": ARGS.model_dump(mode="json"), "count": 2},
                            headers={"Authorization": f"Bearer {TOKEN}"})
    assert batch.status_code != 500 and "capacity_exceeded" in batch.text, batch.text
    return said


async def test_no_node_joined_yet(world):
    client, http, cluster, _ = world
    cluster.join_hint = "start nodes with the dsec_edge resource"
    for said in await refusals(client, http):
        assert "no node has joined the cluster: start nodes with the dsec_edge resource" in said, said
    assert await client.node_info(include_unready=True) == []


async def test_every_node_lost_or_failed_says_which_and_why(world):
    client, http, cluster, edge = world
    cluster.add_edge(edge)
    cluster.mark_lost("n0", "its Ray node died")
    cluster.note_failed("n1", "[Errno 28] No space left on device: '/var/lib/dsec/nodes/n1'")
    for said in await refusals(client, http):
        assert said.startswith("no node is ready"), said
        assert "the edge did not start on n1 ([Errno 28] No space left" in said, said
        assert "lost: n0 (its Ray node died" in said, said
    assert await client.node_info() == []
    unready = {n.node: (n.state, n.problem) for n in await client.node_info(include_unready=True)}
    assert unready.keys() == {"n0", "n1"}
    assert unready["n0"][0] == "lost" and unready["n0"][1].startswith("its Ray node died (")
    assert unready["n1"][0] == "failed" and "No space left" in unready["n1"][1]
    # The node comes back: creates are served again, and it is no longer listed as unready.
    cluster.add_edge(edge)
    made = await client.run_containers(ARGS, count=2)
    assert {s.info.node for s in made} == {"n0"}
    states = {n.node: n.state for n in await client.node_info(include_unready=True)}
    assert states == {"n0": "ready", "n1": "failed"}
    for s in made:
        await s.stop()


async def test_a_node_that_does_not_report_is_named(world):
    """Nodes in the cluster that answered no report: the refusal says so, not "no room"."""
    client, _, cluster, edge = world

    class Silent:
        node = "n0"

        async def node_info(self):
            raise OSError("connection refused")

    cluster.edges["n0"] = Silent()
    with pytest.raises(CapacityExceeded, match=r"no node answered the apiserver's last look \(1 in the cluster: n0\)"):
        await client.run_container(ARGS)
