"""What a container sandbox wrote, read from the node in its writable layer (the overlay's
upper, in the bundle's tmpfs): packed into a layer of the store (``pack_diff``), replayed
beneath kept paths into a clean copy (``carry``), looked through for tampering.

The sandbox is frozen while its layer is read, and thawed after unless it was paused already.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

from libdsec import BackendError, SandboxStateError

from ...images import carry, scrub
from ...images.store import LayerBuildError, LayerStore
from ...isolation import userns
from ...resources import cgroups
from ..base import Handle, PackedDiff
from .rootfs import RootFilesystems


class WritableLayer:
    """``ContainerBackend``'s calls on a sandbox's writable layer (the state they use is the
    backend's; freezing and liveness are its lifecycle's)."""

    cgroup_parent: str
    store: LayerStore
    id_ranges: userns.IdRanges | None
    rootfs: RootFilesystems

    def _upper(self, handle: Handle) -> Path:
        return self.rootfs.plan(handle.cid, handle.layers, handle.image).upper

    async def pack_diff(self, handle: Handle, once: bool = False) -> PackedDiff:
        """Freeze the sandbox, turn its writable layer (minus residue) into a layer in the
        store, thaw it. Whiteouts and opaque directories travel as overlay markers. It is
        thawed once its layer is read (``LayerStore.add_dir``'s ``read``), before the layer's
        sums are taken and it is placed; the answer's ``frozen_s`` ends there. ``once``: a
        layer for one use, named by its file (``LayerStore.add_dir``)."""
        if not await self.is_alive(handle):
            raise SandboxStateError(f"cannot pack: sandbox process of {handle.cid} is gone")
        upper = self._upper(handle)
        frozen_at = time.perf_counter()
        was_paused = not await self._freeze(handle)
        thawed = was_paused  # (one paused already stays paused)
        frozen_s = 0.0

        def thaw() -> None:
            nonlocal thawed, frozen_s
            if not thawed:
                cgroups.thaw(self.cgroup_parent, handle.cid)
                thawed = True
                frozen_s = time.perf_counter() - frozen_at

        try:
            with contextlib.ExitStack() as stack:
                idmap = self.id_ranges.of(handle.cid) if self.id_ranges else None
                if idmap is not None:  # the layer holds the ids as the sandbox saw them
                    upper = stack.enter_context(userns.shifted_view(idmap, upper, upper.parent / "packview", self.store.tmp_dir))
                skip = await asyncio.to_thread(scrub.residue, upper)
                digest = await asyncio.to_thread(self.store.add_dir, upper, skip, thaw, once)
        except LayerBuildError as exc:
            # The sandbox's own files, packed by the node: a failure here (the store's disk
            # full, mkfs.erofs failing) is the node's, not a bad request.
            raise BackendError(f"cannot pack {handle.cid}: {exc}") from None
        finally:
            thaw()
        # (One paused already stood frozen throughout: the whole pack.)
        return PackedDiff(digest, sorted("/" + p for p in skip), frozen_s or time.perf_counter() - frozen_at)

    async def check_kept(self, handle: Handle, keep: list[str]) -> None:
        """Each kept path exists in the running sandbox, with no link on the way."""
        root = self._root_fd(handle)
        try:
            for path in keep:
                carry.check_in_root(root, path, "keep path", "the sandbox")
        finally:
            os.close(root)

    async def carry(self, source: Handle, target: Handle, keep: list[str]) -> carry.Carried:
        """Freeze ``source``, replay its changes beneath ``keep`` into ``target`` (which has
        run nothing yet) through ``target``'s own root, thaw ``source``."""
        if not await self.is_alive(source):
            raise SandboxStateError(f"cannot make a clean copy: sandbox process of {source.cid} is gone")
        src = self.id_ranges.of(source.cid) if self.id_ranges else None
        dst = self.id_ranges.of(target.cid) if self.id_ranges else None

        def ids(host_id: int) -> int:
            inside = host_id if src is None else host_id - src.base
            if not 0 <= inside < (src.count if src else 1 << 32):
                inside = 65534  # not one of the sandbox's ids: nobody
            return inside if dst is None else dst.host(inside)

        upper = self._upper(source)
        root = self._root_fd(target)
        was_paused = not await self._freeze(source)
        try:
            return await asyncio.to_thread(carry.carry, upper, root, keep, ids)
        except OSError as exc:
            raise BackendError(f"cannot carry the kept paths into the clean copy: {exc}") from exc
        finally:
            if not was_paused:
                cgroups.thaw(self.cgroup_parent, source.cid)
            os.close(root)

    async def new_identity(self, handle: Handle, hostname: str, machine_id: str, seed: bytes) -> None:
        """A fork's child: its host name is its own from its create (its UTS namespace), the
        kernel's random number generator is the host's; what is left is ``/etc/machine-id``."""
        await self.write_file(handle, "/etc/machine-id", machine_id.encode() + b"\n", 0o444, 0, 0)

    def tampered(self, handle: Handle) -> list[str]:
        return carry.tampered(self._upper(handle))
