"""Quota arithmetic over nested projects: delegation within the parent's quota, pools of
projects without a cap of their own, and create checks that name the limit."""

from __future__ import annotations

import pytest

from dsec.apiserver.quota import Amount, Project, Tree, check_create, check_tree
from libdsec import QuotaExceeded


def tree(*projects: tuple) -> Tree:
    """(name, parent, caps) tuples; root is added without a cap."""
    return Tree([Project("root", None, {}), *(Project(n, p, caps) for n, p, caps in projects)])


def sandboxes(n: float) -> Amount:
    return Amount(sandboxes=n)


def test_ancestors_subtree_and_paths():
    t = tree(("a", "root", {}), ("b", "a", {}), ("c", "a", {}), ("d", "c", {}))
    assert t.ancestors("d") == ["d", "c", "a", "root"]
    assert t.subtree("a") == {"a", "b", "c", "d"}
    assert t.path("d") == "root/a/c/d"


def test_unlimited_everywhere_allows_anything():
    t = tree(("a", "root", {}))
    check_create(t, {"a": Amount(10**6, 10**6, 10**9)}, "a", Amount(5, 5, 5))


def test_own_cap():
    t = tree(("a", "root", {"sandboxes": 3}))
    check_create(t, {"a": sandboxes(2)}, "a", sandboxes(1))
    with pytest.raises(QuotaExceeded, match=r"project 'a' asks for 1 sandboxes more but the sandboxes quota "
                                            r"of 'a' is 3 sandboxes \(3 sandboxes in use\)"):
        check_create(t, {"a": sandboxes(3)}, "a", sandboxes(1))
    with pytest.raises(QuotaExceeded):
        check_create(t, {}, "a", sandboxes(4))  # a batch larger than the quota


def test_child_without_a_cap_draws_on_its_parent():
    t = tree(("a", "root", {"memory_mb": 1000}), ("b", "a", {}), ("c", "b", {}))
    usage = {"a": Amount(memory_mb=300), "b": Amount(memory_mb=300), "c": Amount(memory_mb=300)}
    check_create(t, usage, "c", Amount(memory_mb=100))
    with pytest.raises(QuotaExceeded, match=r"project 'c' \(drawing on 'a'\).*memory_mb quota of 'a' is 1000 MB "
                                            r"\(900 MB in use\)"):
        check_create(t, usage, "c", Amount(memory_mb=101))


def test_quota_handed_to_a_child_is_reserved_for_it():
    t = tree(("team", "root", {"cpu_cores": 10}), ("x", "team", {"cpu_cores": 6}), ("y", "team", {}))
    # The team's own sandboxes and y (no cap: shares the team's pool) have 10 - 6 = 4 cores.
    check_create(t, {"team": Amount(cpu_cores=2)}, "y", Amount(cpu_cores=2))
    with pytest.raises(QuotaExceeded, match=r"cpu_cores quota of 'team' is 10 cores \(2 cores in use, 6 cores handed "
                                            r"to sub-projects\)"):
        check_create(t, {"team": Amount(cpu_cores=2)}, "team", Amount(cpu_cores=2.5))
    # x has its own 6, whatever the team uses.
    check_create(t, {"team": Amount(cpu_cores=4)}, "x", Amount(cpu_cores=6))
    with pytest.raises(QuotaExceeded, match="quota of 'x' is 6 cores"):
        check_create(t, {"x": Amount(cpu_cores=5)}, "x", Amount(cpu_cores=1.5))
    # What x's subtree uses is not the team pool's business.
    check_create(t, {"x": Amount(cpu_cores=6)}, "team", Amount(cpu_cores=4))


def test_grandchild_carved_through_an_uncapped_child():
    t = tree(("a", "root", {"sandboxes": 10}), ("b", "a", {}), ("c", "b", {"sandboxes": 4}))
    assert t.carved("a", "sandboxes") == ["c"]
    assert t.pool("a", "sandboxes") == {"a", "b"}
    with pytest.raises(QuotaExceeded, match="4 sandboxes handed to sub-projects"):
        check_create(t, {"b": sandboxes(6)}, "b", sandboxes(1))


def test_resources_are_independent():
    t = tree(("a", "root", {"sandboxes": 100, "memory_mb": 512}))
    check_create(t, {"a": Amount(5, 99.0, 0)}, "a", Amount(1, 1000.0, 512))  # CPU has no cap here
    with pytest.raises(QuotaExceeded, match="memory_mb"):
        check_create(t, {"a": Amount(5, 0, 1)}, "a", Amount(1, 0, 512))


def test_delegation_must_fit_the_parent():
    good = tree(("a", "root", {"memory_mb": 1000}), ("b", "a", {"memory_mb": 600}), ("c", "a", {"memory_mb": 400}))
    check_tree(good)
    bad = good.with_project(Project("c", "a", {"memory_mb": 401}))
    with pytest.raises(QuotaExceeded, match=r"'a' has a memory_mb quota of 1000 MB but its sub-projects would be "
                                            r"handed 1001 MB \(b 600 MB, c 401 MB\)"):
        check_tree(bad)
    # A parent cannot shrink below what it handed out; a child without a cap passes it on.
    with pytest.raises(QuotaExceeded):
        check_tree(good.with_project(Project("a", "root", {"memory_mb": 999})))
    passing = tree(("a", "root", {"memory_mb": 1000}), ("b", "a", {}), ("c", "b", {"memory_mb": 700}),
                   ("d", "a", {"memory_mb": 400}))
    with pytest.raises(QuotaExceeded, match="1100 MB"):
        check_tree(passing)


def test_an_unlimited_parent_may_hand_out_anything():
    check_tree(tree(("a", "root", {}), ("b", "a", {"sandboxes": 10**6}), ("c", "a", {"sandboxes": 10**6})))


def test_negative_quota_is_refused():
    with pytest.raises(QuotaExceeded, match=">= 0"):
        check_tree(tree(("a", "root", {"sandboxes": -1})))


def test_zero_quota_refuses_everything_but_nothing():
    t = tree(("a", "root", {"sandboxes": 0}))
    check_create(t, {}, "a", Amount())  # asking for nothing is fine
    with pytest.raises(QuotaExceeded):
        check_create(t, {}, "a", sandboxes(1))


def test_amount_arithmetic():
    a = Amount(1, 2.5, 100) + Amount(2, 0.5, 28)
    assert a == Amount(3, 3.0, 128)
    assert a - Amount(1, 1, 28) == Amount(2, 2.0, 100)
    assert Amount(1, 0.5, 64).times(4) == Amount(4, 2.0, 256)
