"""Node-local, reference-counted mounts of EROFS layers.

Each layer is mounted once per node, file-backed (no loop device) and read-only, and shared by
every sandbox on the node. ``acquire`` mounts on first use; ``release`` unmounts when the last
user lets go. ``adopt`` rebuilds the counts after an edge restart from the sandboxes that are
still running; ``release_unused`` unmounts the rest.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

from .. import _sys
from .compose import LayerMount


class LayerMounts:
    def __init__(self, mount_dir: Path) -> None:
        self.mount_dir = Path(mount_dir)
        self.mount_dir.mkdir(parents=True, exist_ok=True)
        self._refs: Counter[str] = Counter()
        self._lock = threading.Lock()

    def acquire(self, layers: tuple[LayerMount, ...]) -> None:
        with self._lock:
            done: list[LayerMount] = []
            try:
                for layer in layers:
                    if self._refs[layer.digest] == 0 and not os.path.ismount(layer.target):
                        layer.target.mkdir(parents=True, exist_ok=True)
                        _sys.mount(
                            str(layer.source), str(layer.target), "erofs",
                            _sys.MS_RDONLY | _sys.MS_NODEV | _sys.MS_NOSUID,
                        )
                    self._refs[layer.digest] += 1
                    done.append(layer)
            except BaseException:
                for layer in done:
                    self._release_locked(layer)
                raise

    def release(self, layers: tuple[LayerMount, ...]) -> None:
        with self._lock:
            for layer in layers:
                self._release_locked(layer)

    def _release_locked(self, layer: LayerMount) -> None:
        self._refs[layer.digest] -= 1
        if self._refs[layer.digest] <= 0:
            del self._refs[layer.digest]
            self._unmount(layer.target)

    def _unmount(self, target: Path) -> None:
        if os.path.ismount(target):
            _sys.umount(str(target), _sys.MNT_DETACH)
        try:
            target.rmdir()
        except OSError:
            pass

    def adopt(self, sandboxes: list[tuple[LayerMount, ...]]) -> None:
        """Recount from scratch: the given sandboxes hold their layers, nothing else does.
        Called when an edge (re)starts; ``release_unused`` then unmounts the rest."""
        with self._lock:
            self._refs.clear()
        for layers in sandboxes:
            self.acquire(layers)

    def release_unused(self) -> list[str]:
        """Unmount every layer mount under the mount dir that no sandbox holds."""
        removed = []
        with self._lock:
            for target in self.mount_dir.iterdir():
                if target.name not in self._refs:
                    self._unmount(target)
                    removed.append(target.name)
        return removed

    def mounted(self) -> dict[str, int]:
        with self._lock:
            return dict(self._refs)
