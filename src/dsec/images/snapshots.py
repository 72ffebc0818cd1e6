"""The snapshot catalogue: every named snapshot's record, kept in the layer store.

A snapshot (``libdsec.protocol.Snapshot``) is kept beside the images it starts from, so it
outlives its sandbox and the node's restarts, and every node sharing the store finds it:

    <store>/snapshots/<id>.json         its record (the model, and where its memory lies)
    <store>/snapshots/names/<name>      its name, claimed with O_EXCL: holds the id
    <store>/snapshots/pending/<id>      a snapshot being taken: the node and process taking
                                        it (and its memory's kind and id, once made)

Taking one is ``begin`` (the id reserved and the name claimed, both atomically on the
shared store), the work, then ``commit`` (the record written by rename, the pending mark
dropped) or ``abandon``. A record is written last, so nothing half-made is ever found by
``get``; what a crash left pending is the taking node's to clear on its next start
(``pending_of``). Its image in the store is ``image_name(id)``.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from dataclasses import dataclass

from libdsec import InvalidRequest, SnapshotConflict, SnapshotNotFound
from libdsec.protocol import SNAPSHOT_ID, Snapshot, check_snapshot_name

from .store import LayerStore


def image_name(snapshot_id: str) -> str:
    """The name of a snapshot's image in the layer store."""
    return f"snapshot-{snapshot_id}"


def check_name(name: str) -> str:
    """``check_snapshot_name`` as the platform's error (``InvalidRequest``)."""
    try:
        return check_snapshot_name(name)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


@dataclass(frozen=True)
class Kept:
    """A snapshot's record: its public model and, for a full one, its memory's id on its node."""

    snapshot: Snapshot
    memory: str | None = None


