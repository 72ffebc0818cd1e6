"""The embedded project store: one SQLite file (stdlib ``sqlite3``), the default of ``dsec serve``.

A ``ProjectStore`` (see ``projects``). Each write holds the database's write lock (``BEGIN
IMMEDIATE``) while it reads the tree, checks it and changes it, so writers in several processes
cannot break the tree between them; readers elsewhere see a change within ``recheck_s`` (WAL).
Writes run on the caller's thread: they take a local file a fraction of a millisecond.

The job log's hot writes (entries, and a new key's claim) have two forms: ``*_blocking``, which
waits for the write lock like any other write, for a thread of their own; and ``*_now``, for
the apiserver's event loop, which writes only if it need not wait (no other writer holds the
lock: another process, or this store's thread mid-write) and else writes nothing and says so.
The ``*_now`` writes go through a second connection that waits for no lock and leaves
checkpoints (which sync the file) to ``checkpoint_blocking``, called off the loop once
``checkpoint_due``.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from libdsec._projects import ROOT_PROJECT, ProjectQuota

from .projects import (
    JOB_LAST_WRITTEN,
    JOB_ROW,
    JobRow,
    KeyClaim,
    OwedStop,
    check_removal,
    key_claim,
    make_token,
    plan_create,
    plan_set_quota,
    project_in,
    token_digest,
)
from .quota import Project, Tree

T = TypeVar("T")

# Commits by the ``*_now`` writes between checkpoints (each commit adds a page or a few to the
# WAL; SQLite's own checkpoints come every 1,000 pages).
CHECKPOINT_EVERY = 256
# What SQLite answers a write that would wait for another writer (its busy timeout 0).
_BUSY = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS projects (
    name TEXT PRIMARY KEY,
    parent TEXT REFERENCES projects(name),
    sandboxes INTEGER,
    cpu_cores REAL,
    memory_mb INTEGER,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tokens (
    sha256 TEXT PRIMARY KEY,
    project TEXT NOT NULL REFERENCES projects(name) ON DELETE CASCADE,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS tokens_by_project ON tokens(project);
CREATE TABLE IF NOT EXISTS owed_stops (
    sandbox_id TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    reason TEXT NOT NULL,
    since REAL NOT NULL,
    project TEXT
);
CREATE INDEX IF NOT EXISTS owed_stops_by_node ON owed_stops(node);
CREATE TABLE IF NOT EXISTS create_keys (
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    digest TEXT NOT NULL,
    result TEXT,
    claimed_at REAL NOT NULL,
    PRIMARY KEY (scope, key)
);
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
    project TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS job_log (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL REFERENCES jobs(name) ON DELETE CASCADE,
    at REAL NOT NULL,
    entry TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS job_log_by_job ON job_log(job, seq);
"""


def _read_tree(db: sqlite3.Connection) -> Tree:
    rows = db.execute("SELECT name, parent, sandboxes, cpu_cores, memory_mb FROM projects").fetchall()
    return Tree(Project(name=n, parent=p, caps={"sandboxes": s, "cpu_cores": c, "memory_mb": m})
                for n, p, s, c, m in rows)


def _add_column(db: sqlite3.Connection, table: str, column: str) -> None:
    """``ALTER TABLE table ADD COLUMN column`` unless it is there (another process may add it
    at the same moment)."""
    name = column.split()[0]
    if name in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
        return
    try:
        db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")
    except sqlite3.OperationalError as exc:
        if "duplicate column" not in str(exc):
            raise


