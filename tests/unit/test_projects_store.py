"""The SQLite project store: durable projects, quotas and hashed tokens; invariants checked on
every change; a second reader sees a writer's changes."""

from __future__ import annotations

import sqlite3
import time

import pytest

from dsec.apiserver.projects import ProjectStore, token_digest
from libdsec import InvalidRequest, LimitOutOfRange, ProjectNotFound, QuotaExceeded
from libdsec._projects import ProjectQuota


@pytest.fixture
def store(tmp_path):
    with ProjectStore(tmp_path / "projects.db") as s:
        yield s


def test_root_always_exists_and_survives_reopening(tmp_path):
    path = tmp_path / "p.db"
    with ProjectStore(path) as s:
        assert s.get("root").parent is None
        s.create("team", "root", ProjectQuota(sandboxes=5, memory_mb=2048))
        s.create("sub", "team", ProjectQuota(sandboxes=2))
    with ProjectStore(path) as s:
        tree = s.tree()
        assert tree.path("sub") == "root/team/sub"
        assert s.get("team").cap("memory_mb") == 2048 and s.get("team").cap("cpu_cores") is None


def test_names_and_duplicates(store):
    for bad in ("", "Team", "1abc", "a" * 64, "a b", "a/b", "a\n"):
        with pytest.raises(InvalidRequest, match="invalid project name"):
            store.create(bad, "root")
    store.create("a-1", "root")
    with pytest.raises(InvalidRequest, match="exists already"):
        store.create("a-1", "root")
    with pytest.raises(ProjectNotFound, match="'nope'"):
        store.create("b", "nope")
    with pytest.raises(ProjectNotFound):
        store.get("nope")


@pytest.mark.parametrize("quota", [ProjectQuota(sandboxes=-1), ProjectQuota(memory_mb=1 << 50),
                                   ProjectQuota(cpu_cores=-0.5), ProjectQuota(cpu_cores=1e12)])
def test_absurd_quotas_are_out_of_range(store, quota):
    with pytest.raises(LimitOutOfRange, match="out of range"):
        store.create("a", "root", quota)
    with pytest.raises(ProjectNotFound):
        store.get("a")


def test_delegation_is_checked_on_create_and_on_change(store):
    store.create("team", "root", ProjectQuota(sandboxes=10))
    store.create("x", "team", ProjectQuota(sandboxes=6))
    with pytest.raises(QuotaExceeded, match="handed 11 sandboxes"):
        store.create("y", "team", ProjectQuota(sandboxes=5))
    store.create("y", "team", ProjectQuota(sandboxes=4))
    with pytest.raises(QuotaExceeded):
        store.set_quota("x", ProjectQuota(sandboxes=7))
    with pytest.raises(QuotaExceeded):
        store.set_quota("team", ProjectQuota(sandboxes=9))
    store.set_quota("team", ProjectQuota(sandboxes=12))
    store.set_quota("x", ProjectQuota(sandboxes=8))
    assert store.tree().handed_out("team").sandboxes == 12


def test_remove(store):
    store.create("a", "root")
    store.create("b", "a")
    with pytest.raises(InvalidRequest, match="sub-projects \\(b\\)"):
        store.remove("a")
    token = store.new_token("b")
    store.remove("b")
    assert store.project_of_token(token) is None  # tokens go with their project
    store.remove("a")
    with pytest.raises(InvalidRequest, match="root"):
        store.remove("root")
    with pytest.raises(ProjectNotFound):
        store.remove("a")


def test_tokens_are_stored_hashed(store, tmp_path):
    store.create("a", "root")
    token = store.new_token("a")
    assert token.startswith("dsp_") and len(token) > 40
    assert store.project_of_token(token) == "a"
    assert store.project_of_token(token + "x") is None
    assert store.new_token("a") != token and store.token_count("a") == 2
    raw = sqlite3.connect(tmp_path / "projects.db").execute("SELECT sha256 FROM tokens").fetchall()
    assert (token_digest(token),) in raw
    assert all(token not in row[0] for row in raw)
    with pytest.raises(ProjectNotFound):
        store.new_token("nope")


def test_a_second_connection_sees_changes(tmp_path):
    """Another connection's changes show within ``recheck_s``; one's own at once."""
    path = tmp_path / "p.db"
    with ProjectStore(path) as writer, ProjectStore(path) as reader:
        reader.recheck_s = 0.05
        assert "a" not in reader.tree()
        writer.create("a", "root", ProjectQuota(sandboxes=1))
        assert writer.get("a").cap("sandboxes") == 1
        time.sleep(reader.recheck_s)
        assert reader.get("a").cap("sandboxes") == 1
        writer.set_quota("a", ProjectQuota(sandboxes=2))
        assert writer.get("a").cap("sandboxes") == 2
        time.sleep(reader.recheck_s)
        assert reader.get("a").cap("sandboxes") == 2


def test_close_twice_and_use_after_close(tmp_path):
    s = ProjectStore(tmp_path / "p.db")
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.tree()
