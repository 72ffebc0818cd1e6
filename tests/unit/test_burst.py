"""Bursting: the policy over views (when to ask for nodes, how many, when to drain and release),
placement with overflow and draining nodes, and the applier's whole round over real edges on the
fake backend (a fake autoscaler: the requests it got, the nodes let go)."""

from __future__ import annotations

import random

import pytest

from dsec.apiserver.cluster import Cluster
from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from dsec.nodes.burst import BurstSettings, BurstState, committed_share, decide
from dsec.nodes.ray_burst import RayBurst
from libdsec.protocol import DSecContainerRunArgs, NodeInfo

SETTINGS = BurstSettings(high_water=0.8, low_water=0.5, quiet_s=60, max_nodes=4, settle_s=5)


def node(name: str, sandboxes: int = 0, *, max_sandboxes: int | None = 10, memory_mb: int = 0,
         cpu: float = 0.0) -> NodeInfo:
    """A node of 4 cores and 1000 MB, no overcommit, holding ``sandboxes`` and the given commitments."""
    return NodeInfo(node=name, cgroup_version="2", runtime="container", sandboxes=sandboxes, memory_total_mb=1000,
                    cpu_cores=4, max_sandboxes=max_sandboxes, committed_memory_mb=memory_mb, committed_cpu=cpu)


def run(steps, burst=(), settings=SETTINGS, state=None):
    """Plans for successive (time, infos) views, each from the state the last one left; the
    nodes named in ``burst`` are burst nodes while they are in the view."""
    state = state or BurstState()
    plans = []
    for now, infos in steps:
        plan = decide(infos, {i.node for i in infos} & set(burst), state, now, settings)
        state = plan.state
        plans.append(plan)
    return plans


# -- the committed share -----------------------------------------------------------------------

def test_the_share_is_the_most_committed_resource_over_the_nodes_with_their_overcommit():
    a = node("a", 2, memory_mb=300, cpu=1.0)
    b = node("b", 0, memory_mb=100, cpu=3.0)
    assert committed_share([a, b]) == pytest.approx(max(2 / 20, 400 / 2000, 4 / 8))
    over = a.model_copy(update={"cpu_overcommit": 4.0, "memory_overcommit": 2.0})
    assert committed_share([over]) == pytest.approx(max(2 / 10, 300 / 2000, 1 / 16))
    assert committed_share([]) == 0.0


def test_a_node_without_a_count_limit_leaves_the_count_out():
    assert committed_share([node("a", 9), node("b", 0, max_sandboxes=None)]) == 0.0
    assert committed_share([node("a", 9), node("b", 0)]) == pytest.approx(0.45)


# -- asking for nodes ---------------------------------------------------------------------------

def test_below_high_water_nothing_is_asked():
    (plan,) = run([(0, [node("a", 7)])])
    assert (plan.request, plan.drain, plan.release) == (0, frozenset(), frozenset())
    assert plan.share == pytest.approx(0.7)


def test_at_high_water_one_node_is_asked_and_not_again_while_it_comes():
    plans = run([(0, [node("a", 8)]), (1, [node("a", 9)]), (2, [node("a", 10)])])
    assert [p.request for p in plans] == [1, 1, 1]


def test_once_the_node_joined_and_the_share_is_still_high_another_is_asked():
    first, joined = run([(0, [node("a", 9)]), (5, [node("a", 10), node("b1", 7)])], burst={"b1"})
    assert (first.request, joined.request) == (1, 2)  # 17 of 20 is still above 0.8


def test_enough_nodes_are_asked_for_a_big_cluster_at_once():
    infos = [node(f"n{i}", 10) for i in range(10)]  # full
    (plan,) = run([(0, infos)])
    # 100 sandboxes below 0.8 needs 13 nodes of 10: 3 more, but no more than max_nodes.
    assert plan.request == 3
    (capped,) = run([(0, infos * 2)], settings=BurstSettings(max_nodes=2))
    assert capped.request == 2


