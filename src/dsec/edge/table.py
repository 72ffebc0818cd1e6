"""The edge's sandbox table: the records of a node's live sandboxes (and the last word on those
that ended), and the moves of their lifecycle that are the table's own.

``SandboxTable`` is the part of ``dsec.edge.edge.Edge`` that every other part builds on: it finds
a record for a call and asks the lifecycle table whether the call is allowed now (``_get``,
``_allowed``, ``_ready``, which resumes a paused sandbox first), counts a call in flight
(``_call``, which fails a sandbox found dead), keeps each record in the journal (``_persist``)
and drops it when the sandbox ends (``_forget``, its last info kept in ``Finished``). Here too:
get and list, stop, pause and resume, a sandbox's TTL and network rules, its security events.
A record's state changes only through ``lifecycle.move``.

The state it works on is made by ``Edge.__init__``; the names below are declared for the
reader (and the type checker). Calls stay plain method calls on the one ``Edge`` object: the
parts are mixed into its class, not objects that calls are passed through.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import TYPE_CHECKING

from libdsec import BackendError, InvalidRequest, LimitOutOfRange, SandboxNotFound, SandboxStateError, StoreUnavailable
from libdsec.protocol import PauseMode, PauseResult, SandboxInfo, SandboxKind, SandboxStatus, SecurityEvent

from ..backends.base import Capability, Handle
from . import lifecycle
from .admission import MAX_TTL_S
from .lifecycle import Action, Record

if TYPE_CHECKING:
    from pathlib import Path

    from ..backends.base import SandboxBackend
    from ..images.store import LayerStore, StoreHealth
    from .admission import Admission, WorkGate
    from .config import EdgeConfig
    from .journal import RecordJournal
    from .pool import WarmPool
    from .pty import PtyTable
    from .security import EdgeSecurity
    from .stats import EdgeStats
    from .watches import Watches

log = logging.getLogger("dsec.edge")


class SandboxTable:
    """The records of the node's sandboxes and their lifecycle's own moves (see the module)."""

    # Made by Edge.__init__.
    node: str
    config: EdgeConfig
    backends: dict[SandboxKind, SandboxBackend]
    store: LayerStore
    store_health: StoreHealth
    records_dir: Path
    journal: RecordJournal
    _records: dict[str, Record]  # the live sandboxes, by id
    _port_conns: dict[str, weakref.WeakSet[asyncio.StreamWriter]]  # a live sandbox's connections to its ports
    _finished: lifecycle.Finished  # the last info of those that ended
    _looking: dict[str, asyncio.Task]  # sandboxes whose death is being confirmed (_look_again)
    _closed: bool
    admission: Admission
    create_gate: WorkGate
    command_gate: WorkGate
    warm_pool: WarmPool
    security: EdgeSecurity
    stats: EdgeStats
    ptys: PtyTable
    watches: Watches

    # -- the records: read, asked of the lifecycle table, kept in the journal -----------------

    async def get(self, sandbox_id: str) -> SandboxInfo:
        rec = self._records.get(sandbox_id)
        if rec is not None:
            return rec.info(self.node)
        if (info := self._finished.get(sandbox_id)) is not None:
            return info
        raise SandboxNotFound(f"no sandbox {sandbox_id} on node {self.node}")

    async def list(self) -> list[SandboxInfo]:
        return [r.info(self.node) for r in self._records.values()]

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
        """The record of a sandbox that can take a call: a paused one is resumed first. Refused
        (``StoreUnavailable``) while the layer store, which its layers are read from, is away."""
        rec = self._allowed(sandbox_id, action)
        await self._check_store(rec)
        while rec.status is SandboxStatus.paused:  # the table allows the call: it resumes it
            if rec.pause_mode == "filesystem":
                raise SandboxStateError(
                    f"cannot {action.value}: sandbox {sandbox_id} is paused keeping its files only (its processes "
                    f"ended), and a call does not start it again; resume it first (sandbox.resume(), or `dsec "
                    f"resume --id {sandbox_id}`)")
            if not rec.args.auto_resume:
                raise SandboxStateError(
                    f"cannot {action.value}: sandbox {sandbox_id} is paused and was made with auto_resume=False; "
                    f"resume it first (sandbox.resume(), client.resume_sandboxes(ids=[...]), or `dsec resume --id "
                    f"{sandbox_id}`)")
            async with rec.transition:
                if rec.status is SandboxStatus.paused:
                    await self._thaw(rec)
            rec = self._allowed(sandbox_id, action)
        return rec

    async def _check_store(self, rec: Record, cached: bool = True) -> None:
        """Raise ``StoreUnavailable`` if the layer store is away, or if it was mounted again
        since ``rec`` started (its layers read through the mount that has gone)."""
        await self.store_health.check(cached)
        if rec.created_at < self.store_health.remounted_at:
            raise StoreUnavailable(
                f"sandbox {rec.id} cannot read its layers: node {self.node} read them through a mount of the "
                f"layer store {self.store_health.root} that has gone since it started (the store was mounted "
                f"again); stop it and create another")

    async def _call(self, rec: Record, coro):
        rec.calls += 1
        rec.last_active = time.time()
        try:
            return await coro
        except (BackendError, OSError) as exc:
            # The store went away since the last check (it is kept for a second): say so.
            if not isinstance(exc, StoreUnavailable):
                await self._check_store(rec, cached=False)
            raise
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

    def _persist(self, rec: Record) -> None:
        self.journal.put(rec.id, rec.to_json())

    # -- the end of a sandbox: stopped by request, or failed when found dead ------------------

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
        for writer in list(self._port_conns.pop(rec.id, ())):
            writer.close()
        self.admission.unhold(rec.id)
        self.journal.drop(rec.id)
        info = self._finished[rec.id] = rec.info(self.node)
        while len(self._finished) > self.config.finished_kept:
            self._finished.popitem(last=False)
        return info

    def _died(self, rec: Record) -> str:
        """The reason a sandbox found dead failed with: what its backend knows of why (a VM's
        console: its agent OOM-killed, its kernel panicked), if it can tell."""
        backend = self.backends[rec.kind]
        detail = backend.why_gone(rec.handle) if Capability.WATCHED in backend.capabilities else None
        return "sandbox processes died" + (f": {detail}" if detail else "")

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

    # -- pause and resume ---------------------------------------------------------------------

    async def pause(self, sandbox_id: str, mode: PauseMode = "full") -> PauseResult:
        """``full``: freeze the sandbox and push its memory out; ``filesystem``: end its
        processes and keep its files (``Reboots.halt``; its PTYs, watches and network link go
        with them). Says what it held before and after."""
        rec = self._get(sandbox_id, Action.pause)
        backend = self.backends[rec.kind]
        if mode == "filesystem":
            if Capability.REBOOT not in backend.capabilities:
                raise InvalidRequest(f"cannot pause sandbox {sandbox_id} keeping its files only: a {rec.kind.value} "
                                     "sandbox cannot start again over its files (containers can); pause it whole "
                                     "(mode='full')")
            if getattr(rec.args, "desktop", None) is not None:
                raise InvalidRequest(f"cannot pause sandbox {sandbox_id} keeping its files only: its desktop would "
                                     "not come back on resume; pause it whole (mode='full')")
        async with rec.transition:
            to = lifecycle.check(Action.pause, sandbox_id, rec.status, rec.reason)
            if rec.calls:
                raise SandboxStateError(f"cannot pause: sandbox {sandbox_id} has {rec.calls} calls in flight")
            before = backend.memory_usage(rec.handle)
            start = time.perf_counter()
            # Calls that arrive from here on find it paused and wait (on the lock) to resume it.
            lifecycle.move(rec, to)
            if mode == "filesystem":
                rec.pause_mode = "filesystem"
                await self._halt(rec)
            else:
                try:
                    await backend.pause(rec.handle)
                except BaseException:
                    if rec.status is SandboxStatus.paused:
                        lifecycle.move(rec, SandboxStatus.running)
                    raise
                rec.pause_mode = "full"
            if rec.status is not SandboxStatus.paused:  # stopped meanwhile
                raise SandboxStateError(f"sandbox {sandbox_id} was {rec.status.value} while it was being paused")
            rec.paused_at = time.time()
            self._persist(rec)
            self.stats.paused()
            return PauseResult(sandbox=rec.info(self.node), memory_before_bytes=before,
                               memory_after_bytes=backend.memory_usage(rec.handle),
                               pause_s=time.perf_counter() - start)

    async def _halt(self, rec: Record) -> None:
        """A filesystem-only pause's step (the caller holds ``rec.transition``): what the edge
        holds of the sandbox's processes goes, then they do; a failure fails the sandbox."""
        await self.ptys.close_sandbox(rec.id)
        self.watches.close_sandbox(rec.id)
        self.security.halted(rec)
        try:
            await self.backends[rec.kind].halt(rec.handle)  # type: ignore[attr-defined]  # (Capability.REBOOT)
        except Exception as exc:
            await self._fail(rec, f"a filesystem-only pause failed: {exc}")
            raise
        self._persist(rec)  # (its handle has no init now)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        rec = self._get(sandbox_id, Action.resume)
        async with rec.transition:
            lifecycle.check(Action.resume, sandbox_id, rec.status, rec.reason)
            await self._thaw(rec)
        return rec.info(self.node)

    async def _thaw(self, rec: Record) -> None:
        """Resume a paused sandbox (the caller holds ``rec.transition``); one paused keeping its
        files only starts afresh over them, its network link made again."""
        backend = self.backends[rec.kind]
        if rec.pause_mode == "filesystem":
            try:
                await backend.boot(rec.handle)  # type: ignore[attr-defined]  # (Capability.REBOOT)
                if rec.status is SandboxStatus.paused:
                    await self.security.attach(rec)
            except Exception as exc:
                await self._fail(rec, f"its start after a filesystem-only pause failed: {exc}")
                raise
        else:
            await backend.resume(rec.handle)
        if rec.status is not SandboxStatus.paused:  # stopped meanwhile: it stays so, unwritten
            raise SandboxStateError(f"sandbox {rec.id} was {rec.status.value} while it was being resumed")
        lifecycle.move(rec, SandboxStatus.running)
        rec.paused_at = None
        rec.pause_mode = None
        rec.last_active = time.time()
        self._persist(rec)
        self.stats.resumed()

    def idle_sandboxes(self, idle_s: float) -> list[tuple[SandboxKind, Handle]]:
        """(kind, handle) of the running sandboxes without a call for ``idle_s`` seconds."""
        now = time.time()
        return [(r.kind, r.handle) for r in self._records.values()
                if r.status is SandboxStatus.running and r.calls == 0 and now - r.last_active >= idle_s]

    # -- what a record holds for its sandbox: its TTL, its network rules, its security events ---

    async def set_ttl(self, sandbox_id: str, ttl_running_stop: float) -> SandboxInfo:
        rec = self._allowed(sandbox_id, Action.set_ttl)
        if not 1 <= ttl_running_stop <= MAX_TTL_S:
            raise LimitOutOfRange(f"ttl_running_stop={ttl_running_stop:g} is out of range: 1..{int(MAX_TTL_S)} seconds "
                                  f"on node {self.node}")
        rec.args = rec.args.model_copy(update={"ttl_running_stop": float(ttl_running_stop)})
        rec.last_active = time.time()
        self._persist(rec)
        return rec.info(self.node)

    async def set_network_rules(self, sandbox_id: str, network_rules: dict) -> None:
        rec = self._allowed(sandbox_id, Action.set_network_rules)
        await self.security.set_rules(rec, network_rules)
        self._persist(rec)

    async def security_events(self, sandbox_id: str) -> list[SecurityEvent]:
        """Denied actions seen in the sandbox (see dsec.isolation.events); kept after it ends."""
        await self.get(sandbox_id)  # SandboxNotFound for an id this node never had
        rec = self._records.get(sandbox_id)
        if rec is not None and rec.status is SandboxStatus.running:  # (a paused VM is not woken for it)
            await self.security.check_guest_tampering(rec)
        return self.security.list(sandbox_id)
