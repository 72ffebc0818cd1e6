"""Durable projects, quotas and tokens: one embedded SQLite file (stdlib ``sqlite3``).

``ProjectStore(path)`` opens (and creates) the database; ``close()`` ends it (a second call
does nothing). The ``root`` project always exists. Tokens are kept as SHA-256 digests only; a
new token is shown once, when it is made. The store checks the quota tree's invariants on every
change (see ``quota``); who may change what is the apiserver's business.

One writer is expected (the apiserver); readers in other processes see its changes within
``ProjectStore.recheck_s`` (WAL).
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
import sqlite3
import threading
import time
from pathlib import Path

from libdsec import InvalidRequest, LimitOutOfRange, ProjectNotFound
from libdsec._projects import ROOT_PROJECT, ProjectQuota

from .quota import RESOURCES, Project, Tree, check_tree

NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}\Z")
# Bounds on a quota value: past these it is a typo, not a plan.
QUOTA_MAX = {"sandboxes": 10_000_000, "cpu_cores": 10_000_000.0, "memory_mb": 1 << 40}

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
"""


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_quota(quota: ProjectQuota) -> ProjectQuota:
    """Raise ``LimitOutOfRange`` for a negative or absurd quota value, naming the field."""
    for r in RESOURCES:
        value = getattr(quota, r)
        if value is None:
            continue
        if not math.isfinite(value) or not 0 <= value <= QUOTA_MAX[r]:
            raise LimitOutOfRange(f"quota {r}={value} is out of range: 0..{QUOTA_MAX[r]}")
    return quota


def quota_of(project: Project) -> ProjectQuota:
    return ProjectQuota(**{r: project.cap(r) for r in RESOURCES})


class ProjectStore:
    # How long the tree read last is trusted before asking whether another process changed it.
    recheck_s = 0.5

    def __init__(self, path: Path | str = ":memory:") -> None:
        self.path = str(path)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA foreign_keys = ON")
        if self.path != ":memory:":
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.executescript(_SCHEMA)
        self._db.execute(
            "INSERT OR IGNORE INTO projects (name, parent, created_at) VALUES (?, NULL, ?)", (ROOT_PROJECT, time.time())
        )
        self._tree: Tree | None = None
        self._version: int | None = None
        self._checked_at = float("-inf")

    def close(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            db.close()

    def __enter__(self) -> ProjectStore:
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
                rows = db.execute("SELECT name, parent, sandboxes, cpu_cores, memory_mb FROM projects").fetchall()
                self._tree = Tree(
                    Project(name=n, parent=p, caps={"sandboxes": s, "cpu_cores": c, "memory_mb": m})
                    for n, p, s, c, m in rows
                )
                self._version = version
            return self._tree

    def get(self, name: str) -> Project:
        tree = self.tree()
        if name not in tree:
            raise ProjectNotFound(f"no project {name!r}")
        return tree.projects[name]

    def project_of_token(self, token: str) -> str | None:
        with self._lock:
            row = self._conn().execute("SELECT project FROM tokens WHERE sha256 = ?", (token_digest(token),)).fetchone()
        return row[0] if row else None

    # -- changing --------------------------------------------------------------------------

    def _changed(self) -> None:
        self._tree = None  # our own writes do not move data_version

    def create(self, name: str, parent: str, quota: ProjectQuota = ProjectQuota()) -> Project:
        if not NAME.match(name):
            raise InvalidRequest(
                f"invalid project name {name!r}: 1 to 63 lowercase letters, digits and '-', starting with a letter"
            )
        check_quota(quota)
        tree = self.tree()
        if name in tree:
            raise InvalidRequest(f"project {name!r} exists already")
        if parent not in tree:
            raise ProjectNotFound(f"no project {parent!r}")
        project = Project(name=name, parent=parent, caps=quota.model_dump())
        check_tree(tree.with_project(project))
        with self._lock:
            self._conn().execute(
                "INSERT INTO projects (name, parent, sandboxes, cpu_cores, memory_mb, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                (name, parent, quota.sandboxes, quota.cpu_cores, quota.memory_mb, time.time()),
            )
            self._changed()
        return project

    def set_quota(self, name: str, quota: ProjectQuota) -> Project:
        check_quota(quota)
        current = self.get(name)
        project = Project(name=name, parent=current.parent, caps=quota.model_dump())
        check_tree(self.tree().with_project(project))
        with self._lock:
            self._conn().execute(
                "UPDATE projects SET sandboxes = ?, cpu_cores = ?, memory_mb = ? WHERE name = ?",
                (quota.sandboxes, quota.cpu_cores, quota.memory_mb, name),
            )
            self._changed()
        return project

    def remove(self, name: str) -> None:
        """Remove a project without children; its tokens go with it."""
        if name == ROOT_PROJECT:
            raise InvalidRequest("the root project cannot be removed")
        tree = self.tree()
        self.get(name)
        if tree.children.get(name):
            raise InvalidRequest(
                f"project {name!r} has sub-projects ({', '.join(tree.children[name])}): remove them first"
            )
        with self._lock:
            self._conn().execute("DELETE FROM projects WHERE name = ?", (name,))
            self._changed()

    def new_token(self, name: str) -> str:
        """A new token for ``name``; only its digest is stored."""
        self.get(name)
        token = "dsp_" + secrets.token_urlsafe(32)
        with self._lock:
            self._conn().execute(
                "INSERT INTO tokens (sha256, project, created_at) VALUES (?, ?, ?)",
                (token_digest(token), name, time.time()),
            )
        return token

    def token_count(self, name: str) -> int:
        with self._lock:
            return self._conn().execute("SELECT count(*) FROM tokens WHERE project = ?", (name,)).fetchone()[0]
