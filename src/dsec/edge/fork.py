"""Forking a live sandbox: ``Forks``, the part of ``dsec.edge.edge.Edge`` that branches one
running sandbox into many (an RL episode at step k into N continuations, one expensive set-up
shared by a group of rollouts).

What is taken of the parent is taken once, while it is frozen, and shared by every child:

- ``memory`` (backends with memory snapshots, ``Capability.SNAPSHOT``: microVMs): one snapshot
  of its memory and devices; each child is restored from it, its RAM a private (copy-on-write)
  mapping of the one snapshot file, so the children share the pages they only read. Their
  processes carry on where the parent's were. The snapshot's files are removed once the
  children are up (their mappings keep what they use; the disk is freed with the last child).
- ``filesystem`` (the others: containers, full VMs): the parent's writable layer packed into one
  read-only layer (``pack_diff``: residue such as /tmp, /run and shell histories left out,
  as the children's processes start afresh), and each child made from the image's layers plus
  that one, with a writable layer of its own: nothing is copied per child. Containers could fork
  memory only with CRIU, whose ``criu check`` fails on the kernels here: the node's info says
  so (``NodeInfo.container_memory_fork``).

A child is someone new before it counts as running (``Capability.NEW_IDENTITY``): its own
sandbox id, host name, ``/etc/machine-id`` and network (made for it as for any create), and, in
a guest restored from the parent's memory, a random number generator reseeded by its agent.
The parent runs on with its id, TTL and state untouched.

Children are made side by side (at most ``batch_concurrency`` at once) through the one create
path (``Creates._create``). All or none by default: a child that fails stops every child made,
and the fork fails with that child's error; ``all_or_none=False`` answers one entry per child.
A fork cut short (its caller went away, the edge closing) stops the children made so far; until
it answers, its children are held as a batch of their own (``Record.batch``), so an edge killed
in the middle of a fork stops them when it starts again, as it stops an uncommitted batch's.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable

from libdsec import BackendError, DSecError, InvalidRequest, LimitOutOfRange, SandboxStateError
from libdsec.protocol import (
    MAX_FORK_COUNT,
    DSecContainerRunArgs,
    ErrorBody,
    ForkChild,
    ForkKind,
    ForkResult,
    SandboxInfo,
    SandboxKind,
)

from ..backends.base import Capability, Handle, SandboxBackend
from ..images.store import Image
from .lifecycle import Action, Record
from .table import SandboxTable


def fork_kind(backend: SandboxBackend) -> ForkKind:
    """What a fork of this backend's sandboxes carries."""
    return "memory" if Capability.SNAPSHOT in backend.capabilities else "filesystem"


def child_hostname() -> str:
    """A host name of a fork's child's own (a DNS label: 6 random bytes in hex)."""
    return f"fork-{secrets.token_hex(6)}"


def _error_body(exc: BaseException) -> ErrorBody:
    if isinstance(exc, DSecError):
        return ErrorBody(**exc.to_wire()["error"])
    return ErrorBody(code=BackendError.code, message=f"{type(exc).__name__}: {exc}")


