"""Overload on a real node: more concurrent commands and creates than ``dsec serve`` is set to
take get 429 ``Overloaded`` at once (none hangs, none times out at the client), and the SDK's
retries bring every command through, each run once."""

from __future__ import annotations

import asyncio
import time

import pytest

from dsec.local import LocalServer, leftovers
from libdsec import DSecClient, DSecContainerRunArgs, Overloaded

pytestmark = [pytest.mark.slow, pytest.mark.root]

ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32)


@pytest.fixture
def server(new_state_dir):
    state = new_state_dir("dsec-overload")
    srv = LocalServer(state, extra_args=("--max-commands", "2", "--max-creates", "1", "--max-queued", "1",
                                         "--max-queue-wait-s", "20", "--pool-max", "0"),
                      env={"DSEC_VMS": "0"}).start()
    try:
        yield srv
    finally:
        srv.stop_sandboxes()
        srv.stop()
    assert not leftovers(state), leftovers(state)


async def test_commands_past_the_queue_are_refused_at_once_and_retried_through(server):
    async with DSecClient(server.endpoint, token=server.token, retries=0) as plain:
        async with await plain.run_container(ARGS) as sandbox:
            # 2 run, 4 wait (the command queue is 4x --max-queued), the other 14 are refused.
            started = time.monotonic()
            outcomes = await asyncio.wait_for(asyncio.gather(
                *(sandbox.run_shell(f"sleep 1; echo {i}") for i in range(20)), return_exceptions=True), 60)
            refused = [o for o in outcomes if isinstance(o, Overloaded)]
            ran = [o for o in outcomes if not isinstance(o, BaseException)]
            assert len(refused) + len(ran) == 20, [o for o in outcomes if isinstance(o, BaseException)][:3]
            assert len(ran) == 6 and len(refused) == 14, (len(ran), len(refused))
            assert all(r.exit_code == 0 for r in ran)
            assert all("node n0 is overloaded" in str(e) and e.retry_after > 0 for e in refused)
            assert time.monotonic() - started < 20
            async with DSecClient(server.endpoint, token=server.token, retries=30, retry_backoff_s=0.05,
                                  retry_max_wait_s=1.0) as retrying:
                again = await retrying.get_sandbox(sandbox.id)
                results = await asyncio.wait_for(asyncio.gather(
                    *(again.run_shell(f"echo {i} >> /tmp/ran; echo {i}") for i in range(20))), 120)
                assert sorted(int(r.stdout) for r in results) == list(range(20))
            ran_lines = (await sandbox.read_file("/tmp/ran")).decode().split()
            assert sorted(map(int, ran_lines)) == list(range(20)), "each command ran once"


async def test_creates_past_the_queue_are_refused_and_make_nothing(server):
    async with DSecClient(server.endpoint, token=server.token) as client:
        outcomes = await asyncio.wait_for(asyncio.gather(
            *(client.run_container(ARGS) for _ in range(8)), return_exceptions=True), 120)
        made = [o for o in outcomes if not isinstance(o, BaseException)]
        refused = [o for o in outcomes if isinstance(o, Overloaded)]
        try:
            assert len(made) + len(refused) == 8, outcomes
            assert made and refused, "one runs, one waits, the rest are refused (a plain create is not retried)"
            listed = {s.id for s in await client.list_sandboxes()}
            assert listed == {s.id for s in made}, "a refused create made nothing"
        finally:
            await asyncio.gather(*(s.stop() for s in made))