class SQLiteProjectStore:
    # How long the tree read last is trusted before asking whether another process changed it.
    recheck_s = 0.5
    # The job log's writes have blocking twins (``*_blocking``): the apiserver runs them on a
    # thread of their own, off its event loop (sqlite3 lets go of the GIL while it writes).

    def __init__(self, path: Path | str = ":memory:") -> None:
        self.path = str(path)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA foreign_keys = ON")
        if self.path != ":memory:":
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.executescript(_SCHEMA)
        _add_column(self._db, "owed_stops", "project TEXT")  # (a file made before it had one)
        self._db.execute(
            "INSERT OR IGNORE INTO projects (name, parent, created_at) VALUES (?, NULL, ?)", (ROOT_PROJECT, time.time())
        )
        self._tree: Tree | None = None
        self._version: int | None = None
        self._checked_at = float("-inf")
        self._quick: sqlite3.Connection | None = None  # the ``*_now`` writes' (opened on first use)
        self._quick_lock = threading.Lock()
        self._quick_commits = 0

    def close(self) -> None:
        with self._quick_lock:
            if self._quick is not None:
                quick, self._quick = self._quick, None
                quick.close()
        if self._db is not None:
            db, self._db = self._db, None
            db.close()

    def __enter__(self) -> SQLiteProjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("the project store is closed")
        return self._db

    # -- reading ---------------------------------------------------------------------------

    def tree(self) -> Tree:
        """The whole tree, re-read only when the database changed. Our own writes show at once;
        another process's within ``recheck_s`` (asking SQLite whether the file changed takes
        three system calls, and every create asks for the tree)."""
        with self._lock:
            now = time.monotonic()
            if self._tree is not None and now - self._checked_at < self.recheck_s:
                return self._tree
            db = self._conn()
            version = db.execute("PRAGMA data_version").fetchone()[0]
            self._checked_at = now
            if self._tree is None or version != self._version:
                self._tree = _read_tree(db)
                self._version = version
            return self._tree

    def get(self, name: str) -> Project:
        return project_in(self.tree(), name)

    def project_of_token(self, token: str) -> str | None:
        with self._lock:
            row = self._conn().execute("SELECT project FROM tokens WHERE sha256 = ?", (token_digest(token),)).fetchone()
        return row[0] if row else None

    def token_count(self, name: str) -> int:
        with self._lock:
            return self._conn().execute("SELECT count(*) FROM tokens WHERE project = ?", (name,)).fetchone()[0]

    # -- changing --------------------------------------------------------------------------

    def _write(self, change: Callable[[sqlite3.Connection, Tree], T]) -> T:
        """``change(db, tree)`` in one transaction holding the write lock, ``tree`` as it is in
        the file (not the one cached: another process may have changed it)."""
        with self._lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                result = change(db, _read_tree(db))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            finally:
                self._tree = None  # our own writes do not move data_version
        return result

    async def create(self, name: str, parent: str, quota: ProjectQuota = ProjectQuota()) -> Project:
        def change(db: sqlite3.Connection, tree: Tree) -> Project:
            project = plan_create(tree, name, parent, quota)
            db.execute(
                "INSERT INTO projects (name, parent, sandboxes, cpu_cores, memory_mb, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                (name, parent, quota.sandboxes, quota.cpu_cores, quota.memory_mb, time.time()),
            )
            return project

        return self._write(change)

    async def set_quota(self, name: str, quota: ProjectQuota) -> Project:
        def change(db: sqlite3.Connection, tree: Tree) -> Project:
            project = plan_set_quota(tree, name, quota)
            db.execute(
                "UPDATE projects SET sandboxes = ?, cpu_cores = ?, memory_mb = ? WHERE name = ?",
                (quota.sandboxes, quota.cpu_cores, quota.memory_mb, name),
            )
            return project

        return self._write(change)

    async def remove(self, name: str) -> None:
        """Remove a project without children; its tokens go with it."""
        def change(db: sqlite3.Connection, tree: Tree) -> None:
            check_removal(tree, name)
            db.execute("DELETE FROM projects WHERE name = ?", (name,))

        self._write(change)

    async def new_token(self, name: str, e2b: bool = False) -> str:
        """A new token for ``name``; only its digest is stored."""
        token = make_token(e2b)

        def change(db: sqlite3.Connection, tree: Tree) -> None:
            project_in(tree, name)
            db.execute("INSERT INTO tokens (sha256, project, created_at) VALUES (?, ?, ?)",
                       (token_digest(token), name, time.time()))

        self._write(change)
        return token

    # -- stops owed to nodes -----------------------------------------------------------------

    async def owe_stops(self, node: str, sandbox_ids: Iterable[str], reason: str,
                        project: str | None = None) -> None:
        rows = [(sid, node, reason, time.time(), project) for sid in sandbox_ids]
        self._many("INSERT OR IGNORE INTO owed_stops (sandbox_id, node, reason, since, project) "
                   "VALUES (?, ?, ?, ?, ?)", rows)

    async def owed_stops(self, node: str) -> dict[str, OwedStop]:
        with self._lock:
            rows = self._conn().execute("SELECT sandbox_id, reason, project FROM owed_stops WHERE node = ?", (node,))
            return {sid: OwedStop(reason, project) for sid, reason, project in rows}

    async def settle_stops(self, sandbox_ids: Iterable[str]) -> None:
        self._many("DELETE FROM owed_stops WHERE sandbox_id = ?", [(sid,) for sid in sandbox_ids])

    def _many(self, statement: str, rows: list[tuple]) -> None:
        with self._lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany(statement, rows)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def _transaction(self, work: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                result = work(db)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return result

    def _now(self, work: Callable[[sqlite3.Connection], T], one_statement: bool = False) -> tuple[bool, T | None]:
        """(True, ``work(db)``) done in one transaction on the second connection, or (False,
        None) with nothing written when that would wait for another writer. ``one_statement``:
        ``work`` makes one, its own transaction (no BEGIN and COMMIT to pay for)."""
        if self.path == ":memory:" or not self._quick_lock.acquire(blocking=False):
            return False, None  # (an in-memory database is this connection's alone)
        try:
            db = self._quick
            if db is None:
                self._conn()  # (closed: raises)
                db = self._quick = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=0)
                db.execute("PRAGMA foreign_keys = ON")
                db.execute("PRAGMA synchronous = NORMAL")
                db.execute("PRAGMA wal_autocheckpoint = 0")
            try:
                if one_statement:
                    result = work(db)
                else:
                    db.execute("BEGIN IMMEDIATE")
                    result = work(db)
                    db.execute("COMMIT")
            except BaseException as exc:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.OperationalError) and exc.sqlite_errorcode in _BUSY:
                    return False, None
                raise
            self._quick_commits += 1
            return True, result
        finally:
            self._quick_lock.release()

    @property
    def checkpoint_due(self) -> bool:
        """The ``*_now`` writes have added ``CHECKPOINT_EVERY`` commits to the WAL since the
        last ``checkpoint_blocking``."""
        return self._quick_commits >= CHECKPOINT_EVERY

    def checkpoint_blocking(self) -> None:
        """Copy the WAL into the database as far as no reader holds it back (it syncs the file)."""
        self._quick_commits = 0
        with self._lock:
            self._conn().execute("PRAGMA wal_checkpoint(PASSIVE)")

    # -- idempotency keys --------------------------------------------------------------------

    async def claim_key(self, scope: str, key: str, digest: str) -> KeyClaim:
        return self.claim_key_blocking(scope, key, digest)

    def claim_key_blocking(self, scope: str, key: str, digest: str) -> KeyClaim:
        with self._lock:  # a new key, the common case: one statement
            inserted = self._conn().execute(
                "INSERT OR IGNORE INTO create_keys (scope, key, digest, result, claimed_at) VALUES (?, ?, ?, NULL, ?)",
                (scope, key, digest, time.time())).rowcount
        if inserted == 1:
            return KeyClaim("claimed")

        def work(db: sqlite3.Connection) -> KeyClaim:
            now = time.time()
            row = db.execute("SELECT digest, result, claimed_at FROM create_keys WHERE scope = ? AND key = ?",
                             (scope, key)).fetchone()
            claim = key_claim(key, digest, row, now)
            if claim.state == "claimed":
                db.execute("INSERT OR REPLACE INTO create_keys (scope, key, digest, result, claimed_at) "
                           "VALUES (?, ?, ?, NULL, ?)", (scope, key, digest, now))
            return claim

        return self._transaction(work)

    def claim_key_now(self, scope: str, key: str, digest: str) -> KeyClaim | None:
        """``claim_key`` of a new key, if that need not wait; None when it would, or when the
        key is there already (``claim_key_blocking`` says what it holds)."""
        def work(db: sqlite3.Connection) -> int:
            return db.execute("INSERT OR IGNORE INTO create_keys (scope, key, digest, result, claimed_at) "
                              "VALUES (?, ?, ?, NULL, ?)", (scope, key, digest, time.time())).rowcount

        written, inserted = self._now(work, one_statement=True)
        return KeyClaim("claimed") if written and inserted == 1 else None

    async def settle_key(self, scope: str, key: str, result: str) -> None:
        self._many("UPDATE create_keys SET result = ? WHERE scope = ? AND key = ?", [(result, scope, key)])

    async def release_key(self, scope: str, key: str) -> None:
        self._many("DELETE FROM create_keys WHERE scope = ? AND key = ?", [(scope, key)])

    # -- job logs ----------------------------------------------------------------------------

    async def open_job(self, name: str, project: str) -> str:
        def work(db: sqlite3.Connection) -> str:
            now = time.time()
            db.execute("INSERT OR IGNORE INTO jobs (name, project, created_at) VALUES (?, ?, ?)", (name, project, now))
            return db.execute("SELECT project FROM jobs WHERE name = ?", (name,)).fetchone()[0]

        return self._transaction(work)

    async def append_job(self, rows: list[tuple[str, float, str]],
                         settles: list[tuple[str, str, str]] = ()) -> None:
        self.append_job_blocking(rows, settles)

    def append_job_blocking(self, rows: list[tuple[str, float, str]],
                            settles: list[tuple[str, str, str]] = ()) -> None:
        if len(rows) == 1 and not settles:  # one statement is its own transaction
            with self._lock:
                self._conn().execute("INSERT INTO job_log (job, at, entry) VALUES (?, ?, ?)", rows[0])
            return

        def work(db: sqlite3.Connection) -> None:
            db.executemany("INSERT INTO job_log (job, at, entry) VALUES (?, ?, ?)", rows)
            if settles:
                db.executemany("UPDATE create_keys SET result = ? WHERE scope = ? AND key = ?",
                               [(result, scope, key) for scope, key, result in settles])

        self._transaction(work)

    def append_job_now(self, rows: list[tuple[str, float, str]], settles: list[tuple[str, str, str]] = ()) -> bool:
        """``append_job`` if that need not wait; False (nothing written) when it would."""
        if len(rows) == 1 and not settles:
            return self._now(lambda db: db.execute("INSERT INTO job_log (job, at, entry) VALUES (?, ?, ?)", rows[0]),
                             one_statement=True)[0]

        def work(db: sqlite3.Connection) -> None:
            db.executemany("INSERT INTO job_log (job, at, entry) VALUES (?, ?, ?)", rows)
            for scope, key, result in settles:
                db.execute("UPDATE create_keys SET result = ? WHERE scope = ? AND key = ?", (result, scope, key))

        return self._now(work)[0]

    async def job(self, name: str) -> JobRow | None:
        with self._lock:
            row = self._conn().execute(JOB_ROW + " WHERE j.name = ?", (name,)).fetchone()
        return JobRow(*row) if row else None

    async def jobs(self, project: str | None = None) -> list[JobRow]:
        with self._lock:
            rows = self._conn().execute(JOB_ROW + " ORDER BY j.created_at, j.name").fetchall()
        return [JobRow(*r) for r in rows if project is None or r[1] == project]

    async def job_entries(self, name: str, after: int = 0, limit: int = 1_000_000) -> list[tuple[int, float, str]]:
        with self._lock:
            return self._conn().execute("SELECT seq, at, entry FROM job_log WHERE job = ? AND seq > ? "
                                        "ORDER BY seq LIMIT ?", (name, after, limit)).fetchall()

    async def remove_jobs(self, names: Iterable[str]) -> None:
        names = list(names)

        def work(db: sqlite3.Connection) -> None:
            db.executemany("DELETE FROM job_log WHERE job = ?", [(n,) for n in names])
            db.executemany("DELETE FROM jobs WHERE name = ?", [(n,) for n in names])
            db.executemany("DELETE FROM create_keys WHERE scope = ?", [("job:" + n,) for n in names])

        self._transaction(work)

    async def jobs_idle_since(self, before: float) -> list[str]:
        with self._lock:
            return [n for (n,) in self._conn().execute(f"SELECT j.name FROM jobs j WHERE {JOB_LAST_WRITTEN} < ?",
                                                       (before,))]
