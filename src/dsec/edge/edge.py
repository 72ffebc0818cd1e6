"""The edge: one per node. It owns the node's sandbox table and implements the node seam
(``dsec.edge.api.EdgeAPI``) over it. ``Edge`` is one class made of parts, one module each:

- ``table``: the records, get and list, the lifecycle's moves of its own (stop, pause, resume, a
  sandbox found dead), a sandbox's TTL, network rules and security events (``SandboxTable``);
- ``create``: creates, alone or in batches, from the warm pool, and clean copies and packed
  diffs (``Creates``);
- ``snapshots``: named snapshots (full or filesystem), kept in the layer store, and what a
  create starts from (``Snapshots``);
- ``fork``: forks of a running sandbox into many children, its memory or its filesystem taken
  once and shared by them (``Forks``);
- ``inside``: commands, background processes, sessions, PTYs, directory watches, files and
  ports inside a running sandbox (``Inside``);
- ``desktop``: a sandbox's desktop, started with it, and its screenshots and input (``Desktops``);
- ``nodeinfo``: the node's info and stats, its layer store and builds, fncall (``NodeCalls``).

The parts are mixed into ``Edge`` rather than held by it, so a call (``create``, ``exec``: the
hot ones) is one method call on one object, and the parts share its state, made here. They
compose the pieces that each keep one concern:

- ``lifecycle``: the states of a sandbox and the one table of what may be done in which
  (``lifecycle.check``, asked by every method that acts on a sandbox; ``lifecycle.move``, the one
  place a record's state changes), and its ``Record``;
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
sandboxes still running and removes the remains of the rest (here: ``start``). ``close()``
(SIGTERM) releases what no running sandbox uses — the warm pool, unused layer mounts — and
leaves running sandboxes to be adopted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Iterable
from pathlib import Path

from libdsec import DSecError, StoreUnavailable
from libdsec.protocol import SandboxKind, SandboxStatus

from ..backends.base import SandboxBackend, check_backend
from ..fncall.pool import FnCallPool
from ..images.snapshots import SnapshotCatalog
from ..images.store import LayerStore, StoreHealth
from . import lifecycle
from .admission import Admission, WorkGate, memory_total_mb
from .build import ImageBuilder
from .config import EdgeConfig
from .create import Creates
from .desktop import Desktops
from .fork import Forks
from .inside import Inside
from .journal import RecordJournal
from .lifecycle import Record
from .nodeinfo import NodeCalls
from .pool import WarmPool
from .pty import PtyTable
from .reaper import TTLReaper
from .snapshots import Snapshots
from .security import EdgeSecurity
from .stats import EdgeStats
from .watches import Watches

log = logging.getLogger("dsec.edge")


class Edge(Creates, Snapshots, Forks, Inside, Desktops, NodeCalls):
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
        self.backends: dict[SandboxKind, SandboxBackend] = {SandboxKind(b.kind): b for b in backends}
        for backend in self.backends.values():
            check_backend(backend)
        self.backend = next(iter(self.backends.values()))
        self.store = store
        # Asked before creates and calls into sandboxes: a store on a shared filesystem may go away.
        self.store_health = StoreHealth(store.root, config.node, within_s=config.store_check_s)
        self.catalog = SnapshotCatalog(store)  # named snapshots, beside the images they start from
        self.records_dir = Path(config.records_dir or Path(config.node_dir) / "records")
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.journal = RecordJournal(self.records_dir)
        self._records: dict[str, Record] = {}
        self._finished = lifecycle.Finished(config.finished_kept)
        # One command at a time per session; held only while one runs (no entry outlives it).
        self._session_locks: weakref.WeakValueDictionary[tuple[str, int], asyncio.Lock] = weakref.WeakValueDictionary()
        # The connections to its ports each live sandbox has open (closed when it ends).
        self._port_conns: dict[str, weakref.WeakSet[asyncio.StreamWriter]] = {}
        self.admission = Admission(config, memory_total_mb(), os.cpu_count() or 1)
        self.create_gate = WorkGate("creates", config.node, config.max_creates_running, config.max_creates_queued,
                                    config.max_queue_wait_s)
        self.command_gate = WorkGate("commands", config.node, config.max_commands_running,
                                     config.max_commands_queued, config.max_queue_wait_s)
        self.warm_pool = WarmPool(config, self.backends, self._records.__len__)
        # Batches whose sandboxes are held here until committed: id -> when they are given up
        # (None while the batch is still being made).
        self._batches: dict[str, float | None] = {}
        self.reaper = TTLReaper(config, self._records, self.stop, self._batches, sweep=self._sweep_gone,
                                pause=self.pause)
        self._undoing: set[asyncio.Task] = set()  # failed batches being undone (close() waits for them)
        self._looking: dict[str, asyncio.Task] = {}  # sandboxes whose death is being confirmed (_look_again)
        self._closed = False
        self.security = EdgeSecurity(self.backends, config.node_dir, self._records)  # network allowlists, security events
        self.builder = ImageBuilder(self, store)  # Dockerfile builds, through this edge's own calls
        self.fncalls = fncalls  # the warm pool for stateless calls (dsec.fncall), if served here
        self.stats = EdgeStats()  # what node_stats reports
        self.ptys = PtyTable()  # commands on terminals: this process's, they end with it
        self.watches = Watches()  # directory watches (inotify): this process's, they end with it
        self._desktops = {}  # sandbox id -> the connection to its desktop agent (desktop.py)
        self._desktop_restarts = {}  # sandbox id -> the restart of its desktop, found dead
        self._desktop_connects = {}  # sandbox id -> the lock of the one call connecting to its agent

    # -- start / close ------------------------------------------------------------------------

    async def start(self) -> None:
        try:  # the store's device from now on: a mount of it made again later is told apart
            await self.store_health.check()
        except StoreUnavailable as exc:
            log.warning("%s", exc)
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
        self.clear_pending_snapshots()  # after recover, which removed unfinished memory snapshots
        self.clear_unheld_memory()  # (a fork's, when the edge died before it removed it)
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
        self.close_desktops()
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
