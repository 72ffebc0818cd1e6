"""Named snapshots: ``Snapshots``, the part of ``dsec.edge.edge.Edge`` that takes, finds and
removes them, and starts sandboxes from them.

One call, two modes. ``filesystem``: the sandbox's writable layer, scrubbed (``pack_diff``'s
path), becomes a layer on top of its image's: every kind. ``full``: its memory and devices as
well (the backend's ``snapshot``, where it has ``Capability.SNAPSHOT``: microVMs), whose files
live in that memory. Either way the snapshot gets an image of its own in the layer store
(``snapshots.image_name``: for ``full``, the source's layers), so its layers outlive the
source's image and no layer GC takes them, and a record in the catalogue
(``dsec.images.snapshots``), which outlives the sandbox and the node's restarts.

Run args naming a snapshot (``snapshot=`` id or name) start from it (``start_point``): its
image, and for a ``full`` one its memory, restored on the node that holds it. A snapshot
starts sandboxes of its own kind; one that sandboxes started from still run cannot be removed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from datetime import datetime, timezone

from libdsec import BackendError, DSecError, ImageNotFound, InvalidRequest, SandboxStateError, SnapshotConflict, SnapshotNotFound
from libdsec.protocol import DSecContainerRunArgs, SandboxKind, SandboxStatus, Snapshot, SnapshotMode

from ..backends.base import Capability
from ..images import snapshots
from ..images.snapshots import Kept, SnapshotCatalog
from ..images.store import Image
from .lifecycle import Action
from .table import SandboxTable

log = logging.getLogger("dsec.edge")

# The states in which a sandbox holds the snapshot it was started from.
_HOLDING = (SandboxStatus.creating, SandboxStatus.running, SandboxStatus.paused, SandboxStatus.stopping)


class Snapshots(SandboxTable):
    """Takes, lists, removes and starts from named snapshots (see the module)."""

    catalog: SnapshotCatalog  # made by Edge.__init__, over the edge's layer store

    def default_mode(self, kind: SandboxKind) -> SnapshotMode:
        """``full`` where the kind's backend keeps memory, else ``filesystem``."""
        backend = self.backends.get(kind)
        return "full" if backend is not None and Capability.SNAPSHOT in backend.capabilities else "filesystem"

    async def snapshot(self, sandbox_id: str, mode: SnapshotMode | None = None, name: str | None = None) -> Snapshot:
        """Keep the running sandbox's state as a snapshot (it runs on afterwards)."""
        rec = self._allowed(sandbox_id, Action.snapshot)
        await self._check_store(rec)  # a snapshot is kept in the store
        backend = self.backends[rec.kind]
        mode = mode or self.default_mode(rec.kind)
        if mode == "full" and Capability.SNAPSHOT not in backend.capabilities:
            raise InvalidRequest(f"a {rec.kind.value} sandbox takes no full snapshots (memory and devices: "
                                 f"microvm sandboxes only); take mode='filesystem' to keep its files")
        if mode not in ("full", "filesystem"):
            raise InvalidRequest(f"snapshot mode {mode!r} is neither 'full' nor 'filesystem'")
        if name is not None:
            snapshots.check_name(name)
        if self._closed:
            raise SandboxStateError(f"edge {self.node} is shutting down")
        try:
            return await self._take(rec, backend, mode, name)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise BackendError(f"cannot snapshot {rec.id}: no space left on the disk of {exc.filename or self.store.root} "
                               f"(ENOSPC); nothing was kept") from None

    async def _take(self, rec, backend, mode: SnapshotMode, name: str | None) -> Snapshot:
        snap_id = self.catalog.begin(self.node, name)
        image_made = memory = None
        try:
            start = time.perf_counter()
            if mode == "full":
                meta = await self._call(rec, backend.snapshot(rec.handle))
                memory, layer, size, memory_mb = meta["id"], None, meta["size_bytes"], meta["memory_mb"]
                self.catalog.note_memory(snap_id, self.node, rec.kind.value, memory)
                layers, roles = rec.image.layers, rec.image.roles
            else:
                self.security.check_tampering(rec)
                await self.security.check_guest_tampering(rec)
                layer = (await self._call(rec, backend.pack_diff(rec.handle))).digest
                size, memory_mb = self.store.layer_size(layer), None
                layers, roles = rec.image.layers + (layer,), rec.image.roles + ("snapshot",)
            image = Image(name=snapshots.image_name(snap_id), layers=layers, roles=roles, env=rec.image.env,
                          workdir=rec.image.workdir, user=rec.image.user, parent=rec.image.name,
                          setuid=rec.image.setuid, start_cmd=rec.image.start_cmd, ready_cmd=rec.image.ready_cmd)
            image_made = self.store.put_image(image).name
            snap = Snapshot(id=snap_id, name=name, mode=mode, kind=rec.kind.value, sandbox_id=rec.id, node=self.node,
                            project=rec.project, image=image.name, source_image=rec.image.name, layer=layer,
                            size_bytes=size, memory_mb=memory_mb, save_s=time.perf_counter() - start,
                            created_at=datetime.now(timezone.utc))
            self.catalog.commit(Kept(snap, memory))
        except BaseException:
            self._undo_snapshot(snap_id, name, image_made, rec.kind, memory)
            raise
        return snap

    def _undo_snapshot(self, snap_id: str, name: str | None, image: str | None, kind: SandboxKind,
                       memory: str | None) -> None:
        """Remove what a snapshot that failed (or was cut short) had made."""
        if image is not None:
            with contextlib.suppress(OSError, DSecError):
                self.store.remove_image(image)
        if memory is not None:
            self._drop_memory(kind, memory)
        self.catalog.abandon(snap_id, name)

    def _drop_memory(self, kind: SandboxKind | str, memory: str) -> None:
        try:
            backend = self.backends.get(SandboxKind(kind))
        except ValueError:  # a kind this node does not know: nothing of it is here
            return
        delete = getattr(backend, "delete_snapshot", None)
        if delete is not None:
            with contextlib.suppress(OSError, DSecError):
                delete(memory)

    def clear_pending_snapshots(self) -> None:
        """On start: what snapshots this node was taking when it stopped (a crash) had made."""
        for snap_id in self.catalog.pending_of(self.node):
            log.info("removing snapshot %s, cut short when the edge stopped", snap_id)
            if (made := self.catalog.pending_memory(snap_id)) is not None:
                self._drop_memory(*made)
            for name in self.catalog.names_of(snap_id):
                self.catalog.abandon(snap_id, name)
            with contextlib.suppress(OSError, DSecError):
                self.store.remove_image(snapshots.image_name(snap_id))
            self.catalog.abandon(snap_id, None)
        # (Memory files still being written when it stopped: the backend's recover removes them.)

    def clear_unheld_memory(self) -> None:
        """On start, after ``clear_pending_snapshots``: the memory snapshots on this node that no
        snapshot record holds. A fork's own is removed once its children are up, and a full
        snapshot's is recorded just after it is saved: an edge killed in between left it."""
        # Read from every record's text: a record that cannot be read (the store away) keeps
        # all memory, rather than have what it holds taken for unheld.
        try:
            records = [path.read_text() for path in self.catalog.dir.glob("s*.json")]
        except OSError as exc:
            log.warning("cannot read the snapshot records (%s): memory snapshots left as they are", exc)
            return
        if not self.catalog.dir.is_dir():
            return
        for kind, backend in self.backends.items():
            listing = getattr(backend, "memory_snapshots", None)
            if listing is None:
                continue
            try:
                found = listing()
            except OSError as exc:
                log.warning("cannot list the %s memory snapshots: %s", kind.value, exc)
                continue
            for memory in found:
                if not any(f'"{memory}"' in text for text in records):
                    log.info("removing memory snapshot %s, which no snapshot holds (a fork or a snapshot cut short)",
                             memory)
                    self._drop_memory(kind, memory)

    async def list_snapshots(self) -> list[Snapshot]:
        return [kept.snapshot for kept in self.catalog.list()]

    async def get_snapshot(self, ref: str) -> Snapshot:
        return self.catalog.get(ref).snapshot

    async def remove_snapshot(self, ref: str, users: list[str]) -> Snapshot:
        """Remove a snapshot: its record, its memory (on this node: the apiserver sends a full
        one's removal to its node) and its image. Refused while sandboxes started from it run
        (``users``: those on other nodes, as the apiserver found them; this node's own are
        looked up here)."""
        kept = self.catalog.get(ref)
        snap = kept.snapshot
        mine = [r.id for r in self._records.values() if r.args.snapshot == snap.id and r.status in _HOLDING]
        using = sorted(set(users) | set(mine))
        if using:
            raise SnapshotConflict(f"snapshot {_named(snap)} is in use by the sandboxes started from it "
                                   f"({', '.join(using)}); stop them first")
        if kept.memory is not None and snap.node != self.node:
            raise InvalidRequest(f"snapshot {_named(snap)}'s memory is on node {snap.node}, not {self.node}")
        self.catalog.remove(kept)
        if kept.memory is not None:
            self._drop_memory(snap.kind, kept.memory)
        with contextlib.suppress(ImageNotFound):
            self.store.remove_image(snap.image, in_use=frozenset(r.image.name for r in self._records.values()))
        return snap

    def start_point(self, args: DSecContainerRunArgs, kind: SandboxKind,
                    project: str = "root") -> tuple[DSecContainerRunArgs, Image, str | None]:
        """What a create of ``args`` for ``project`` starts from: (its args, with a snapshot
        resolved to its id and its image; the image; the backend's memory snapshot to restore,
        or None). A project starts from its own snapshots only (root from any)."""
        if args.snapshot is None:
            return args, self.store.resolve(args.image_ref), None
        kept = self.catalog.get(args.snapshot)
        snap = kept.snapshot
        if project != "root" and snap.project != project:
            raise SnapshotNotFound(f"no snapshot {args.snapshot!r} (neither an id nor a name of one kept in the "
                                   "layer store)")
        if snap.kind != kind.value:
            also = (f"; its image {snap.image!r} can be named as container_image by any kind"
                    if snap.mode == "filesystem" else "")
            raise InvalidRequest(f"snapshot {_named(snap)} is a {snap.mode} snapshot of a {snap.kind} sandbox: it "
                                 f"starts {snap.kind} sandboxes, not {kind.value}{also}")
        if kept.memory is not None and snap.node != self.node:
            raise InvalidRequest(f"snapshot {_named(snap)} is a full snapshot: its memory is on node {snap.node}, "
                                 f"so sandboxes start from it there, not on {self.node}")
        if args.container_image and args.image_ref not in (snap.image, snap.source_image):
            raise InvalidRequest(f"snapshot {_named(snap)} was taken of image {snap.source_image!r}; container_image "
                                 f"{args.image_ref!r} names another (leave container_image out)")
        try:
            image = self.store.resolve(snap.image)
        except ImageNotFound:
            raise SnapshotNotFound(f"snapshot {_named(snap)} has lost its image {snap.image!r} from the layer "
                                   "store; remove the snapshot") from None
        args = args.model_copy(update={"container_image": snap.image, "workspace": None, "toolkits": [],
                                       "snapshot": snap.id})
        return args, image, kept.memory

    def _check_snapshot_image(self, name: str) -> None:
        """An image that backs a snapshot goes with the snapshot (``remove_snapshot``), not alone."""
        snap_id = self.catalog.backing(name)
        if snap_id is not None:
            raise InvalidRequest(f"image {name!r} is snapshot {snap_id}'s: remove the snapshot instead")


def _named(snap: Snapshot) -> str:
    return f"{snap.id} ({snap.name})" if snap.name else snap.id