class Forks(SandboxTable):
    """Forks running sandboxes (see the module)."""

    # Creates' (mixed into Edge beside this part): the one path a sandbox is made by.
    _create: Callable[..., Awaitable[Record]]
    _counted: Callable[[SandboxKind, Awaitable[SandboxInfo]], Awaitable[SandboxInfo]]
    _undoing: set[asyncio.Task]
    _batches: dict[str, float | None]

    async def fork(self, sandbox_id: str, count: int = 1, all_or_none: bool = True,
                   ttl_running_stop: float | None = None) -> ForkResult:
        start = time.perf_counter()
        if not 1 <= count <= MAX_FORK_COUNT:
            raise LimitOutOfRange(f"a fork makes 1 to {MAX_FORK_COUNT} children, not {count}")
        rec = self._allowed(sandbox_id, Action.fork)
        await self._check_store(rec)  # its children read the parent's layers from the store
        if self._closed:
            raise SandboxStateError(f"edge {self.node} is shutting down")
        backend = self.backends[rec.kind]
        if Capability.NEW_IDENTITY not in backend.capabilities:
            raise InvalidRequest(f"a {rec.kind.value} sandbox cannot be forked here: its children could not be "
                                 "given an identity of their own")
        args = rec.args
        if ttl_running_stop is not None:
            args = args.model_copy(update={"ttl_running_stop": ttl_running_stop})
        limits = self.admission.limits(args)  # (the TTL asked in range)
        # Refused whole, before the parent is touched: too many for the node, or the node busy.
        self.admission.fits(args, count)
        self.create_gate.check()
        kind = fork_kind(backend)
        taken = time.perf_counter()
        if kind == "memory":
            meta = await self._call(rec, backend.snapshot(rec.handle))  # type: ignore[attr-defined]
            snapshot, layer, image = meta["id"], None, rec.image
            frozen_s = float(meta.get("paused_s", time.perf_counter() - taken))
            # (A restored guest keeps the read-only mounts of the parent's protected paths: they
            # are in its memory, and a restore takes none anew.)
            args = args.model_copy(update={"protected_paths": []})
        else:
            # Named by its file, not its tree (``LayerStore.add_dir``'s ``once``): the layer
            # is its children's alone, and the tree's digest was a tenth of a fork's CPU.
            packed = await self._call(rec, backend.pack_diff(rec.handle, once=True))
            layer, frozen_s, snapshot = packed.digest, packed.frozen_s, None
            image = Image(name=rec.image.name, layers=rec.image.layers + (layer,), roles=rec.image.roles + ("fork",),
                          env=rec.image.env, workdir=rec.image.workdir, user=rec.image.user, parent=rec.image.parent,
                          setuid=rec.image.setuid, start_cmd=rec.image.start_cmd, ready_cmd=rec.image.ready_cmd)
        try:
            children = await self._make_children(rec, backend, args, image, limits, count, all_or_none, snapshot)
        finally:
            if snapshot is not None:  # the children map what they use of it; nothing else does
                with contextlib.suppress(DSecError, OSError):
                    backend.delete_snapshot(snapshot)  # type: ignore[attr-defined]
        return ForkResult(parent=rec.id, kind=kind, children=children, layer=layer, snapshot=snapshot,
                          frozen_s=frozen_s, fork_s=time.perf_counter() - start)

    async def _make_children(self, parent: Record, backend: SandboxBackend, args: DSecContainerRunArgs, image: Image,
                             limits, count: int, all_or_none: bool, memory: str | None) -> list[ForkChild]:
        room = asyncio.Semaphore(max(1, self.config.batch_concurrency))
        # Held as a batch of their own until the fork answers: an edge that dies meanwhile stops
        # them when it starts again (no one was handed them), as it stops an uncommitted batch's.
        hold = f"fork-{secrets.token_hex(8)}"
        self._batches[hold] = None

        async def child() -> SandboxInfo:
            hostname = child_hostname()

            async def identity(handle: Handle) -> None:
                await backend.new_identity(handle, hostname, secrets.token_hex(16),  # type: ignore[attr-defined]
                                           secrets.token_bytes(64))

            async with room, self.create_gate.slot(queue=False):  # the gate was checked for the whole fork
                made = await self._create(args, parent.kind, parent.project, image, limits, seed=identity,
                                          hostname=hostname, batch=hold, memory=memory)
                return made.info(self.node)

        tasks = [asyncio.ensure_future(self._counted(parent.kind, child())) for _ in range(count)]
        try:
            await asyncio.wait(tasks)
        except BaseException:  # cut short: no child outlives the fork that made it
            for task in tasks:
                task.cancel()
            self._stop_children(tasks, "its fork was cut short")
            raise
        finally:
            self._batches.pop(hold, None)
        failed = [t.exception() for t in tasks if t.exception() is not None]
        if failed and all_or_none:
            await self._stop_children(tasks, "a sibling of its fork failed")
            first = next((e for e in failed if isinstance(e, DSecError)), failed[0])
            raise first  # type: ignore[misc]
        for rec in self._records.values():  # the caller's from here on
            if rec.batch == hold:
                rec.batch = None
                self._persist(rec)
        return [ForkChild(error=_error_body(t.exception())) if t.exception() is not None  # type: ignore[arg-type]
                else ForkChild(sandbox=t.result()) for t in tasks]

    def _stop_children(self, tasks: list[asyncio.Future], reason: str) -> asyncio.Task:
        """Stop every child the tasks made (once they are done), in a task ``close()`` waits for."""

        async def undo() -> None:
            await asyncio.gather(*tasks, return_exceptions=True)
            made = [t.result().id for t in tasks if not t.cancelled() and t.exception() is None]
            await asyncio.gather(*(self.stop(sid, reason=reason) for sid in made), return_exceptions=True)

        task = asyncio.ensure_future(undo())
        self._undoing.add(task)
        task.add_done_callback(self._undoing.discard)
        return task
