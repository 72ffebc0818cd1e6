"""The project stores, SQLite and PostgreSQL, against one suite: durable projects, quotas and
hashed tokens; invariants checked on every change; a second store over the same database sees
the first's changes; writers racing from two stores cannot break the tree."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import asyncpg
import pytest

from dsec.apiserver.projects import OwedStop, open_project_store, token_digest
from dsec.apiserver.quota import check_tree
from libdsec import BackendError, InvalidRequest, LimitOutOfRange, ProjectNotFound, QuotaExceeded
from libdsec._projects import ProjectQuota


@pytest.fixture
def store(project_db):
    with open_project_store(project_db) as s:
        yield s


async def eventually(check, within_s: float = 3.0):
    """Wait until ``check()`` holds (another store's change shows within its ``recheck_s``)."""
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "the change did not show"
        await asyncio.sleep(0.01)


async def sql(url: str, query: str, *args):
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(query, *args)
    finally:
        await conn.close()


async def stored_digests(where) -> list[str]:
    if isinstance(where, Path):
        return [row[0] for row in sqlite3.connect(where).execute("SELECT sha256 FROM tokens")]
    return [row[0] for row in await sql(where, "SELECT sha256 FROM tokens")]


async def test_root_always_exists_and_survives_reopening(project_db):
    with open_project_store(project_db) as s:
        assert s.get("root").parent is None
        await s.create("team", "root", ProjectQuota(sandboxes=5, memory_mb=2048))
        await s.create("sub", "team", ProjectQuota(sandboxes=2))
    with open_project_store(project_db) as s:
        tree = s.tree()
        assert tree.path("sub") == "root/team/sub"
        assert s.get("team").cap("memory_mb") == 2048 and s.get("team").cap("cpu_cores") is None


async def test_names_and_duplicates(store):
    for bad in ("", "Team", "1abc", "a" * 64, "a b", "a/b", "a\n"):
        with pytest.raises(InvalidRequest, match="invalid project name"):
            await store.create(bad, "root")
    await store.create("a-1", "root")
    with pytest.raises(InvalidRequest, match="exists already"):
        await store.create("a-1", "root")
    with pytest.raises(ProjectNotFound, match="'nope'"):
        await store.create("b", "nope")
    with pytest.raises(ProjectNotFound):
        store.get("nope")


@pytest.mark.parametrize("quota", [ProjectQuota(sandboxes=-1), ProjectQuota(memory_mb=1 << 50),
                                   ProjectQuota(cpu_cores=-0.5), ProjectQuota(cpu_cores=1e12)])
async def test_absurd_quotas_are_out_of_range(store, quota):
    with pytest.raises(LimitOutOfRange, match="out of range"):
        await store.create("a", "root", quota)
    with pytest.raises(ProjectNotFound):
        store.get("a")


async def test_delegation_is_checked_on_create_and_on_change(store):
    await store.create("team", "root", ProjectQuota(sandboxes=10, cpu_cores=2.5))
    await store.create("x", "team", ProjectQuota(sandboxes=6, cpu_cores=0.25))
    with pytest.raises(QuotaExceeded, match="handed 11 sandboxes"):
        await store.create("y", "team", ProjectQuota(sandboxes=5))
    await store.create("y", "team", ProjectQuota(sandboxes=4))
    with pytest.raises(QuotaExceeded):
        await store.set_quota("x", ProjectQuota(sandboxes=7))
    with pytest.raises(QuotaExceeded):
        await store.set_quota("team", ProjectQuota(sandboxes=9))
    await store.set_quota("team", ProjectQuota(sandboxes=12, cpu_cores=2.5))
    await store.set_quota("x", ProjectQuota(sandboxes=8, cpu_cores=0.25))
    assert store.tree().handed_out("team").sandboxes == 12
    assert store.get("x").cap("cpu_cores") == 0.25 and store.get("y").cap("cpu_cores") is None
    with pytest.raises(ProjectNotFound):
        await store.set_quota("nope", ProjectQuota())


async def test_remove(store):
    await store.create("a", "root")
    await store.create("b", "a")
    with pytest.raises(InvalidRequest, match="sub-projects \\(b\\)"):
        await store.remove("a")
    token = await store.new_token("b")
    await store.remove("b")
    assert store.project_of_token(token) is None  # tokens go with their project
    await store.remove("a")
    with pytest.raises(InvalidRequest, match="root"):
        await store.remove("root")
    with pytest.raises(ProjectNotFound):
        await store.remove("a")


async def test_tokens_are_stored_hashed(store, project_db):
    await store.create("a", "root")
    token = await store.new_token("a")
    assert token.startswith("dsp_") and len(token) > 40
    assert store.project_of_token(token) == "a"
    assert store.project_of_token(token + "x") is None
    assert await store.new_token("a") != token and store.token_count("a") == 2
    raw = await stored_digests(project_db)
    assert token_digest(token) in raw
    assert all(token not in digest for digest in raw)
    with pytest.raises(ProjectNotFound):
        await store.new_token("nope")


async def test_a_second_store_sees_changes(project_db):
    """Another store's changes show within ``recheck_s``; one's own at once."""
    with open_project_store(project_db) as writer, open_project_store(project_db) as reader:
        reader.recheck_s = 0.05
        assert "a" not in reader.tree()
        await writer.create("a", "root", ProjectQuota(sandboxes=1))
        assert writer.get("a").cap("sandboxes") == 1
        await eventually(lambda: "a" in reader.tree())
        assert reader.get("a").cap("sandboxes") == 1
        await writer.set_quota("a", ProjectQuota(sandboxes=2))
        assert writer.get("a").cap("sandboxes") == 2
        await eventually(lambda: reader.get("a").cap("sandboxes") == 2)
        token = await writer.new_token("a")
        await eventually(lambda: reader.project_of_token(token) == "a")
        # The reader writes on top of what the writer did (its check sees the writer's tree).
        with pytest.raises(QuotaExceeded):
            await reader.create("b", "a", ProjectQuota(sandboxes=3))
        await reader.create("b", "a", ProjectQuota(sandboxes=2))
        await eventually(lambda: "b" in writer.tree())
        await writer.remove("b")
        await writer.remove("a")
        await eventually(lambda: "a" not in reader.tree() and reader.project_of_token(token) is None)


async def test_racing_writers_cannot_break_the_tree(project_db):
    """Two stores hand out one parent's quota at once, and lower it meanwhile: the checks of
    the one see what the other committed, so the caps never add up past the parent's."""
    with open_project_store(project_db) as one, open_project_store(project_db) as two:
        await one.create("team", "root", ProjectQuota(sandboxes=10))

        async def carve(store, prefix: str) -> int:
            made = 0
            for i in range(12):
                try:
                    await store.create(f"{prefix}{i}", "team", ProjectQuota(sandboxes=1))
                    made += 1
                except QuotaExceeded:
                    pass
            return made

        async def lower(store) -> None:
            for cap in (9, 8, 7):
                try:
                    await store.set_quota("team", ProjectQuota(sandboxes=cap))
                except QuotaExceeded:
                    pass

        made = await asyncio.gather(carve(one, "a"), carve(two, "b"), lower(one), lower(two))
        await eventually(lambda: len(one.tree().children["team"]) == len(two.tree().children["team"]))
        for store in (one, two):
            tree = store.tree()
            check_tree(tree)
            assert made[0] + made[1] == len(tree.children["team"]) <= tree.projects["team"].cap("sandboxes") <= 10


async def test_a_change_made_without_a_notification_shows_within_recheck_s(postgres):
    url = postgres.new_database()
    with open_project_store(url) as s:
        s.recheck_s = 0.1
        await sql(url, "INSERT INTO projects (name, parent, sandboxes) VALUES ('quiet', 'root', 3)")
        await sql(url, "UPDATE projects_version SET version = version + 1")  # no NOTIFY
        await eventually(lambda: "quiet" in s.tree())
        assert s.get("quiet").cap("sandboxes") == 3


async def test_a_store_follows_the_database_again_after_losing_its_connections(postgres):
    url = postgres.new_database()
    with open_project_store(url) as writer, open_project_store(url) as reader:
        await writer.create("before", "root")
        await eventually(lambda: "before" in reader.tree())
        await sql(url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        assert "before" in reader.tree()  # meanwhile: what it read last
        deadline = time.monotonic() + 10
        while True:  # writes fail until the pool has a connection again
            try:
                await writer.create("after", "root")
                break
            except BackendError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        await eventually(lambda: "after" in reader.tree(), within_s=10)


def test_close_twice_and_use_after_close(project_db):
    s = open_project_store(project_db)
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.tree()


def test_which_store_a_url_opens(tmp_path):
    from dsec.apiserver.projects_sqlite import SQLiteProjectStore

    with open_project_store(f"sqlite://{tmp_path}/p.db") as s:
        assert isinstance(s, SQLiteProjectStore) and s.path == f"{tmp_path}/p.db"
    for bad in ("mysql://h/db", "postgresql//h/db", "sqlite://relative.db", "projects.db"):
        with pytest.raises(InvalidRequest, match="not a project database URL"):
            open_project_store(bad)


@pytest.mark.parametrize("url, error", [
    ("postgresql://u@127.0.0.1:notaport/db", "malformed PostgreSQL URL"),
    ("postgresql://u:secret@127.0.0.1:{free}/db", "cannot open the project database postgresql://u:\\*\\*\\*@"),
])
def test_a_bad_postgresql_url_fails_at_open_naming_it(url, error):
    from dsec.local import free_port
    from libdsec import DSecError

    started = time.monotonic()
    with pytest.raises(DSecError, match=error) as info:
        open_project_store(url.format(free=free_port()))
    assert "secret" not in str(info.value)
    assert time.monotonic() - started < 5


async def test_stops_owed_to_a_node_are_kept_until_settled_and_seen_by_another_store(store, project_db):
    failed = OwedStop("batch create failed")
    await store.owe_stops("n1", ["n1-a", "n1-b"], "batch create failed")
    await store.owe_stops("n1", ["n1-a"], "again")  # owed once
    await store.owe_stops("n2", ["n2-a"], "batch create failed")
    with open_project_store(project_db) as other:
        assert await other.owed_stops("n1") == {"n1-a": failed, "n1-b": failed}
        await other.settle_stops(["n1-a", "nothing-owed"])
    assert await store.owed_stops("n1") == {"n1-b": failed}
    assert await store.owed_stops("n2") == {"n2-a": failed}
    assert await store.owed_stops("n3") == {}
    await store.owe_stops("n3", ["n3-a"], "stopped while away", project="team")
    assert await store.owed_stops("n3") == {"n3-a": OwedStop("stopped while away", "team")}


def test_an_sqlite_file_from_before_owed_stops_had_a_project_gets_the_column(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE owed_stops (sandbox_id TEXT PRIMARY KEY, node TEXT NOT NULL, "
                   "reason TEXT NOT NULL, since REAL NOT NULL)")
        db.execute("INSERT INTO owed_stops VALUES ('n1-a', 'n1', 'batch create failed', 0)")
    for _ in range(2):  # (the second open finds the column there)
        with open_project_store(path) as store:
            assert asyncio.run(store.owed_stops("n1")) == {"n1-a": OwedStop("batch create failed", None)}


def test_the_job_logs_writes_now_write_only_when_they_need_not_wait(tmp_path):
    """``append_job_now``/``claim_key_now`` (the apiserver's event loop) write at once when no
    other writer holds the file's lock; while one does (here another connection, as another
    process would), they write nothing and say so, and the blocking twins wait for it. They
    leave checkpoints to ``checkpoint_blocking``, due every ``CHECKPOINT_EVERY`` commits."""
    from dsec.apiserver import projects_sqlite

    path = tmp_path / "projects.db"
    with projects_sqlite.SQLiteProjectStore(path) as store:
        asyncio.run(store.open_job("j", "root"))
        assert store.claim_key_now("job:j", "k1", "d1").state == "claimed"
        assert store.claim_key_now("job:j", "k1", "d1") is None  # (there: the blocking claim says what it holds)
        assert store.append_job_now([("j", 1.0, '{"op":"create"}')], [("job:j", "k1", '{"id":"n0-1"}')])
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        assert store.append_job_now([("j", 2.0, '{"op":"exec"}')]) is False
        assert store.claim_key_now("job:j", "k2", "d2") is None
        other.execute("COMMIT")
        other.close()
        assert store.append_job_now([("j", 3.0, '{"op":"stop"}')])
        entries = [entry for _, _, entry in asyncio.run(store.job_entries("j"))]
        assert entries == ['{"op":"create"}', '{"op":"stop"}']
        assert store.claim_key_blocking("job:j", "k1", "d1").result == '{"id":"n0-1"}'
        assert store.claim_key_blocking("job:j", "k2", "d2").state == "claimed"

        assert not store.checkpoint_due
        size = path.stat().st_size
        for i in range(projects_sqlite.CHECKPOINT_EVERY):
            store.append_job_now([("j", 4.0 + i, '{"op":"exec","padding":"%s"}' % ("x" * 200))])
        assert store.checkpoint_due and path.stat().st_size == size  # (all in the WAL yet)
        store.checkpoint_blocking()
        assert not store.checkpoint_due and path.stat().st_size > size
    with pytest.raises(RuntimeError, match="closed"):
        store.append_job_now([("j", 9.0, "{}")])
