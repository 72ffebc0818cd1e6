"""Making sandboxes: ``Creates``, the part of ``dsec.edge.edge.Edge`` that creates them.

A create passes, in order: the edge's gate on creates running at once (``WorkGate``), the
kind's backend, the limits in range (``admission.limits``), the network rules, the protected
paths, room for its record, the node's capacity (``admission.admit``), then either a sandbox
made ahead in the warm pool (``pool.WarmPool``) or the backend's ``create``. It counts as running
once its user is resolved, its workdir made, its network attached and its record written;
a create that fails on the way leaves nothing behind. Each create is counted (``stats``).

Here too: batches (all or none, ``dsec.batch``, held until ``commit_batch``), and what a
sandbox is made again from: a clean copy (only the changes beneath the kept paths, on the
original image) and an image of its changes (``pack_diff``). Named snapshots, and starts
from them (``start_point``), are ``dsec.edge.snapshots``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import shlex
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing

from libdsec import (
    BackendError, CapacityExceeded, DSecError, InvalidRequest, LimitOutOfRange, Overloaded, SandboxLost, SandboxStateError,
)
from libdsec.protocol import (
    CleanCopyResult,
    DSecContainerRunArgs,
    DSecMicroVMRunArgs,
    ExecRequest,
    PackDiffResult,
    SandboxInfo,
    SandboxKind,
    SandboxStatus,
)

from ..backends.base import Capability, ExecContext, Handle, SandboxBackend, SandboxSpec
from ..batch import Part, all_or_none, single
from ..images import carry
from ..images.store import Image, check_name
from . import lifecycle
from .api import new_sandbox_id
from .lifecycle import KINDS, Action, Record
from .table import SandboxTable

# Free space a create wants where records are written (its record, crun's state, the journal's rewrites).
MIN_FREE_FOR_CREATE = 1 << 20


class Creates(SandboxTable):
    """Creates sandboxes, alone, in batches, and from others (see the module)."""

    # Made by Edge.__init__: batches whose sandboxes are held here until committed (id -> when
    # they are given up; None while the batch is still being made), and failed ones being undone.
    _batches: dict[str, float | None]
    _undoing: set[asyncio.Task]

    # -- create -------------------------------------------------------------------------------

    def _backend(self, kind: SandboxKind) -> SandboxBackend:
        backend = self.backends.get(kind)
        if backend is None:
            named = kind.value if isinstance(kind, SandboxKind) else kind
            raise InvalidRequest(
                f"sandbox kind {named!r} is not served by node {self.node} (it serves {', '.join(self.backends)})"
            )
        return backend

    async def create(self, args: DSecContainerRunArgs, kind: SandboxKind = SandboxKind.container,
                     project: str = "root") -> SandboxInfo:
        kind = KINDS.get(kind, kind)  # (a kind named by its string: the enum)

        async def one() -> SandboxInfo:
            async with self.create_gate.slot():
                return await self._create_one(args, kind, project)

        return await self._counted(kind, one())

    async def _counted(self, kind: SandboxKind, creating: Awaitable[SandboxInfo]) -> SandboxInfo:
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

    async def _create_one(self, args: DSecContainerRunArgs, kind: SandboxKind, project: str,
                          batch: str | None = None) -> SandboxInfo:
        if self._closed:
            raise SandboxStateError(f"edge {self.node} is shutting down")
        self._backend(kind)
        limits = self.admission.limits(args)
        self.security.check_rules(args.network_rules)
        self._check_protected(args, kind)
        self._check_desktop(args, kind)
        if getattr(args, "desktop", None) is not None:  # its commands see the desktop
            args = args.model_copy(update={"env": {"DISPLAY": ":0", **args.env}})
        await self.store_health.check()
        try:
            args, image, memory = self.start_point(args, kind, project)
            rec = await self._create(args, kind, project, image, limits, batch=batch, memory=memory)
        except (OSError, BackendError):
            # The store went away since the last check (it is kept for a second): say so.
            await self.store_health.check(cached=False)
            raise
        if getattr(args, "desktop", None) is not None:
            try:
                await self._start_desktop(rec)
            except BaseException:
                with contextlib.suppress(DSecError, OSError):
                    await self.stop(rec.id, reason="its desktop did not start")
                raise
        return rec.info(self.node)

    def _check_protected(self, args: DSecContainerRunArgs, kind: SandboxKind) -> None:
        if args.protected_paths and Capability.PROTECTED_PATHS not in self._backend(kind).capabilities:
            raise InvalidRequest(f"a {kind.value} sandbox on node {self.node} cannot protect paths "
                                 f"(protected_paths is for containers and VMs)")

    async def _create(self, args: DSecContainerRunArgs, kind: SandboxKind, project: str, image: Image, limits,
                      seed=None, batch: str | None = None, memory: str | None = None,
                      hostname: str | None = None) -> Record:
        """Admit and start a sandbox of ``image``; ``seed(handle)``, if given, runs on it before
        it counts as running (a clean copy's carried files, a fork child's identity); ``batch``:
        held for that batch; ``memory``: the backend's memory snapshot it resumes
        (``Snapshots.start_point``, a fork's); ``hostname``: its own (made to order, not from the
        warm pool)."""
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
        snapshot = memory
        pooled = (Capability.WARM_POOL in backend.capabilities and snapshot is None and not args.protected_paths
                  and hostname is None)
        pool = self.warm_pool.arrive(kind, image, limits) if pooled else None
        try:
            if pool is not None:
                rec.handle, has = await self.warm_pool.take(pool, limits, self.store_health.remounted_at)
            else:
                spec = SandboxSpec(image=image.name, layers=image.layers, env=dict(image.env), limits=limits,
                                   snapshot=snapshot, protected_paths=tuple(args.protected_paths), setuid=image.setuid,
                                   **({"hostname": hostname} if hostname else {}))
                # Made to order, it has its limits already (``SandboxSpec.limits``: a backend sets
                # them all before ``create`` returns); setting them again cost a fork's children
                # a sixth of their create's time on the event loop (cgroup writes, the tmpfs resized).
                rec.handle, has = await backend.create(f"c{secrets.token_hex(8)}", spec), limits
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

    # -- batches: all or none (dsec.batch), held until committed ------------------------------

    async def create_batch(
        self, args: DSecContainerRunArgs, count: int, kind: SandboxKind = SandboxKind.container,
        project: str = "root", batch: str | None = None,
    ) -> AsyncIterator[tuple[int, SandboxInfo]]:
        """Create ``count`` sandboxes; yields (index, info) as each comes up. All or none
        (``dsec.batch``): on the first failure (or if the consumer goes away) every sandbox
        made so far is stopped. The request is checked, whole, when the first is asked for.
        With ``batch``, they are held for it until ``commit_batch`` (see ``EdgeAPI``)."""
        kind = KINDS.get(kind, kind)  # (a kind named by its string: the enum)
        self._backend(kind)
        try:
            self.admission.limits(args)
        except LimitOutOfRange:
            self.stats.refused("limit", count)
            raise
        self.security.check_rules(args.network_rules)
        self._check_protected(args, kind)
        await self.store_health.check()
        self.start_point(args, kind, project)
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

    # -- what a sandbox is made again from: a clean copy, an image of its changes, a memory snapshot ---

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
        raise InvalidRequest(f"a {rec.kind.value} sandbox cannot make clean copies")

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

    async def pack_diff(self, sandbox_id: str, name: str | None = None, role: str = "snapshot") -> PackDiffResult:
        """The sandbox's changes as a new image on top of its own (it keeps running)."""
        rec = self._allowed(sandbox_id, Action.pack_diff)
        await self._check_store(rec)
        if name is not None:
            check_name(name)
            if self.store.has_image(name):
                raise InvalidRequest(f"image {name!r} exists already; pick another name")
        backend = self.backends[rec.kind]
        self.security.check_tampering(rec)
        await self.security.check_guest_tampering(rec)
        packed = await self._call(rec, backend.pack_diff(rec.handle))
        digest = packed.digest
        image = Image(
            name=name or f"snap-{digest.removeprefix('sha256-')[:16]}",
            layers=rec.image.layers + (digest,), roles=rec.image.roles + (role,),
            env=rec.image.env, workdir=rec.image.workdir, user=rec.image.user, parent=rec.image.name,
        )
        self.store.put_image(image)
        return PackDiffResult(image=image.name, layer=digest, layers=list(image.layers),
                              size_bytes=self.store.layer_size(digest), scrubbed=packed.scrubbed)
