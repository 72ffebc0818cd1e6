"""The layer store and the image store.

A layer is one EROFS file named by the digest of its content (``sha256-<hex>.erofs``); identical
content is stored once. An image is an ordered list of layer digests (bottom first) plus config,
stored by name as a small JSON manifest beside the layers. Nothing here mounts anything: the
edge turns an image into mounts (see ``compose``).

Writes are atomic: a layer or manifest is built under ``tmp/`` and renamed into place, so a
half-written one is never visible. Each rename is recorded in the store's index
(``dsec.images.index``), which answers listings, GC and totals without reading every manifest.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from libdsec import BackendError, ImageNotFound, InvalidRequest, StoreUnavailable
from libdsec.protocol import ImageInfo
from . import sums
from .index import StoreIndex

log = logging.getLogger("dsec.images")

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}\Z")
# A fixed filesystem UUID keeps the EROFS bytes free of randomness.
_EROFS_UUID = "6f2a1d9e-5dec-4000-8000-000000000000"
# DAX maps a layer in 2 MiB pages: its file is padded to a multiple of that.
DAX_ALIGN = 2 << 20


class LayerBuildError(InvalidRequest):
    """A layer source was unusable (bad archive, path escaping its root, mkfs failure)."""


ROLES = ("base", "workspace", "toolkit", "step", "snapshot")


@dataclass(frozen=True)
class Image:
    """Layers bottom first, each with a role (base, workspace, toolkit, step, snapshot)."""

    name: str
    layers: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = "root"
    roles: tuple[str, ...] = ()
    parent: str | None = None
    # Its sandboxes may gain privileges through setuid programs (sudo): no no_new_privs, where
    # the backend can leave it off (a container's; its root is still the sandbox's own).
    setuid: bool = False
    # What a sandbox of it runs when it starts (in the background), and the command that says
    # it is ready (exit 0): an E2B template's start and ready commands.
    start_cmd: str | None = None
    ready_cmd: str | None = None

    def __post_init__(self) -> None:
        if not self.roles:
            object.__setattr__(self, "roles", ("base",) * len(self.layers))
        if len(self.roles) != len(self.layers):
            raise InvalidRequest(f"image {self.name!r}: {len(self.roles)} roles for {len(self.layers)} layers")

    def to_json(self) -> str:
        return json.dumps(
            {"name": self.name, "layers": list(self.layers), "roles": list(self.roles), "env": self.env,
             "workdir": self.workdir, "user": self.user, "parent": self.parent, "created_at": time.time(),
             **({"setuid": True} if self.setuid else {}),
             **({"start_cmd": self.start_cmd} if self.start_cmd else {}),
             **({"ready_cmd": self.ready_cmd} if self.ready_cmd else {})},
            indent=1,
        )

    def on_top(self, other: Image, name: str) -> Image:
        """This image with ``other``'s layers stacked above it, and ``other``'s config over its own."""
        return Image(
            name=name, layers=self.layers + other.layers, roles=self.roles + other.roles,
            env={**self.env, **other.env},
            workdir=other.workdir if other.workdir != "/" else self.workdir,
            user=other.user if other.user != "root" else self.user, setuid=self.setuid or other.setuid,
            start_cmd=other.start_cmd or self.start_cmd, ready_cmd=other.ready_cmd or self.ready_cmd,
        )


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise InvalidRequest(
            f"invalid image name {name!r}: use lowercase letters, digits, '.', '_' or '-' (max 128)"
        )
    return name


def tree_digest(root: Path, exclude: frozenset[str] = frozenset()) -> str:
    """sha256 over a directory tree's paths, metadata, xattrs and contents (walk order is sorted);
    ``exclude`` lists relative paths left out, as mkfs leaves them out.

    The order is ``os.walk``'s, top down: a directory's entries (sorted by name), then each of
    its subdirectories in turn. It is walked with ``os.scandir`` and plain strings (a pulled
    base of 12,000 files took twice as long through ``os.walk`` and ``Path``), and each file read
    by descriptor into one buffer (``open`` and a new bytes object a read cost a pulled base's
    digest a quarter more CPU, half of it the kernel's); the bytes hashed, so the digests, are
    those layers have always been named by."""
    h = hashlib.sha256()
    update = h.update
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    top = os.fspath(root)
    todo = [(top, "")]  # (directory, its path relative to root), a stack in walk order
    while todo:
        dirpath, prefix = todo.pop()
        try:
            with os.scandir(dirpath) as it:
                entries = sorted((e.name, e.path) for e in it)  # (names are unique: by name)
        except OSError:
            continue  # (as os.walk: an unreadable directory is passed over)
        subdirs = []
        for name, path in entries:
            rel = prefix + name
            if rel in exclude:
                continue
            st = os.lstat(path)
            mode = st.st_mode
            update(f"{rel}\0{mode}\0{st.st_uid}\0{st.st_gid}\0{st.st_mtime_ns}\0".encode())
            try:
                # Overlay whiteout and opaque markers live in trusted.* xattrs.
                for attr in sorted(os.listxattr(path, follow_symlinks=False)):
                    update(attr.encode() + b"=" + os.getxattr(path, attr, follow_symlinks=False) + b"\0")
            except OSError:
                pass
            if stat.S_ISLNK(mode):
                update(os.readlink(path).encode())
            elif stat.S_ISREG(mode):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    while n := os.readv(fd, (buf,)):
                        update(view[:n])
                finally:
                    os.close(fd)
            elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                update(str(st.st_rdev).encode())
            elif stat.S_ISDIR(mode):
                subdirs.append((path, rel + "/"))
            update(b"\n")
        todo.extend(reversed(subdirs))
    return "sha256-" + h.hexdigest()


class LayerStore:
    """Layers (EROFS files) and image manifests under one root directory.

    The root may sit on a shared filesystem: it holds no node-local state.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.layers_dir = self.root / "layers"
        self.images_dir = self.root / "images"
        self.tmp_dir = self.root / "tmp"
        if self.root.is_symlink() and not self.root.exists():  # a link to a store not made yet
            Path(os.path.realpath(self.root)).mkdir(parents=True, exist_ok=True)
        for d in (self.layers_dir, self.images_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        # Manifests read, by name: (inode, mtime, size) when read, and the image. Every create
        # resolves its image; a stat tells whether the file (replaced by rename, maybe from
        # another process sharing the store) is still the one read.
        self._images: dict[str, tuple[tuple[int, int, int], Image]] = {}
        # Names, layer references and totals, answered without reading every manifest.
        self.index = StoreIndex(self.root, self.images_dir, self.layers_dir, self.locked)

    # -- layers ----------------------------------------------------------------------------

    def layer_path(self, digest: str) -> Path:
        return self.layers_dir / f"{digest}.erofs"

    def has_layer(self, digest: str) -> bool:
        return self.layer_path(digest).exists()

    def add_dir(self, source: Path, exclude: frozenset[str] = frozenset(),
                read: Callable[[], None] | None = None, once: bool = False) -> str:
        """Build a layer from a directory, leaving out the relative paths in ``exclude``;
        returns its digest. Idempotent for equal content. Overlay whiteouts (0:0 character
        devices) and opaque-directory xattrs are kept, so an overlay upper becomes a layer.
        ``read`` (if given) is called, in this thread, as soon as nothing reads ``source`` any
        more: the sums and the placement that follow read only the file built (a sandbox frozen
        while its writable layer is packed is thawed there, not after them).

        ``mkfs.erofs`` runs while the tree's digest is taken (both only read the tree): on two
        cores the digest costs no time beside it (a 280 MB base: about a second each). When the
        digest names a layer the store has, the build is stopped and thrown away.

        ``once``: a layer made for one use (a fork's, shared by its children and dropped by the
        store's GC once none runs), named by its file's bytes (``sums.file_digest``) instead of
        its tree's: no second read and hash of every byte of the tree beside ``mkfs.erofs``
        (the tree digest of a fork's 50 MB was 0.1-0.17 s of the server's CPU, a tenth of the
        fork's). Equal trees then make layers of their own (``mkfs.erofs`` stamps each with
        its build time), as a fork of a parent that changed since its last one does anyway."""
        source = Path(source)
        if not source.is_dir():
            raise LayerBuildError(f"layer source {source} is not a directory")
        with self._room_for(f"a layer of {source}"):
            fd, tmp = tempfile.mkstemp(dir=self.tmp_dir, suffix=".erofs")
            os.close(fd)
            try:
                with subprocess.Popen(
                    ["mkfs.erofs", "--quiet", f"-U{_EROFS_UUID}", "--preserve-mtime",
                     *(f"--exclude-path={p}" for p in sorted(exclude)), tmp, str(source)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                ) as proc:
                    digest: str | None = None
                    if not once:
                        try:
                            digest = tree_digest(source, exclude)
                        except BaseException:
                            proc.kill()
                            raise
                        if self.layer_path(digest).exists():
                            proc.kill()
                            return digest
                    err = proc.communicate()[1]
                if read is not None:
                    read()
                if proc.returncode != 0:
                    raise LayerBuildError(f"mkfs.erofs failed for {source}: {err.strip()[:500]}")
                taken = None
                if digest is None:
                    taken = sums.take(Path(tmp))
                    digest = sums.file_digest(taken)
                    if self.layer_path(digest).exists():  # the same bytes, placed already
                        return digest
                self.place_layer(digest, Path(tmp), taken)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return digest

    @contextmanager
    def _room_for(self, what: str) -> Iterator[None]:
        """A write to the store that finds its filesystem full (or the quota spent) is a
        ``LayerBuildError`` naming the store, not an unexplained OSError; the caller's clean-up
        runs as before, so nothing half-written is kept."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise LayerBuildError(f"no space left on device ({errno.errorcode[exc.errno]}) in the layer store "
                                  f"{self.root} while writing {what}; nothing was kept: free room on the "
                                  f"store's filesystem and try again") from None

    def place_layer(self, digest: str, tmp: Path, taken: bytes | None = None) -> None:
        """Place the layer file ``tmp`` (in ``tmp_dir``) as layer ``digest``, with its sums
        beside it (``dsec.images.sums``: ``taken`` of it already, else taken now, from the
        bytes just written)."""
        final = self.layer_path(digest)
        os.chmod(tmp, 0o444)
        tmp_sums = tmp.with_suffix(sums.SUFFIX)
        try:
            tmp_sums.write_bytes(taken if taken is not None else sums.take(tmp))
            os.chmod(tmp_sums, 0o444)

            def place() -> None:  # the sums first: a layer is never there without them
                os.rename(tmp_sums, sums.path_of(final))
                os.rename(tmp, final)
            self.index.layer_placed(digest, os.stat(tmp).st_size, place)
        finally:
            tmp_sums.unlink(missing_ok=True)

    def check_layer(self, digest: str) -> Path:
        """The layer's file, once checked against its sums by what costs no read of it (its
        size, its sums file whole): else ``BackendError`` naming the layer (``dsec.images.sums``)."""
        path = self.layer_path(digest)
        try:
            problem = sums.mount_problem(path, os.stat(path).st_size)
        except FileNotFoundError:
            raise InvalidRequest(f"no layer {digest} in the store {self.root}") from None
        if problem is not None:
            raise BackendError(problem)
        return path

    def verify_layer(self, digest: str) -> list[str]:
        """The layer's file read whole against its sums: each problem found (empty: intact, or
        placed before sums were kept)."""
        path = self.layer_path(digest)
        if not path.exists():
            raise InvalidRequest(f"no layer {digest} in the store {self.root}")
        return sums.verify(path)

    def add_tar(self, tar_path: Path) -> str:
        """Build a layer from a tar archive (any compression tarfile reads), checked for escapes."""
        with tempfile.TemporaryDirectory(dir=self.tmp_dir) as work:
            root = Path(work, "root")
            root.mkdir()
            extract_tar(Path(tar_path), root)
            return self.add_dir(root)

    def layer_size(self, digest: str) -> int:
        return self.layer_path(digest).stat().st_size

    def layer_digests(self) -> list[str]:
        return sorted(p.name.removesuffix(".erofs") for p in self.layers_dir.glob("*.erofs"))

    def remove_layer(self, digest: str) -> None:
        def unlink() -> None:
            self.layer_path(digest).unlink(missing_ok=True)
            self.dax_layer_path(digest).unlink(missing_ok=True)
            sums.path_of(self.dax_layer_path(digest)).unlink(missing_ok=True)
            sums.path_of(self.layer_path(digest)).unlink(missing_ok=True)
        self.index.layer_removed(digest, unlink)

    def _remove_unheld(self, digest: str) -> bool:
        """Remove the layer unless a node holds it mounted (a shared lock on its file)."""
        try:
            fd = os.open(self.layer_path(digest), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False  # removed meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        else:
            self.remove_layer(digest)
            return True
        finally:
            os.close(fd)

    # -- DAX variants (layers mapped into VMs as persistent memory) ------------------------

    def dax_layer_path(self, digest: str) -> Path:
        return self.layers_dir / f"{digest}.dax"

    def dax_layer(self, digest: str) -> Path:
        """The layer rebuilt for DAX: uncompressed, no inline (tail-packed) data, its size a
        multiple of 2 MiB, so a VM can map it as pmem and read it in place. Made on first use
        from the layer itself (mounted read-only) and kept beside it, with sums of its own
        (``DIGEST.dax.sums``) that a node's layer cache checks what it fetches of it against."""
        source = self.check_layer(digest)
        final = self.dax_layer_path(digest)
        if not final.exists():
            # (The nodes of a shared store make it once: two made at once could place one's
            # sums beside the other's file, whose superblocks differ by their build time.)
            with self.locked(f"dax-{digest}"):
                if not final.exists():
                    self._make_dax_layer(digest, source, final)
        # Checked as a layer is before it is mounted: its size against its sums (a file cut
        # short would be mapped past its end), its sums file whole.
        if (problem := sums.mount_problem(final)) is not None:
            raise BackendError(f"{problem} (the DAX variant {final.name}: remove it, and the next microVM of the "
                               f"image makes it again)")
        return final

    def _make_dax_layer(self, digest: str, source: Path, final: Path) -> None:
        with tempfile.TemporaryDirectory(dir=self.tmp_dir) as work:
            mnt, tmp = Path(work, "mnt"), Path(work, "layer.dax")
            mnt.mkdir()
            subprocess.run(["mount", "-t", "erofs", "-o", "ro", str(source), str(mnt)], check=True, capture_output=True)
            try:
                proc = subprocess.run(
                    ["mkfs.erofs", "--quiet", "-Enoinline_data", f"-U{_EROFS_UUID}", "--preserve-mtime", str(tmp), str(mnt)],
                    capture_output=True, text=True,
                )
            finally:
                subprocess.run(["umount", str(mnt)], capture_output=True)
            if proc.returncode != 0:
                raise LayerBuildError(f"mkfs.erofs (DAX variant of {digest}) failed: {proc.stderr.strip()[:500]}")
            os.truncate(tmp, -(-tmp.stat().st_size // DAX_ALIGN) * DAX_ALIGN)
            os.chmod(tmp, 0o444)
            tmp_sums = Path(work, "layer.dax.sums")
            tmp_sums.write_bytes(sums.take(tmp))
            os.chmod(tmp_sums, 0o444)

            def place() -> None:  # the sums first, as for a layer
                os.rename(tmp_sums, sums.path_of(final))
                os.rename(tmp, final)
            self.index.layer_file_placed(place)

    # -- images ----------------------------------------------------------------------------

    def put_image(self, image: Image) -> Image:
        check_name(image.name)
        if not image.layers:
            raise InvalidRequest(f"image {image.name!r} has no layers")
        sizes = {}
        for digest in image.layers:
            try:
                sizes[digest] = os.stat(self.layer_path(digest)).st_size
            except FileNotFoundError:
                raise InvalidRequest(f"image {image.name!r} names missing layer {digest}") from None
        fd, tmp = tempfile.mkstemp(dir=self.tmp_dir, suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(image.to_json())
        self.index.image_put(image.name, list(image.layers), list(image.roles), sizes,
                             lambda: os.rename(tmp, self.images_dir / f"{image.name}.json"))
        return image

    def get_image(self, name: str) -> Image:
        if not _NAME.match(name):
            raise ImageNotFound(f"unknown image {name!r}")
        path = f"{self.images_dir}/{name}.json"
        try:
            st = os.stat(path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            cached = self._images.get(name)
            if cached is not None and cached[0] == key:
                return cached[1]
            with open(path, "rb") as f:
                data = json.loads(f.read())
        except FileNotFoundError:
            self._images.pop(name, None)  # removed by another process sharing the store
            raise ImageNotFound(f"unknown image {name!r}; {self._known_names(name)}") from None
        image = Image(
            name=data["name"], layers=tuple(data["layers"]), env=data.get("env", {}),
            workdir=data.get("workdir", "/"), user=data.get("user", "root"),
            roles=tuple(data.get("roles", ())), parent=data.get("parent"), setuid=bool(data.get("setuid", False)),
            start_cmd=data.get("start_cmd"), ready_cmd=data.get("ready_cmd"),
        )
        self._images[name] = (key, image)
        return image

    def resolve(self, ref: str) -> Image:
        """An image by name, or a composition ``base+workspace+toolkit…`` stacked in that order."""
        names = ref.split("+")
        image = self.get_image(names[0])
        for name in names[1:]:
            image = image.on_top(self.get_image(name), ref)
        return image

    def image_names(self) -> list[str]:
        return self.index.names()

    def _known_names(self, missing: str, shown: int = 20) -> str:
        """The images an unknown name might have meant: those sharing its first characters,
        or the first ones; a store of 100,000 images is not spelled out in an error."""
        total = self.index.count()
        near = self.index.names(limit=shown, prefix=missing[:3]) or self.index.names(limit=shown)
        more = f", … ({total} images; see `dsec image ls`)" if total > len(near) else ""
        return f"known: {', '.join(near) or 'none'}{more}"

    def has_image(self, name: str) -> bool:
        return bool(_NAME.match(name)) and (self.images_dir / f"{name}.json").exists()

    def remove_image(self, name: str, in_use: frozenset[str] = frozenset()) -> None:
        """Remove an image's manifest; refused while a sandbox uses it (``in_use``: image refs
        of live sandboxes, compositions included)."""
        self.get_image(name)
        users = sorted(ref for ref in in_use if name in ref.split("+"))
        if users:
            raise InvalidRequest(f"image {name!r} is in use by running sandboxes ({', '.join(users)}); stop them first")
        self.index.image_removed(name, (self.images_dir / f"{name}.json").unlink)
        self._images.pop(name, None)  # else its cached manifest stays for ever (a soak packs and removes thousands)

    @contextmanager
    def locked(self, name: str) -> Iterator[None]:
        """Hold the store's lock ``name`` (a lock file under ``locks/``; every process and node
        sharing the store sees it) for as long as the block runs."""
        locks = self.root / "locks"
        locks.mkdir(exist_ok=True)
        fd = os.open(locks / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def image_size(self, image: Image) -> int:
        return sum(self.layer_size(d) for d in image.layers)

    def describe(self, image: Image) -> ImageInfo:
        sizes = [self.layer_size(d) for d in image.layers]
        return ImageInfo(name=image.name, layers=list(image.layers), roles=list(image.roles), layer_sizes=sizes,
                         parent=image.parent, size_bytes=sum(sizes), env=image.env, workdir=image.workdir,
                         user=image.user, setuid=image.setuid, start_cmd=image.start_cmd, ready_cmd=image.ready_cmd)

    def unreferenced_layers(self) -> list[str]:
        return self.index.unreferenced_layers()

    def gc(self, in_use: frozenset[str] = frozenset()) -> list[str]:
        """Remove layers no image refers to and no sandbox holds (``in_use``: layer digests).
        A layer some node has mounted is left too, whichever machine asks: each node holds a
        shared lock on the files of the layers it has mounted (``dsec.images.mounts``), and a
        layer is removed only under an exclusive one."""
        removed = [d for d in self.unreferenced_layers() if d not in in_use and self._remove_unheld(d)]
        for stale in self.tmp_dir.iterdir():
            # Half-built layers of builds that died; a live build's files are younger.
            if time.time() - stale.lstat().st_mtime > 24 * 3600:
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        return removed


class StoreHealth:
    """Whether a node can read its layer store, asked before every create and every call into a
    sandbox: a store on a shared filesystem may go away (unmounted, its server stopped, its
    FUSE client killed), and then the sandboxes' layers cannot be read either.

    ``check()`` stats the store's filesystem (``statvfs`` of its root, which a network or FUSE
    filesystem answers from its server) in a thread, waits at most ``within_s`` for it, and
    raises ``StoreUnavailable`` naming the store and the node when it fails or does not answer
    in time: a call never hangs on a store that is away. An answer is kept for ``fresh_s``;
    a failure is not kept, so calls work again as soon as the store answers. One stat runs at
    a time: while one hangs, later checks wait on it (never more than ``within_s``).

    ``remounted_at`` (wall clock, 0 until then) is when a check first saw the store on another
    device than before: its filesystem was mounted again (a FUSE client that died and was
    started again). Layer mounts made before then read through the mount that is gone, so the
    sandboxes that were started before it cannot read their layers any more (the edge refuses
    their calls with ``StoreUnavailable``); new layer mounts read through the new one
    (``dsec.images.mounts``)."""

    def __init__(self, root: Path, node: str, within_s: float = 10.0, fresh_s: float = 1.0) -> None:
        # Named by where it really is (a node's state dir links to a shared store).
        self.root, self.node = Path(os.path.realpath(root)), node
        self.within_s, self.fresh_s = within_s, fresh_s
        self._fine_at = -float("inf")
        self._probe: asyncio.Future | None = None
        self.dev: int | None = None
        self.remounted_at = 0.0

    async def check(self, cached: bool = True) -> None:
        """Raise ``StoreUnavailable`` unless the store answers (``cached``: or answered within
        ``fresh_s``)."""
        if cached and time.monotonic() - self._fine_at < self.fresh_s:
            return
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(asyncio.to_thread(_store_device, self.root))
        self._fine_at = -float("inf")  # until it answers: the next check looks again, however soon
        try:
            dev = await asyncio.wait_for(asyncio.shield(self._probe), self.within_s)
        except TimeoutError:
            raise StoreUnavailable(
                f"the layer store {self.root} did not answer within {self.within_s:g} s on node {self.node}: "
                f"its filesystem is away or stuck; sandboxes of this node take calls again once it answers"
            ) from None
        except OSError as exc:
            raise StoreUnavailable(
                f"the layer store {self.root} cannot be read on node {self.node}: {exc.strerror or exc} "
                f"(its filesystem is unmounted or its server is away); sandboxes of this node take calls "
                f"again once it answers"
            ) from None
        if self.dev is not None and dev != self.dev:
            self.remounted_at = time.time()
            log.warning("the layer store %s was mounted again (device %d, was %d): sandboxes of node %s "
                        "started before read their layers through the mount that has gone", self.root, dev,
                        self.dev, self.node)
        self.dev = dev
        self._fine_at = time.monotonic()


def _store_device(root: Path) -> int:
    os.statvfs(root)  # answered by a network or FUSE filesystem's server, never from a cache
    return os.stat(root).st_dev


def extract_tar(tar_path: Path, dest: Path) -> None:
    """Extract a tar into ``dest``, refusing members that would land or point outside it."""
    dest = dest.resolve()
    try:
        with tarfile.open(tar_path) as tar:
            members = tar.getmembers()
            symlinks: set[str] = set()
            for m in members:
                _check_member(m, dest)
                parents = Path(m.name).parents
                if any(str(p) in symlinks for p in parents):
                    raise LayerBuildError(f"tar member {m.name!r} is written through a symlink")
                # tarfile writes (and chmods) a member over an existing symlink by following it.
                if os.path.normpath(m.name) in symlinks:
                    raise LayerBuildError(f"tar member {m.name!r} replaces a symlink")
                if m.islnk() and (os.path.normpath(m.linkname) in symlinks
                                  or any(str(p) in symlinks for p in Path(m.linkname).parents)):
                    raise LayerBuildError(f"hard link {m.name!r} -> {m.linkname!r} goes through a symlink")
                if m.issym():
                    symlinks.add(os.path.normpath(m.name))
            tar.extractall(dest, members=members, numeric_owner=True)
            _fix_mtimes(dest, members)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise LayerBuildError(f"cannot read tar archive {tar_path}: {exc}") from exc


def _fix_mtimes(dest: Path, members: list[tarfile.TarInfo]) -> None:
    """tarfile leaves symlinks and the directories an archive does not list with the time of
    extraction; pin them so the same archive always makes the same layer."""
    times = {os.path.normpath(m.name): m.mtime for m in members if m.isdir() or m.issym()}
    for dirpath, dirnames, filenames in os.walk(dest):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, dest)
            if name in dirnames or os.path.islink(path):
                mtime = times.get(rel, 0)
                os.utime(path, (mtime, mtime), follow_symlinks=False)


# Deeper or longer member names are refused: no real image has them, and extracting one
# recursed past Python's limit (a RecursionError, not a refusal).
MAX_MEMBER_DEPTH = 256
MAX_MEMBER_NAME = 4095  # PATH_MAX less its NUL


def _check_member(member: tarfile.TarInfo, dest: Path) -> None:
    # (With strings: ``Path(name).parts`` is what a relative name splits into less its empty
    # and "." parts; a base of 12,000 members spent a tenth of its applying in ``pathlib``.)
    name = member.name
    parts = [p for p in name.split("/") if p and p != "."]
    if name.startswith("/") or ".." in parts:
        raise LayerBuildError(f"tar member {name!r} escapes the layer root")
    if len(parts) > MAX_MEMBER_DEPTH or len(name.encode()) > MAX_MEMBER_NAME or len(member.linkname) > MAX_MEMBER_NAME:
        raise LayerBuildError(f"tar member {name[:80]!r}… is too deep or too long (at most {MAX_MEMBER_DEPTH} "
                              f"directories, {MAX_MEMBER_NAME} bytes)")
    if member.islnk() or member.issym():
        target = member.linkname
        if member.islnk() and (target.startswith("/") or ".." in target.split("/")):
            raise LayerBuildError(f"hard link {name!r} -> {target!r} escapes the layer root")
        if member.issym() and not target.startswith("/"):
            root = str(dest)
            base = os.path.join(root, *parts[:-1]) if parts else os.path.dirname(root)
            resolved = os.path.normpath(os.path.join(base, target))
            if not resolved.startswith(root):
                raise LayerBuildError(f"symlink {name!r} -> {target!r} escapes the layer root")
    # (tarfile's isdev() counts FIFOs too: they are harmless, and a VM's packed changes may hold one.)
    if (member.ischr() or member.isblk()) and not (member.ischr() and member.devmajor == 0 and member.devminor == 0):
        # Overlay whiteouts (0:0 char devices) are the only device nodes a layer may hold.
        raise LayerBuildError(f"tar member {name!r} is a device node")


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
