"""Idempotency keys and job logs, kept in the project store (so they outlive an apiserver and
are shared by every apiserver over one database).

- A create with an idempotency key (``idempotency-key`` header) claims the key in its scope
  (the caller's job, else its project) with the digest of its arguments, makes the sandbox(es)
  and settles the key with what it made. Another create with that key gets what the first one
  made (its status as the node reports it now) and makes nothing; one with other arguments is
  ``KeyReused``; one that arrives while the first is under way waits for it.
- A request with a job (``x-dsec-job`` header) is recorded, after it ran, in the job's log with
  its result (or its error): creates (with their key), commands (``exec``), file writes and
  reads, pack_diffs, clean copies, pauses, resumes (one sandbox, or a group: ``dsec.apiserver.pausing``), network rules, TTLs and stops. The other
  calls that change a sandbox (``journal="made"`` in the public table, ``libdsec.api_ops``:
  streamed commands, background processes, sessions, PTYs, file-tree calls, snapshots) are
  logged as *made*, before they run, with no
  result: a resume cannot answer one, and says so (``ReplayIncomplete``) instead of running it
  a second time. A job belongs to the project that first wrote to it. Each request is answered once its
  entry is durable. Into SQLite, an entry (and a new key's claim) is written at once, on the
  event loop, when no other writer holds the file's lock (a write to the page cache: tens of
  microseconds, and durable past a ``kill -9``); else it waits for a thread of their own,
  which also takes the checkpoints that sync the file, and the entries that arrive meanwhile
  are written after it, in one group (a hop to a thread cost each write milliseconds of
  waiting for the GIL and the CPU on a busy server). Other stores write every entry in
  groups: one transaction for those that arrive while the last group is being written.
- Jobs idle past ``retention_s`` (``DSEC_JOB_RETENTION_S``, 7 days by default) are removed
  with their keys, checked at most once a minute when a job is first used.

A call that ran but whose entry could not be written answers ``BackendError`` saying so.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel

from libdsec import BackendError, DSecError, JobNotFound, SandboxStateError
from libdsec.protocol import JobEntry, JobInfo, JobList, JobLog, SandboxInfo

from .. import settings
from .auth import Caller
from .projects import JobRow, ProjectStore

log = logging.getLogger("dsec.apiserver.jobs")

DEFAULT_RETENTION_S: float = settings.Settings.job_retention_s
PRUNE_EVERY_S = 60.0
# A create that finds its key claimed by one under way waits this long for it at most.
PENDING_WAIT_S = 600.0
# File writes of a job keep their bytes in the log up to this size (replay writes them again).
MAX_LOGGED_FILE_BYTES = 8 << 20


# How the entries of the calls that make sandboxes begin (``record`` writes "op" first).
_MAKING = ('{"op":"create"', '{"op":"create_batch"', '{"op":"clean_copy"', '{"op":"fork"')


def retention_from_env() -> float:
    """``DSEC_JOB_RETENTION_S`` (seconds a job may stay idle before it is removed), else 7 days."""
    return settings.current().job_retention_s


def digest_of(kind: str, args: BaseModel, count: int | None = None) -> str:
    text = f"{kind}\n{count}\n{args.model_dump_json()}"
    return hashlib.sha256(text.encode()).hexdigest()


def _when(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, timezone.utc)


def job_info(row: JobRow) -> JobInfo:
    return JobInfo(name=row.name, project=row.project, created_at=_when(row.created_at),
                   updated_at=_when(row.updated_at), entries=row.entries)


def file_request(path: str, mode: int, data: bytes) -> dict:
    request = {"path": path, "mode": mode, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if len(data) <= MAX_LOGGED_FILE_BYTES:
        request["data_b64"] = base64.b64encode(data).decode()
    return request


class Jobs:
    """Keys and job logs over ``projects`` (see the module docstring)."""

    def __init__(self, projects: ProjectStore, *, retention_s: float | None = None) -> None:
        self.projects = projects
        self.retention_s = retention_from_env() if retention_s is None else retention_s
        self._owners: dict[str, str] = {}  # job → project, as the store said
        self._queue: list[tuple[tuple[str, float, str], tuple[str, str, str] | None, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        self._pruned_at = float("-inf")
        self._checkpointing: Future | None = None
        # A store with blocking writes (SQLite) gets a thread for those that would wait (for
        # another writer, or a checkpoint's sync): the event loop carries every request of the
        # apiserver (docs/BENCHMARKS.md, "Job log").
        self._writer = (ThreadPoolExecutor(1, thread_name_prefix="dsec-joblog")
                        if hasattr(projects, "append_job_blocking") else None)

    # -- jobs ------------------------------------------------------------------------------

    async def check(self, caller: Caller) -> None:
        """The caller may write to its job (making it on first use); ``JobNotFound`` when the
        job is another project's."""
        job = caller.job
        if job is None:
            return
        owner = self._owners.get(job)
        if owner is None:
            await self._prune_now_and_then()
            owner = self._owners[job] = await self.projects.open_job(job, caller.project)
        if owner != caller.project:
            raise JobNotFound(f"job {job!r} belongs to another project: a job records one project's calls")

    async def _prune_now_and_then(self) -> None:
        now = time.time()
        if now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now
        await self.prune(now)

    async def prune(self, now: float | None = None) -> list[str]:
        """Remove the jobs idle past the retention limit; returns their names."""
        idle = await self.projects.jobs_idle_since((time.time() if now is None else now) - self.retention_s)
        if idle:
            await self.projects.remove_jobs(idle)
            for name in idle:
                self._owners.pop(name, None)
            log.info("job logs past retention (%gs idle) removed: %s", self.retention_s, ", ".join(idle))
        return idle

    async def _visible(self, caller: Caller, name: str) -> JobRow:
        row = await self.projects.job(name)
        if row is None:
            raise JobNotFound(f"no job log {name!r}: nothing was recorded under that name, or it was removed "
                              f"(by `dsec job rm`, or idle past the retention limit of {self.retention_s:g}s)")
        if not caller.is_root and row.project != caller.project:
            raise JobNotFound(f"job {name!r} belongs to another project")
        return row

    async def list(self, caller: Caller) -> JobList:
        rows = await self.projects.jobs(None if caller.is_root else caller.project)
        return JobList(jobs=[job_info(r) for r in rows])

    async def show(self, caller: Caller, name: str, after: int = 0) -> JobLog:
        row = await self._visible(caller, name)
        entries = [JobEntry(seq=seq, at=_when(at), **json.loads(entry))
                   for seq, at, entry in await self.projects.job_entries(name, after)]
        return JobLog(job=job_info(row), entries=entries)

    async def sandboxes_made(self, caller: Caller, name: str) -> list[str]:
        """The ids of the sandboxes the job made (its creates, batches, clean copies and forks), in
        order; ``JobNotFound`` for a job the caller may not see."""
        await self._visible(caller, name)
        ids: list[str] = []
        for _, _, text in await self.projects.job_entries(name):
            if not text.startswith(_MAKING):  # (most entries are commands: not parsed)
                continue
            entry = json.loads(text)
            result = entry.get("result")
            if entry.get("error") is not None or result is None:
                continue
            if entry["op"] == "create":
                ids.append(result["id"])
            elif entry["op"] == "create_batch":
                ids.extend(info["id"] for info in result)
            elif entry["op"] == "clean_copy":
                ids.append(result["sandbox"]["id"])
            elif entry["op"] == "fork":
                ids.extend(child["sandbox"]["id"] for child in result.get("children", []) if child.get("sandbox"))
        return list(dict.fromkeys(ids))

    async def remove(self, caller: Caller, name: str) -> None:
        await self._visible(caller, name)
        await self.projects.remove_jobs([name])
        self._owners.pop(name, None)

    # -- recording -------------------------------------------------------------------------

    async def record(self, caller: Caller, op: str, sandbox: str | None, request: dict,
                     result: Any = None, error: DSecError | None = None, settle: str | None = None,
                     result_json: str | None = None) -> None:
        """Append the entry (and settle the caller's key with ``settle``, in the same write).
        ``result_json``: the result as JSON already (a model's, say), in place of ``result``."""
        assert caller.job is not None
        entry = {"op": op, "sandbox": sandbox, "key": caller.key, "request": request, "result": result,
                 "error": error.to_wire()["error"] if error is not None else None}
        if result_json is None:
            text = json.dumps(entry, separators=(",", ":"))
        else:  # (spliced in: not parsed and written again)
            del entry["result"], entry["error"]
            text = f'{json.dumps(entry, separators=(",", ":"))[:-1]},"result":{result_json},"error":null}}'
        row = (caller.job, time.time(), text)
        settles = (self._scope(caller), caller.key, settle) if settle is not None and caller.key else None
        try:
            if self._writer is not None and not self._queue and (self._flusher is None or self._flusher.done()):
                # Nothing is waiting to be written before it: at once, if that need not wait.
                if self._write_now([row], [settles] if settles else []):
                    return
            done = asyncio.get_running_loop().create_future()
            self._queue.append((row, settles, done))
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.create_task(self._flush())
            await asyncio.shield(done)
        except DSecError as exc:
            raise BackendError(f"the call ran, but the job log {caller.job!r} could not record it: {exc}") from None

    def _write_now(self, rows: list[tuple[str, float, str]], settles: list[tuple[str, str, str]]) -> bool:
        """The rows written on the loop (True), or nothing written, for the store's writer
        would have to wait (False)."""
        try:
            written = self.projects.append_job_now(rows, settles)  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - as the request's error
            raise self._failed(exc) from None
        if written:
            self._checkpoint_now_and_then()
        return written

    def _failed(self, exc: Exception) -> DSecError:
        self._owners.clear()  # a job removed meanwhile is made again on next use
        return exc if isinstance(exc, DSecError) else BackendError(f"{type(exc).__name__}: {exc}")

    async def _flush(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            rows = [row for row, _, _ in batch]
            settles = [settle for _, settle, _ in batch if settle is not None]
            try:
                if self._writer is not None:
                    if not self._write_now(rows, settles):
                        await asyncio.get_running_loop().run_in_executor(
                            self._writer, self.projects.append_job_blocking, rows, settles)  # type: ignore[attr-defined]
                else:
                    await self.projects.append_job(rows, settles)
            except Exception as exc:  # noqa: BLE001 - each waiting request answers it
                failure = self._failed(exc)
                for _, _, done in batch:
                    if not done.done():
                        done.set_exception(failure)
                continue
            for _, _, done in batch:
                if not done.done():
                    done.set_result(None)

    def _checkpoint_now_and_then(self) -> None:
        """Checkpoint the store's WAL on the writer's thread once the writes on the loop are due one."""
        if self._checkpointing is None and self.projects.checkpoint_due:  # type: ignore[attr-defined]
            self._checkpointing = self._writer.submit(self.projects.checkpoint_blocking)  # type: ignore[attr-defined,union-attr]
            self._checkpointing.add_done_callback(self._checkpointed)

    def _checkpointed(self, done: Future) -> None:
        self._checkpointing = None
        if (exc := done.exception()) is not None:  # (the next is due after as many writes again)
            log.warning("the job log's checkpoint failed: %s: %s", type(exc).__name__, exc)

    async def recorded(self, caller: Caller, op: str, sandbox: str, request: dict,
                       call: Callable[[], Awaitable[Any]], summary: Callable[[Any], Any] | None = None) -> Any:
        """``call()``'s answer, recorded in the caller's job (if it has one) with ``request``
        (as ``summary(answer)`` when given, else as the answer's JSON)."""
        if caller.job is None:
            return await call()
        await self.check(caller)
        try:
            answer = await call()
        except DSecError as exc:
            await self.record(caller, op, sandbox, request, error=exc)
            raise
        if summary is not None:
            await self.record(caller, op, sandbox, request, summary(answer))
        elif isinstance(answer, BaseModel):
            await self.record(caller, op, sandbox, request, result_json=answer.model_dump_json())
        else:
            await self.record(caller, op, sandbox, request, answer)
        return answer

    async def mark(self, caller: Caller, sandbox: str, call: str) -> None:
        """Log ``call`` (an operation whose journal is ``made``) as made, before it runs."""
        if caller.job is None:
            return
        await self.check(caller)
        await self.record(caller, "unrecorded", sandbox, {"call": call})

    async def recorded_read(self, caller: Caller, sandbox: str, path: str, call: Callable[[], Awaitable[bytes]]) -> bytes:
        """A file read, recorded with its size, digest and (up to ``MAX_LOGGED_FILE_BYTES``) bytes."""
        def summary(data: bytes) -> dict:
            result = file_request(path, 0, data)
            del result["path"], result["mode"]
            return result

        return await self.recorded(caller, "read_file", sandbox, {"path": path}, call, summary)

    # -- creates ---------------------------------------------------------------------------

    def _scope(self, caller: Caller) -> str:
        return f"job:{caller.job}" if caller.job is not None else f"project:{caller.project}"

    async def _claim(self, caller: Caller, digest: str) -> str | None:
        """None when this create is to make its sandboxes (the key is claimed), else what the
        first create with the key made (JSON)."""
        assert caller.key is not None
        scope, deadline = self._scope(caller), time.monotonic() + PENDING_WAIT_S
        while True:
            if self._writer is not None:
                claim = self.projects.claim_key_now(scope, caller.key, digest)  # type: ignore[attr-defined]
                if claim is None:
                    claim = await asyncio.get_running_loop().run_in_executor(
                        self._writer, self.projects.claim_key_blocking, scope, caller.key, digest)  # type: ignore[attr-defined]
                self._checkpoint_now_and_then()
            else:
                claim = await self.projects.claim_key(scope, caller.key, digest)
            if claim.state == "claimed":
                return None
            if claim.state == "done":
                return claim.result
            if time.monotonic() > deadline:
                raise SandboxStateError(f"a create with idempotency key {caller.key!r} has been under way for "
                                        f"{PENDING_WAIT_S:g}s; try again later")
            await asyncio.sleep(0.05)

    async def create(self, caller: Caller, kind: str, args: BaseModel,
                     make: Callable[[], Awaitable[SandboxInfo]],
                     now: Callable[[SandboxInfo], Awaitable[SandboxInfo]]) -> SandboxInfo:
        """One sandbox: made by ``make()``, or (a key used before) the one made then, as
        ``now(info)`` finds it."""
        if caller.job is None and caller.key is None:
            return await make()
        await self.check(caller)
        request = {"kind": kind, "args": args.model_dump(mode="json")}
        if caller.key is not None:
            made = await self._claim(caller, digest_of(kind, args))
            if made is not None:
                return await now(SandboxInfo.model_validate_json(made))
        try:
            info = await make()
        except BaseException:
            if caller.key is not None:
                await self.projects.release_key(self._scope(caller), caller.key)
            raise
        made = info.model_dump_json()
        if caller.job is None:
            assert caller.key is not None
            await self.projects.settle_key(self._scope(caller), caller.key, made)
        else:  # the entry and the key's settling in one write
            try:
                await self.record(caller, "create", info.id, request, result_json=made,
                                  settle=made if caller.key is not None else None)
            except DSecError:
                if caller.key is not None:  # (a retry must find the sandbox, not wait on the claim)
                    await self.projects.settle_key(self._scope(caller), caller.key, made)
                raise
        return info

    async def create_batch(self, caller: Caller, kind: str, args: BaseModel, count: int,
                           make: Callable[[], AsyncIterator[tuple[int, SandboxInfo]]],
                           now: Callable[[SandboxInfo], Awaitable[SandboxInfo]]) -> AsyncIterator[tuple[int, SandboxInfo]]:
        """A batch's (index, info) as they come: made by ``make()``, or (a key used before) the
        ones made then."""
        if caller.job is None and caller.key is None:
            async for item in make():
                yield item
            return
        await self.check(caller)
        if caller.key is not None:
            made = await self._claim(caller, digest_of(kind, args, count))
            if made is not None:
                for index, info in enumerate(json.loads(made)):
                    yield index, await now(SandboxInfo.model_validate(info))
                return
        infos: list[SandboxInfo | None] = [None] * count
        settled = False
        try:
            async for index, info in make():
                infos[index] = info
                yield index, info
            result = [i.model_dump(mode="json") for i in infos if i is not None]
            if caller.key is not None:
                await self.projects.settle_key(self._scope(caller), caller.key, json.dumps(result))
            settled = True
            if caller.job is not None:
                await self.record(caller, "create_batch", None,
                                  {"kind": kind, "args": args.model_dump(mode="json"), "count": count}, result)
        finally:
            if not settled and caller.key is not None:
                await self.projects.release_key(self._scope(caller), caller.key)

    async def undo_batch(self, caller: Caller) -> None:
        """A batch settled under a key was undone after all (its client went away): free the key."""
        if caller.key is not None:
            await self.projects.release_key(self._scope(caller), caller.key)
