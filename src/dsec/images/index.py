"""The store's index: image manifests and layer references, read without scanning the store.

The manifests (``images/NAME.json``) and layer files (``layers/DIGEST.erofs``) stay the truth;
the index is a SQLite file beside them (``index/store.sqlite``) that answers what would
otherwise read every manifest or list every layer: a page of image names (by prefix, by the
role of their top layer), the layers no image refers to, and the store's totals (kept by
triggers as rows come and go, so ``stats()`` reads one row at any size). With 100,000 images a
listing or a GC read every manifest (seconds); from the index they cost a query.

Kept current by the store's own writes: ``LayerStore`` calls ``placed``/``removed`` around
each rename or unlink, under the store's ``index`` lock (every process and node sharing the
store takes it). A write made without the index (a process that died between its rename and
its index update, an older DSec on another node) is found by the directory's mtime: the index
records the ``images/`` and ``layers/`` mtimes it has seen, and a read that finds a directory
changed behind its back first reconciles it (a listing and a stat of each entry, reading only
the manifests that changed). A missing or unreadable index file is rebuilt the same way, and
``rebuild()`` (``dsec image ls --reindex``) does it on demand. (A directory's mtime has the
kernel's clock tick, a few milliseconds: a write made without the lock in the same tick as an
indexed one goes unseen until that directory changes again.)

The file is a cache of the manifests, so its commits are not synced (``synchronous=OFF``): a
process that dies mid-write leaves the previous state (SQLite's rollback journal); a damaged
file after a machine crash fails to open and is rebuilt.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from libdsec import InvalidRequest

_SCHEMA = """
CREATE TABLE IF NOT EXISTS images (
    name TEXT PRIMARY KEY, top_role TEXT NOT NULL, layers TEXT NOT NULL, size INTEGER NOT NULL,
    key TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS images_role ON images (top_role, name);
CREATE TABLE IF NOT EXISTS layers (digest TEXT PRIMARY KEY, size INTEGER NOT NULL, refs INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS layers_unused ON layers (refs) WHERE refs <= 0;
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS totals (
    one INTEGER PRIMARY KEY CHECK (one = 1), images INTEGER NOT NULL, referenced INTEGER NOT NULL,
    distinct_layers INTEGER NOT NULL, stored INTEGER NOT NULL, stored_bytes INTEGER NOT NULL);
INSERT OR IGNORE INTO totals VALUES (1, 0, 0, 0, 0, 0);
CREATE TRIGGER IF NOT EXISTS images_in AFTER INSERT ON images BEGIN
    UPDATE totals SET images = images + 1, referenced = referenced + new.size; END;
CREATE TRIGGER IF NOT EXISTS images_out AFTER DELETE ON images BEGIN
    UPDATE totals SET images = images - 1, referenced = referenced - old.size; END;
CREATE TRIGGER IF NOT EXISTS images_changed AFTER UPDATE ON images BEGIN
    UPDATE totals SET referenced = referenced - old.size + new.size; END;
CREATE TRIGGER IF NOT EXISTS layers_in AFTER INSERT ON layers BEGIN
    UPDATE totals SET distinct_layers = distinct_layers + (new.refs > 0), stored = stored + (new.size > 0),
                      stored_bytes = stored_bytes + max(new.size, 0); END;
CREATE TRIGGER IF NOT EXISTS layers_out AFTER DELETE ON layers BEGIN
    UPDATE totals SET distinct_layers = distinct_layers - (old.refs > 0), stored = stored - (old.size > 0),
                      stored_bytes = stored_bytes - max(old.size, 0); END;
CREATE TRIGGER IF NOT EXISTS layers_changed AFTER UPDATE ON layers BEGIN
    UPDATE totals SET distinct_layers = distinct_layers - (old.refs > 0) + (new.refs > 0),
                      stored = stored - (old.size > 0) + (new.size > 0),
                      stored_bytes = stored_bytes - max(old.size, 0) + max(new.size, 0); END;
"""
# Version 2: the store's totals kept by triggers (``totals``), so ``stats()`` reads one row.
_VERSION = "2"
log = logging.getLogger(__name__)
MAX_PAGE = 10_000  # images in one answer of the API when a limit is given


def page_limit(limit: str | int | None) -> int | None:
    """A page's ``limit`` as given on the wire (None: no limit); ``InvalidRequest`` if it is
    not a number from 1 to ``MAX_PAGE``."""
    if limit is None:
        return None
    try:
        n = int(limit)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_PAGE:
        raise InvalidRequest(f"bad limit {limit!r}: a number of images from 1 to {MAX_PAGE}")
    return n


@dataclass(frozen=True)
class StoreStats:
    """What the store holds: its images, the distinct layers they refer to, the layer files on
    disk and their bytes, and the bytes the images refer to (a layer counted once per image
    that refers to it). ``referenced_bytes / stored_bytes`` is what sharing layers saves."""

    images: int
    distinct_layers: int
    stored_layers: int
    stored_bytes: int
    referenced_bytes: int


def _key(st: os.stat_result) -> str:
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


def _manifest_layers(path: Path) -> tuple[list[str], list[str]]:
    """A manifest file's layers and their roles."""
    data = json.loads(path.read_bytes())
    layers = list(data["layers"])
    return layers, list(data.get("roles") or ["base"] * len(layers))


def _mtime(path: Path) -> str:
    return str(os.stat(path).st_mtime_ns)


class StoreIndex:
    """The index of one store's ``images_dir`` and ``layers_dir``. ``lock`` is the store's
    lock context (``LayerStore.locked``). Safe to use from several threads; a forked child
    opens its own connection."""

    def __init__(self, root: Path, images_dir: Path, layers_dir: Path, lock: Callable[[str], object]) -> None:
        self.path = root / "index" / "store.sqlite"
        self.images_dir, self.layers_dir = images_dir, layers_dir
        self._lock = lock
        self._db: sqlite3.Connection | None = None
        self._pid = 0
        self._mutex = threading.RLock()
        self._warned = False

    # -- the file ------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        if self._db is not None and self._pid == os.getpid():
            return self._db
        self.path.parent.mkdir(exist_ok=True)
        for attempt in (0, 1):
            db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
            try:
                db.execute("PRAGMA synchronous=OFF")
                db.executescript(_SCHEMA)
                row = db.execute("SELECT v FROM meta WHERE k='version'").fetchone()
                if row is None:
                    db.execute("INSERT OR IGNORE INTO meta VALUES ('version', ?)", (_VERSION,))
                elif row[0] != _VERSION:
                    raise sqlite3.DatabaseError(f"index version {row[0]}, this DSec writes {_VERSION}")
                break
            except sqlite3.OperationalError:
                db.close()  # locked or unreachable: not to be thrown away
                raise
            except sqlite3.DatabaseError:
                db.close()
                if attempt:
                    raise
                self.path.unlink(missing_ok=True)  # damaged or of another version: rebuilt
        self._db, self._pid = db, os.getpid()
        if row is None:  # a new index: filled now, while the store is small or empty
            self._reconcile_images()
            self._reconcile_layers()
        return db

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._mutex:
            db = self._open()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _meta(self, db: sqlite3.Connection, k: str) -> str | None:
        row = db.execute("SELECT v FROM meta WHERE k=?", (k,)).fetchone()
        return row[0] if row else None

    def _set_meta(self, db: sqlite3.Connection, k: str, v: str) -> None:
        db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (k, v))

    # -- kept current by the store's writes -------------------------------------------------

    def _placed(self, directory: Path, watermark: str, place: Callable[[], None],
                record: Callable[[sqlite3.Connection], None] | None = None) -> None:
        """Under the index lock, run ``place`` (a rename into ``directory`` or an unlink from
        it), then ``record`` the change in the index. The directory's mtime stays trusted when
        it was before: no other change slipped in unseen. An index that cannot be written is
        logged and left behind: the change is made all the same, and found by the next read."""
        with self._mutex:
            try:
                self._open()  # (a new index fills itself, under the lock taken below)
            except (sqlite3.Error, OSError) as exc:
                self._degraded(exc)
        with self._mutex, self._lock("index"):
            before = _mtime(directory)
            place()
            after = _mtime(directory)
            try:
                with self._write() as db:
                    if record is not None:
                        record(db)
                    if self._meta(db, watermark) == before:
                        self._set_meta(db, watermark, after)
            except (sqlite3.Error, OSError) as exc:
                self._degraded(exc)

    def _degraded(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("the layer store's index %s cannot be used (%s): listing and GC read every manifest",
                        self.path, exc)

    def image_put(self, name: str, layers: list[str], roles: list[str], sizes: dict[str, int],
                  place: Callable[[], None]) -> None:
        """Run ``place`` (the manifest's rename) and record the image (replacing one of its name)."""
        def record(db: sqlite3.Connection) -> None:
            key = _key(os.stat(self.images_dir / f"{name}.json"))
            self._unref(db, name)
            self._insert_image(db, name, layers, roles, sizes, key)
        self._placed(self.images_dir, "images_mtime", place, record)

    def image_removed(self, name: str, unlink: Callable[[], None]) -> None:
        self._placed(self.images_dir, "images_mtime", unlink, lambda db: self._unref(db, name))

    def layer_placed(self, digest: str, size: int, place: Callable[[], None]) -> None:
        self._placed(self.layers_dir, "layers_mtime", place, lambda db: db.execute(
            "INSERT INTO layers VALUES (?, ?, 0) ON CONFLICT (digest) DO UPDATE SET size=excluded.size", (digest, size)))

    def layer_file_placed(self, place: Callable[[], None]) -> None:
        """Run ``place``, which adds a file beside the layers that is not a layer (a DAX variant)."""
        self._placed(self.layers_dir, "layers_mtime", place)

    def layer_removed(self, digest: str, unlink: Callable[[], None]) -> None:
        self._placed(self.layers_dir, "layers_mtime", unlink,
                     lambda db: db.execute("DELETE FROM layers WHERE digest=?", (digest,)))

    def _unref(self, db: sqlite3.Connection, name: str) -> None:
        row = db.execute("SELECT layers FROM images WHERE name=?", (name,)).fetchone()
        if row is not None:
            db.executemany("UPDATE layers SET refs=refs-1 WHERE digest=?", ((d,) for d in set(json.loads(row[0]))))
            db.execute("DELETE FROM images WHERE name=?", (name,))

    def _insert_image(self, db: sqlite3.Connection, name: str, layers: list[str], roles: list[str],
                      sizes: dict[str, int], key: str) -> None:
        db.execute("INSERT INTO images VALUES (?, ?, ?, ?, ?)",
                   (name, roles[-1] if roles else "base", json.dumps(layers), sum(sizes.get(d, 0) for d in layers), key))
        # A layer the index has not seen yet (a reconcile finds its file later) is counted all the same.
        db.executemany("INSERT INTO layers VALUES (?, ?, 1) ON CONFLICT (digest) DO UPDATE SET refs=refs+1",
                       ((d, sizes.get(d, 0)) for d in set(layers)))

    # -- reconciling with the directories ------------------------------------------------------

    def _fresh(self) -> sqlite3.Connection:
        """The index, first brought up to date with any directory changed behind its back."""
        with self._mutex:
            db = self._open()
            if self._meta(db, "images_mtime") != _mtime(self.images_dir):
                self._reconcile_images()
            if self._meta(db, "layers_mtime") != _mtime(self.layers_dir):
                self._reconcile_layers()
            return db

    def _reconcile_images(self) -> None:
        with self._lock("index"), self._write() as db:
            seen = _mtime(self.images_dir)  # before listing: a change during it is seen next time
            known = dict(db.execute("SELECT name, key FROM images"))
            present: set[str] = set()
            with os.scandir(self.images_dir) as it:
                for entry in it:
                    if not entry.name.endswith(".json"):
                        continue
                    name = entry.name.removesuffix(".json")
                    try:
                        key = _key(entry.stat())
                        present.add(name)
                        if known.get(name) == key:
                            continue
                        layers, roles = _manifest_layers(Path(entry.path))
                    except (OSError, ValueError, KeyError, TypeError):
                        continue  # removed meanwhile, or not a manifest: not an image
                    self._unref(db, name)
                    self._insert_image(db, name, layers, roles, self._sizes(db, layers), key)
            for name in known.keys() - present:
                self._unref(db, name)
            self._set_meta(db, "images_mtime", seen)

    def _reconcile_layers(self) -> None:
        with self._lock("index"), self._write() as db:
            seen = _mtime(self.layers_dir)
            known = {d for (d,) in db.execute("SELECT digest FROM layers WHERE size > 0")}
            present: set[str] = set()
            with os.scandir(self.layers_dir) as it:
                for entry in it:
                    if not entry.name.endswith(".erofs"):
                        continue
                    digest = entry.name.removesuffix(".erofs")
                    present.add(digest)
                    if digest in known:
                        continue
                    try:
                        size = entry.stat().st_size
                    except OSError:
                        continue
                    db.execute("INSERT INTO layers VALUES (?, ?, 0) ON CONFLICT (digest) DO UPDATE SET size=excluded.size",
                               (digest, size))
            gone = [(d,) for d in known - present]
            db.executemany("DELETE FROM layers WHERE digest=? AND refs <= 0", gone)
            db.executemany("UPDATE layers SET size=0 WHERE digest=?", gone)  # still referenced, file gone
            self._set_meta(db, "layers_mtime", seen)

    def _sizes(self, db: sqlite3.Connection, layers: list[str]) -> dict[str, int]:
        sizes = {}
        for d in set(layers):
            row = db.execute("SELECT size FROM layers WHERE digest=?", (d,)).fetchone()
            if row is not None and row[0] > 0:
                sizes[d] = row[0]
            else:
                try:
                    sizes[d] = os.stat(self.layers_dir / f"{d}.erofs").st_size
                except OSError:
                    sizes[d] = 0
        return sizes

    # -- reads -----------------------------------------------------------------------------

    def names(self, limit: int | None = None, after: str | None = None, prefix: str | None = None,
              role: str | None = None) -> list[str]:
        """Image names in order: after ``after``, starting with ``prefix``, whose top layer has
        ``role``; at most ``limit``."""
        sql, args = "SELECT name FROM images WHERE 1", []
        if after:
            sql += " AND name > ?"
            args.append(after)
        if prefix:
            # Names are lowercase ASCII (``check_name``): '\x7f' sorts after every one of them.
            sql += " AND name >= ? AND name < ?"
            args += [prefix, prefix + "\x7f"]
        if role:
            sql += " AND top_role = ?"
            args.append(role)
        sql += " ORDER BY name"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        with self._mutex:
            try:
                return [n for (n,) in self._fresh().execute(sql, args)]
            except (sqlite3.Error, OSError) as exc:
                self._degraded(exc)
        return self._scan_names(limit, after, prefix, role)

    def count(self) -> int:
        with self._mutex:
            try:
                return self._fresh().execute("SELECT images FROM totals").fetchone()[0]
            except (sqlite3.Error, OSError) as exc:
                self._degraded(exc)
        return len(self._scan_names())

    def unreferenced_layers(self) -> list[str]:
        """Digests of layer files no image refers to, sorted."""
        with self._mutex:
            try:
                db = self._fresh()
                rows = db.execute("SELECT digest, size FROM layers INDEXED BY layers_unused WHERE refs <= 0").fetchall()
                return sorted(d for d, size in rows if size > 0)
            except (sqlite3.Error, OSError) as exc:
                self._degraded(exc)
        used = {d for layers, _ in self._scan_manifests() for d in layers}
        return sorted(d for d in self._scan_layers() if d not in used)

    def stats(self) -> StoreStats:
        with self._mutex:
            try:
                images, referenced, distinct, stored, stored_bytes = self._fresh().execute(
                    "SELECT images, referenced, distinct_layers, stored, stored_bytes FROM totals").fetchone()
                return StoreStats(images=images, distinct_layers=distinct, stored_layers=stored,
                                  stored_bytes=stored_bytes, referenced_bytes=referenced)
            except (sqlite3.Error, OSError) as exc:
                self._degraded(exc)
        manifests, files = self._scan_manifests(), self._scan_layers()
        referenced = sum(files.get(d, 0) for layers, _ in manifests for d in layers)
        return StoreStats(images=len(manifests), distinct_layers=len({d for layers, _ in manifests for d in layers}),
                          stored_layers=len(files), stored_bytes=sum(files.values()), referenced_bytes=referenced)

    # -- without the index: what reading every manifest answers -----------------------------

    def _scan_names(self, limit: int | None = None, after: str | None = None, prefix: str | None = None,
                    role: str | None = None) -> list[str]:
        out = []
        for name in sorted(p.removesuffix(".json") for p in os.listdir(self.images_dir) if p.endswith(".json")):
            if (after and name <= after) or (prefix and not name.startswith(prefix)):
                continue
            if role:
                try:
                    roles = _manifest_layers(self.images_dir / f"{name}.json")[1]
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                if (roles[-1] if roles else "base") != role:
                    continue
            out.append(name)
            if limit is not None and len(out) >= limit:
                break
        return out

    def _scan_manifests(self) -> list[tuple[list[str], list[str]]]:
        out = []
        for name in self._scan_names():
            try:
                out.append(_manifest_layers(self.images_dir / f"{name}.json"))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    def _scan_layers(self) -> dict[str, int]:
        out = {}
        with os.scandir(self.layers_dir) as it:
            for entry in it:
                if entry.name.endswith(".erofs"):
                    try:
                        out[entry.name.removesuffix(".erofs")] = entry.stat().st_size
                    except OSError:
                        continue
        return out

    def rebuild(self) -> None:
        """Forget the index and build it again from the directories."""
        with self._mutex, self._lock("index"):
            self.close()
            self.path.unlink(missing_ok=True)
        self.count()

    def close(self) -> None:
        with self._mutex:
            if self._db is not None and self._pid == os.getpid():
                self._db.close()
            self._db = None