def test_no_bursting_with_max_nodes_zero():
    (plan,) = run([(0, [node("a", 10)])], settings=BurstSettings(max_nodes=0))
    assert plan.request == 0


# -- draining and releasing ---------------------------------------------------------------------

def test_a_quiet_spell_below_low_water_drains_the_burst_node_then_releases_it_once_empty():
    busy = [node("a", 10), node("b1", 7)]
    quiet = [node("a", 2), node("b1", 1)]
    empty = [node("a", 2), node("b1", 0)]
    plans = run([(0, busy), (10, quiet), (69, quiet), (70, quiet), (72, empty), (76, empty)], burst={"b1"})
    assert [p.request for p in plans] == [2, 2, 2, 0, 0, 0]  # (17 of 20 first: one more)
    assert [p.drain for p in plans] == [frozenset()] * 3 + [frozenset({"b1"})] * 3
    # Released once empty and draining for settle_s: creates placed before it began have landed.
    assert [p.release for p in plans] == [frozenset()] * 5 + [frozenset({"b1"})]
    # Once draining, it counts no more in the share that decides (it takes no new sandboxes).
    assert (plans[3].share, plans[4].share) == (pytest.approx(3 / 20), pytest.approx(2 / 10))


def test_the_quiet_spell_starts_again_when_the_share_rises_above_low_water():
    quiet, middling = [node("a", 2), node("b1", 0)], [node("a", 10), node("b1", 1)]
    plans = run([(0, quiet), (50, middling), (70, quiet), (119, quiet), (130, quiet)], burst={"b1"})
    assert [bool(p.drain) for p in plans] == [False, False, False, False, True]


def test_a_burst_node_is_drained_only_while_the_rest_can_hold_everything_below_low_water():
    # 4 + 4 + 0 of 30: dropping b2 leaves 8/20 < 0.5; dropping b1 too would leave 8/10.
    infos = [node("a", 4), node("b1", 4), node("b2", 0)]
    (first, later) = run([(0, infos), (60, infos)], burst={"b1", "b2"})
    assert later.drain == {"b2"} and later.request == 1


def test_base_nodes_are_never_drained():
    (_, plan) = run([(0, [node("a", 0), node("c", 0)]), (100, [node("a", 0), node("c", 0)])])
    assert plan.drain == frozenset() and plan.request == 0


def test_high_water_again_takes_draining_nodes_back_before_asking_for_more():
    quiet = [node("a", 1), node("b1", 1)]
    plans = run([(0, quiet), (60, quiet), (61, [node("a", 10), node("b1", 1)])], burst={"b1"})
    assert plans[1].drain == {"b1"} and plans[1].request == 0
    assert plans[2].drain == frozenset() and plans[2].request == 1 and plans[2].release == frozenset()


def test_a_draining_node_that_left_is_forgotten():
    quiet = [node("a", 1), node("b1", 0)]
    plans = run([(0, quiet), (60, quiet), (70, quiet)], burst={"b1"})
    assert plans[-1].release == {"b1"}
    after = decide([node("a", 1)], set(), plans[-1].state, 71, SETTINGS)
    assert after.state.draining == {} and after.request == 0


def test_nodes_asked_for_and_not_come_are_no_longer_wanted_after_a_quiet_spell():
    plans = run([(0, [node("a", 9)]), (5, [node("a", 1)]), (65, [node("a", 1)])])
    assert [p.request for p in plans] == [1, 1, 0]


def test_settings_are_checked():
    with pytest.raises(ValueError, match="low water < high water"):
        BurstSettings(high_water=0.5, low_water=0.6)
    with pytest.raises(ValueError):
        BurstSettings(max_nodes=-1)


# -- placement with overflow and draining nodes --------------------------------------------------

ARGS = DSecContainerRunArgs(container_image="tiny", memory_limit_mb=64)


