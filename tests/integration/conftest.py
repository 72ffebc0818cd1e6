"""Fixtures shared by the integration tests (a real ``dsec serve``: ``server`` and ``client`` are in
the root conftest)."""

from __future__ import annotations

import asyncio
import time

import pytest


@pytest.fixture
async def no_sandbox_outlives_the_test(client):
    """After the test: every sandbox it made is gone (within 10 s: a batch's undo is quick)."""

    async def running_ids() -> set[str]:
        return {s.id for s in await client.list_sandboxes()}

    before = await running_ids()
    yield
    deadline = time.monotonic() + 10
    while (extra := await running_ids() - before) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not extra, f"sandboxes still there after the test: {extra}"
