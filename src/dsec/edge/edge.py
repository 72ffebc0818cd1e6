"""The edge: one per node. It owns the node's sandbox table and implements the node seam
(``dsec.edge.api.EdgeAPI``) over it, composing the pieces that each keep one concern:

- ``lifecycle``: the states of a sandbox and the one table of what may be done in which
  (``lifecycle.check``, asked by every method that acts on a sandbox), and its ``Record``;
- ``admission``: limits in range for this node, sandbox count, (overcommitted) memory and CPU
  within its capacity (``LimitOutOfRange`` / ``CapacityExceeded``), and what held sandboxes commit;
- ``pool``: the warm pool, sandboxes made ahead for images in demand;
- ``reaper``: the TTL reaper (``ttl_running_stop``, and ``paused_ttl_s`` for paused sandboxes);
- ``batch``: the all-or-none rule of ``create_batch``;
- ``security``: network allowlists and security events; ``journal``: the records on disk.

Pause freezes a sandbox and pushes its memory out (swap); exec and file calls on a paused
sandbox resume it first. CPU requests are weights (overcommitted, ``cpu_overcommit``);
best-effort sandboxes commit none and run under SCHED_IDLE.

Records are kept in one append-only log (``journal``); on start the edge re-adopts the
sandboxes still running and removes the remains of the rest. ``close()`` (SIGTERM) releases
what no running sandbox uses — the warm pool, unused layer mounts — and leaves running
sandboxes to be adopted.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import logging
import os
import secrets
import shlex
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Iterable
from contextlib import aclosing
from datetime import datetime, timezone
from pathlib import Path

from libdsec import (
    BackendError, CapacityExceeded, CommandTimeout, DSecError, InvalidRequest, LimitOutOfRange, Overloaded, PortUnreachable,
    ProcessNotFound, SandboxFileNotFound,
    SandboxLost, SandboxNotFound, SandboxStateError, SessionClosed,
)
from libdsec.protocol import DEFAULT_COMMAND_TIMEOUT_S, MAX_OUTPUT_BYTES_LIMIT
from libdsec.protocol import (
    BuildImageRequest,
    CleanCopyResult,
    DSecContainerRunArgs,
    DSecFnCallArgs,
    DSecMicroVMRunArgs,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    OpenPtyRequest,
    OpenWatchRequest,
    OpenSessionRequest,
    PtyInfo,
    WatchEvents,
    WatchInfo,
    ProcessInfo,
    ProcessStreamRequest,
    SessionInfo,
    StartProcessRequest,
    FnCallResult,
    ImageInfo,
    NodeInfo,
    NodeStats,
    PackDiffResult,
    PauseResult,
    SandboxInfo,
    SandboxStatus,
    SecurityEvent,
    SnapshotInfo,
)

from ..batch import Part, all_or_none, single
from ..backends.base import Capability, ExecContext, Handle, SandboxBackend, SandboxSpec, check_backend
from ..fncall.pool import FnCallPool
from ..images import carry
from ..images.store import Image, LayerStore, check_name
from ..isolation import apparmor
from ..resources import cgroups
from . import lifecycle
from .protocol import LayerUse
from .admission import MAX_TTL_S, Admission, WorkGate, memory_total_mb
from .config import EdgeConfig
from .api import new_sandbox_id
from .journal import RecordJournal
from .lifecycle import Action, Record
from .pool import WarmPool
from .reaper import TTLReaper
from .security import EdgeSecurity
from .build import ImageBuilder
from . import files, processes, sessions
from .pty import PtyTable
from .watches import Watches
from .stream import stream_bytes, stream_exec
from .stats import EdgeStats

log = logging.getLogger("dsec.edge")

# Free space a create wants where records are written (its record, crun's state, the journal's rewrites).
MIN_FREE_FOR_CREATE = 1 << 20



class Edge:
    """The node daemon's core. ``await start()`` before use; ``await close()`` at the end
    (a second ``close()`` does nothing)."""

    def __init__(
        self, config: EdgeConfig, backends: SandboxBackend | Iterable[SandboxBackend], store: LayerStore,
        fncalls: FnCallPool | None = None,
    ) -> None:
        self.config = config
        self.node = config.node
        if hasattr(backends, "kind"):
            backends = [backends]
        # One backend per sandbox kind (container, microvm, …); the first is the default.
        self.backends: dict[str, SandboxBackend] = {b.kind: b for b in backends}
        for backend in self.backends.values():
            check_backend(backend)
        self.backend = next(iter(self.backends.values()))
        self.store = store
        self.records_dir = Path(config.records_dir or Path(config.node_dir) / "records")
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.journal = RecordJournal(self.records_dir)
        self._records: dict[str, Record] = {}
        self._finished = lifecycle.Finished(config.finished_kept)
        # One command at a time per session; held only while one runs (no entry outlives it).
        self._session_locks: weakref.WeakValueDictionary[tuple[str, int], asyncio.Lock] = weakref.WeakValueDictionary()
        self.admission = Admission(config, memory_total_mb(), os.cpu_count() or 1)
        self.create_gate = WorkGate("creates", config.node, config.max_creates_running, config.max_creates_queued,
                                    config.max_queue_wait_s)
        self.command_gate = WorkGate("commands", config.node, config.max_commands_running,
                                     config.max_commands_queued, config.max_queue_wait_s)
        self.warm_pool = WarmPool(config, self.backends, self._records.__len__)
        # Batches whose sandboxes are held here until committed: id -> when they are given up
        # (None while the batch is still being made).
        self._batches: dict[str, float | None] = {}
        self.reaper = TTLReaper(config, self._records, self.stop, self._batches, sweep=self._sweep_gone)
        self._undoing: set[asyncio.Task] = set()  # failed batches being undone (close() waits for them)
        self._looking: dict[str, asyncio.Task] = {}  # sandboxes whose death is being confirmed (_look_again)
        self._closed = False
        self.security = EdgeSecurity(self.backends, config.node_dir, self._records)  # network allowlists, security events
        self.builder = ImageBuilder(self, store)  # Dockerfile builds, through this edge's own calls
        self.fncalls = fncalls  # the warm pool for stateless calls (dsec.fncall), if served here
        self.stats = EdgeStats()  # what node_stats reports
        self.ptys = PtyTable()  # commands on terminals: this process's, they end with it
        self.watches = Watches()  # directory watches (inotify): this process's, they end with it

    # -- start / close ---------------------------------------------------------------------

    async def start(self) -> None:
        records = []
        for sandbox_id, text in self.journal.load().items():
            try:
                records.append(Record.from_json(text))
            except (ValueError, KeyError) as exc:
                log.warning("dropping the unreadable record of %s: %s", sandbox_id, exc)
                self.journal.drop(sandbox_id)
        alive: set[str] = set()
        for kind, backend in self.backends.items():
            mine = [r.handle for r in records if r.kind == kind]
            alive |= {h.cid for h in await backend.recover(mine)}
        for rec in records:
            if rec.handle.cid in alive:
                self._records[rec.id] = rec
                self.admission.hold(rec.id, rec.args)
                log.debug("re-adopted running sandbox %s", rec.id)
            else:
                lifecycle.move(rec, SandboxStatus.failed, "sandbox was gone when the edge restarted")
                self._forget(rec)
        if self._records:
            log.info("re-adopted %d running sandboxes", len(self._records))
        # A crash in the middle of a pause or a pack_diff leaves its sandbox frozen while its
        # record says running (its calls would hang): thaw each one that is not paused by its
        # record (a paused one is thawed by its next call). Thawing a running one changes nothing.
        for rec in self._records.values():
            if rec.status is SandboxStatus.running:
                try:
                    await self.backends[rec.kind].resume(rec.handle)
                except (DSecError, OSError) as exc:
                    log.warning("could not thaw re-adopted sandbox %s: %s", rec.id, exc)
        if self.fncalls is not None:  # after recover, which removed the workers of an earlier run
            await self.fncalls.start()
        await self.security.start(self._records.values())
        # The sandboxes of batches never committed: whoever asked for them got none of them.
        uncommitted = [r for r in self._records.values() if r.batch is not None]
        if uncommitted:
            log.info("stopping %d sandboxes of batches not committed when the edge restarted", len(uncommitted))
            await asyncio.gather(*(self.stop(r.id, reason=f"its batch {r.batch} was not committed when the edge "
                                             "restarted") for r in uncommitted), return_exceptions=True)
        self.reaper.start()
        self.warm_pool.start()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.warm_pool.stop_filling()
        await self.reaper.close()
        await self.ptys.close_all()
        self.watches.close_all()
        await asyncio.gather(*self._undoing, return_exceptions=True)
        for task in list(self._looking.values()):
            task.cancel()
        await asyncio.gather(*self._looking.values(), return_exceptions=True)
        await self.warm_pool.close()  # after the batches' creates: it destroys what it holds
        if self.fncalls is not None:
            await self.fncalls.close()
        for backend in self.backends.values():
            backend.release_unused()
        self.security.close()
        self.journal.close()

    # -- create ----------------------------------------------------------------------------

    def _backend(self, kind: str) -> SandboxBackend:
        backend = self.backends.get(kind)
        if backend is None:
            raise InvalidRequest(
                f"sandbox kind {kind!r} is not served by node {self.node} (it serves {', '.join(self.backends)})"
            )
        return backend

    async def create(self, args: DSecContainerRunArgs, kind: str = "container", project: str = "root") -> SandboxInfo:
        async def one() -> SandboxInfo:
            async with self.create_gate.slot():
                return await self._create_one(args, kind, project)

        return await self._counted(kind, one())

    async def _counted(self, kind: str, creating: Awaitable[SandboxInfo]) -> SandboxInfo:
        """A create (alone or one of a batch's), counted: made, refused, or failed (cut short too)."""
        if not self.stats.enabled:
            return await creating
        try:
            info = await creating
        except Overloaded:
            self.stats.refused("overload")
            raise
        except CapacityExceeded:
            self.stats.refused("capacity")
            raise
        except LimitOutOfRange:
            self.stats.refused("limit")
            raise
        except (Exception, asyncio.CancelledError):
            self.stats.create_failed(kind)
            raise
        self.stats.created(kind, info.create_s or 0.0)
        return info

    async def _create_one(self, args: DSecContainerRunArgs, kind: str, project: str,
                          batch: str | None = None) -> SandboxInfo:
        if self._closed:
            raise SandboxStateError(f"edge {self.node} is shutting down")
        self._backend(kind)
        limits = self.admission.limits(args)
        self.security.check_rules(args.network_rules)
        self._check_protected(args, kind)
        rec = await self._create(args, kind, project, self.store.resolve(args.image_ref), limits, batch=batch)
        return rec.info(self.node)

    def _check_protected(self, args: DSecContainerRunArgs, kind: str) -> None:
        if args.protected_paths and Capability.PROTECTED_PATHS not in self._backend(kind).capabilities:
            raise InvalidRequest(f"a {kind} sandbox on node {self.node} cannot protect paths "
                                 f"(protected_paths is for containers and VMs)")

    async def _create(self, args: DSecContainerRunArgs, kind: str, project: str, image: Image, limits,
                      seed=None, batch: str | None = None) -> Record:
        """Admit and start a sandbox of ``image``; ``seed(handle)``, if given, runs on it before
        it counts as running (a clean copy's carried files); ``batch``: held for that batch."""
        backend = self._backend(kind)
        self._check_room()
        if args.init_user is None or args.workdir is None:  # the image's, as a Dockerfile's USER and WORKDIR
            args = args.model_copy(update={"init_user": args.init_user or image.user,
                                           "workdir": args.workdir or image.workdir})
        sandbox_id = new_sandbox_id(self.node)
        self.admission.admit(sandbox_id, args)
        now = time.time()
        rec = Record(
            id=sandbox_id, kind=kind, handle=Handle(cid="", image=image.name, layers=image.layers),
            args=args, image=image, status=SandboxStatus.creating, created_at=now, last_active=now, project=project,
            batch=batch,
        )
        self._records[sandbox_id] = rec
        # VMs (whose memory is set at boot), restores from a snapshot and sandboxes with paths
        # of their own made read-only are made to order.
        snapshot = args.snapshot if isinstance(args, DSecMicroVMRunArgs) else None
        pooled = Capability.WARM_POOL in backend.capabilities and snapshot is None and not args.protected_paths
        pool = self.warm_pool.arrive(kind, image, limits) if pooled else None
        try:
            if pool is not None:
                rec.handle, has = await self.warm_pool.take(pool, limits)
            else:
                spec = SandboxSpec(image=image.name, layers=image.layers, env=dict(image.env), limits=limits,
                                   snapshot=snapshot, protected_paths=tuple(args.protected_paths), setuid=image.setuid)
                rec.handle, has = await backend.create(f"c{secrets.token_hex(8)}", spec), None
            try:
                if has != limits:
                    await backend.apply_limits(rec.handle, limits)
                rec.uid, rec.gid = await backend.resolve_user(rec.handle, args.init_user)
                if seed is not None:
                    await seed(rec.handle)
                if args.workdir != "/":
                    await backend.make_dir(rec.handle, args.workdir, rec.uid, rec.gid)
                await self.security.attach(rec)
                self._persist_new(rec)
            except BaseException:
                self.security.forget(rec)
                await backend.destroy(rec.handle)
                with contextlib.suppress(OSError):
                    self.journal.drop(rec.id)
                raise
        except BaseException:
            del self._records[sandbox_id]
            self.admission.unhold(sandbox_id)
            raise
        finally:
            if pool is not None:
                self.warm_pool.leave(pool)
        lifecycle.move(rec, SandboxStatus.running)
        rec.last_active = time.time()
        rec.create_s = rec.last_active - now
        return rec

    def _check_room(self) -> None:
        """A sandbox is only as durable as its record: with no room for it (on the node's
        tmpfs, beside crun's state), a create is refused at once, by name, before anything is made."""
        try:
            st = os.statvfs(self.records_dir)
        except OSError:
            return
        # What any writer may still use: the root reserve (and ext4's own for its metadata) is
        # left to the host, as the disk-pressure thresholds of kubelet do.
        free = st.f_bavail * st.f_frsize
        if free < MIN_FREE_FOR_CREATE:
            raise BackendError(f"no space left on device (ENOSPC): {free >> 10} KiB free on the filesystem of "
                               f"{self.records_dir}, where sandboxes' records are written (a create wants "
                               f"{MIN_FREE_FOR_CREATE >> 10} KiB); make room there")

    def _persist_new(self, rec: Record) -> None:
        try:
            self._persist(rec)
        except OSError as exc:
            code = errno.errorcode.get(exc.errno or 0, "")
            raise BackendError(f"cannot write the record of sandbox {rec.id} to {self.records_dir}: "
                               f"{exc.strerror or exc}" + (f" ({code})" if code else "")) from exc

    async def clean_copy(self, sandbox_id: str, keep: list[str]) -> CleanCopyResult:
        """A new running sandbox from the original image's layers with only this sandbox's
        changes beneath ``keep`` (scrubbed as ``pack_diff`` scrubs; links carried as links),
        for a verdict nothing the agent did elsewhere can touch. The source is frozen while its
        changes are read and keeps running; the copy has the source's run args and project."""
        rec = self._allowed(sandbox_id, Action.clean_copy)
        if self._closed:
            raise SandboxStateError(f"edge {self.node} is shutting down")
        keep = carry.normalize_paths(keep, "keep path")
        if not keep:
            raise InvalidRequest("a clean copy needs at least one keep path")
        if "/" in keep:
            raise InvalidRequest("keep path '/' would carry all the sandbox's changes, tampering included: "
                                 "name the directories that hold the work")
        backend = self.backends[rec.kind]
        if Capability.CARRY in backend.capabilities:
            return await self._call(rec, self._clean_copy(rec, backend, keep))
        if Capability.KEPT_LAYER in backend.capabilities:
            return await self._call(rec, self._clean_copy_as_layer(rec, backend, keep))
        raise InvalidRequest(f"a {rec.kind} sandbox cannot make clean copies")

    async def _clean_copy_as_layer(self, rec: Record, backend: SandboxBackend, keep: list[str]) -> CleanCopyResult:
        """A VM's clean copy: its writable layer is in the guest, whose agent streams it out; the
        kept paths become one layer on the image's, and a new VM boots from them."""
        start = time.perf_counter()
        await self._check_kept_inside(rec, backend, keep)
        digest, done, tampered = await backend.kept_layer(rec.handle, keep)
        self.security.record_tampered(rec, tampered)
        image = Image(name=rec.image.name, layers=rec.image.layers + (digest,), roles=rec.image.roles + ("snapshot",),
                      env=rec.image.env, workdir=rec.image.workdir, user=rec.image.user, parent=rec.image.parent,
                      setuid=rec.image.setuid, start_cmd=rec.image.start_cmd, ready_cmd=rec.image.ready_cmd)
        args = (rec.args.model_copy(update={"snapshot": None})
                if isinstance(rec.args, DSecMicroVMRunArgs) and rec.args.snapshot else rec.args)
        copy = await self._create(args, rec.kind, rec.project, image, self.admission.limits(args))
        return CleanCopyResult(sandbox=copy.info(self.node), source=rec.id, keep=keep, files=done.files,
                               bytes=done.bytes, scrubbed=done.scrubbed, tampered=tampered,
                               copy_s=time.perf_counter() - start)

    async def _check_kept_inside(self, rec: Record, backend: SandboxBackend, keep: list[str]) -> None:
        """Each kept path exists, with no link on the way, as a command in the sandbox sees it.
        Only for the message: an agent that forged the answer gains nothing, since the host
        reads what it carries from the packed layer and never follows a link there."""
        for path in keep:
            script = ('p=""; for c in ' + " ".join(shlex.quote(c) for c in path.split("/") if c) + "; do "
                      'p="$p/$c"; if [ -L "$p" ]; then echo "LINK $p -> $(readlink "$p")"; exit 0; fi; '
                      '[ -e "$p" ] || { echo MISSING; exit 0; }; done; echo OK')
            ctx = ExecContext(uid=0, gid=0, workdir="/", env={**rec.image.env, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
            result = await backend.exec(rec.handle, ExecRequest(command=script, timeout=60), ctx)
            said = result.stdout.strip()
            if said == "MISSING":
                raise InvalidRequest(f"keep path {path!r} does not exist in the sandbox")
            if said.startswith("LINK "):
                raise InvalidRequest(f"keep path {path!r} passes through the symbolic link {said[5:]}: links are "
                                     f"carried as links, never followed; name a path without links")

    async def _clean_copy(self, rec: Record, backend: SandboxBackend, keep: list[str]) -> CleanCopyResult:
        start = time.perf_counter()
        tampered = self.security.check_tampering(rec)
        await backend.check_kept(rec.handle, keep)
        carried: list = []

        async def seed(handle: Handle) -> None:
            lifecycle.check(Action.clean_copy, rec.id, rec.status, rec.reason)  # not paused or stopped meanwhile
            carried.append(await backend.carry(rec.handle, handle, keep))

        copy = await self._create(rec.args, rec.kind, rec.project, rec.image, self.admission.limits(rec.args), seed=seed)
        done = carried[0]
        return CleanCopyResult(sandbox=copy.info(self.node), source=rec.id, keep=keep, files=done.files,
                               bytes=done.bytes, scrubbed=done.scrubbed, tampered=tampered,
                               copy_s=time.perf_counter() - start)

    async def create_batch(
        self, args: DSecContainerRunArgs, count: int, kind: str = "container", project: str = "root",
        batch: str | None = None,
    ) -> AsyncIterator[tuple[int, SandboxInfo]]:
        """Create ``count`` sandboxes; yields (index, info) as each comes up. All or none
        (``dsec.batch``): on the first failure (or if the consumer goes away) every sandbox
        made so far is stopped. The request is checked, whole, when the first is asked for.
        With ``batch``, they are held for it until ``commit_batch`` (see ``EdgeAPI``)."""
        self._backend(kind)
        try:
            self.admission.limits(args)
        except LimitOutOfRange:
            self.stats.refused("limit", count)
            raise
        self.security.check_rules(args.network_rules)
        self._check_protected(args, kind)
        self.store.resolve(args.image_ref)
        try:
            self.admission.fits(args, count)
            self.create_gate.check()
        except CapacityExceeded:
            self.stats.refused("capacity", count)
            raise
        except Overloaded:
            self.stats.refused("overload", count)
            raise
        if batch is not None:
            if batch in self._batches:
                raise InvalidRequest(f"batch {batch!r} is being made on node {self.node} already")
            self._batches[batch] = None

        async def undo(made: list[tuple[Part, str]]) -> None:
            await asyncio.gather(*(self.stop(sid, reason="batch create failed") for _, sid in made),
                                 return_exceptions=True)

        async def one() -> SandboxInfo:
            async with self.create_gate.slot(queue=False):  # the gate was checked for the whole batch
                return await self._create_one(args, kind, project, batch)

        parts = (single(i, lambda: self._counted(kind, one())) for i in range(count))
        complete = False
        try:
            async with aclosing(all_or_none(parts, undo, undoing=self._undoing,
                                            concurrency=self.config.batch_concurrency)) as events:
                async for item in events:
                    yield item
            complete = True
        finally:
            if batch is not None:
                if complete and batch in self._batches:
                    self._batches[batch] = time.time() + self.config.batch_commit_s
                else:
                    self._batches.pop(batch, None)

    async def commit_batch(self, batch: str) -> None:
        if self._batches.pop(batch, "gone") == "gone":
            raise SandboxLost(f"batch {batch!r} is not held on node {self.node}: its sandboxes there were stopped "
                              f"(the node restarted, or it was not committed within {self.config.batch_commit_s:g} s)")
        for rec in self._records.values():
            if rec.batch == batch:
                rec.batch = None
                self._persist(rec)

    # -- calls -----------------------------------------------------------------------------

    def _get(self, sandbox_id: str, action: Action) -> Record:
        """The record of a live sandbox (in any state); a sandbox that ended refuses ``action``."""
        rec = self._records.get(sandbox_id)
        if rec is None:
            info = self._finished.get(sandbox_id)
            if info is not None:
                raise lifecycle.refusal(action, sandbox_id, info.status, info.reason)
            raise SandboxNotFound(f"no sandbox {sandbox_id} on node {self.node}")
        return rec

    def _allowed(self, sandbox_id: str, action: Action) -> Record:
        """The record of a sandbox whose state allows ``action`` now (``lifecycle.check``)."""
        rec = self._get(sandbox_id, action)
        lifecycle.check(action, sandbox_id, rec.status, rec.reason)
        return rec

    async def _ready(self, sandbox_id: str, action: Action) -> Record:
        """The record of a sandbox that can take a call: a paused one is resumed first."""
        rec = self._allowed(sandbox_id, action)
        while rec.status is SandboxStatus.paused:  # the table allows the call: it resumes it
            async with rec.transition:
                if rec.status is SandboxStatus.paused:
                    await self._thaw(rec)
            rec = self._allowed(sandbox_id, action)
        return rec

    async def _call(self, rec: Record, coro):
        rec.calls += 1
        rec.last_active = time.time()
        try:
            return await coro
        except SandboxStateError:
            if rec.status is SandboxStatus.running:
                if not await self.backends[rec.kind].is_alive(rec.handle):
                    await self._fail(rec, self._died(rec))
                else:
                    self._look_again(rec)
            raise
        finally:
            rec.calls -= 1
            rec.last_active = time.time()

    async def _exec_context(self, sandbox_id: str, request: ExecRequest) -> tuple[Record, ExecContext]:
        rec = await self._ready(sandbox_id, Action.exec)
        if request.user is not None:
            uid, gid = await self.backends[rec.kind].resolve_user(rec.handle, request.user)
        else:
            uid, gid = rec.uid, rec.gid
        return rec, ExecContext(
            uid=uid, gid=gid, workdir=request.workdir or rec.args.workdir,
            env={**rec.image.env, **rec.args.env, **request.env},
        )

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        async with self.command_gate.slot():
            rec, ctx = await self._exec_context(sandbox_id, request)
            call = self.security.watch_exec(rec, self._call(rec, self.backends[rec.kind].exec(rec.handle, request, ctx)))
            if not self.stats.enabled:
                return await call
            start = time.perf_counter()
            try:
                return await call
            finally:
                self.stats.command(rec.kind, time.perf_counter() - start)

    async def exec_stream(self, sandbox_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        """``exec`` whose output comes as it is written (``dsec.edge.stream``)."""
        async with self.command_gate.slot():
            rec, ctx = await self._exec_context(sandbox_id, request)
            backend = self.backends[rec.kind]
            async for event in stream_exec(
                    lambda emit: self.security.watch_exec(
                        rec, self._call(rec, backend.exec_stream(rec.handle, request, ctx, emit)))):
                yield event

    # -- background processes (kept in the sandbox: dsec.edge.processes) ----------------------

    async def _manage(self, sandbox_id: str, command: str, timeout: float = 30.0,
                      stdin: str | None = None) -> ExecResult:
        """One of processes' management scripts, run as the sandbox's root."""
        rec = await self._ready(sandbox_id, Action.exec)
        ctx = ExecContext(uid=0, gid=0, workdir="/", env={**rec.image.env, **rec.args.env})
        request = ExecRequest(command=command, timeout=timeout, stdin=stdin)
        return await self._call(rec, self.backends[rec.kind].exec(rec.handle, request, ctx))

    async def start_process(self, sandbox_id: str, request: StartProcessRequest) -> ProcessInfo:
        exec_request = ExecRequest(command=processes.start_script(request.command), timeout=30.0,
                                   env=request.env, workdir=request.workdir, user=request.user)
        rec, ctx = await self._exec_context(sandbox_id, exec_request)
        result = await self._call(rec, self.backends[rec.kind].exec(rec.handle, exec_request, ctx))
        return ProcessInfo(pid=processes.started_pid(result), command=request.command[:200], running=True)

    async def start_process_stream(self, sandbox_id: str, request: StartProcessRequest) -> AsyncIterator[ExecEvent]:
        """``start_process`` and ``stream_process`` in one command in the sandbox: ``started``
        with the pid as its data, the output, then ``exit`` with the process's code."""
        exec_request = ExecRequest(command=processes.start_follow_script(request.command), timeout=24 * 3600.0,
                                   env=request.env, workdir=request.workdir, user=request.user, max_output_bytes=0)
        rec, ctx = await self._exec_context(sandbox_id, exec_request)
        backend = self.backends[rec.kind]
        started = False
        events = stream_exec(lambda emit: self._call(rec, backend.exec_stream(rec.handle, exec_request, ctx, emit)))
        async for event in processes.pid_first(events):
            if event.event == "started":
                if not event.data.isdigit():
                    raise InvalidRequest(f"cannot start the background process: {event.data[-300:]!r}")
                started = True
            elif not started and event.event == "exit" and event.result is not None:
                processes.started_pid(event.result)  # the start failed: its error, raised
            yield event

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        return processes.parse_list((await self._manage(sandbox_id, processes.list_script())).stdout)

    async def get_process(self, sandbox_id: str, pid: int) -> ProcessInfo:
        for info in await self.list_processes(sandbox_id):
            if info.pid == pid:
                return info
        processes.check(ExecResult(exit_code=processes._NO_SUCH, stdout="", stderr="", duration_s=0), pid, "find it")
        raise AssertionError("unreachable")

    async def signal_process(self, sandbox_id: str, pid: int, signal: int) -> None:
        processes.check(await self._manage(sandbox_id, processes.signal_script(pid, signal)), pid, f"signal it ({signal})")

    async def process_stdin(self, sandbox_id: str, pid: int, data: str, close: bool) -> None:
        script = processes.stdin_script(pid, write=bool(data), close=close)
        processes.check(await self._manage(sandbox_id, script, timeout=DEFAULT_COMMAND_TIMEOUT_S,
                                           stdin=data if data else None), pid, "write to its stdin")

    async def wait_process(self, sandbox_id: str, pid: int, timeout: float) -> ProcessInfo:
        try:
            processes.check(await self._manage(sandbox_id, processes.wait_script(pid), timeout=timeout), pid, "wait for it")
        except CommandTimeout:
            raise CommandTimeout(f"process {pid} still runs after {timeout:g}s (it goes on running)") from None
        return await self.get_process(sandbox_id, pid)

    async def stream_process(self, sandbox_id: str, pid: int, request: ProcessStreamRequest) -> AsyncIterator[ExecEvent]:
        """Its output from the offsets given until it ends, then ``exit`` (the exit code only)."""
        # ProcessNotFound before the start (also when the look itself could not run)
        found = processes.check(await self._manage(sandbox_id, processes.find_script(pid)), pid, "find it")
        if found.exit_code != 0:
            raise ProcessNotFound(f"cannot find background process {pid} in this sandbox (exit code "
                                  f"{found.exit_code}: {(found.stderr.strip() or found.stdout.strip())[-200:]})")
        rec = await self._ready(sandbox_id, Action.exec)
        ctx = ExecContext(uid=0, gid=0, workdir="/", env={**rec.image.env, **rec.args.env})
        follow = ExecRequest(command=processes.follow_script(pid, request.stdout_offset, request.stderr_offset),
                             timeout=request.timeout, max_output_bytes=0)
        backend = self.backends[rec.kind]
        async for event in stream_exec(lambda emit: self._call(rec, backend.exec_stream(rec.handle, follow, ctx, emit))):
            yield event

    # -- PTYs: commands on a terminal, held by this edge (dsec.edge.pty) ----------------------

    async def open_pty(self, sandbox_id: str, request: OpenPtyRequest) -> PtyInfo:
        rec, ctx = await self._exec_context(sandbox_id, ExecRequest(
            command=request.command, env=request.env, workdir=request.workdir, user=request.user))
        ctx = ExecContext(uid=ctx.uid, gid=ctx.gid, workdir=ctx.workdir, env={"TERM": "xterm-256color", **ctx.env})
        proc = await self._call(rec, self.backends[rec.kind].open_pty(rec.handle, request.command, ctx,
                                                                      request.cols, request.rows))
        pty_id = self.ptys.add(sandbox_id, proc, request.idle_timeout)
        return PtyInfo(id=pty_id, cols=request.cols, rows=request.rows)

    async def pty_input(self, sandbox_id: str, pty: int, data: bytes) -> None:
        await self.ptys.write(sandbox_id, pty, data)
        if (rec := self._records.get(sandbox_id)) is not None:
            rec.last_active = time.time()  # someone types: the sandbox is in use

    async def resize_pty(self, sandbox_id: str, pty: int, cols: int, rows: int) -> None:
        await self.ptys.resize(sandbox_id, pty, cols, rows)

    def pty_stream(self, sandbox_id: str, pty: int, encoding: str = "utf-8") -> AsyncIterator[ExecEvent]:
        return self.ptys.stream(sandbox_id, pty, encoding)

    async def close_pty(self, sandbox_id: str, pty: int) -> None:
        await self.ptys.close(sandbox_id, pty)

    # -- directory watches: inotify from the node (dsec.edge.watches) ------------------------

    async def open_watch(self, sandbox_id: str, request: OpenWatchRequest) -> WatchInfo:
        path = files.check_path(request.path)
        rec = await self._ready(sandbox_id, Action.read_file)
        backend = self.backends[rec.kind]
        if Capability.HOST_PATHS not in backend.capabilities:
            raise InvalidRequest(f"a {rec.kind} sandbox's directories cannot be watched from the node")

        def open_dir(where: str) -> int:
            return backend.open_path(rec.handle, where, os.O_RDONLY | os.O_DIRECTORY)
        rec.last_active = time.time()
        return self.watches.open(sandbox_id, path, request.recursive, open_dir)

    async def watch_events(self, sandbox_id: str, watch: int, wait: float = 0.0) -> WatchEvents:
        return await self.watches.events(sandbox_id, watch, wait)

    async def close_watch(self, sandbox_id: str, watch: int) -> None:
        self.watches.close(sandbox_id, watch)

    # -- sessions: a shell whose state persists (a background process: dsec.edge.processes) ---

    async def open_session(self, sandbox_id: str, request: OpenSessionRequest) -> SessionInfo:
        if request.shell != "sh" and (await self._as_user(sandbox_id, f"command -v {request.shell}")).exit_code != 0:
            raise InvalidRequest(f"no {request.shell} in the sandbox's image: open the session with shell='sh'")
        info = await self.start_process(sandbox_id, StartProcessRequest(
            command=processes.session_command(request.idle_timeout, request.shell), env=request.env, workdir=request.workdir,
            user=request.user))
        # A first command: the shell is up, and what it said starting is behind the next one.
        await self.session_exec(sandbox_id, info.pid, ExecRequest(command="true", timeout=30.0))
        return SessionInfo(id=info.pid)

    async def session_exec(self, sandbox_id: str, session: int, request: ExecRequest) -> ExecResult:
        return await self._session_call(sandbox_id, session, request, None)

    async def session_exec_stream(self, sandbox_id: str, session: int, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        await self._session_alive(sandbox_id, session)  # errors before the start are raised
        async for event in stream_exec(lambda emit: self._session_call(sandbox_id, session, request, emit)):
            yield event

    async def interrupt_session(self, sandbox_id: str, session: int) -> None:
        """Ctrl-C: SIGINT to what runs in the session (its shell reads on)."""
        await self._session_alive(sandbox_id, session)
        await self.signal_process(sandbox_id, session, 2)

    async def close_session(self, sandbox_id: str, session: int) -> None:
        """End its shell and all it started; closing a closed one does nothing."""
        try:
            await self.signal_process(sandbox_id, session, 9)
        except (SandboxStateError, ProcessNotFound):
            pass

    async def _session_alive(self, sandbox_id: str, session: int) -> ProcessInfo:
        try:
            info = await self.get_process(sandbox_id, session)
        except ProcessNotFound:
            raise ProcessNotFound(f"no session {session} in sandbox {sandbox_id}") from None
        if not info.running:
            raise SessionClosed(self._session_end(session, info))
        return info

    async def _session_ended(self, sandbox_id: str, session: int) -> None:
        """Its shell is gone: ``SessionClosed`` naming why, once its supervisor recorded the exit."""
        info = None
        for _ in range(250):
            try:
                info = await self.get_process(sandbox_id, session)
            except ProcessNotFound:
                raise ProcessNotFound(f"no session {session} in sandbox {sandbox_id}") from None
            if info.exit_code is not None and info.exit_code != -1:
                break  # (-1: its shell is gone and the supervisor has not recorded the exit yet)
            await asyncio.sleep(0.02)
        raise SessionClosed(self._session_end(session, info))

    def _session_end(self, session: int, info: ProcessInfo) -> str:
        why = {137: "it was closed, or idle past its idle_timeout"}.get(info.exit_code or 0, "its shell exited")
        return f"session {session} has ended: {why} (exit code {info.exit_code}); open a new one"

    async def _session_call(self, sandbox_id: str, session: int, request: ExecRequest, emit) -> ExecResult:
        async with self.command_gate.slot():
            return await self._session_command(sandbox_id, session, request, emit)

    async def _session_command(self, sandbox_id: str, session: int, request: ExecRequest, emit) -> ExecResult:
        if request.env or request.workdir or request.user or request.stdin is not None:
            raise InvalidRequest("a session's command runs in its shell, as that shell is: no env, workdir, user "
                                 "or stdin of its own (use export, cd, su in the command)")
        rec = await self._ready(sandbox_id, Action.exec)
        backend = self.backends[rec.kind]
        ctx = ExecContext(uid=0, gid=0, workdir="/", env={**rec.image.env, **rec.args.env})
        nonce = secrets.token_hex(8)
        run = ExecRequest(command=processes.session_run_script(session, nonce, stream=emit is not None),
                          timeout=request.timeout,
                          stdin=processes.session_input(request.command),
                          max_output_bytes=request.max_output_bytes)
        lock = self._session_locks.get((sandbox_id, session))
        if lock is None:
            lock = self._session_locks[(sandbox_id, session)] = asyncio.Lock()
        async with lock:  # one command at a time: they share the shell
            try:
                result = None
                if emit is None and sessions.applies(backend):
                    try:
                        result = await self._call(rec, sessions.run(backend, rec.handle, session, nonce, request))
                    except sessions.Missing:
                        raise ProcessNotFound(f"no session {session} in sandbox {sandbox_id}") from None
                    except sessions.Dead:
                        await self._session_ended(sandbox_id, session)
                if result is None:
                    call = backend.exec(rec.handle, run, ctx) if emit is None else backend.exec_stream(rec.handle, run, ctx, emit)
                    result = await self._call(rec, call)
            except CommandTimeout:
                after = await self._manage(sandbox_id, processes.interrupt_script(session, nonce))
                if after.exit_code == processes._SESSION_DEAD:
                    raise SessionClosed(self._session_end(session, await self.get_process(sandbox_id, session))) from None
                raise CommandTimeout(
                    f"command timed out after {request.timeout:g}s and was interrupted (as Ctrl-C would); "
                    + {0: "the session goes on",
                       3: "it ignored that, and its processes were killed; the session goes on"}.get(
                        after.exit_code, "it ignored that and could not be killed: the session is busy")) from None
        if result.exit_code in (processes._NO_SUCH, processes._SESSION_DEAD):
            await self._session_alive(sandbox_id, session)  # (raises: a command's own 91 or 94 passes)
        return result

    # -- file trees (one command each, as the sandbox's user: dsec.edge.files) ---------------

    async def _as_user(self, sandbox_id: str, command: str, stdin: str | None = None,
                       timeout: float = 120.0) -> ExecResult:
        request = ExecRequest(command=command, stdin=stdin, timeout=timeout, max_output_bytes=MAX_OUTPUT_BYTES_LIMIT)
        rec, ctx = await self._exec_context(sandbox_id, request)
        return await self._call(rec, self.backends[rec.kind].exec(rec.handle, request, ctx))

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileEntry]:
        path = files.check_path(path)
        result = files.check(await self._as_user(sandbox_id, files.list_script(path)), "list", path)
        return files.parse_entries(result.stdout, path)

    async def stat_path(self, sandbox_id: str, path: str) -> FileEntry:
        path = files.check_path(path)
        result = files.check(await self._as_user(sandbox_id, files.stat_script(path)), "stat", path)
        entries = files.parse_entries(result.stdout, None)
        if not entries:
            raise SandboxFileNotFound(f"cannot stat {path}: no such file or directory")
        return entries[0]

    async def remove_path(self, sandbox_id: str, path: str, recursive: bool) -> None:
        path = files.check_path(path)
        if path == "/":
            raise InvalidRequest("cannot remove /: the sandbox's root stays")
        files.check(await self._as_user(sandbox_id, files.remove_script(path, recursive)), "remove", path)

    async def make_dir(self, sandbox_id: str, path: str) -> None:
        path = files.check_path(path)
        files.check(await self._as_user(sandbox_id, files.make_dir_script(path)), "make directory", path)

    async def rename_path(self, sandbox_id: str, src: str, dst: str) -> None:
        src, dst = files.check_path(src, "source"), files.check_path(dst, "destination")
        files.check(await self._as_user(sandbox_id, files.rename_script(src, dst)), "rename", f"{src} to {dst}")

    async def upload_tree(self, sandbox_id: str, path: str, data: bytes | AsyncIterator[bytes]) -> None:
        """Unpack the tar ``data`` at ``path`` (made if missing), as the sandbox's user: streamed
        into the sandbox's ``tar x`` where the backend feeds a command a stream, each member
        checked on its way (``files.TarChecker``); else held, checked, and sent in pieces."""
        path = files.check_path(path)
        limit = self.config.max_upload_bytes
        request = ExecRequest(command=files.unpack_stdin_script(path), timeout=3600.0, max_output_bytes=1 << 16)
        rec, ctx = await self._exec_context(sandbox_id, request)
        backend = self.backends[rec.kind]
        if Capability.PIPED_STDIN in backend.capabilities:
            chunks = _one_chunk(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
            checker = files.TarChecker(limit)

            async def discard(kind: str, out: bytes) -> None:
                pass
            result = await self._call(rec, backend.exec_piped(rec.handle, request, ctx, checker.checked(chunks), discard))
            files.check(result, "unpack into", path)
            return
        if not isinstance(data, (bytes, bytearray, memoryview)):
            data = await _gathered(data, limit)
        if len(data) > limit:
            raise InvalidRequest(f"tar of {len(data)} bytes is over the {limit}-byte limit")
        files.checked_tar(data)
        tmp = f"/tmp/.dsec-upload-{secrets.token_hex(8)}.tar"
        for at in range(0, max(len(data), 1), files.UPLOAD_PIECE):
            piece = base64.b64encode(data[at:at + files.UPLOAD_PIECE]).decode()
            files.check(await self._as_user(sandbox_id, files.upload_piece_script(tmp, at == 0), stdin=piece),
                        "upload to", path)
        files.check(await self._as_user(sandbox_id, files.unpack_script(tmp, path), timeout=600.0), "unpack into", path)

    async def download_tree_tar(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """``tar c`` of the tree at ``path``, its bytes as they come (the consumer's pace)."""
        path = files.check_path(path)
        await self.stat_path(sandbox_id, path)  # errors before the start are raised
        request = ExecRequest(command=files.download_tar_script(path), timeout=3600.0, max_output_bytes=1 << 16)
        rec, ctx = await self._exec_context(sandbox_id, request)
        backend = self.backends[rec.kind]
        async for chunk in stream_bytes(lambda emit: self._call(rec, backend.exec_stream(rec.handle, request, ctx, emit)),
                                        lambda result: files.check(result, "download", path)):
            yield chunk

    async def download_tree(self, sandbox_id: str, path: str) -> AsyncIterator[ExecEvent]:
        """``tar c`` of the tree at ``path``, as base64 text in stdout events, then ``exit``."""
        path = files.check_path(path)
        await self.stat_path(sandbox_id, path)  # errors before the start are raised
        request = ExecRequest(command=files.download_script(path), timeout=3600.0, max_output_bytes=0)
        rec, ctx = await self._exec_context(sandbox_id, request)
        backend = self.backends[rec.kind]
        async for event in stream_exec(lambda emit: self._call(rec, backend.exec_stream(rec.handle, request, ctx, emit))):
            yield event

    # -- ports: a TCP connection to a port inside (dsec.backends.portconn) --------------------

    async def connect_port(self, sandbox_id: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if not 1 <= port <= 65535:
            raise InvalidRequest(f"port {port} is outside 1-65535")
        rec = await self._ready(sandbox_id, Action.exec)
        backend = self.backends[rec.kind]
        if Capability.PORTS not in backend.capabilities:
            raise PortUnreachable(f"a {rec.kind} sandbox's ports cannot be reached from the node")
        return await self._call(rec, backend.connect_port(rec.handle, port))

    async def security_events(self, sandbox_id: str) -> list[SecurityEvent]:
        """Denied actions seen in the sandbox (see dsec.isolation.events); kept after it ends."""
        await self.get(sandbox_id)  # SandboxNotFound for an id this node never had
        rec = self._records.get(sandbox_id)
        if rec is not None and rec.status is SandboxStatus.running:  # (a paused VM is not woken for it)
            await self.security.check_guest_tampering(rec)
        return self.security.list(sandbox_id)

    async def set_network_rules(self, sandbox_id: str, network_rules: dict) -> None:
        rec = self._allowed(sandbox_id, Action.set_network_rules)
        await self.security.set_rules(rec, network_rules)
        self._persist(rec)

    async def set_ttl(self, sandbox_id: str, ttl_running_stop: float) -> SandboxInfo:
        rec = self._allowed(sandbox_id, Action.set_ttl)
        if not 1 <= ttl_running_stop <= MAX_TTL_S:
            raise LimitOutOfRange(f"ttl_running_stop={ttl_running_stop:g} is out of range: 1..{int(MAX_TTL_S)} seconds "
                                  f"on node {self.node}")
        rec.args = rec.args.model_copy(update={"ttl_running_stop": float(ttl_running_stop)})
        rec.last_active = time.time()
        self._persist(rec)
        return rec.info(self.node)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        rec = await self._ready(sandbox_id, Action.read_file)
        backend = self.backends[rec.kind]
        return await self._call(rec, backend.read_file(rec.handle, path, self.config.max_file_bytes))

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None:
        rec = await self._ready(sandbox_id, Action.write_file)
        if len(data) > self.config.max_file_bytes:
            raise InvalidRequest(f"file of {len(data)} bytes is over the {self.config.max_file_bytes}-byte limit")
        if not 0 <= mode <= 0o7777:
            raise InvalidRequest(f"invalid file mode {oct(mode)}")
        backend = self.backends[rec.kind]
        await self._call(rec, backend.write_file(rec.handle, path, data, mode, rec.uid, rec.gid))

    async def read_file_stream(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """The file's bytes as they are read in the sandbox (``cat`` as its root, at the
        consumer's pace: no size limit, nothing held); errors before the first chunk raised."""
        path = files.check_path(path)
        rec = await self._ready(sandbox_id, Action.read_file)
        ctx = ExecContext(uid=0, gid=0, workdir="/", env={**rec.image.env, **rec.args.env})
        request = ExecRequest(command=files.read_script(path), timeout=3600.0, max_output_bytes=1 << 16)
        backend = self.backends[rec.kind]
        async for chunk in stream_bytes(lambda emit: self._call(rec, backend.exec_stream(rec.handle, request, ctx, emit)),
                                        lambda result: files.check(result, "read", path)):
            yield chunk

    async def write_file_stream(self, sandbox_id: str, path: str, data: bytes | AsyncIterator[bytes], mode: int) -> None:
        """Write the file from its chunks as they come (a container's ``cat`` fed the stream:
        no size limit, nothing held); a new file belongs to the sandbox's user, an existing one
        keeps its owner. Where the backend feeds no stream, held up to ``max_file_bytes``."""
        path = files.check_path(path)
        if not 0 <= mode <= 0o7777:
            raise InvalidRequest(f"invalid file mode {oct(mode)}")
        rec = await self._ready(sandbox_id, Action.write_file)
        backend = self.backends[rec.kind]
        if Capability.PIPED_STDIN not in backend.capabilities:
            held = data if isinstance(data, (bytes, bytearray, memoryview)) else await _gathered(data, self.config.max_file_bytes)
            await self.write_file(sandbox_id, path, bytes(held), mode)
            return
        chunks = _one_chunk(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
        ctx = ExecContext(uid=0, gid=0, workdir="/", env={**rec.image.env, **rec.args.env})
        request = ExecRequest(command=files.write_script(path, mode, rec.uid, rec.gid), timeout=3600.0,
                              max_output_bytes=1 << 16)

        async def discard(kind: str, out: bytes) -> None:
            pass
        result = await self._call(rec, backend.exec_piped(rec.handle, request, ctx, chunks, discard))
        files.check(result, "write", path)

    # -- fncall: stateless calls in the warm pool (no record, no sandbox id) -------------------

    def _fncall_pool(self) -> FnCallPool:
        if self.fncalls is None:
            raise InvalidRequest(f"node {self.node} does not serve fncall")
        if self._closed:
            raise SandboxStateError(f"edge {self.node} is shutting down")
        return self.fncalls

    async def fncall(self, args: DSecFnCallArgs) -> FnCallResult:
        result = await self._fncall_pool().call(args)
        self.stats.fncall(result.duration_s, not result.ok)
        return result

    async def fncall_many(self, calls: list[DSecFnCallArgs]) -> list[FnCallResult]:
        results = await self._fncall_pool().call_many(calls)
        for result in results:
            self.stats.fncall(result.duration_s, not result.ok)
        return results

    async def pack_diff(self, sandbox_id: str, name: str | None = None, role: str = "snapshot") -> PackDiffResult:
        """The sandbox's changes as a new image on top of its own (it keeps running)."""
        rec = self._allowed(sandbox_id, Action.pack_diff)
        if name is not None:
            check_name(name)
            if self.store.has_image(name):
                raise InvalidRequest(f"image {name!r} exists already; pick another name")
        backend = self.backends[rec.kind]
        self.security.check_tampering(rec)
        await self.security.check_guest_tampering(rec)
        digest, scrubbed = await self._call(rec, backend.pack_diff(rec.handle))
        image = Image(
            name=name or f"snap-{digest.removeprefix('sha256-')[:16]}",
            layers=rec.image.layers + (digest,), roles=rec.image.roles + (role,),
            env=rec.image.env, workdir=rec.image.workdir, user=rec.image.user, parent=rec.image.name,
        )
        self.store.put_image(image)
        return PackDiffResult(image=image.name, layer=digest, layers=list(image.layers),
                              size_bytes=self.store.layer_size(digest), scrubbed=scrubbed)

    async def snapshot(self, sandbox_id: str) -> SnapshotInfo:
        """Save a running sandbox's memory and device state (it keeps running); restore it with
        run args that name the snapshot. Only backends with memory snapshots (microvm) can."""
        rec = self._allowed(sandbox_id, Action.snapshot)
        backend = self.backends[rec.kind]
        if Capability.SNAPSHOT not in backend.capabilities:
            raise InvalidRequest(f"a {rec.kind} sandbox takes no memory snapshots (use pack_diff)")
        meta = await self._call(rec, backend.snapshot(rec.handle))
        return SnapshotInfo(
            id=meta["id"], sandbox_id=rec.id, kind=rec.kind, node=self.node, image=rec.image.name,
            size_bytes=meta["size_bytes"], memory_mb=meta["memory_mb"], save_s=meta["save_s"],
            created_at=datetime.fromtimestamp(meta["created_at"], timezone.utc),
        )

    async def layer_use(self) -> LayerUse:
        """The image refs and layer digests this node's sandboxes hold, pooled ones included."""
        recs = list(self._records.values())
        refs = {r.image.name for r in recs}
        layers = {d for r in recs for d in r.image.layers}
        layers |= self.warm_pool.layers()
        return LayerUse(images=sorted(refs), layers=sorted(layers))

    # -- the layer store, as this node sees it -----------------------------------------------

    async def list_images(self) -> list[ImageInfo]:
        return [self.store.describe(self.store.get_image(name)) for name in self.store.image_names()]

    async def inspect_image(self, ref: str) -> ImageInfo:
        return self.store.describe(self.store.resolve(ref))

    async def remove_image(self, name: str, in_use: frozenset[str]) -> None:
        self.store.remove_image(name, in_use=frozenset(in_use))

    async def gc_layers(self, in_use: frozenset[str]) -> list[str]:
        return self.store.gc(in_use=frozenset(in_use))

    def build_image(self, build: BuildImageRequest, project: str = "root") -> AsyncIterator[ExecEvent]:
        return self.builder.build(build, project)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        rec = self._records.get(sandbox_id)
        if rec is not None:
            return rec.info(self.node)
        if (info := self._finished.get(sandbox_id)) is not None:
            return info
        raise SandboxNotFound(f"no sandbox {sandbox_id} on node {self.node}")

    async def list(self) -> list[SandboxInfo]:
        return [r.info(self.node) for r in self._records.values()]

    async def stop(self, sandbox_id: str, reason: str = "stopped by request") -> SandboxInfo:
        rec = self._records.get(sandbox_id)
        if rec is None:
            return await self.get(sandbox_id)  # already stopped: nothing to do
        to = lifecycle.check(Action.stop, sandbox_id, rec.status, rec.reason)
        if to is rec.status:
            while self._records.get(sandbox_id) is rec:  # a stop or a failure under way: wait for its end
                await asyncio.sleep(0.01)
            return await self.get(sandbox_id)
        lifecycle.move(rec, to)
        self.admission.unhold(rec.id)
        self.security.check_tampering(rec)
        await self.security.check_guest_tampering(rec)
        await self.ptys.close_sandbox(sandbox_id)
        self.watches.close_sandbox(sandbox_id)
        try:
            await self.backends[rec.kind].destroy(rec.handle)
        except Exception as exc:
            await self._fail(rec, f"stop failed: {exc}")
            raise
        lifecycle.move(rec, SandboxStatus.stopped, reason)
        return self._forget(rec)

    # -- pause and resume ------------------------------------------------------------------

    async def pause(self, sandbox_id: str) -> PauseResult:
        """Freeze the sandbox and push its memory out; says what it held before and after."""
        rec = self._get(sandbox_id, Action.pause)
        async with rec.transition:
            to = lifecycle.check(Action.pause, sandbox_id, rec.status, rec.reason)
            if rec.calls:
                raise SandboxStateError(f"cannot pause: sandbox {sandbox_id} has {rec.calls} calls in flight")
            backend = self.backends[rec.kind]
            before = backend.memory_usage(rec.handle)
            start = time.perf_counter()
            # Calls that arrive from here on find it paused and wait (on the lock) to resume it.
            lifecycle.move(rec, to)
            try:
                await backend.pause(rec.handle)
            except BaseException:
                if rec.status is SandboxStatus.paused:
                    lifecycle.move(rec, SandboxStatus.running)
                raise
            if rec.status is not SandboxStatus.paused:  # stopped meanwhile
                raise SandboxStateError(f"sandbox {sandbox_id} was {rec.status.value} while it was being paused")
            rec.paused_at = time.time()
            self._persist(rec)
            self.stats.paused()
            return PauseResult(sandbox=rec.info(self.node), memory_before_bytes=before,
                               memory_after_bytes=backend.memory_usage(rec.handle),
                               pause_s=time.perf_counter() - start)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        rec = self._get(sandbox_id, Action.resume)
        async with rec.transition:
            lifecycle.check(Action.resume, sandbox_id, rec.status, rec.reason)
            await self._thaw(rec)
        return rec.info(self.node)

    async def _thaw(self, rec: Record) -> None:
        """Resume a paused sandbox (the caller holds ``rec.transition``)."""
        await self.backends[rec.kind].resume(rec.handle)
        if rec.status is not SandboxStatus.paused:  # stopped meanwhile: it stays so, unwritten
            raise SandboxStateError(f"sandbox {rec.id} was {rec.status.value} while it was being resumed")
        lifecycle.move(rec, SandboxStatus.running)
        rec.paused_at = None
        rec.last_active = time.time()
        self._persist(rec)
        self.stats.resumed()

    def idle_sandboxes(self, idle_s: float) -> list[tuple[str, Handle]]:
        """(kind, handle) of the running sandboxes without a call for ``idle_s`` seconds."""
        now = time.time()
        return [(r.kind, r.handle) for r in self._records.values()
                if r.status is SandboxStatus.running and r.calls == 0 and now - r.last_active >= idle_s]

    def _look_again(self, rec: Record) -> None:
        """A call found the sandbox's processes gone while its init still counts as alive (a
        killed pid namespace's init takes a moment to finish dying): look again for a few
        seconds, in the background, and fail it once it is seen dead (the error answered at once)."""
        if rec.id in self._looking:
            return

        async def look() -> None:
            backend = self.backends[rec.kind]
            for _ in range(30):
                await asyncio.sleep(0.1)
                if self._records.get(rec.id) is not rec or rec.status is not SandboxStatus.running:
                    return
                if not await backend.is_alive(rec.handle):
                    await self._fail(rec, self._died(rec))
                    return

        task = asyncio.create_task(look(), name=f"dsec-look-again-{rec.id}")
        self._looking[rec.id] = task
        task.add_done_callback(lambda _: self._looking.pop(rec.id, None))

    async def _sweep_gone(self) -> None:
        """Fail the running sandboxes whose backend can tell, without a call, that they are gone
        (``why_gone``: a VM whose QEMU exited or whose agent closed its channel; a flag and a
        signal-0 each, so every reaper round)."""
        watched = {kind for kind, b in self.backends.items() if Capability.WATCHED in b.capabilities}
        if not watched:
            return
        for rec in list(self._records.values()):
            if (rec.kind in watched and rec.status is SandboxStatus.running and rec.calls == 0
                    and self.backends[rec.kind].why_gone(rec.handle) is not None
                    and self._records.get(rec.id) is rec):
                await self._fail(rec, self._died(rec))

    def _died(self, rec: Record) -> str:
        """The reason a sandbox found dead failed with: what its backend knows of why (a VM's
        console: its agent OOM-killed, its kernel panicked), if it can tell."""
        backend = self.backends[rec.kind]
        detail = backend.why_gone(rec.handle) if Capability.WATCHED in backend.capabilities else None
        return "sandbox processes died" + (f": {detail}" if detail else "")

    async def _fail(self, rec: Record, reason: str) -> None:
        if rec.status in (SandboxStatus.stopped, SandboxStatus.failed):
            return  # its end came first (a stop, or another call that found it dead), and is under way
        log.warning("sandbox %s failed: %s", rec.id, reason)
        lifecycle.move(rec, SandboxStatus.failed, reason)
        self.admission.unhold(rec.id)
        self.security.check_tampering(rec)
        await self.ptys.close_sandbox(rec.id)
        self.watches.close_sandbox(rec.id)
        try:
            await self.backends[rec.kind].destroy(rec.handle)
        finally:
            self._forget(rec)

    def _forget(self, rec: Record) -> SandboxInfo:
        """Drop the record of an ended sandbox; its last info, kept for later reads, is returned."""
        self.security.forget(rec)
        self._records.pop(rec.id, None)
        self.admission.unhold(rec.id)
        self.journal.drop(rec.id)
        info = self._finished[rec.id] = rec.info(self.node)
        while len(self._finished) > self.config.finished_kept:
            self._finished.popitem(last=False)
        return info

    def _persist(self, rec: Record) -> None:
        self.journal.put(rec.id, rec.to_json())

    async def node_info(self) -> NodeInfo:
        return NodeInfo(
            node=self.node, cgroup_version=cgroups.version(),
            runtime="; ".join([b.describe() for b in self.backends.values()]
                              + (["fncall"] if self.fncalls is not None else [])),
            sandboxes=len(self._records), memory_total_mb=self.admission.memory_total_mb,
            cpu_cores=self.admission.cpu_cores,
            layer_attach=next((v.layer_attach for b in self.backends.values() if (v := b.host_view()) is not None),
                              "file"),
            apparmor=apparmor.status(),
            **self.admission.commitments(self._records.values()),
        )

    async def node_stats(self) -> NodeStats:
        return self.stats.report(await self.node_info(), self._records.values(), self.security.events, self.warm_pool)


async def _one_chunk(data: bytes) -> AsyncIterator[bytes]:
    yield bytes(data)


async def _gathered(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    held = bytearray()
    async for chunk in chunks:
        held += chunk
        if len(held) > limit:
            raise InvalidRequest(f"tar of over {limit} bytes is over the node's {limit}-byte limit")
    return bytes(held)
