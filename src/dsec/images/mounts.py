"""Node-local, reference-counted mounts of EROFS layers.

Each layer is mounted once per node, read-only, and shared by every sandbox on the node:
file-backed where the kernel can (Linux 6.12), else through a read-only loop device of its own
(``attach="loop"``, see dsec.images.loopdev and dsec.hostcheck), which the kernel detaches when
the mount's last user is gone. ``acquire`` mounts on first use; ``release`` unmounts when the
last user lets go. ``adopt`` rebuilds the counts after an edge restart from the sandboxes that
are still running; ``release_unused`` unmounts the rest, and detaches any loop device still
backed by a layer of the store that nothing holds (left by an earlier run). ``idmapped`` hands out idmapped clones of
a layer mount for a sandbox id range (dsec.isolation.userns), made once per (layer, range),
kept for the last ``CLONES_KEPT`` used, and closed with their layer's mount.

A store on a shared filesystem may be mounted again under the node (its FUSE client died and
was started again): a layer mount made before reads through the mount that has gone. ``acquire``
tells it by the device its layer file is on now and was on when mounted, and mounts the layer
anew for the new sandbox; the sandboxes on the old mount keep it, detached, until they end.

With a layer cache (``DSEC_LAYER_CACHE_MB``, see dsec.images.layercache) a layer is mounted
from the cache's file of it, which reads the store's on demand and keeps what was read on the
node's disk; the cache is stopped once no layer is mounted here (``release_unused``), unless a
VM still maps layer files from it (``LayerCache.stop_unless_busy``: the node's VMs read their
layers through the same cache), and started again, with what it kept, at the next mount.

A node's creates mount their layers at once: each layer has a lock of its own over its mount,
unmount and checks, and a layer mounted and in use is counted after a check under no lock at all;
the node's lock covers only the counts. ``release_unused`` and ``adopt`` wait until no acquire or
release is under way.

While a layer is mounted here its file is held open with a shared ``flock``: GC, wherever it
runs on the store (``LayerStore.gc``), removes only the layers it can lock alone.

Before a layer is first mounted here its file's size is checked against its sums
(``dsec.images.sums``): a file cut short on the store, or a damaged sums file, is refused with
``BackendError`` naming the layer, never mounted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from pathlib import Path

from libdsec import BackendError

from .. import _sys, hostcheck, settings
from ..isolation import userns
from . import loopdev, sums
from .compose import LayerMount
from .layercache import LayerCache

CLONES_KEPT = 256


class LayerMounts:
    """``attach``: ``"file"`` or ``"loop"`` (None: what dsec.hostcheck chose for this host);
    ``layers_dir``: the store's layer files, whose loop devices ``release_unused`` sweeps;
    ``cache``: the node's layer cache (None: the one the settings ask for, if any)."""

    def __init__(self, mount_dir: Path, attach: str | None = None, layers_dir: Path | None = None,
                 cache: LayerCache | None = None) -> None:
        self.mount_dir = Path(mount_dir)
        self.mount_dir.mkdir(parents=True, exist_ok=True)
        self.attach = attach or hostcheck.layer_attach()
        if self.attach not in ("file", "loop"):
            raise ValueError(f"layer attach must be file or loop, not {self.attach!r}")
        self.layers_dir = layers_dir
        self.cache = cache or configured_cache(self.mount_dir.parent, layers_dir)
        self._refs: Counter[str] = Counter()
        # digest -> (fd, device) of its layer file, open while mounted here with a shared lock on
        # it: GC on any machine sharing the store leaves a locked layer (LayerStore.gc). The
        # device tells a store mounted again since (a FUSE client restarted): the mount reads
        # through the gone one.
        self._holds: dict[str, tuple[int, int]] = {}
        # digest -> the device of the layer cache's mount it was mounted through: a cache whose
        # server was killed and started again serves another.
        self._cache_devs: dict[str, int | None] = {}
        # Over the counts, holds and clones (and ``idmapped``'s clones in use): the filesystem
        # work of an acquire or release (on a shared store each stat, open, flock and read is a
        # round trip through its client) is done outside it, under the layer's own lock
        # (``_layer_lock``), so that the creates of a node mount different layers at once and
        # two creates needing the same layer wait for one mount.
        self._lock = threading.Lock()
        self._layer_locks: dict[str, threading.Lock] = {}
        # Acquires and releases under way (``_working``); ``release_unused`` and ``adopt`` wait
        # for none to be (``_alone``), and new ones wait while they run.
        self._changed = threading.Condition(self._lock)
        self._busy = 0
        self._sweeps = 0
        # (layer mount target, id range base) -> fd of its detached idmapped clone
        self._clones: OrderedDict[tuple[str, int], int] = OrderedDict()
        # Where clones are attached for a moment on kernels whose overlayfs takes no detached layer.
        self.clones_dir = self.mount_dir / ".idmapped"

    @contextlib.contextmanager
    def idmapped(self, layers: tuple[LayerMount, ...], idmap: userns.IdMap) -> Iterator[list[int]]:
        """fds of idmapped clones of these (acquired) layer mounts for ``idmap``, valid in the
        ``with`` block (mount the overlay there). Cloning costs kernel work for each layer, and
        an unmount when done with; a clone kept serves every later sandbox of that range.

        Where overlayfs takes no detached layer (before Linux 6.15) each clone is made for this
        block alone and attached under ``clones_dir`` while the overlay is mounted, then unmounted
        (the overlay holds a private copy of its layers): nothing stays in the mount table, so a
        crash leaves at most the clones of one create, which ``release_unused`` sweeps.

        The range's user namespace is made first, with no lock held (a process spawn for each
        new range: under the node's lock it held up every create's layer mounts)."""
        userns.prepare(idmap)
        if not userns.detached_layers():
            with self._lock, self._attached_clones(layers, idmap) as fds:
                yield fds
            return
        with self._lock:
            fds = []
            for layer in layers:
                key = (str(layer.target), idmap.base)
                fd = self._clones.get(key)
                if fd is None:
                    fd = self._clones[key] = userns.idmapped_clone(layer.target, idmap)
                else:
                    self._clones.move_to_end(key)
                fds.append(fd)
            yield fds
            while len(self._clones) > CLONES_KEPT:
                os.close(self._clones.popitem(last=False)[1])

    @contextlib.contextmanager
    def _attached_clones(self, layers: tuple[LayerMount, ...], idmap: userns.IdMap) -> Iterator[list[int]]:
        made: list[tuple[int, Path]] = []
        try:
            for layer in layers:
                fd = userns.idmapped_clone(layer.target, idmap)
                path = self.clones_dir / f"{idmap.base}-{layer.target.name}-{os.getpid()}-{threading.get_ident()}"
                try:
                    userns.attach_clone(fd, path)
                except BaseException:
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        path.rmdir()
                    raise
                made.append((fd, path))
            yield [fd for fd, _ in made]
        finally:
            for fd, path in made:
                os.close(fd)
                _unmount_dir(path)

    def _sweep_clones(self) -> None:
        """Clones a crashed create left attached (kernels before 6.15)."""
        try:
            left = list(self.clones_dir.iterdir())
        except FileNotFoundError:
            return
        for path in left:
            _unmount_dir(path)
        with contextlib.suppress(OSError):
            self.clones_dir.rmdir()

    def _close_clones(self, target: Path) -> None:
        for key in [k for k in self._clones if k[0] == str(target)]:
            os.close(self._clones.pop(key))

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        """An acquire or release under way, outside ``_lock``: ``_alone`` waits for it."""
        with self._lock:
            while self._sweeps:
                self._changed.wait()
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                if not self._busy:
                    self._changed.notify_all()

    @contextlib.contextmanager
    def _alone(self) -> Iterator[None]:
        """``_lock`` held with no acquire or release under way (for the sweeps, which look at
        every mount at once, as a create half-way through its mounts would not have them)."""
        with self._lock:
            self._sweeps += 1
            try:
                while self._busy:
                    self._changed.wait()
                yield
            finally:
                self._sweeps -= 1
                self._changed.notify_all()

    def _layer_lock(self, digest: str) -> threading.Lock:
        with self._lock:
            return self._layer_locks.setdefault(digest, threading.Lock())

    def acquire(self, layers: tuple[LayerMount, ...]) -> None:
        with self._working():
            done: list[LayerMount] = []
            try:
                for layer in layers:
                    self._acquire_one(layer)
                    done.append(layer)
            except BaseException:
                for layer in done:
                    self._release_one(layer)
                raise

    def _acquire_one(self, layer: LayerMount) -> None:
        if self._take_mounted(layer):
            return
        with self._layer_lock(layer.digest):
            with self._lock:
                unused = self._refs[layer.digest] == 0
            if unused and not os.path.ismount(layer.target):
                layer.target.mkdir(parents=True, exist_ok=True)
                self._mount(layer)
            elif self._stale(layer):
                # The sandboxes on the old mount keep it (detached); new ones get this.
                with self._lock:
                    self._close_clones(layer.target)
                _sys.umount(str(layer.target), _sys.MNT_DETACH)
                self._mount(layer)
            with self._lock:
                self._refs[layer.digest] += 1

    def _take_mounted(self, layer: LayerMount) -> bool:
        """Count one more user of a layer mounted here and in use, still reading through the
        store's mount and the cache's server it was mounted through, with no lock held over the
        checks; False (nothing counted): it needs ``_acquire_one``'s locked way."""
        with self._lock:
            held = self._holds.get(layer.digest)
            if held is None or self._refs[layer.digest] == 0:
                return False
            cache_dev = self._cache_devs.get(layer.digest, _NOT_CACHED)
        if self._moved(layer, held[1], cache_dev):
            return False
        with self._lock:
            # (released to nothing, or mounted anew, while it was looked at: the locked way)
            if self._holds.get(layer.digest) is not held or self._refs[layer.digest] == 0:
                return False
            self._refs[layer.digest] += 1
            return True

    def _moved(self, layer: LayerMount, store_dev: int, cache_dev: int | None | object) -> bool:
        """Whether the layer's file is on another device than ``store_dev`` now (a store mounted
        again), or the cache's mount it was mounted through (``cache_dev``) is not served now."""
        if self.cache is not None and cache_dev is not _NOT_CACHED and self.cache.device() != cache_dev:
            return True
        return os.stat(layer.source).st_dev != store_dev

    def _stale(self, layer: LayerMount) -> bool:
        """Whether the layer's mount reads through a mount of the store, or a server of the
        layer cache, that has gone."""
        held = self._holds.get(layer.digest)
        if held is None:  # adopted: mounted by an earlier edge, taken as it is
            self._hold(layer)
            return False
        if self.cache is not None and layer.digest in self._cache_devs:
            self.cache.ensure()
        return self._moved(layer, held[1], self._cache_devs.get(layer.digest, _NOT_CACHED))

    def _hold(self, layer: LayerMount) -> int:
        """Open and share-lock the layer's file (held while mounted here); its fd."""
        self._let_go(layer.digest)
        fd = os.open(layer.source, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            held = (fd, os.fstat(fd).st_dev)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self._holds[layer.digest] = held
        return fd

    def _let_go(self, digest: str) -> None:
        with self._lock:
            held = self._holds.pop(digest, None)
        _close_held(held)

    def _mount(self, layer: LayerMount) -> None:
        fd = self._hold(layer)
        flags = _sys.MS_RDONLY | _sys.MS_NODEV | _sys.MS_NOSUID
        try:
            self._check(layer, fd)
            source = layer.source
            if self.cache is not None:
                source = self.cache.path(layer.source)
                cache_dev = self.cache.device()
                with self._lock:
                    self._cache_devs[layer.digest] = cache_dev
            if self.attach == "file":
                _sys.mount(str(source), str(layer.target), "erofs", flags)
                return
            with loopdev.attached(source) as device:
                _sys.mount(device, str(layer.target), "erofs", flags)
        except BaseException:
            self._let_go(layer.digest)
            raise

    def _check(self, layer: LayerMount, fd: int) -> None:
        """Refuse a layer whose file in the store does not have the size its sums were taken
        over, or whose sums file is damaged."""
        problem = sums.mount_problem(Path(layer.source), os.fstat(fd).st_size)
        if problem is not None:
            raise BackendError(problem)

    def release(self, layers: tuple[LayerMount, ...]) -> None:
        with self._working():
            for layer in layers:
                self._release_one(layer)

    def _release_one(self, layer: LayerMount) -> None:
        with self._lock:
            if self._refs[layer.digest] > 1:  # (others still use it: nothing to unmount)
                self._refs[layer.digest] -= 1
                return
        with self._layer_lock(layer.digest):
            with self._lock:
                self._refs[layer.digest] -= 1
                if self._refs[layer.digest] > 0:
                    return
                del self._refs[layer.digest]
                self._cache_devs.pop(layer.digest, None)
                held = self._holds.pop(layer.digest, None)
                self._close_clones(layer.target)
            _close_held(held)
            _unmount_layer(layer.target)

    def adopt(self, sandboxes: list[tuple[LayerMount, ...]]) -> None:
        """Recount from scratch: the given sandboxes hold their layers, nothing else does.
        Called when an edge (re)starts; ``release_unused`` then unmounts the rest."""
        with self._alone():
            self._refs.clear()
        for layers in sandboxes:
            self.acquire(layers)

    def release_unused(self) -> list[str]:
        """Unmount every layer mount under the mount dir that no sandbox holds, and detach the
        loop devices of the store's layers that nothing holds (whichever way this process
        attaches: an earlier run may have used the other)."""
        removed = []
        with self._alone():
            self._layer_locks.clear()  # (none is held: no acquire or release is under way)
            self._sweep_clones()
            for target in self.mount_dir.iterdir():
                if target.name not in self._refs and target != self.clones_dir:
                    _close_held(self._holds.pop(target.name, None))
                    self._close_clones(target)
                    _unmount_layer(target)
                    removed.append(target.name)
            if self.layers_dir is not None:
                loopdev.detach_backed_by(self.layers_dir)
            if self.cache is not None and not self._refs:
                if self.attach == "loop":
                    loopdev.detach_backed_by(self.cache.mountpoint)
                self.cache.stop_unless_busy()  # (not under a VM mapping layers from it)
        return removed

    def mounted(self) -> dict[str, int]:
        with self._lock:
            return dict(self._refs)


_node_caches: dict[Path, LayerCache] = {}
_node_caches_lock = threading.Lock()


def configured_cache(node_dir: Path, layers_dir: Path | None) -> LayerCache | None:
    """The layer cache DSEC_LAYER_CACHE_MB asks for (``node_dir/layer-cache``, or at
    DSEC_LAYER_CACHE_DIR), over the store's ``layers_dir``: one handle per cache in a process,
    shared by the node's layer mounts (containers) and its VM backends, so that they start its
    server once between them."""
    conf = settings.current()
    if layers_dir is None or conf.layer_cache_mb <= 0:
        return None
    cache_dir = Path(conf.layer_cache_dir or Path(node_dir) / "layer-cache")
    with _node_caches_lock:
        cache = _node_caches.get(cache_dir)
        if cache is None or (cache.limit, cache.layers_dir) != (conf.layer_cache_mb << 20, Path(layers_dir)):
            cache = _node_caches[cache_dir] = LayerCache(cache_dir, conf.layer_cache_mb << 20, layers_dir)
        return cache


_NOT_CACHED = object()  # (a layer mounted straight from the store's file)


def _close_held(held: tuple[int, int] | None) -> None:
    if held is not None:
        # A store that is gone answers the close with an error (ENOTCONN); the fd is closed.
        with contextlib.suppress(OSError):
            os.close(held[0])


def _unmount_layer(target: Path) -> None:
    if os.path.ismount(target):
        _sys.umount(str(target), _sys.MNT_DETACH)
    try:
        target.rmdir()
    except OSError:
        pass


def _unmount_dir(path: Path) -> None:
    if os.path.ismount(path):
        with contextlib.suppress(OSError):
            _sys.umount(str(path), _sys.MNT_DETACH)
    with contextlib.suppress(OSError):
        path.rmdir()
