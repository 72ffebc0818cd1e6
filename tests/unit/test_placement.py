"""Placement over simulated clusters: filtering by overcommitted capacity, power-of-k spread,
batches, exclusion of nodes that refused, and the last-resort choice."""

from __future__ import annotations

import random
import statistics

import pytest

from dsec.placement import Demand, NodeLoad, Overcommit, fits, least_loaded, load, place

ONE = Demand(cpu_cores=1.0, memory_mb=512)


def cluster(n: int, *, cores: int = 32, memory_mb: int = 65536, max_sandboxes: int | None = 4096,
            seed: int = 0, busy: float = 0.0) -> list[NodeLoad]:
    """``n`` nodes; with ``busy``, each already holds a random share (up to ``busy``) of its memory."""
    rng = random.Random(seed)
    nodes = []
    for i in range(n):
        used = int(memory_mb * busy * rng.random())
        nodes.append(NodeLoad(node=f"n{i}", cpu_cores=cores, memory_mb=memory_mb, max_sandboxes=max_sandboxes,
                              committed_memory_mb=used, committed_cpu=used / 512, sandboxes=used // 512))
    return nodes


def test_filter_respects_each_overcommit_ratio():
    node = NodeLoad("a", cpu_cores=2, memory_mb=1000, max_sandboxes=10)
    assert fits(node, Demand(cpu_cores=4, memory_mb=100), Overcommit(cpu=2, memory=1))
    assert not fits(node, Demand(cpu_cores=4.5, memory_mb=100), Overcommit(cpu=2, memory=1))
    assert fits(node, Demand(cpu_cores=0.1, memory_mb=1500), Overcommit(cpu=1, memory=1.5))
    assert not fits(node, Demand(cpu_cores=0.1, memory_mb=1501), Overcommit(cpu=1, memory=1.5))
    full = NodeLoad("b", cpu_cores=2, memory_mb=1000, max_sandboxes=3, sandboxes=3)
    assert not fits(full, Demand(0, 1))
    assert not fits(NodeLoad("c", cpu_cores=2, memory_mb=1000, healthy=False), Demand(0, 1))


def test_defaults_overcommit_cpu_far_more_than_memory():
    oc = Overcommit()
    assert oc.cpu >= 16 * oc.memory and oc.memory <= 4
    with pytest.raises(ValueError, match="cpu overcommit"):
        Overcommit(cpu=0)
    with pytest.raises(ValueError, match="memory overcommit"):
        Overcommit(memory=float("inf"))


def test_never_over_capacity_and_fills_exactly():
    view = cluster(300, cores=4, memory_mb=4096, max_sandboxes=None)
    oc = Overcommit(cpu=4, memory=1)  # 16 weighted cores, 4096 MB: 8 sandboxes of 512 MB each
    chosen = place(view, ONE, 300 * 8 + 50, overcommit=oc, rng=random.Random(1))
    assert len(chosen) == 300 * 8  # the rest did not fit anywhere
    counts = {n: chosen.count(n) for n in set(chosen)}
    assert set(counts.values()) == {8}


def test_power_of_two_spreads_a_batch_evenly_over_hundreds_of_nodes():
    view = cluster(500, busy=0.5, seed=3)
    chosen = place(view, ONE, 5000, rng=random.Random(2))
    assert len(chosen) == 5000
    after = {n.node: n.committed_memory_mb for n in view}
    for node in chosen:
        after[node] += ONE.memory_mb
    loads = sorted(after.values())
    # Least-loaded-of-two keeps the spread tight: the fullest node is close to the mean, far
    # closer than a random choice would leave it.
    mean = statistics.fmean(loads)
    assert loads[-1] - mean < 0.35 * 65536
    random_choice = {n.node: n.committed_memory_mb for n in view}
    rng = random.Random(2)
    for _ in range(5000):
        random_choice[rng.choice(view).node] += ONE.memory_mb
    assert max(after.values()) < max(random_choice.values())


def test_k_equal_to_cluster_size_is_the_global_least_loaded():
    view = [NodeLoad(f"n{i}", cpu_cores=8, memory_mb=8192, committed_memory_mb=100 * i) for i in range(5)]
    assert place(view, ONE, 1, k=5) == ["n0"]
    assert place(view, ONE, 1, k=5, exclude={"n0"}) == ["n1"]


def test_exclude_and_unhealthy_nodes_are_never_chosen():
    view = cluster(200)
    view[7] = NodeLoad("n7", cpu_cores=32, memory_mb=65536, healthy=False)
    skip = {f"n{i}" for i in range(0, 200, 2)}
    chosen = place(view, ONE, 2000, exclude=skip, rng=random.Random(5))
    assert not set(chosen) & skip and "n7" not in chosen


def test_nothing_fits_gives_empty_and_least_loaded_is_the_last_resort():
    view = cluster(50, memory_mb=1024, busy=0.9, seed=9)
    huge = Demand(cpu_cores=1, memory_mb=10 ** 6)
    assert place(view, huge, 3) == []
    best = least_loaded(view)
    assert best == min(view, key=lambda n: (load(n), n.sandboxes)).node
    assert least_loaded(view, exclude={n.node for n in view}) is None
    assert least_loaded([]) is None


def test_heterogeneous_nodes_fill_in_proportion():
    big = [NodeLoad(f"big{i}", cpu_cores=64, memory_mb=262144) for i in range(10)]
    small = [NodeLoad(f"small{i}", cpu_cores=4, memory_mb=16384) for i in range(90)]
    chosen = place(big + small, Demand(cpu_cores=0.5, memory_mb=1024), 2000, overcommit=Overcommit(memory=1),
                   rng=random.Random(11))
    per_big = sum(c.startswith("big") for c in chosen) / 10
    per_small = sum(c.startswith("small") for c in chosen) / 90
    assert per_big > 3 * per_small  # bigger nodes take more: load is a share of capacity


def test_best_effort_demand_commits_no_cpu():
    view = [NodeLoad("a", cpu_cores=1, memory_mb=1 << 20, committed_cpu=1.0)]
    oc = Overcommit(cpu=1, memory=1)
    assert place(view, Demand(cpu_cores=1, memory_mb=16), 1, overcommit=oc) == []
    assert place(view, Demand(cpu_cores=0, memory_mb=16), 100, overcommit=oc) == ["a"] * 100


def test_deterministic_with_a_seed_and_the_view_is_not_changed():
    view = cluster(100, busy=0.3)
    before = list(view)
    a = place(view, ONE, 500, rng=random.Random(42))
    b = place(view, ONE, 500, rng=random.Random(42))
    assert a == b and view == before


def test_bad_arguments():
    with pytest.raises(ValueError, match="count"):
        place(cluster(2), ONE, -1)
    with pytest.raises(ValueError, match="k must"):
        place(cluster(2), ONE, 1, k=0)
    assert place(cluster(2), ONE, 0) == []
    assert place([], ONE, 5) == []
