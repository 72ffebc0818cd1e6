"""StoreHealth: a store whose filesystem is away refuses at once with StoreUnavailable naming
the store and the node; one that does not answer, within its bound; and it answers again as
soon as the store does. (On a real GlusterFS volume stopped and started: tests/cluster/test_gluster_store.py.)"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from dsec.images.store import StoreHealth
from libdsec import BackendError, StoreUnavailable


async def test_a_store_that_is_gone_is_refused_naming_it_then_answers_again(tmp_path):
    root = tmp_path / "store"
    health = StoreHealth(root, "n7", fresh_s=0)
    with pytest.raises(StoreUnavailable) as caught:
        await health.check()
    assert str(root) in str(caught.value) and "n7" in str(caught.value)
    assert isinstance(caught.value, BackendError) and caught.value.status == 503
    root.mkdir()
    await health.check()


async def test_a_store_that_does_not_answer_is_refused_within_the_bound(tmp_path, monkeypatch):
    release = threading.Event()
    calls = []
    real_statvfs = os.statvfs

    def stuck(path):  # a filesystem whose server stopped answering
        calls.append(path)
        release.wait(30)
        return real_statvfs(path)

    monkeypatch.setattr(os, "statvfs", stuck)
    health = StoreHealth(tmp_path, "n1", within_s=0.3, fresh_s=60)
    started = time.monotonic()
    results = await asyncio.gather(health.check(), health.check(), return_exceptions=True)
    assert all(isinstance(r, StoreUnavailable) and "did not answer within 0.3 s" in str(r) for r in results), results
    assert time.monotonic() - started < 2
    assert len(calls) == 1  # one stat at a time: the later check waited on the stuck one
    release.set()
    await health.check()
    # An answer is kept for fresh_s: no stat for the next calls.
    stats = len(calls)
    await health.check()
    assert len(calls) == stats
