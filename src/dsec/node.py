"""A node's edge put together: the host made ready, the node's state dir locked, its layer store,
its backends (containers, VMs where the host runs them, the FnCall pool) and the edge over them.
``dsec serve`` makes one in its own process (``dsec.server``); a cluster's node daemon makes one
on its node (``dsec.nodes.edged``).

A state dir holds ``store/`` (layers and image manifests, or a link to a shared store) and
``node/`` (this node's mounts, sandboxes and records, under its lock).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import resource
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from libdsec import BackendError

from . import hostcheck, native, settings
from ._sys import set_child_subreaper
from .backends.container import CRUN, ContainerBackend
from .edge.edge import Edge, EdgeConfig
from .images.builders import build_busybox
from .images.store import LayerStore
from .isolation import apparmor
from .resources import cgroups

log = logging.getLogger("dsec.node")


@dataclass
class NodeConfig:
    """What a node's edge is made with: its state dir and name, ``EdgeConfig`` overrides, and
    ``FnCallConfig`` overrides (None: no FnCall pool)."""

    state_dir: Path
    node: str = "n0"
    edge: dict = field(default_factory=dict)
    fncall: dict | None = field(default_factory=dict)


def use_pidfd_child_watcher() -> None:
    """Python < 3.12 waits for each child in a thread of its own; a pidfd watcher does not."""
    if sys.version_info < (3, 12) and hasattr(asyncio, "PidfdChildWatcher"):
        watcher = asyncio.PidfdChildWatcher()
        watcher.attach_loop(asyncio.get_running_loop())
        asyncio.set_child_watcher(watcher)


# Open files the server wants: a sandbox holds two while it lives (its init channel's socket and
# its init's pidfd), a running command a few pipes more; 10,000 idle sandboxes hold 20,000.
NOFILE_WANTED = 1 << 18


def raise_nofile(wanted: int = NOFILE_WANTED) -> str | None:
    """Raise this process's open-file limit to ``wanted`` (as root the hard limit too, never
    past the kernel's ``fs.nr_open``); a shell's or a unit's 1,024 or 20,000 would otherwise stop
    the node at half that many sandboxes. Returns a note when the limit stays under ``wanted``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        nr_open = wanted
    infinite = hard == resource.RLIM_INFINITY
    if not infinite and hard < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, min(wanted, nr_open)))
            hard = min(wanted, nr_open)
        except (OSError, ValueError):  # no CAP_SYS_RESOURCE: up to the hard limit only
            pass
    target = min(max(soft, wanted), nr_open) if infinite else hard
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if max(soft, target) < wanted:
        return (f"open files limited to {target:,} (about {target // 2:,} sandboxes: each holds two); raise the "
                "hard limit (LimitNOFILE=, ulimit -Hn) for more")
    return None


def prepare_host() -> list[str]:
    """Check the runtime and fix what the host needs; returns notes for the log."""
    notes = []
    if not os.path.exists(CRUN):
        raise BackendError(f"{CRUN} not found: run `make demo` or install crun")
    try:
        native.binary("init")
        native.library("zygote")  # the FnCall zygotes' per-call loop
    except native.NativeBuildError as exc:
        raise BackendError(str(exc)) from None
    if os.geteuid() != 0:
        raise BackendError("dsec serve runs as root (it mounts layers and makes cgroups)")
    if note := raise_nofile():
        notes.append(note)
    notes += hostcheck.check_host()  # EROFS, overlayfs, loop devices, user namespaces
    try:
        notes.append(apparmor.ensure_loaded())  # the dsec-sandbox profile, where the host has AppArmor
    except apparmor.AppArmorError as exc:
        raise BackendError(str(exc)) from None
    if cgroups.fix_hybrid_hugetlb():
        notes.append("hybrid cgroups: mounted hugetlb on a v1 hierarchy so crun can run")
    notes.append(f"cgroups {cgroups.version()}")
    set_child_subreaper()
    return notes


def open_store(state_dir: Path) -> LayerStore:
    store = LayerStore(state_dir / "store")
    if not store.has_image("busybox") and shutil.which("busybox"):
        with store.locked("busybox"):  # the nodes of a new shared store start at once: one builds it
            if not store.has_image("busybox"):
                build_busybox(store)
    return store


