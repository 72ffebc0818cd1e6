"""Container sandboxes: an OCI bundle run by crun over EROFS layers and a private overlay upper.

No Python process stays with a sandbox: crun starts ``dsec-init`` (dsec/native/init.c, a small
static program that reaps zombies) as the sandbox's init and exits, so an idle sandbox costs the
host its init, its namespaces and its cgroups. The cgroup is the backend's own, made with its
limits before crun runs (crun is told not to manage cgroups; see dsec.resources.cgroups); the
init is moved into it before it is asked to run anything. ``exec`` asks that init, over a
socketpair only it holds (dsec.backends.initchan), to fork the command with our pipes as its
stdio: it inherits the namespaces, cgroup, capabilities, no_new_privs and seccomp filter the init
has. A sandbox adopted after a server restart has lost its channel; its commands go through
``crun exec`` (which enters the namespaces and applies the same profile), started by a shell that
first joins the sandbox's cgroup. Pause is the cgroup freezer. Files are read and written
from the host through the sandbox's own root with openat2(RESOLVE_IN_ROOT), so a symlink inside
the sandbox can never point outside it.

Per node (``node_dir``): ``layers/<digest>`` (the shared layer mounts) and ``run/``, a tmpfs the
backend mounts, with ``crun/`` (crun's state) and ``sandboxes/<cid>/`` (``config.json``,
``upper``, ``work``, ``rootfs``; ``rootfs``, the overlay, is unmounted on the host once the
sandbox's init runs on its own namespace's copy). A sandbox's writes thus live in memory, charged to the sandbox's
own memory limit, and making or removing a sandbox costs no disk metadata operations (on a
disk those are a sizeable part of a create). The tmpfs outlives an edge restart, like the
sandboxes in it, and is unmounted when the last sandbox is gone.

The package, by concern: ``oci`` (the bundle's config.json), ``rootfs`` (the overlay plan, the
bundle's tmpfs, the layer mounts), ``crun`` (its command line), ``lifecycle`` (create with one
undo stack, pause, destroy, recover), ``exec`` (commands and ports), ``files``, ``pty`` and
``upper`` (the writable layer: pack, carry, tampering). ``ContainerBackend`` is made of them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

from ... import _sys, native, settings
from ...images.mounts import LayerMounts
from ...images.store import LayerStore
from ...isolation import userns
from ...resources import cgroups
from ..base import Capability, HostView, SandboxSpec
from ..initchan import InitChannel
from ..procs import sealed_copy
from . import crun
from .crun import CRUN
from .exec import Exec
from .files import Files
from .lifecycle import Lifecycle
from .oci import INIT_PATH, BundleConfigs
from .pty import Pty
from .rootfs import RootFilesystems
from .upper import WritableLayer

__all__ = ["CRUN", "INIT_PATH", "ContainerBackend"]

# Id ranges whose user namespace is made when the backend warms up: half of those kept
# (``userns._USERNS_FDS_KEPT``), about 0.55 ms of CPU and a kernel object of a few KiB each.
IDS_AHEAD = 128


class ContainerBackend(Lifecycle, Exec, Pty, Files, WritableLayer):
    """crun + overlayfs over shared EROFS layer mounts. See the package docstring."""

    kind = "container"
    # PROTECTED_PATHS: read-only binds (see oci.protected_mounts); CARRY: check_kept, carry, tampered.
    capabilities = frozenset({Capability.WARM_POOL, Capability.PROTECTED_PATHS, Capability.CARRY, Capability.HOST_PATHS,
                              Capability.PIPED_STDIN, Capability.PORTS, Capability.NEW_IDENTITY,
                              Capability.REBOOT, Capability.DESKTOP})
    # The v1 controllers of a sandbox's cgroup (see dsec.resources.cgroups).
    cgroup_controllers: tuple[str, ...] = cgroups.SANDBOX_CONTROLLERS

    def __init__(self, node_dir: Path, store: LayerStore, layer_mounts: LayerMounts | None = None,
                 cgroup_parent: str = cgroups.DEFAULT_PARENT,
                 bundle_hook: Callable[[dict, SandboxSpec], None] | None = None) -> None:
        """``bundle_hook(config, spec)``: changes each sandbox's OCI config in place before it
        is written (the FnCall workers' read-only root and mounts); it must leave
        ``config["linux"]["seccomp"]`` as it found it."""
        self.node_dir = Path(node_dir)
        self.cgroup_parent = cgroup_parent
        self.store = store
        self.run_dir = self.node_dir / "run"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not os.path.ismount(self.run_dir):
            _sys.mount("dsec-run", str(self.run_dir), "tmpfs", _sys.MS_NODEV | _sys.MS_NOSUID, "mode=0700")
        self.crun_root = self.run_dir / "crun"
        self.sandboxes_dir = self.run_dir / "sandboxes"
        for d in (self.crun_root, self.sandboxes_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.layer_mounts = layer_mounts or LayerMounts(self.node_dir / "layers", layers_dir=store.layers_dir)
        # Root inside is not root outside: each sandbox gets a user namespace and a host uid
        # range of its own (see dsec.isolation.userns); DSEC_USERNS=0 turns it off.
        self.id_ranges = userns.IdRanges() if settings.current().userns else None
        self.rootfs = RootFilesystems(store, self.layer_mounts, self.sandboxes_dir, self.id_ranges)
        self.oci = BundleConfigs(native.binary("init"), bundle_hook)
        # Each sandbox's init channel (see dsec.backends.initchan); none for a sandbox adopted
        # after a restart, whose commands go through `crun exec`.
        self.channels: dict[str, InitChannel] = {}
        # The sandboxes whose cgroups this process made (in its controllers' hierarchies only),
        # until they are removed (``Lifecycle._remove_cgroup``).
        self.cgroups_made: set[str] = set()
        self._crun_exe = sealed_copy(CRUN)

    @property
    def layer_attach(self) -> str:
        """How this node attaches layers: ``"file"`` (file-backed EROFS) or ``"loop"``."""
        return self.layer_mounts.attach

    def describe(self) -> str:
        """One line for ``dsec info``."""
        how = "file-backed" if self.layer_attach == "file" else "on read-only loop devices"
        return f"{self.kind}: crun, EROFS layers {how}"

    def host_view(self) -> HostView:
        return HostView(self.cgroup_parent, self.sandboxes_dir, self.id_ranges, self.layer_attach)

    async def warm_up(self) -> None:
        """The node's layer cache started (``start_layer_cache``); layers are mounted at the
        first create that needs them. The user namespaces of the first ``IDS_AHEAD`` id ranges
        are made ahead (``userns.prepare``), so that the first creates of a burst or a fork,
        which take those ranges, make none."""
        await self.start_layer_cache()
        if self.id_ranges is not None:
            await asyncio.to_thread(self._prepare_ranges, self.id_ranges.first(IDS_AHEAD))

    @staticmethod
    def _prepare_ranges(idmaps: list[userns.IdMap]) -> None:
        for idmap in idmaps:
            try:
                userns.prepare(idmap)
            except OSError as exc:  # (said again by the create that needs it)
                logging.getLogger("dsec.backends.container").warning("cannot make a user namespace ahead: %s", exc)
                return

    async def start_layer_cache(self) -> None:
        """The node's layer cache started, if it has one, so that its first create need not
        wait for it (a node of a cluster calls it at start, as the server calls ``warm_up``)."""
        if self.layer_mounts.cache is not None:
            try:
                await asyncio.to_thread(self.layer_mounts.cache.ensure)
            except OSError as exc:  # said again by the first create that needs it
                logging.getLogger("dsec.images").warning("%s", exc)

    async def close(self) -> None:
        """Nothing held in this process outlives it but what the sandboxes themselves hold."""

    def _crun(self, *args: str) -> list[str]:
        """A crun command line on this node's state root."""
        return crun.argv(self.crun_root, *args)

    async def _run_crun(self, *args: str, timeout: float = 30.0, log: Path | None = None,
                        stdin: int | None = None) -> tuple[int, str]:
        """Run crun (see ``crun.run``); returns (exit code, output)."""
        return await crun.run(self._crun_exe, self.crun_root, *args, timeout=timeout, log=log, stdin=stdin)
