"""Observability over the fake backend: what an edge counts (``dsec.edge.stats``), ``/metrics``
and ``/v1/stats`` on the apiserver (``dsec.apiserver.metrics``), who may read them, and the
dashboard's cookie."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsec.apiserver.cluster import Cluster
from dsec.app import create_app
from dsec.apiserver.projects import open_project_store
from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from dsec.edge.stats import EdgeStats
from libdsec import CapacityExceeded, LimitOutOfRange
from libdsec.protocol import LATENCY_BOUNDS, ClusterStats, DSecContainerRunArgs, ExecRequest, LatencyHistogram

TOKEN = "root-token"


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image="tiny", **{"memory_limit_mb": 64, **kw})


@pytest.fixture
async def edge(tmp_path, store):
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=0, pool_max=0, max_sandboxes=3), FakeBackend(), store)
    await edge.start()
    yield edge
    await edge.close()


@pytest.fixture
async def api(edge, tmp_path):
    projects = open_project_store(tmp_path / "projects.db")
    cluster = Cluster([edge], projects=projects)
    app = create_app(cluster, TOKEN)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://api",
                                 headers={"authorization": f"Bearer {TOKEN}"}) as client:
        yield client, cluster
    projects.close()


def test_quantile_interpolates_within_its_bucket():
    hist = LatencyHistogram()
    assert hist.quantile(0.5) is None
    i = LATENCY_BOUNDS.index(0.01)
    hist.counts[i] = 10  # ten observations in (0.005, 0.01]
    assert hist.quantile(0.5) == pytest.approx(0.0075)
    assert hist.quantile(1.0) == pytest.approx(0.01)
    hist.counts[-1] = 1  # one above the last bound
    assert hist.quantile(1.0) == LATENCY_BOUNDS[-1]
    assert hist.plus(hist).count == 22 and hist.plus(hist).minus(hist).count == 11


async def test_edge_counts_what_it_does(edge):
    a = await edge.create(args(), project="team")
    b = await edge.create(args())
    await edge.exec(a.id, ExecRequest(command="echo hi"))
    await edge.exec(b.id, ExecRequest(command="echo hi"))
    await edge.pause(b.id)
    await edge.resume(b.id)
    await edge.pause(b.id)
    with pytest.raises(LimitOutOfRange):
        await edge.create(args(memory_limit_mb=1))
    async for _ in edge.create_batch(args(), 1):  # a batch's sandboxes count as creates too
        pass
    with pytest.raises(CapacityExceeded):
        await edge.create(args())  # max_sandboxes=3
    with pytest.raises(CapacityExceeded):
        async for _ in edge.create_batch(args(), 5):
            pass
    edge.security.events.record(a.id, "network.blocked", "10.0.0.1:80")
    edge.security.events.record(a.id, "network.blocked", "10.0.0.1:80")  # a repeat: counted on the last one
    edge.security.events.record(b.id, "limit.timeout", "sleep 9")

    stats = await edge.node_stats()
    assert stats.info.node == "n0" and stats.info.sandboxes == 3
    assert stats.creates == {"container": 3}
    assert stats.create_seconds["container"].count == 3
    assert stats.command_seconds["container"].count == 2
    assert stats.admission_refusals == {"limit": 1, "capacity": 6}  # the batch's five count as five
    assert (stats.pauses, stats.resumes) == (2, 1)
    assert stats.security_events == {"network.blocked": 2, "limit.timeout": 1}
    assert [(e.sandbox_id, e.event.kind, e.event.count) for e in stats.recent_security_events] == [
        (a.id, "network.blocked", 2), (b.id, "limit.timeout", 1)]
    by = {(c.status.value, c.kind.value, c.project): c.count for c in stats.sandboxes}
    assert by == {("running", "container", "team"): 1, ("running", "container", "root"): 1,
                  ("paused", "container", "root"): 1}
    assert stats.memory_used_mb > 0 and stats.cpu_used_cores >= 0


async def test_counting_can_be_turned_off(edge, monkeypatch):
    monkeypatch.setenv("DSEC_METRICS", "0")
    edge.stats = EdgeStats()
    info = await edge.create(args())
    await edge.exec(info.id, ExecRequest(command="true"))
    stats = await edge.node_stats()
    assert stats.creates == {} and stats.command_seconds == {}
    assert stats.sandboxes[0].count == 1  # what it holds is read, not counted


def _samples(text: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


async def test_metrics_and_stats(api):
    client, cluster = api
    created = [(await client.post("/v1/sandboxes", json=args().model_dump())).json() for _ in range(2)]
    for info in created:
        assert (await client.post(f"/v1/sandboxes/{info['id']}/exec", json={"command": "echo hi"})).status_code == 200
    assert (await client.post(f"/v1/sandboxes/{created[0]['id']}/pause")).status_code == 200
    refused = await client.post("/v1/sandboxes", json=args(memory_limit_mb=10 ** 7).model_dump())
    assert refused.status_code == 422  # out of range: the node's refusal

    answer = await client.get("/metrics")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    m = _samples(answer.text)
    assert m[("dsec_api_creates_total", ("kind", "container"), ("outcome", "ok"))] == 2
    assert m[("dsec_api_creates_total", ("kind", "container"), ("outcome", "invalid"))] == 1
    assert m[("dsec_api_create_seconds_count", ("kind", "container"))] == 3
    assert m[("dsec_api_commands_total",)] == 2
    assert m[("dsec_api_command_seconds_count",)] == 2
    assert m[("dsec_node_up", ("node", "n0"))] == 1
    assert m[("dsec_sandboxes", ("kind", "container"), ("node", "n0"), ("project", "root"), ("state", "running"))] == 1
    assert m[("dsec_sandboxes", ("kind", "container"), ("node", "n0"), ("project", "root"), ("state", "paused"))] == 1
    assert m[("dsec_node_creates_total", ("kind", "container"), ("node", "n0"))] == 2
    assert m[("dsec_node_command_seconds_count", ("kind", "container"), ("node", "n0"))] == 2
    assert m[("dsec_node_command_seconds_bucket", ("kind", "container"), ("le", "+Inf"), ("node", "n0"))] == 2
    assert m[("dsec_node_admission_refusals_total", ("node", "n0"), ("reason", "limit"))] == 1
    assert m[("dsec_node_pauses_total", ("node", "n0"))] == 1
    assert m[("dsec_node_memory_committed_bytes", ("node", "n0"))] == 128 << 20
    assert m[("dsec_node_cpu_committed_cores", ("node", "n0"))] == 2
    assert ("process_resident_memory_bytes",) in m

    stats = ClusterStats.model_validate((await client.get("/v1/stats")).json())
    assert [n.info.node for n in stats.nodes] == ["n0"] and stats.lost_nodes == []
    assert stats.apiserver.creates == {"container": {"ok": 2, "invalid": 1}}
    assert stats.nodes[0].creates == {"container": 2}

    cluster.mark_lost("n9", "gone for the test")
    assert _samples((await client.get("/metrics")).text)[("dsec_node_up", ("node", "n9"))] == 0


async def test_only_the_root_token_reads_them(api):
    client, cluster = api
    await cluster.projects.create("team", "root")
    team = await cluster.projects.new_token("team")
    for path in ("/metrics", "/v1/stats", "/dashboard", "/dashboard/stats", "/dashboard/app.js"):
        for headers in ({"authorization": ""}, {"authorization": "Bearer nope"}, {"authorization": f"Bearer {team}"}):
            answer = await client.get(path, headers=headers)
            assert answer.status_code == 401, (path, headers, answer.text)
            assert answer.json()["error"]["code"] == "unauthenticated"
    assert (await client.get("/dashboard", params={"token": team}, headers={"authorization": ""})).status_code == 401


async def test_dashboard_takes_its_token_once_as_a_cookie(api):
    client, _ = api
    client.headers.pop("authorization")
    answer = await client.get("/dashboard", params={"token": TOKEN})
    assert answer.status_code == 303 and answer.headers["location"] == "/dashboard"
    cookie = answer.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/dashboard" in cookie
    page = await client.get("/dashboard")
    assert page.status_code == 200 and '<script src="/dashboard/app.js">' in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from another host
    script = await client.get("/dashboard/app.js")
    assert script.status_code == 200 and "fetch(\"/dashboard/stats\"" in script.text
    assert ClusterStats.model_validate((await client.get("/dashboard/stats")).json()).nodes
    # The cookie is the dashboard's alone.
    assert (await client.get("/v1/stats")).status_code == 401
    assert (await client.get("/metrics")).status_code == 401


async def test_top_frame_shows_the_stats(api):
    from collections import deque

    from rich.console import Console

    from dsec.cli_top import Summary, frame

    client, _ = api
    info = (await client.post("/v1/sandboxes", json=args().model_dump())).json()
    await client.post(f"/v1/sandboxes/{info['id']}/exec", json={"command": "echo hi"})
    first = ClusterStats.model_validate((await client.get("/v1/stats")).json())
    await client.post("/v1/sandboxes", json=args().model_dump())
    second = ClusterStats.model_validate((await client.get("/v1/stats")).json())
    console = Console(width=200, record=True)
    console.print(frame(second, deque([Summary.of(first)])))
    text = console.export_text()
    assert "nodes 1 up" in text and "sandboxes 2: running 2" in text and "made 2, commands 1" in text
    assert "create (container)" in text and "command (container)" in text
    assert "(avg)" not in text  # two readings: a rate over the interval
    console = Console(width=200, record=True)
    console.print(frame(second))
    assert "(avg)" in console.export_text()


async def test_a_cluster_reports_every_node(tmp_path, store):
    edges = [Edge(EdgeConfig(node_dir=tmp_path / name, node=name, pool_min=0, pool_max=0), FakeBackend(), store)
             for name in ("n1", "n2")]
    for e in edges:
        await e.start()
    projects = open_project_store(tmp_path / "projects.db")
    try:
        cluster = Cluster(edges, projects=projects)
        transport = httpx.ASGITransport(app=create_app(cluster, TOKEN), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://api",
                                     headers={"authorization": f"Bearer {TOKEN}"}) as client:
            for e in edges:
                await e.create(args(), project="team")
            m = _samples((await client.get("/metrics")).text)
            for name in ("n1", "n2"):
                assert m[("dsec_node_up", ("node", name))] == 1
                assert m[("dsec_node_creates_total", ("kind", "container"), ("node", name))] == 1
                assert m[("dsec_sandboxes", ("kind", "container"), ("node", name), ("project", "team"),
                          ("state", "running"))] == 1
            # None of that passed through the apiserver.
            assert not any(key[0] == "dsec_api_creates_total" for key in m)
            cluster.mark_lost("n2", "gone for the test")
            m = _samples((await client.get("/metrics")).text)
            assert m[("dsec_node_up", ("node", "n2"))] == 0
            assert ("dsec_node_creates_total", ("kind", "container"), ("node", "n2")) not in m
    finally:
        projects.close()
        for e in edges:
            await e.close()
