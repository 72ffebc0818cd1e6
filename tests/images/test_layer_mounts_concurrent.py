"""A node's creates mount their layers at once: a layer whose mount waits (here on its file's
lock, as while GC on some machine holds it alone; on a shared store, on a round trip) holds up
no create of other layers, a second create of the same layer waits for the one mount, and the
counts stay exact under many threads (dsec.images.mounts)."""

from __future__ import annotations

import fcntl
import os
import random
import threading
from pathlib import Path

import pytest

from dsec.images.compose import LayerMount
from dsec.images.mounts import LayerMounts
from dsec.images.store import LayerStore
from dsec.isolation import userns

pytestmark = [pytest.mark.slow, pytest.mark.root]


@pytest.fixture
def layers(tmp_path) -> tuple[LayerMounts, list[LayerMount]]:
    """Node layer mounts over a store of three one-file layers (file ``f`` says the layer's index)."""
    store = LayerStore(tmp_path / "store")
    mounts = LayerMounts(tmp_path / "node" / "layers", layers_dir=store.layers_dir)
    made = []
    for i in range(3):
        src = tmp_path / f"src{i}"
        src.mkdir()
        (src / "f").write_text(f"{i}\n")
        digest = store.add_dir(src)
        made.append(LayerMount(digest=digest, source=store.layer_path(digest), target=mounts.mount_dir / digest))
    yield mounts, made
    counts = mounts.mounted()  # (a failed test may leave some held)
    for layer in made:
        for _ in range(counts.get(layer.digest, 0)):
            mounts.release((layer,))
    mounts.release_unused()


def _mounts_at(target: Path) -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(line.split()[4] == str(target) for line in f)


def _in_thread(fn, *args) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


def test_a_mount_waiting_on_its_layer_holds_up_no_other_layer_and_one_mount_serves_both_waiters(layers):
    mounts, (a, b, _) = layers
    gc = os.open(a.source, os.O_RDONLY)  # GC's lock: a's acquire waits on its shared lock
    fcntl.flock(gc, fcntl.LOCK_EX)
    first = _in_thread(mounts.acquire, (a,))
    second = _in_thread(mounts.acquire, (a,))
    other = _in_thread(mounts.acquire, (b,))
    try:
        other.join(timeout=10)
        assert not other.is_alive(), "b's mount waited on a's"
        assert mounts.mounted() == {b.digest: 1}
        assert first.is_alive() and second.is_alive()
    finally:
        os.close(gc)  # (lets a's acquires go on, whatever was asserted)
        for thread in (first, second, other):
            thread.join(timeout=10)
    assert not first.is_alive() and not second.is_alive()
    assert mounts.mounted() == {a.digest: 2, b.digest: 1}
    assert _mounts_at(a.target) == 1
    assert (a.target / "f").read_text() == "0\n"
    mounts.release((a,))
    assert os.path.ismount(a.target)
    mounts.release((a, b))
    assert mounts.mounted() == {}
    assert not os.path.ismount(a.target) and not os.path.ismount(b.target)


