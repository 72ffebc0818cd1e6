"""``dsec bench density`` judges each goal once: the table and ``--strict`` read the same verdicts."""

from __future__ import annotations

from dsec_bench import density


def result(count=1000, mib_each=2.0, host_mib=9.0, share=0.9) -> dict:
    return {"idle": {"count": count, "host_mib_per_sandbox": host_mib,
                     "attributable_mib_per_sandbox": {"kernel_plus_charged": mib_each}},
            "pause_touched": {"returned_share": share}}


def test_the_per_sandbox_goal_is_judged_on_the_attributable_figure():
    # The host's MemAvailable delta (moved by everything else on the machine) is shown, not judged.
    assert density._goals(result(mib_each=density.GOAL_IDLE_MIB - 0.1, host_mib=99))["idle_mib"] is True
    assert density._goals(result(mib_each=density.GOAL_IDLE_MIB + 0.1, host_mib=0.1))["idle_mib"] is False


def test_each_goal_and_what_was_not_measured():
    assert density._goals(result(count=density.GOAL_IDLE_COUNT, share=density.GOAL_PAUSE_RETURNED)) == {
        "idle_count": True, "idle_mib": True, "pause_returned": True}
    assert density._goals(result(count=density.GOAL_IDLE_COUNT - 1))["idle_count"] is False
    assert density._goals(result(share=density.GOAL_PAUSE_RETURNED - 0.01))["pause_returned"] is False
    assert density._goals({}) == {"idle_count": None, "idle_mib": None, "pause_returned": None}
