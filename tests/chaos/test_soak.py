"""A short soak (``dsec bench soak`` runs 10,000): lifecycles mixed with pauses, pack_diffs, file
writes and FnCalls, every one right, and what the server and the state dir hold flat from the
first hundred to the last (mounts and sandbox cgroups exactly; server memory and fds within a
little noise)."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from dsec_bench.soak import growth, soak
from dsec.local import LocalServer, leftovers

pytestmark = [pytest.mark.slow, pytest.mark.root]


async def test_short_soak_holds_flat(new_state_dir, python_image):  # FnCalls run on python
    state = new_state_dir("dsec-soak")
    server = LocalServer(state, extra_args=("--pool-max", "8"), env={"DSEC_VMS": "0"}).start()
    try:
        result = await soak(server, state, Console(quiet=True), lifecycles=120, concurrency=8, sample_every=40,
                            pause_every=10, pack_every=20, fncall_every=5)
    finally:
        server.stop()
    assert not leftovers(state), leftovers(state)
    assert result["errors"] == []
    samples = result["samples"]
    assert [s["lifecycles"] for s in samples] == [40, 80, 120]
    grew = growth(samples)
    assert grew["mounts"] == 0 and grew["sandbox_cgroups"] == 0, samples
    assert grew["server_fds"] <= 16, samples
    assert grew["server_rss_mib"] <= 32, samples


def grown_by_line(report: str) -> dict[str, float]:
    """The "by line" section of a ``dsec.memtrace`` report: ``{file:line: KiB grown}``."""
    section = report.split("by line", 1)[1].split("by allocating stack", 1)[0]
    found = re.findall(r"^\s+\+([\d.]+) KiB\s+[+-]\d+ blocks\s+(\S+:\d+)", section, re.M)
    return {where: float(kib) for kib, where in found}


# 80 lifecycles after the first 40: 200 bytes a lifecycle is 16 KB in the report.
LIFECYCLES = 120


async def test_short_soak_under_tracemalloc_keeps_nothing_per_lifecycle(new_state_dir, python_image):
    """What the server allocates and keeps, line by line (``DSEC_TRACEMALLOC``): after the first
    40 lifecycles nothing grows by more than 200 bytes a lifecycle. (Each ended sandbox's
    ``SandboxInfo`` object, 1.25 KB, and the event log every sandbox left, 0.4 KB, did.)"""
    state = new_state_dir("dsec-soaktrace")
    # The ended sandboxes a node remembers (``--ended-kept``, about 200 bytes each) fill during the
    # first 40 here; one frame an allocation is all the report's "by line" needs (and twice as fast).
    server = LocalServer(state, extra_args=("--pool-max", "8", "--ended-kept", "20"),
                         env={"DSEC_VMS": "0", "DSEC_TRACEMALLOC": "1", "DSEC_TRACEMALLOC_FRAMES": "1"})
    server.start_timeout_s = max(server.start_timeout_s, 300)
    server.start()
    try:
        result = await soak(server, state, Console(quiet=True), lifecycles=LIFECYCLES, concurrency=8, sample_every=40,
                            pause_every=10, pack_every=20, fncall_every=5, tracemalloc=True)
    finally:
        server.stop()
    assert not leftovers(state), leftovers(state)
    assert result["errors"] == []
    grown = {where: kib for where, kib in grown_by_line(result["tracemalloc"]).items() if "memtrace.py" not in where}
    per_lifecycle = {where: kib * 1024 / (LIFECYCLES - 40) for where, kib in grown.items()}
    assert max(per_lifecycle.values(), default=0) <= 200, sorted(per_lifecycle.items(), key=lambda w: -w[1])[:5]
