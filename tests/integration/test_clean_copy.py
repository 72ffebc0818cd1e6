"""A verdict the agent cannot forge (issue 17, part 1).

The hole: an agent that is root in its sandbox replaces ``/bin/sh`` (or plants a start-up hook),
and every later command of the trainer in that sandbox, the grader's included, prints what the
agent wants. The answer: grade in ``sandbox.clean_copy(keep=[...])``, a new sandbox from the
original image's layers plus only the agent's changes under the kept paths; and see the
tampering as ``file.tampered`` security events.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from libdsec import DSecContainerRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root]

# What an agent under RL pressure does instead of fixing the bug: the grader's shell, whatever
# it is asked, reports success.
PLANT_FORGED_SH = ("rm -f /bin/sh && printf '%s\\n' '#!/bin/busybox ash' \"echo '1 passed'\" 'exit 0' > /bin/sh"
                   " && chmod +x /bin/sh")


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(**{"container_image": "busybox", "memory_limit_mb": 64, **kw})


async def running_ids(client) -> set[str]:
    return {s.id for s in await client.list_sandboxes()}


@pytest.fixture(autouse=True)
async def no_sandbox_outlives_the_test(client):
    before = await running_ids(client)
    yield
    deadline = time.monotonic() + 10
    while (extra := await running_ids(client) - before) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not extra, f"sandboxes still there after the test: {extra}"


async def plant_forged_shell(sandbox) -> None:
    # Through a copy of busybox: once /bin/sh is replaced, every command runs through it.
    r = await sandbox.run_shell(
        "mkdir -p /testbed && echo 'def test(): assert 1 == 2' > /testbed/test_x.py && " + PLANT_FORGED_SH)
    assert r.exit_code == 0, r


async def test_the_hole_the_agents_own_sandbox_forges_the_graders_run(client):
    """Reproduces the hole: the trainer's run_shell in the agent's sandbox prints the agent's
    verdict. (This stays true by design: grade in a clean copy.)"""
    async with await client.run_container(args()) as sandbox:
        await plant_forged_shell(sandbox)
        graded = await sandbox.run_shell("grep -q 'assert 1 == 2' /testbed/test_x.py && echo '1 failed' && exit 1")
        assert graded.exit_code == 0 and graded.stdout == "1 passed\n"  # forged
