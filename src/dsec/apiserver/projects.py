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
from typing import Protocol
from urllib.parse import urlsplit

from libdsec import InvalidRequest, LimitOutOfRange, ProjectNotFound
from libdsec._projects import ROOT_PROJECT, ProjectQuota

from .quota import RESOURCES, Project, Tree, check_tree

NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}\Z")
# Bounds on a quota value: past these it is a typo, not a plan.
QUOTA_MAX = {"sandboxes": 10_000_000, "cpu_cores": 10_000_000.0, "memory_mb": 1 << 40}


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

    # Stops owed to nodes: the sandboxes of batches that failed while their node was lost,
    # kept until the node is back and has stopped them (an apiserver may restart meanwhile,
    # and another may be the one the node comes back to).

    async def owe_stops(self, node: str, sandbox_ids: Iterable[str], reason: str) -> None: ...

    async def owed_stops(self, node: str) -> set[str]: ...

    async def settle_stops(self, sandbox_ids: Iterable[str]) -> None:
        """The stops made (or found needless: the sandbox is gone)."""
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


# -- the rules every store checks (on the tree it is about to change) --------------------------

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
