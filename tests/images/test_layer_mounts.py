"""Layer mounts: one EROFS mount per layer, refcounted; the two non-blocking questions the
container backend asks on its event loop (hold a layer already mounted; would a release unmount)."""

from __future__ import annotations

import os
import threading

import pytest

from dsec.images.compose import LayerMount
from dsec.images.mounts import LayerMounts
from dsec.images.store import LayerStore

pytestmark = [pytest.mark.slow, pytest.mark.root]


@pytest.fixture
def busybox(test_store, tmp_path):
    store = LayerStore(test_store)
    digest = store.get_image("busybox").layers[0]
    mounts = LayerMounts(tmp_path / "layers")
    layers = (LayerMount(digest, store.layer_path(digest), mounts.mount_dir / digest),)
    yield mounts, layers
    mounts.release_unused()
    assert not os.path.ismount(layers[0].target)


def test_hold_mounted_only_holds_what_is_mounted(busybox):
    mounts, layers = busybox
    target = layers[0].target
    assert not mounts.hold_mounted(layers)  # not mounted: it would have to mount, so no
    assert not os.path.ismount(target) and mounts.mounted() == {}

    mounts.acquire(layers)
    assert os.path.ismount(target) and (target / "bin" / "busybox").exists()
    assert not mounts.shared(layers)  # one holder: its release unmounts
    assert mounts.hold_mounted(layers)
    assert mounts.mounted() == {layers[0].digest: 2} and mounts.shared(layers)

    mounts.release(layers)
    assert os.path.ismount(target) and not mounts.shared(layers)
    mounts.release(layers)
    assert not os.path.ismount(target) and mounts.mounted() == {}


def test_hold_mounted_does_not_wait_for_another_thread(busybox):
    """A thread mounting (holding the lock) makes hold_mounted say no at once, not block."""
    mounts, layers = busybox
    mounts.acquire(layers)
    taken, go = threading.Event(), threading.Event()

    def mounting():
        with mounts._lock:
            taken.set()
            go.wait(5)

    t = threading.Thread(target=mounting)
    t.start()
    try:
        assert taken.wait(5)
        assert not mounts.hold_mounted(layers)
        assert mounts.mounted() == {layers[0].digest: 1}
    finally:
        go.set()
        t.join()
    assert mounts.hold_mounted(layers)
    mounts.release(layers)
    mounts.release(layers)
