"""Fixtures for the fast control-plane tests."""

from __future__ import annotations

import pytest

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
