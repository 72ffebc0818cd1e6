"""Shared fixtures. Kernel-level tests (crun, mounts, cgroups) are marked ``slow`` and need root."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Layers are content-addressed, so one store can be shared by every test run on a machine; the
# python image (debootstrap, about a minute) is then built once.
TEST_STORE = Path(os.environ.get("DSEC_TEST_STORE", "/var/lib/dsec-test/store"))


def pytest_collection_modifyitems(config, items):
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root (crun, mounts, cgroups)")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def test_store() -> Path:
    from dsec.images.builders import build_busybox
    from dsec.images.store import LayerStore

    store = LayerStore(TEST_STORE)
    if not store.has_image("busybox"):
        build_busybox(store)
    return TEST_STORE


@pytest.fixture(scope="session")
def python_image(test_store: Path) -> str:
    from dsec.images.builders import build_python
    from dsec.images.store import LayerStore

    store = LayerStore(test_store)
    if not store.has_image("python"):
        build_python(store)
    return "python"


def make_state_dir(tmp_path_factory: pytest.TempPathFactory, store: Path, name: str) -> Path:
    state = tmp_path_factory.mktemp(name)
    (state / "store").symlink_to(store)
    return state


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_store):
    """A ``dsec serve`` for the module's tests; checks on the way out that nothing was left."""
    from dsec.local import LocalServer, leftovers

    state = make_state_dir(tmp_path_factory, test_store, "dsec-state")
    srv = LocalServer(state, extra_args=("--pool-max", "4"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        left = leftovers(state)
        shutil.rmtree(state, ignore_errors=True)
    assert not left, f"left behind: {left}"


@pytest.fixture
async def client(server):
    from libdsec import DSecClient

    async with DSecClient(server.endpoint, token=server.token) as c:
        yield c
