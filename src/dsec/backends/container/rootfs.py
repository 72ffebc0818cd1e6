"""The root filesystems of a node's container sandboxes: each sandbox's overlay plan, its
bundle's tmpfs (the writable layer, sized by the disk limit), the shared layer mounts under it
(idmapped for a sandbox with a user namespace) and the overlay itself.

One ``RootFilesystems`` per backend. A root is planned (``plan``, pure), mounted whole or not
at all (``mount``, in a thread: it blocks), handed to the sandbox's init, then unmounted from
the host once the init runs on its own namespace's copy (``started``, done with the next
``mount``), and finally released (``release``: the layers, the bundle's tmpfs and directory).
``remove_remains`` clears what a sandbox of a crashed edge left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from ... import _sys
from ...images.compose import OverlayPlan, compose
from ...images.mounts import LayerMounts
from ...images.store import Image, LayerStore
from ...isolation import disk, userns
from ...resources.cgroups import Limits


class RootFilesystems:
    """The roots under ``sandboxes_dir`` (a bundle per sandbox), over ``layer_mounts``."""

    def __init__(self, store: LayerStore, layer_mounts: LayerMounts, sandboxes_dir: Path,
                 id_ranges: userns.IdRanges | None) -> None:
        self.store = store
        self.layer_mounts = layer_mounts
        self.sandboxes_dir = sandboxes_dir
        self.id_ranges = id_ranges
        # The overlay plan of each live sandbox made here: paths, worked out once.
        self.plans: dict[str, OverlayPlan] = {}
        # The host's overlay mounts of sandboxes that have started, to unmount (detach_started).
        self._started: list[Path] = []

    def plan(self, cid: str, layers: tuple[str, ...], image: str) -> OverlayPlan:
        plan = self.plans.get(cid)
        if plan is None:
            plan = compose(Image(name=image, layers=layers), self.store, self.layer_mounts.mount_dir,
                           self.sandboxes_dir / cid)
        return plan

    def mount(self, plan: OverlayPlan, limits: Limits | None) -> None:
        """Make the bundle and mount the root; on a failure, undo what was done and raise.
        Blocks: call it from a thread."""
        self.detach_started()
        bundle = plan.target.parent
        with self._preparing_ids(bundle.name), contextlib.ExitStack() as undo:
            undo.callback(shutil.rmtree, bundle, ignore_errors=True)
            # The bundle (and so the writable layer) is a tmpfs of its own: its size is the
            # sandbox's disk limit (ENOSPC past it), set again with the memory limit.
            disk.mount_bundle(bundle, disk.INITIAL_BYTES if limits is None else disk.cap_for(limits.memory_bytes))
            undo.callback(disk.unmount_bundle, bundle)
            for d in (plan.upper, plan.work, plan.target):
                d.mkdir(parents=True, exist_ok=True)
            self.layer_mounts.acquire(plan.layers)
            undo.callback(self.layer_mounts.release, plan.layers)
            self._mount_overlay(plan)
            undo.pop_all()

    @contextlib.contextmanager
    def _preparing_ids(self, cid: str) -> Iterator[None]:
        """The user namespace of the sandbox's id range made in a thread of its own while the
        block runs (its bundle and layers are mounted), and waited for at its end: a process
        spawn for each new range, the slowest step of a create under a burst, costs the layer
        mounts (round trips, on a shared store) no time beside it. A failure is left to the
        overlay's mount to meet and report. A range whose namespace is kept (the usual case:
        released ranges are handed out again) needs no thread, whose start and join cost ~0.2 ms
        of CPU here, a hundredth of a whole lifecycle."""
        idmap = None if self.id_ranges is None else self.id_ranges.of(cid)
        if idmap is None or userns.kept(idmap):
            yield
            return
        thread = threading.Thread(target=_prepare_quietly, args=(idmap,), name=f"ids-{cid}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            thread.join()

    def _mount_overlay(self, plan: OverlayPlan) -> None:
        if self.id_ranges is None:
            _sys.mount("overlay", str(plan.target), "overlay", _sys.MS_NODEV, plan.options)
        else:
            idmap = self.id_ranges.take(plan.target.parent.name)
            with self.layer_mounts.idmapped(tuple(reversed(plan.layers)), idmap) as lowers:
                userns.mount_shifted_overlay(idmap, lowers, plan.upper, plan.work, plan.target, _sys.MS_NODEV)

    def mount_again(self, plan: OverlayPlan) -> None:
        """The overlay of a sandbox whose init ended with its files kept (``Lifecycle.halt``),
        on the host again for its next start, over the same writable layer (its bundle's tmpfs
        and its layers were held all along). Blocks."""
        self.detach_started()
        if plan.target in self._started:  # (not unmounted yet: it is still there)
            self._started.remove(plan.target)
        if not os.path.ismount(plan.target):
            self._mount_overlay(plan)

    def started(self, plan: OverlayPlan) -> None:
        """The sandbox's init runs on its own namespace's copy of the overlay: the host's copy
        is only one more mount that every later `crun run` copies into its new namespace and
        unmounts again, a cost that grows with the sandboxes alive (the benchmark's crun took
        ~30% more CPU with 150 mounts more on the host). It is unmounted with the next
        sandbox's mount (``detach_started``); the bundle's tmpfs, which holds the writable layer
        (pack, resize), stays."""
        self._started.append(plan.target)

    def detach_started(self) -> None:
        """Unmount, on the host, the overlays of sandboxes that have started since the last
        call. Blocks (each unmount waits for an RCU grace period): called in the thread that
        mounts the next sandbox's root, so it costs no extra hop to a thread."""
        while self._started:
            with contextlib.suppress(OSError):  # torn down meanwhile
                _sys.umount(str(self._started.pop()), _sys.MNT_DETACH)

    def release(self, plan: OverlayPlan) -> None:
        """Unmount a root mounted by ``mount`` and remove its bundle. Blocks."""
        # The bundle's tmpfs stays mounted until here (the overlay may be gone from the host
        # already, see started): while it is, the sandbox still holds its layers.
        mounted = os.path.ismount(plan.target.parent)
        with contextlib.suppress(OSError):  # detached after the start (EINVAL) or never made (ENOENT)
            _sys.umount(str(plan.target), _sys.MNT_DETACH)
        if mounted:
            self.layer_mounts.release(plan.layers)
        disk.unmount_bundle(plan.target.parent)
        shutil.rmtree(plan.target.parent, ignore_errors=True)

    def remove_remains(self, cid: str) -> None:
        """Unmount and remove the bundle of sandbox ``cid`` of an earlier edge (its layers are
        counted again by the layer mounts' ``adopt``, not here)."""
        target = self.sandboxes_dir / cid / "rootfs"
        if os.path.ismount(target):
            _sys.umount(str(target), _sys.MNT_DETACH)
        disk.unmount_bundle(self.sandboxes_dir / cid)
        shutil.rmtree(self.sandboxes_dir / cid, ignore_errors=True)


def _prepare_quietly(idmap: userns.IdMap) -> None:
    with contextlib.suppress(OSError):
        userns.prepare(idmap)
