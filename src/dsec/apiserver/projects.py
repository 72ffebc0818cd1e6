"""Durable projects, quotas and tokens: the ``ProjectStore`` interface, the rules every store
checks, and ``open_project_store`` to pick one.

Two stores: an embedded SQLite file (``projects_sqlite``, the default of ``dsec serve``) and
PostgreSQL (``projects_pg``, ``dsec serve --db postgresql://…``), which several apiservers
share. The ``root`` project always exists. Tokens are kept as SHA-256 digests only; a new
token is shown once, when it is made. Who may change what is the apiserver's business.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, NamedTuple, Protocol
from urllib.parse import urlsplit

from libdsec import InvalidRequest, KeyReused, LimitOutOfRange, ProjectNotFound
from libdsec._projects import ROOT_PROJECT, ProjectQuota

from .quota import RESOURCES, Project, Tree, check_tree

NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}\Z")
# Bounds on a quota value: past these it is a typo, not a plan.
QUOTA_MAX = {"sandboxes": 10_000_000, "cpu_cores": 10_000_000.0, "memory_mb": 1 << 40}
# A key claimed by a create that never settled it (its apiserver died mid-create) is free again
# after this long: longer than any create takes.
KEY_STALE_S = 600.0


class KeyClaim(NamedTuple):
    """What ``claim_key`` found: ``claimed`` (the caller makes the sandbox, then settles the
    key with it or releases it), ``done`` (``result`` is what the first create made) or
    ``pending`` (another create with that key is under way)."""

    state: Literal["claimed", "done", "pending"]
    result: str | None = None


class OwedStop(NamedTuple):
    """A stop owed to a node: why, and (when its asker could not be checked against the
    sandbox's project while the node was away) the project that asked, to be checked then."""

    reason: str
    project: str | None = None


class JobRow(NamedTuple):
    name: str
    project: str
    created_at: float
    updated_at: float
    entries: int


class ProjectStore(Protocol):
    """Projects, quotas and tokens.

    Lifecycle: the constructor opens the database (making the schema on first use) and fails
    there, naming the problem, when it cannot; ``close()`` ends it, a second ``close()`` does
    nothing, and any other call after it raises ``RuntimeError``.

    Reads are synchronous and cheap, for the apiserver asks them on every request (``tree``,
    ``project_of_token``). Writes are coroutines; each checks the quota tree's invariants
    against the tree in the database, atomically with the change, so that two stores over one
    database cannot together break them. A store's own writes show in its reads at once;
    another store's within ``recheck_s``.
    """

    recheck_s: float

    def tree(self) -> Tree: ...

    def get(self, name: str) -> Project:
        """``ProjectNotFound`` if there is none."""
        ...

    def project_of_token(self, token: str) -> str | None: ...

    def token_count(self, name: str) -> int: ...

    async def create(self, name: str, parent: str, quota: ProjectQuota = ProjectQuota()) -> Project: ...

    async def set_quota(self, name: str, quota: ProjectQuota) -> Project: ...

    async def remove(self, name: str) -> None:
        """Remove a project without children; its tokens go with it."""
        ...

    async def new_token(self, name: str, e2b: bool = False) -> str:
        """A new token for ``name``; only its digest is stored. ``e2b``: in E2B's API key form
        (``e2b_`` + 40 hex digits, which e2b SDKs check before they send it)."""
        ...

    # Stops owed to nodes: the sandboxes of batches that failed while their node was lost, and
    # those their owners stopped while it was away, kept until the node is back and has
    # stopped them (an apiserver may restart meanwhile, and another may be the one the node
    # comes back to).

    async def owe_stops(self, node: str, sandbox_ids: Iterable[str], reason: str,
                        project: str | None = None) -> None:
        """Owe the stops (a sandbox owed one already stays owed as it was)."""
        ...

    async def owed_stops(self, node: str) -> dict[str, OwedStop]:
        """The sandboxes ``node`` is owed stops for."""
        ...

    async def settle_stops(self, sandbox_ids: Iterable[str]) -> None:
        """The stops made (or found needless: the sandbox is gone)."""
        ...

    # Idempotency keys of creates, by scope ("project:NAME" or "job:NAME"): a key claimed
    # holds the digest of the create's arguments, and once settled what it made (JSON).

    async def claim_key(self, scope: str, key: str, digest: str) -> KeyClaim:
        """``KeyReused`` when the key holds another digest."""
        ...

    async def settle_key(self, scope: str, key: str, result: str) -> None: ...

    async def release_key(self, scope: str, key: str) -> None:
        """Free the key (its create failed, or what it made was undone)."""
        ...

    # Job logs: one ordered log per job (a name unique in the store, owned by one project).

    async def open_job(self, name: str, project: str) -> str:
        """Make the job ``name`` for ``project`` unless it exists; returns its owner."""
        ...

    async def append_job(self, rows: list[tuple[str, float, str]],
                         settles: list[tuple[str, str, str]] = ()) -> None:
        """(job, at, entry JSON) rows, appended in this order, and (scope, key, result) keys
        settled, in one transaction."""
        ...

    async def job(self, name: str) -> JobRow | None: ...

    async def jobs(self, project: str | None = None) -> list[JobRow]: ...

    async def job_entries(self, name: str, after: int = 0, limit: int = 1_000_000) -> list[tuple[int, float, str]]:
        """(seq, at, entry JSON) of the entries past ``after``, in order."""
        ...

    async def remove_jobs(self, names: Iterable[str]) -> None:
        """The jobs, their logs and their keys."""
        ...

    async def jobs_idle_since(self, before: float) -> list[str]:
        """The jobs last written before ``before`` (epoch seconds)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> ProjectStore: ...

    def __exit__(self, *exc: object) -> None: ...


def open_project_store(where: Path | str = ":memory:") -> ProjectStore:
    """The store at ``where``: a ``postgresql://`` URL, a ``sqlite:///PATH`` URL, or the ``Path``
    of a SQLite file (``":memory:"``: a database of this process alone)."""
    if isinstance(where, Path) or where == ":memory:":
        from .projects_sqlite import SQLiteProjectStore

        return SQLiteProjectStore(where)
    scheme = urlsplit(where).scheme if "://" in where else ""
    if scheme in ("postgresql", "postgres"):
        from .projects_pg import PostgresProjectStore

        return PostgresProjectStore(where)
    if scheme == "sqlite" and where.startswith("sqlite:///") and len(where) > len("sqlite:///"):
        from .projects_sqlite import SQLiteProjectStore

        return SQLiteProjectStore(where[len("sqlite://"):])
    raise InvalidRequest(
        f"not a project database URL: {where!r} (postgresql://USER@HOST:PORT/DATABASE or sqlite:///PATH)"
    )


# A job's last write and its entry count are read from its log (an append writes the log alone).
JOB_ROW = """SELECT j.name, j.project, j.created_at,
       coalesce((SELECT l.at FROM job_log l WHERE l.job = j.name ORDER BY l.seq DESC LIMIT 1), j.created_at),
       (SELECT count(*) FROM job_log l WHERE l.job = j.name)
  FROM jobs j"""
JOB_LAST_WRITTEN = ("coalesce((SELECT l.at FROM job_log l WHERE l.job = j.name ORDER BY l.seq DESC LIMIT 1), "
                    "j.created_at)")


# -- the rules every store checks (on the tree it is about to change) --------------------------

def key_claim(key: str, digest: str, row: tuple[str, str | None, float] | None, now: float) -> KeyClaim:
    """The claim of ``key`` given its row (digest, result, claimed_at), if it has one."""
    if row is None:
        return KeyClaim("claimed")
    held, result, claimed_at = row
    if result is None and now - claimed_at > KEY_STALE_S:
        return KeyClaim("claimed")  # its create died unsettled
    if held != digest:
        raise KeyReused(f"idempotency key {key!r} was used for a create with other arguments: "
                        "use a new key for a new sandbox")
    return KeyClaim("done", result) if result is not None else KeyClaim("pending")


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def make_token(e2b: bool = False) -> str:
    return "e2b_" + secrets.token_hex(20) if e2b else "dsp_" + secrets.token_urlsafe(32)


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


def project_in(tree: Tree, name: str) -> Project:
    if name not in tree:
        raise ProjectNotFound(f"no project {name!r}")
    return tree.projects[name]


def plan_create(tree: Tree, name: str, parent: str, quota: ProjectQuota) -> Project:
    """The project to add to ``tree``, or the error that forbids it."""
    if not NAME.match(name):
        raise InvalidRequest(
            f"invalid project name {name!r}: 1 to 63 lowercase letters, digits and '-', starting with a letter"
        )
    check_quota(quota)
    if name in tree:
        raise InvalidRequest(f"project {name!r} exists already")
    if parent not in tree:
        raise ProjectNotFound(f"no project {parent!r}")
    project = Project(name=name, parent=parent, caps=quota.model_dump())
    check_tree(tree.with_project(project))
    return project


def plan_set_quota(tree: Tree, name: str, quota: ProjectQuota) -> Project:
    """The project ``name`` with ``quota``, or the error that forbids it."""
    check_quota(quota)
    project = Project(name=name, parent=project_in(tree, name).parent, caps=quota.model_dump())
    check_tree(tree.with_project(project))
    return project


def check_removal(tree: Tree, name: str) -> None:
    if name == ROOT_PROJECT:
        raise InvalidRequest("the root project cannot be removed")
    project_in(tree, name)
    if tree.children.get(name):
        raise InvalidRequest(
            f"project {name!r} has sub-projects ({', '.join(tree.children[name])}): remove them first"
        )
