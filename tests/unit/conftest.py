"""Fixtures for the fast control-plane tests."""

from __future__ import annotations

import pytest

from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from dsec.images.store import Image, LayerStore


@pytest.fixture
def store(tmp_path):
    """A store holding one tiny image, ``tiny`` (an /etc/passwd and nothing else)."""
    store = LayerStore(tmp_path / "store")
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    store.put_image(Image(name="tiny", layers=(store.add_dir(root),), env={"PATH": "/bin"}))
    return store


@pytest.fixture(params=["sqlite", "postgresql"])
def project_db(request, tmp_path):
    """Where a project store keeps its records, once per kind: a SQLite file, or a fresh
    PostgreSQL database; ``open_project_store(project_db)`` opens one (again) over it."""
    if request.param == "sqlite":
        return tmp_path / "projects.db"
    return request.getfixturevalue("postgres").new_database()


@pytest.fixture
async def edge(tmp_path, store):
    """An edge over the in-memory fake backend, on ``store``: no warm pool, a quick reaper."""
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", reaper_interval_s=0.05, pool_min=0, pool_max=0),
                FakeBackend(), store)
    await edge.start()
    yield edge
    await edge.close()
