"""FnCall pools over real containers, made in the test's own process (as ``dsec serve`` makes
them), and checked on the way out: nothing may be left behind."""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture
async def make_pool(new_state_dir, test_store, python_image):
    """``await make_pool(**FnCallConfig overrides)`` → a started pool (one worker by default,
    so consecutive calls share it); all are closed and checked for leftovers at the end.
    ``loop="python"``: the zygotes serve with their Python loop instead of the C one;
    ``loop_library``: the path the zygotes are given to load the C loop from."""
    from dsec._sys import set_child_subreaper
    from dsec.backends.container import ContainerBackend
    from dsec.fncall import FnCallConfig, FnCallPool
    from dsec.fncall.backend import FnCallBackend
    from dsec.images.store import LayerStore
    from dsec.local import leftovers
    from dsec.resources import cgroups

    set_child_subreaper()  # as dsec serve does: sandbox inits are reaped by us, at once
    state = new_state_dir("fncall")
    store = LayerStore(test_store)
    made = []

    async def make(loop: str = "native", loop_library=None, **overrides) -> FnCallPool:
        config = FnCallConfig(**{"workers_min": 1, "workers_max": 1, **overrides})
        container = ContainerBackend(state / "node", store, cgroup_parent=cgroups.parent_for(state))
        backend = FnCallBackend.beside(container, tmpfs_mb=config.tmpfs_mb, native_loop=loop == "native")
        if loop_library is not None:
            backend.loop_library = loop_library
        pool = FnCallPool(backend, store, config)
        made.append((pool, container))
        await pool.start()
        return pool

    try:
        yield make
    finally:
        for pool, container in made:
            await pool.close()
            await pool.close()  # a second close does nothing
            container.release_unused()
        left = leftovers(state)
        shutil.rmtree(state, ignore_errors=True)
        assert not left, f"left behind: {left}"


def zygote_pid(worker) -> int:
    """The host pid of a worker's zygote (the child of its ``crun exec``)."""
    pid = worker.proc.pid
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    assert children, "the crun exec has no child"
    return int(children[0])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