async def start_edges(tmp_path, store, sizes: dict[str, int]) -> list[Edge]:
    edges = []
    for name, most in sizes.items():
        edge = Edge(EdgeConfig(node_dir=tmp_path / name, node=name, pool_min=0, pool_max=0, max_sandboxes=most),
                    FakeBackend(), store)
        await edge.start()
        edges.append(edge)
    return edges


@pytest.fixture
async def edges(tmp_path, store):
    edges = await start_edges(tmp_path, store, {"a": 4, "c": 4, "b1": 8})
    yield edges
    for edge in edges:
        await edge.close()


async def test_overflow_nodes_take_only_what_the_others_have_no_room_for(edges):
    cluster = Cluster(edges, rng=random.Random(0), view_max_age_s=0)
    cluster.overflow = frozenset({"b1"})
    singles = [await cluster.create(ARGS, "root") for _ in range(6)]
    assert "b1" not in {s.node for s in singles}
    batch = [info async for _, info in cluster.create_batch(ARGS, 4, "root")]
    assert [s.node for s in batch].count("b1") == 2  # the base nodes had room for 2 more


async def test_draining_nodes_take_nothing_new_and_keep_serving(edges):
    cluster = Cluster(edges, rng=random.Random(0), view_max_age_s=0)
    kept = [await cluster.create(ARGS, "root") for _ in range(6)]
    cluster.draining = frozenset({"b1"})
    fresh = [await cluster.create(ARGS, "root") for _ in range(2)]
    batch = [info async for _, info in cluster.create_batch(ARGS, 2, "root")]
    assert "b1" not in {s.node for s in fresh + batch}
    on_b1 = [s for s in kept if s.node == "b1"]
    assert on_b1, [s.node for s in kept]
    assert (await cluster.edge_for(on_b1[0].id).get(on_b1[0].id)).id == on_b1[0].id


# -- the applier's whole round --------------------------------------------------------------------

async def test_a_burst_round_over_real_edges_asks_places_drains_and_lets_go(tmp_path, store):
    (a,) = await start_edges(tmp_path, store, {"a": 10})
    cluster = Cluster([a], rng=random.Random(0), view_max_age_s=0)
    asked: list[int] = []
    let_go: list[str] = []
    now = [0.0]

    async def release(name: str) -> None:
        let_go.append(name)
        cluster.remove_edge(name)

    burst = RayBurst(BurstSettings(quiet_s=30, settle_s=2, max_nodes=2), cluster, release, request=asked.append,
                     view_max_age_s=0, clock=lambda: now[0])
    (b1,) = await start_edges(tmp_path, store, {"b1": 10})
    try:
        made = [await cluster.create(ARGS, "root") for _ in range(9)]
        assert (await burst.step(set())).request == 1 and asked == [1]
        cluster.add_edge(b1)  # the burst node joined
        now[0] = 5
        await burst.step({"b1"})
        assert asked == [1] and cluster.overflow == {"b1"}
        made += [await cluster.create(ARGS, "root") for _ in range(3)]
        assert [s.node for s in made].count("a") == 10 and [s.node for s in made[-2:]] == ["b1", "b1"]
        for info in made:
            await cluster.edge_for(info.id).stop(info.id)
        # Quiet since t=5 (9 of 20), yet not drained then: a alone would hold 9 of 10.
        for t in (10, 34):
            now[0] = t
            assert (await burst.step({"b1"})).drain == frozenset()
        now[0] = 35
        plan = await burst.step({"b1"})
        assert plan.drain == {"b1"} and cluster.draining == {"b1"} and asked == [1, 0] and not let_go
        now[0] = 37
        await burst.step({"b1"})
        assert let_go == ["b1"] and set(cluster.edges) == {"a"}
        now[0] = 38
        assert (await burst.step(set())).drain == frozenset() and asked == [1, 0]
    finally:
        await a.close()
        await b1.close()
