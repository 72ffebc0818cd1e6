"""``dsec bench density`` judges each goal once: the table and ``--strict`` read the same verdicts,
on the honest figures (issue #34): memory per sandbox is what the host loses, pause is judged
on heap-like content, and the count is how many fit until a limit."""

from __future__ import annotations

from dsec_bench import density


def result(count=1000, mib_each=2.0, host_mib=1.0, share=0.9, limit_hit=True) -> dict:
    return {"idle": {"count": count, "host_mib_per_sandbox": host_mib, "limit_hit": limit_hit,
                     "attributable_mib_per_sandbox": {"kernel_plus_charged": mib_each}},
            "pause_heap": {"returned_share": share}}


def test_the_per_sandbox_goal_is_judged_on_what_the_host_loses():
    # (the cgroup-charged figure is shown beside it, not judged: it leaves out what the host pays)
    assert density._goals(result(host_mib=density.GOAL_IDLE_MIB - 0.1, mib_each=99))["idle_mib"] is True
    assert density._goals(result(host_mib=density.GOAL_IDLE_MIB + 0.1, mib_each=0.1))["idle_mib"] is False


def test_each_goal_and_what_was_not_measured():
    assert density._goals(result(count=density.GOAL_IDLE_COUNT, share=density.GOAL_PAUSE_RETURNED)) == {
        "idle_count": True, "idle_mib": True, "pause_returned": True}
    assert density._goals(result(count=density.GOAL_IDLE_COUNT - 1))["idle_count"] is False  # a limit, short of it
    assert density._goals(result(count=density.GOAL_IDLE_COUNT - 1, limit_hit=False))["idle_count"] is None  # a cap
    assert density._goals(result(share=density.GOAL_PAUSE_RETURNED - 0.01))["pause_returned"] is False
    assert density._goals({}) == {"idle_count": None, "idle_mib": None, "pause_returned": None}