def build_edge(config: NodeConfig, store: LayerStore) -> Edge:
    node_dir = config.state_dir / "node"
    backend = ContainerBackend(node_dir, store, cgroup_parent=cgroups.parent_for(config.state_dir))
    try:
        return _edge_over(backend, config, store)
    except BaseException:
        backend.release_unused()  # the node's tmpfs, if no sandbox of an earlier run is in it
        raise


def _edge_over(backend: ContainerBackend, config: NodeConfig, store: LayerStore) -> Edge:
    node_dir = backend.node_dir
    edge_config = EdgeConfig(node_dir=node_dir, records_dir=backend.run_dir / "records", node=config.node, **config.edge)
    from .backends.vm import vm_backends

    fncalls = None
    if config.fncall is not None:
        from .fncall import FnCallConfig, FnCallPool
        from .fncall.backend import FnCallBackend

        fncall_config = FnCallConfig(**config.fncall)
        fncalls = FnCallPool(FnCallBackend.beside(backend, tmpfs_mb=fncall_config.tmpfs_mb), store, fncall_config)
    # DSEC_VMS=0: containers only (no guest kernel to fetch, no accelerator probe at start).
    vms = vm_backends(node_dir, store, config.state_dir / "vm") if settings.current().vms else []
    return Edge(edge_config, [backend, *vms], store, fncalls=fncalls)


def lock_node(state_dir: Path) -> int:
    """Hold the node dir's lock for the life of the process: one server (or reset) at a time."""
    node_dir = Path(state_dir) / "node"
    node_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(node_dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BackendError(f"another dsec serve is running on {state_dir}") from None
    return fd


async def reset_node(state_dir: Path) -> int:
    """Remove every sandbox, mount and cgroup a node's state dir holds (no server running)."""
    lock = lock_node(state_dir)
    node_dir = Path(state_dir) / "node"
    backend = ContainerBackend(node_dir, LayerStore(Path(state_dir) / "store"),
                               cgroup_parent=cgroups.parent_for(state_dir))
    count = sum(1 for _ in backend.sandboxes_dir.iterdir())
    await backend.recover([])
    if (node_dir / "vms").is_dir():  # the VMs of a node that ran them (their QEMUs, dirs, cgroups)
        from .backends.vm import vm_backends

        for vms in vm_backends(node_dir, backend.store, Path(state_dir) / "vm"):
            count += sum(1 for d in vms.vms_dir.iterdir() if not d.name.startswith("."))
            await vms.recover([])
    records = backend.run_dir / "records"
    if records.is_dir():
        shutil.rmtree(records)
    backend.release_unused()
    os.close(lock)
    return count


def link_store(state_dir: Path, store_dir: Path) -> None:
    """``state_dir/store`` is the layer store at ``store_dir`` (made when missing: a first start,
    or the default ``STATE_DIR/store``). A link left to another store by an earlier start with
    another ``--store-dir`` is pointed at this one; a real directory there is the store itself."""
    store_dir = Path(os.path.abspath(store_dir))
    store_dir.mkdir(parents=True, exist_ok=True)
    link = state_dir / "store"
    if link.is_symlink():
        if Path(os.readlink(link)) == store_dir:
            return
        link.unlink()
    elif link.exists():
        if link.resolve() != store_dir.resolve():
            raise BackendError(f"{link} is a directory of its own, not a link to the store at {store_dir}: "
                               "move it away, or give this node the store it holds")
        return
    link.symlink_to(store_dir)


async def build_node_edge(config: NodeConfig, store_dir: Path) -> Edge:
    """A started edge on ``config.state_dir`` (this process holds its lock from now on), reading
    layers from ``store_dir``: a node of a cluster (``dsec.nodes.ray.EdgeHost``)."""
    config.state_dir.mkdir(parents=True, exist_ok=True)
    for note in prepare_host():
        log.info(note)
    lock_node(config.state_dir)
    link_store(config.state_dir, store_dir)
    use_pidfd_child_watcher()
    edge = build_edge(config, open_store(config.state_dir))
    await edge.start()
    for backend in edge.backends.values():
        if isinstance(backend, ContainerBackend):
            await backend.start_layer_cache()
    return edge