class SnapshotCatalog:
    """Snapshot records under ``<store>/snapshots`` (see the module)."""

    def __init__(self, store: LayerStore) -> None:
        self.dir = store.root / "snapshots"
        self.names_dir = self.dir / "names"
        self.pending_dir = self.dir / "pending"
        for d in (self.dir, self.names_dir, self.pending_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._tmp = store.tmp_dir

    # -- taking one -------------------------------------------------------------------------

    def begin(self, node: str, name: str | None) -> str:
        """A new snapshot id, marked pending for ``node``, with ``name`` claimed for it
        (``SnapshotConflict`` naming it if another snapshot has it)."""
        snap_id = "s" + secrets.token_hex(8)
        try:
            (self.pending_dir / snap_id).write_text(_taker(node))
        except BaseException:  # (a full disk: an empty mark would outlive the error)
            (self.pending_dir / snap_id).unlink(missing_ok=True)
            raise
        if name is not None:
            try:
                self._claim(name, snap_id)
            except BaseException:
                (self.pending_dir / snap_id).unlink(missing_ok=True)
                raise
        return snap_id

    def _claim(self, name: str, snap_id: str) -> None:
        path = self.names_dir / check_name(name)
        for _ in range(2):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._name_holder(name)
                if holder is not None:
                    raise SnapshotConflict(f"snapshot name {name!r} is taken by snapshot {holder}; pick another "
                                           "name, or remove that snapshot first") from None
                path.unlink(missing_ok=True)  # a claim whose snapshot never came to be
                continue
            with os.fdopen(fd, "w") as f:
                f.write(snap_id)
            return
        raise SnapshotConflict(f"snapshot name {name!r} is being claimed by another snapshot; pick another name")

    def _name_holder(self, name: str) -> str | None:
        """The id holding ``name``: a snapshot kept or being taken (None: a stale claim)."""
        try:
            held = (self.names_dir / name).read_text().strip()
        except OSError:
            return None
        if (self.dir / f"{held}.json").exists() or (self.pending_dir / held).exists():
            return held or None
        return None

    def note_memory(self, snap_id: str, node: str, kind: str, memory: str) -> None:
        """Mark a pending snapshot's memory as made (``kind``'s backend, id ``memory``): a crash
        before ``commit`` leaves it to be removed (``pending_memory``)."""
        (self.pending_dir / snap_id).write_text(f"{_taker(node)}\n{kind} {memory}")

    def pending_memory(self, snap_id: str) -> tuple[str, str] | None:
        """(kind, memory id) of a pending snapshot whose memory was made, else None."""
        try:
            lines = (self.pending_dir / snap_id).read_text().split("\n")
        except OSError:
            return None
        kind, _, memory = (lines[1] if len(lines) > 1 else "").partition(" ")
        return (kind, memory) if memory else None

    def commit(self, kept: Kept) -> None:
        """Write the record (atomically: it is found whole or not at all); no longer pending."""
        body = {"snapshot": kept.snapshot.model_dump(mode="json"), "memory": kept.memory}
        fd, tmp = tempfile.mkstemp(dir=self._tmp, suffix=".snapshot.json")
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, self.dir / f"{kept.snapshot.id}.json")
        (self.pending_dir / kept.snapshot.id).unlink(missing_ok=True)

    def abandon(self, snap_id: str, name: str | None) -> None:
        """Drop a snapshot that was not made: its name claim (if still its own) and its mark."""
        if name is not None and self._read_claim(name) == snap_id:
            (self.names_dir / name).unlink(missing_ok=True)
        (self.pending_dir / snap_id).unlink(missing_ok=True)

    def pending_of(self, node: str) -> list[str]:
        """The ids ``node`` began and neither committed nor abandoned, in a process that is gone
        (it crashed meanwhile). A live process's are its own: several servers on one machine
        may share a store and a node name (tests do)."""
        out = []
        for mark in self.pending_dir.iterdir():
            try:
                taker, _, pid = mark.read_text().split("\n")[0].strip().partition(" ")
            except OSError:
                continue
            if taker == node and not _alive(pid):
                out.append(mark.name)
        return out

    def names_of(self, snap_id: str) -> list[str]:
        return [p.name for p in self.names_dir.iterdir() if self._read_claim(p.name) == snap_id]

    def _read_claim(self, name: str) -> str | None:
        try:
            return (self.names_dir / name).read_text().strip()
        except OSError:
            return None

    # -- finding and removing ----------------------------------------------------------------

    def get(self, ref: str) -> Kept:
        """The snapshot of id or name ``ref`` (``SnapshotNotFound`` naming it)."""
        snap_id = ref if SNAPSHOT_ID.match(ref) else self._read_claim(ref) if _plain(ref) else None
        kept = self._load(snap_id) if snap_id else None
        if kept is None:
            raise SnapshotNotFound(f"no snapshot {ref!r} (neither an id nor a name of one kept in the layer store)")
        return kept

    def _load(self, snap_id: str) -> Kept | None:
        if not SNAPSHOT_ID.match(snap_id):
            return None
        try:
            body = json.loads((self.dir / f"{snap_id}.json").read_text())
        except FileNotFoundError:
            return None
        return Kept(Snapshot.model_validate(body["snapshot"]), body.get("memory"))

    def list(self) -> list[Kept]:
        out = []
        for path in self.dir.glob("s*.json"):
            try:
                kept = self._load(path.name.removesuffix(".json"))
            except (OSError, ValueError, KeyError):
                continue  # removed meanwhile, or not a record
            if kept is not None:
                out.append(kept)
        return sorted(out, key=lambda k: k.snapshot.created_at)

    def remove(self, kept: Kept) -> None:
        """Remove the record (nothing starts from it after), then its name."""
        (self.dir / f"{kept.snapshot.id}.json").unlink(missing_ok=True)
        if kept.snapshot.name is not None and self._read_claim(kept.snapshot.name) == kept.snapshot.id:
            (self.names_dir / kept.snapshot.name).unlink(missing_ok=True)

    def backing(self, image: str) -> str | None:
        """The snapshot whose image ``image`` is, if it is one that is kept."""
        snap_id = image.removeprefix("snapshot-")
        if snap_id != image and SNAPSHOT_ID.match(snap_id) and (self.dir / f"{snap_id}.json").exists():
            return snap_id
        return None


def _taker(node: str) -> str:
    """Who takes a snapshot: the node, and this process (``pending_of``)."""
    return f"{node} {os.getpid()}"


def _alive(pid: str) -> bool:
    """Whether process ``pid`` (of a pending mark) runs, other than this one."""
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _plain(ref: str) -> bool:
    """A reference that can be a file name here (no path in it)."""
    return bool(ref) and "/" not in ref and ref not in (".", "..") and "\0" not in ref