def test_counts_stay_exact_under_many_threads(layers):
    mounts, made = layers
    failures: list[str] = []

    def create(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(40):
            mine = tuple(rng.sample(made, rng.randint(1, 3)))
            mounts.acquire(mine)
            try:
                for layer in mine:
                    if (layer.target / "f").read_text() != f"{made.index(layer)}\n":
                        failures.append(f"{layer.digest} unreadable while held")
                    if _mounts_at(layer.target) != 1:
                        failures.append(f"{layer.digest} mounted {_mounts_at(layer.target)} times")
            finally:
                mounts.release(mine)

    threads = [_in_thread(create, seed) for seed in range(6)]
    held = (made[0],)
    mounts.acquire(held)  # (one held throughout: its count must come back to 1, its mount stay)
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    assert mounts.mounted() == {made[0].digest: 1}
    assert _mounts_at(made[0].target) == 1
    mounts.release(held)
    assert mounts.mounted() == {}
    assert all(not os.path.ismount(layer.target) for layer in made)


def test_a_new_id_range_being_made_holds_up_no_layer_mount(layers, monkeypatch):
    """The user namespace of a sandbox's new id range is a process spawn (slow on a loaded host):
    made with no lock held, a create making one holds up no other create's layer mounts."""
    mounts, (a, b, _) = layers
    spawning, go = threading.Event(), threading.Event()
    make = userns._make_userns_fd

    def slow_make(*args):  # (the real spawn, once the test lets it go)
        spawning.set()
        go.wait(20)
        return make(*args)

    monkeypatch.setattr(userns, "_make_userns_fd", slow_make)
    mounts.acquire((a,))
    idmap = userns.IdMap(userns.SANDBOX_ID_BASE + 77 * userns.SANDBOX_ID_COUNT)
    seen: list[int] = []

    def clone() -> None:
        with mounts.idmapped((a,), idmap) as fds:
            seen.append(os.stat("f", dir_fd=fds[0]).st_uid)

    cloning = _in_thread(clone)
    assert spawning.wait(10)
    other = _in_thread(mounts.acquire, (b,))
    try:
        other.join(timeout=10)
        assert not other.is_alive(), "b's mount waited on a's clone's user namespace"
    finally:
        go.set()
        cloning.join(timeout=20)
        other.join(timeout=10)
    assert seen == [idmap.base]  # (on-disk root, read through the clone as the range's root)
    assert mounts.mounted() == {a.digest: 1, b.digest: 1}
    mounts.release((a, b))


def test_clones_of_many_ranges_at_once_each_read_as_their_own_range(layers, monkeypatch):
    """Threads cloning for more ranges than are kept: a user namespace fd is never closed (evicted)
    while another thread clones with it, so each clone maps its own range."""
    mounts, (a, _, _) = layers
    monkeypatch.setattr(userns, "_USERNS_FDS_KEPT", 2)
    mounts.acquire((a,))
    wrong: list[str] = []

    def clones(thread: int) -> None:
        for i in range(8):
            idmap = userns.IdMap(userns.SANDBOX_ID_BASE + (1000 + thread * 8 + i) * userns.SANDBOX_ID_COUNT)
            fd = userns.idmapped_clone(a.target, idmap)
            try:
                uid = os.stat("f", dir_fd=fd).st_uid
            finally:
                os.close(fd)
            if uid != idmap.base:
                wrong.append(f"range at {idmap.base} read as {uid}")

    threads = [_in_thread(clones, t) for t in range(4)]
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []
    assert len(userns._USERNS_FDS) <= 2
    mounts.release((a,))


def test_two_callers_of_one_new_range_wait_for_one_spawn(monkeypatch):
    """A create makes its range's user namespace beside its layer mounts and its overlay's clone
    asks for it again: the second waits for the first's spawn and makes none of its own."""
    spawns: list[tuple] = []
    go = threading.Event()
    make = userns._make_userns_fd

    def held_make(*args):  # (the real spawn, once the test lets it go)
        spawns.append(args)
        go.wait(20)
        return make(*args)

    monkeypatch.setattr(userns, "_make_userns_fd", held_make)
    idmap = userns.IdMap(userns.SANDBOX_ID_BASE + 2000 * userns.SANDBOX_ID_COUNT)
    callers = [_in_thread(userns.prepare, idmap) for _ in range(3)]
    try:
        for thread in callers:
            thread.join(timeout=1)  # (all three asked by now)
    finally:
        go.set()
        for thread in callers:
            thread.join(timeout=20)
    assert not any(t.is_alive() for t in callers)
    assert spawns == [(0, idmap.base, idmap.count)]
    assert (0, idmap.base, idmap.count) in userns._USERNS_FDS


@pytest.mark.parametrize("make", [userns._cloned_userns_fd, userns._spawned_userns_fd], ids=["clone", "spawn"])
def test_a_range_made_by_clone_or_by_spawn_maps_its_range_and_leaves_no_process(layers, make):
    """A user namespace fd made by a clone of the server (no program run) or by ``unshare``
    (where a clone cannot): a layer's clone idmapped with it reads as its range's root and
    others as its range's ids, each call makes a namespace of its own, and no process is left."""
    from dsec.backends.procs import children

    if make is userns._cloned_userns_fd and userns._SYS_GETPID is None:
        pytest.skip("the clone is made on x86-64 only")
    mounts, (a, _, _) = layers
    mounts.acquire((a,))
    before = set(children())
    fds = []
    try:
        for i in (3000, 3001):
            base = userns.SANDBOX_ID_BASE + i * userns.SANDBOX_ID_COUNT
            fds.append(make(0, base, userns.SANDBOX_ID_COUNT))
            clone = userns._clone(a.target, fds[-1])
            try:
                assert os.stat("f", dir_fd=clone).st_uid == base
                assert os.stat("f", dir_fd=clone).st_gid == base
            finally:
                os.close(clone)
        assert os.readlink(f"/proc/self/fd/{fds[0]}") != os.readlink(f"/proc/self/fd/{fds[1]}")
        assert os.readlink(f"/proc/self/fd/{fds[0]}") != os.readlink("/proc/self/ns/user")
        assert set(children()) <= before
    finally:
        for fd in fds:
            os.close(fd)
        mounts.release((a,))


def test_a_container_backend_warming_up_makes_its_first_ranges_user_namespaces(tmp_path):
    """``ContainerBackend.warm_up`` makes the user namespaces of the first ``IDS_AHEAD`` id
    ranges, so that the first creates, which take those ranges, make none (and spawn no thread
    to make one: ``RootFilesystems._preparing_ids``)."""
    import asyncio

    from dsec.backends.container import IDS_AHEAD, ContainerBackend

    from dsec.local import leftovers
    from dsec.resources import cgroups

    backend = ContainerBackend(tmp_path / "node", LayerStore(tmp_path / "store"), cgroup_parent=cgroups.parent_for(tmp_path))
    try:
        if backend.id_ranges is None:
            pytest.skip("no user namespaces here (DSEC_USERNS=0)")
        first = backend.id_ranges.first(IDS_AHEAD + 1)
        for key in [(0, m.base, m.count) for m in first]:  # (none kept, as in a server just started)
            with userns._USERNS_LOCK:
                if (fd := userns._USERNS_FDS.pop(key, None)) is not None:
                    os.close(fd)
        asyncio.run(backend.warm_up())
        assert [userns.kept(m) for m in first] == [True] * IDS_AHEAD + [False]
        assert backend.id_ranges.take("c-first") == first[0]
    finally:
        asyncio.run(backend.recover([]))
        backend.release_unused()
    assert leftovers(tmp_path) == []


def test_a_process_killed_while_it_clones_user_namespaces_leaves_no_process_behind():
    """A server killed (SIGKILL) while it makes user namespaces by clone: no clone of it lives
    on (each has exited before its namespace is mapped; a zombie is reaped by its new parent)."""
    import signal
    import subprocess
    import sys
    import time

    if userns._SYS_GETPID is None:
        pytest.skip("the clone is made on x86-64 only")
    token = f"dsec-userns-kill-test-{os.getpid()}"
    code = (f"import os; from dsec.isolation import userns; tag = {token!r}; print('go', flush=True)\n"
            "while True: os.close(userns._cloned_userns_fd(0, userns.SANDBOX_ID_BASE, userns.SANDBOX_ID_COUNT))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=dict(os.environ))
    assert proc.stdout.readline() == b"go\n"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    alive.append(pid)
        except OSError:
            continue
    assert alive == []
