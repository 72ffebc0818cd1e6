"""The shared project store: PostgreSQL through asyncpg, for several apiservers over one database.

A ``ProjectStore`` (see ``projects``). Every request asks for the caller's token and most for
the tree, so each store holds the whole tree and the token digests in memory, and follows the
database: a write commits a new ``version`` and a NOTIFY on ``dsec_projects``; every store
LISTENs there and reads everything again when one comes, and asks for the version every
``recheck_s`` as well, for a notification lost with a connection. A store's own writes show in
its reads at once, another's within milliseconds (``recheck_s`` at most).

Writes run in a transaction holding one advisory lock (``pg_advisory_xact_lock``): it reads the
tree as committed, checks the change against it (the same rules as the SQLite store), makes it
and moves the version, so two apiservers cannot break the tree between them.

The store runs its connections on an event loop in a thread of its own: it opens (and fails,
naming the problem) synchronously, its reads touch no connection, and callers on any event
loop await its writes. While the database cannot be reached, reads keep answering with what
was read last and the store retries in the background; writes fail with ``BackendError``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from libdsec import BackendError, InvalidRequest
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

log = logging.getLogger("dsec.apiserver.projects")

T = TypeVar("T")

CHANNEL = "dsec_projects"
# pg_advisory_xact_lock key of the project tree (any fixed 64-bit number: "dsecproj").
TREE_LOCK = 0x6473656370726F6A
CONNECT_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 30.0
RETRY_MAX_S = 5.0

_SCHEMA = f"""
SELECT pg_advisory_xact_lock({TREE_LOCK});
CREATE TABLE IF NOT EXISTS projects (
    name text PRIMARY KEY,
    parent text REFERENCES projects(name),
    sandboxes bigint,
    cpu_cores double precision,
    memory_mb bigint,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS tokens (
    sha256 text PRIMARY KEY,
    project text NOT NULL REFERENCES projects(name) ON DELETE CASCADE,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS tokens_by_project ON tokens(project);
CREATE TABLE IF NOT EXISTS owed_stops (
    sandbox_id text PRIMARY KEY,
    node text NOT NULL,
    reason text NOT NULL,
    since timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE owed_stops ADD COLUMN IF NOT EXISTS project text;
CREATE INDEX IF NOT EXISTS owed_stops_by_node ON owed_stops(node);
CREATE TABLE IF NOT EXISTS create_keys (
    scope text NOT NULL,
    key text NOT NULL,
    digest text NOT NULL,
    result text,
    claimed_at double precision NOT NULL,
    PRIMARY KEY (scope, key)
);
CREATE TABLE IF NOT EXISTS jobs (
    name text PRIMARY KEY,
    project text NOT NULL,
    created_at double precision NOT NULL
);
CREATE TABLE IF NOT EXISTS job_log (
    seq bigserial PRIMARY KEY,
    job text NOT NULL REFERENCES jobs(name) ON DELETE CASCADE,
    at double precision NOT NULL,
    entry text NOT NULL
);
CREATE INDEX IF NOT EXISTS job_log_by_job ON job_log(job, seq);
CREATE TABLE IF NOT EXISTS projects_version (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    version bigint NOT NULL
);
INSERT INTO projects_version (version) VALUES (0) ON CONFLICT DO NOTHING;
INSERT INTO projects (name, parent) VALUES ('{ROOT_PROJECT}', NULL) ON CONFLICT DO NOTHING;
"""
_VERSION = "SELECT version FROM projects_version"
# Everything, in one statement: one snapshot, inside a write's transaction or alone.
_EVERYTHING = """
SELECT (SELECT version FROM projects_version),
       (SELECT coalesce(json_agg(json_build_array(name, parent, sandboxes, cpu_cores, memory_mb)), '[]')
          FROM projects),
       (SELECT coalesce(json_agg(json_build_array(sha256, project)), '[]') FROM tokens)
"""
_TREE = "SELECT name, parent, sandboxes, cpu_cores, memory_mb FROM projects"
_DB_ERRORS = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError)


@dataclass(frozen=True)
class _State:
    version: int
    tree: Tree
    tokens: Mapping[str, str]  # digest → project


def _tree_of(rows: Any) -> Tree:
    return Tree(Project(name=n, parent=p, caps={"sandboxes": s, "cpu_cores": c, "memory_mb": m})
                for n, p, s, c, m in rows)


async def _read_state(conn: asyncpg.Connection) -> _State:
    version, projects, tokens = await conn.fetchrow(_EVERYTHING)
    return _State(version, _tree_of(json.loads(projects)), {d: p for d, p in json.loads(tokens)})


def redacted(url: str) -> str:
    """``url`` without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def check_url(url: str) -> str:
    """Raise ``InvalidRequest`` naming what is wrong with a PostgreSQL URL."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise InvalidRequest(f"malformed PostgreSQL URL {redacted(url)!r}: {exc}") from None
    if parts.scheme not in ("postgresql", "postgres"):
        raise InvalidRequest(f"not a PostgreSQL URL: {redacted(url)!r} (postgresql://USER@HOST:PORT/DATABASE)")
    return url


class PostgresProjectStore:
    # The longest a change made elsewhere goes unseen when its notification was lost.
    recheck_s = 1.0

    def __init__(self, url: str, *, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.url = check_url(url)
        self._connect_timeout_s = connect_timeout_s
        self._state: _State | None = None
        self._closed = False
        self._pool: asyncpg.Pool | None = None
        self._listener: asyncpg.Connection | None = None
        self._follower: asyncio.Task | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dsec-projects-pg", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._open(), self._loop).result()
        except BaseException:
            self._stop_loop()
            raise

    # -- lifecycle (on the store's own loop) ---------------------------------------------------

    async def _connect(self) -> asyncpg.Connection:
        return await asyncpg.connect(self.url, timeout=self._connect_timeout_s, command_timeout=COMMAND_TIMEOUT_S)

    async def _open(self) -> None:
        self._wake = asyncio.Event()
        try:
            conn = await self._connect()
            try:
                async with conn.transaction():
                    await conn.execute(_SCHEMA)  # under the tree's lock: apiservers may start together
            finally:
                await conn.close()
            self._pool = await asyncpg.create_pool(
                self.url, min_size=1, max_size=4, timeout=self._connect_timeout_s, command_timeout=COMMAND_TIMEOUT_S,
            )
            await self._listen()
        except ValueError as exc:  # asyncpg's ClientConfigurationError is one
            await self._shutdown()
            raise InvalidRequest(f"malformed PostgreSQL URL {redacted(self.url)!r}: {exc}") from None
        except _DB_ERRORS as exc:
            await self._shutdown()
            raise BackendError(f"cannot open the project database {redacted(self.url)}: {_describe(exc)}") from None
        self._follower = asyncio.create_task(self._follow())

    async def _listen(self) -> None:
        """(Re)connect the listening connection, then read everything: what changed while no
        one listened shows too."""
        await self._drop_listener()
        self._listener = await self._connect()
        await self._listener.add_listener(CHANNEL, self._notified)
        self._install(await _read_state(self._listener))

    async def _drop_listener(self, graceful: bool = False) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        if graceful:
            try:
                await listener.close(timeout=5)
                return
            except _DB_ERRORS:
                pass
        listener.terminate()

    def _notified(self, conn: object, pid: int, channel: str, payload: str) -> None:
        state = self._state
        if state is None or not payload.isdigit() or int(payload) > state.version:
            self._wake.set()

    async def _follow(self) -> None:
        retry_s = 0.1
        while True:
            try:
                if self._listener is None or self._listener.is_closed():
                    await self._listen()
                    log.info("project database %s: following it again", redacted(self.url))
                try:
                    await asyncio.wait_for(self._wake.wait(), self.recheck_s)
                    woken = True
                except TimeoutError:
                    woken = False
                self._wake.clear()
                assert self._listener is not None and self._state is not None
                if woken or await self._listener.fetchval(_VERSION) != self._state.version:
                    self._install(await _read_state(self._listener))
                retry_s = 0.1
            except Exception as exc:  # whatever it is, the store goes on following
                log.warning("project database %s: %s; serving the projects and tokens read last, again in %gs",
                            redacted(self.url), _describe(exc), retry_s)
                await self._drop_listener()
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, RETRY_MAX_S)

    def _install(self, state: _State) -> None:
        # Only ever forward: a read that started before a write may end after it.
        if not self._closed and (self._state is None or state.version >= self._state.version):
            self._state = state

    async def _shutdown(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            try:
                await self._follower
            except asyncio.CancelledError:
                pass
        await self._drop_listener(graceful=True)
        if self._pool is not None:
            pool, self._pool = self._pool, None
            try:
                await asyncio.wait_for(pool.close(), 5)
            except _DB_ERRORS:
                pool.terminate()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        self._stop_loop()

    def __enter__(self) -> PostgresProjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading (from memory) -----------------------------------------------------------------

    def _now(self) -> _State:
        state = self._state
        if self._closed or state is None:
            raise RuntimeError("the project store is closed")
        return state

    def tree(self) -> Tree:
        return self._now().tree

    def get(self, name: str) -> Project:
        return project_in(self.tree(), name)

    def project_of_token(self, token: str) -> str | None:
        return self._now().tokens.get(token_digest(token))

    def token_count(self, name: str) -> int:
        return sum(1 for project in self._now().tokens.values() if project == name)

    # -- changing --------------------------------------------------------------------------

    async def _write(self, change: Callable[[asyncpg.Connection, Tree], Awaitable[T]]) -> T:
        """``change(conn, tree)`` in a transaction holding the tree's lock, ``tree`` as committed;
        then the version moves on, the other stores are told, and this one reads the result."""
        self._now()
        return await self._on_own_loop(self._write_here(change))

    async def _write_here(self, change: Callable[[asyncpg.Connection, Tree], Awaitable[T]]) -> T:
        if self._pool is None:
            raise RuntimeError("the project store is closed")
        for attempt in range(2):
            committing = False
            try:
                async with self._pool.acquire() as conn:
                    transaction = conn.transaction()
                    await transaction.start()
                    try:
                        await conn.execute("SELECT pg_advisory_xact_lock($1)", TREE_LOCK)
                        result = await change(conn, _tree_of(await conn.fetch(_TREE)))
                        version = await conn.fetchval(
                            "UPDATE projects_version SET version = version + 1 RETURNING version")
                        await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, str(version))
                        state = await _read_state(conn)
                    except BaseException:
                        if not conn.is_closed():
                            await transaction.rollback()
                        raise
                    committing = True
                    await transaction.commit()
                break
            except _DB_ERRORS as exc:
                # A transaction that never reached its commit changed nothing: once more, on a
                # connection of its own (a pooled one may have died with the server's restart).
                if committing or attempt:
                    raise BackendError(f"the project database {redacted(self.url)} failed: {_describe(exc)}") from None
                log.info("project database %s: %s; trying the write again", redacted(self.url), _describe(exc))
        self._install(state)
        return result

    async def _on_own_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def create(self, name: str, parent: str, quota: ProjectQuota = ProjectQuota()) -> Project:
        async def change(conn: asyncpg.Connection, tree: Tree) -> Project:
            project = plan_create(tree, name, parent, quota)
            await conn.execute(
                "INSERT INTO projects (name, parent, sandboxes, cpu_cores, memory_mb) VALUES ($1, $2, $3, $4, $5)",
                name, parent, quota.sandboxes, quota.cpu_cores, quota.memory_mb,
            )
            return project

        return await self._write(change)

    async def set_quota(self, name: str, quota: ProjectQuota) -> Project:
        async def change(conn: asyncpg.Connection, tree: Tree) -> Project:
            project = plan_set_quota(tree, name, quota)
            await conn.execute(
                "UPDATE projects SET sandboxes = $1, cpu_cores = $2, memory_mb = $3 WHERE name = $4",
                quota.sandboxes, quota.cpu_cores, quota.memory_mb, name,
            )
            return project

        return await self._write(change)

    async def remove(self, name: str) -> None:
        """Remove a project without children; its tokens go with it."""
        async def change(conn: asyncpg.Connection, tree: Tree) -> None:
            check_removal(tree, name)
            await conn.execute("DELETE FROM projects WHERE name = $1", name)

        await self._write(change)

    async def new_token(self, name: str, e2b: bool = False) -> str:
        """A new token for ``name``; only its digest is stored."""
        token = make_token(e2b)

        async def change(conn: asyncpg.Connection, tree: Tree) -> None:
            project_in(tree, name)
            await conn.execute("INSERT INTO tokens (sha256, project) VALUES ($1, $2)", token_digest(token), name)

        await self._write(change)
        return token

    # -- stops owed to nodes (no tree lock: they touch nothing the tree's invariants read) ---

    async def _plain(self, work: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        async def run() -> T:
            if self._pool is None:
                raise RuntimeError("the project store is closed")
            try:
                async with self._pool.acquire() as conn:
                    return await work(conn)
            except _DB_ERRORS as exc:
                raise BackendError(f"the project database {redacted(self.url)} failed: {_describe(exc)}") from None

        return await self._on_own_loop(run())

    async def owe_stops(self, node: str, sandbox_ids: Iterable[str], reason: str,
                        project: str | None = None) -> None:
        rows = [(sid, node, reason, project) for sid in sandbox_ids]
        await self._plain(lambda conn: conn.executemany(
            "INSERT INTO owed_stops (sandbox_id, node, reason, project) VALUES ($1, $2, $3, $4) "
            "ON CONFLICT DO NOTHING", rows))

    async def owed_stops(self, node: str) -> dict[str, OwedStop]:
        rows = await self._plain(lambda conn: conn.fetch(
            "SELECT sandbox_id, reason, project FROM owed_stops WHERE node = $1", node))
        return {r[0]: OwedStop(r[1], r[2]) for r in rows}

    async def settle_stops(self, sandbox_ids: Iterable[str]) -> None:
        ids = list(sandbox_ids)
        await self._plain(lambda conn: conn.execute("DELETE FROM owed_stops WHERE sandbox_id = ANY($1::text[])", ids))

    async def _in_transaction(self, work: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        async def run(conn: asyncpg.Connection) -> T:
            async with conn.transaction():
                return await work(conn)

        return await self._plain(run)

    # -- idempotency keys (no tree lock: a row lock on the key is enough) ----------------------

    async def claim_key(self, scope: str, key: str, digest: str) -> KeyClaim:
        async def work(conn: asyncpg.Connection) -> KeyClaim:
            now = time.time()
            # Two creates with one key at once: the row's insert (or lock) orders them.
            await conn.execute("INSERT INTO create_keys (scope, key, digest, result, claimed_at) "
                               "VALUES ($1, $2, $3, NULL, $4) ON CONFLICT DO NOTHING", scope, key, digest, -1.0)
            row = await conn.fetchrow("SELECT digest, result, claimed_at FROM create_keys "
                                      "WHERE scope = $1 AND key = $2 FOR UPDATE", scope, key)
            fresh = row["claimed_at"] == -1.0
            claim = KeyClaim("claimed") if fresh else key_claim(key, digest, tuple(row), now)
            if claim.state == "claimed":
                await conn.execute("UPDATE create_keys SET digest = $3, result = NULL, claimed_at = $4 "
                                   "WHERE scope = $1 AND key = $2", scope, key, digest, now)
            return claim

        return await self._in_transaction(work)

    async def settle_key(self, scope: str, key: str, result: str) -> None:
        await self._plain(lambda conn: conn.execute(
            "UPDATE create_keys SET result = $3 WHERE scope = $1 AND key = $2", scope, key, result))

    async def release_key(self, scope: str, key: str) -> None:
        await self._plain(lambda conn: conn.execute(
            "DELETE FROM create_keys WHERE scope = $1 AND key = $2", scope, key))

    # -- job logs ------------------------------------------------------------------------------

    async def open_job(self, name: str, project: str) -> str:
        now = time.time()

        async def work(conn: asyncpg.Connection) -> str:
            await conn.execute("INSERT INTO jobs (name, project, created_at) VALUES ($1, $2, $3) "
                               "ON CONFLICT DO NOTHING", name, project, now)
            return await conn.fetchval("SELECT project FROM jobs WHERE name = $1", name)

        return await self._in_transaction(work)

    async def append_job(self, rows: list[tuple[str, float, str]],
                         settles: list[tuple[str, str, str]] = ()) -> None:
        async def work(conn: asyncpg.Connection) -> None:
            # One statement keeps the rows in order (seq follows the array's order).
            await conn.execute(
                "INSERT INTO job_log (job, at, entry) SELECT r.job, r.at, r.entry FROM "
                "unnest($1::text[], $2::float8[], $3::text[]) WITH ORDINALITY AS r(job, at, entry, n) ORDER BY r.n",
                [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
            if settles:
                await conn.executemany("UPDATE create_keys SET result = $3 WHERE scope = $1 AND key = $2", list(settles))

        await self._in_transaction(work)

    async def job(self, name: str) -> JobRow | None:
        row = await self._plain(lambda conn: conn.fetchrow(
            JOB_ROW + " WHERE j.name = $1", name))
        return JobRow(*row) if row else None

    async def jobs(self, project: str | None = None) -> list[JobRow]:
        rows = await self._plain(lambda conn: conn.fetch(
            JOB_ROW + " ORDER BY j.created_at, j.name"))
        return [JobRow(*r) for r in rows if project is None or r[1] == project]

    async def job_entries(self, name: str, after: int = 0, limit: int = 1_000_000) -> list[tuple[int, float, str]]:
        rows = await self._plain(lambda conn: conn.fetch(
            "SELECT seq, at, entry FROM job_log WHERE job = $1 AND seq > $2 ORDER BY seq LIMIT $3", name, after, limit))
        return [tuple(r) for r in rows]

    async def remove_jobs(self, names: Iterable[str]) -> None:
        names = list(names)

        async def work(conn: asyncpg.Connection) -> None:
            await conn.execute("DELETE FROM job_log WHERE job = ANY($1::text[])", names)
            await conn.execute("DELETE FROM jobs WHERE name = ANY($1::text[])", names)
            await conn.execute("DELETE FROM create_keys WHERE scope = ANY($1::text[])", ["job:" + n for n in names])

        await self._in_transaction(work)

    async def jobs_idle_since(self, before: float) -> list[str]:
        rows = await self._plain(lambda conn: conn.fetch(
            f"SELECT j.name FROM jobs j WHERE {JOB_LAST_WRITTEN} < $1", before))
        return [r[0] for r in rows]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
