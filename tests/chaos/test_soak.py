"""A short soak (``dsec bench soak`` runs 10,000): lifecycles mixed with pauses, pack_diffs, file
writes and FnCalls, every one right, and what the server and the state dir hold flat from the
first hundred to the last (mounts and sandbox cgroups exactly; server memory and fds within a
little noise)."""

from __future__ import annotations

import pytest
from rich.console import Console

from dsec.bench.soak import growth, soak
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
