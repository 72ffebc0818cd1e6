"""MicroVM sandboxes: QEMU's ``microvm`` machine, layers as persistent memory with DAX.

Each layer of the image is mapped into the guest read-only from its DAX variant in the layer
store (``LayerStore.dax_layer``): a NUMA node backed by the file (``share=on,readonly=on``)
that the kernel argument ``memmap=SIZE!ADDR`` turns into legacy pmem (/dev/pmemN, module
nd_e820); the guest mounts it with ``erofs -o dax=always`` and reads the host's page cache in
place, so every VM on the node shares one copy of each layer. (QEMU 7.2's microvm takes a
``virtio-pmem`` device but never maps it, hence this.) A small RAM node follows the layers so
that the initrd, which QEMU puts at the top of memory, does not land inside one. The guest's
init composes the layers with overlayfs under a tmpfs upper, so a VM's writes live in its own
memory — and in its memory snapshots.

Through the node's layer cache (``DSEC_LAYER_CACHE_MB``, dsec.images.layercache), as a node's
containers read theirs: QEMU maps the cache's file of each DAX variant instead of the store's,
so what the guests read is fetched from a shared store once per node, in 64 KiB chunks checked
against the store's sums, and kept on the node's disk within the cache's bound (LRU); a second
VM of the image reads nothing from the store. The cache serves the DAX variant as a file of its
own (the store takes its sums when it makes it, ``DIGEST.dax.sums``) rather than the node making
a DAX copy from the cached layer: such a copy reads every chunk of the layer (mkfs.erofs walks
the whole tree), not the ones guests touch, and keeps a second whole file on the node outside the
cache's bound. QEMU maps a FUSE file as it maps any other (``share=on,readonly=on`` is a shared
read-only mapping of the FUSE file's page cache, filled by the cache's server as the guest faults
pages in: tests/vm/test_vm_layer_cache.py boots one), so the node's VMs still share one copy of
each layer in the host's memory. The DAX variant itself is made once per store from the store's
layer (by the first node that needs it, under the store's lock). A chunk the cache refuses
(damaged on the store) cannot be an EIO in a mapping: QEMU faults on it and ends, and the VM with
it, never fed the bad bytes. The cache's server is not stopped while a VM maps a file of it
(``LayerCache.stop_unless_busy``); one killed under running VMs can serve them no page that is
not in the host's page cache already (a VM faulting one would end, as above).

``layer_mode="private"`` (for comparison in ``dsec bench microvm``) attaches the same layers as
virtio-blk disks read with O_DIRECT (through the layer cache's files too, when the node has one)
and turns off KSM merging: each VM then keeps private copies of what it reads.

Host memory besides the layers: QEMU marks a pmem microVM's RAM mergeable and the backend turns
KSM on for the node (``dsec.resources.ksm``; ``use_ksm=False`` or DSEC_VM_KSM=0 leave it as the
host has it; a stopping edge with no VM left gives the host its settings back), so identical guests share identical pages; they boot with ``nokaslr`` to have more
of them. TCG's translation cache is bounded (``machine.TCG_TB_MB``).

Snapshots: ``snapshot(handle)`` pauses the VM, writes its memory and device state with QEMU's
migration (the pmem layers are skipped: ``x-ignore-shared``) and resumes it; the guest RAM's pages
are then split out of that stream into one sparse file per RAM block (``ramsplit``). Creating a
VM with ``spec.snapshot`` starts QEMU with each RAM block a ``memory-backend-file`` over the
snapshot's file with ``share=off`` (MAP_PRIVATE) and ``-incoming defer`` (and no kernel or initrd:
the guest's are in its memory), loads the rest of the stream (device state, no RAM pages) and
resumes it: its processes carry on where they were, and N clones share one copy of the
snapshot's memory in the host page cache, each writing into its own copy-on-write pages.
Snapshots live in ``<node_dir>/snapshots/<id>/`` (``meta.json``, ``state``, ``<block>.ram``);
a RAM file that is missing, cut short or modified since is refused before any QEMU maps it. (QEMU 7.2 discards guest RAM of a file-backed block by punching a hole
in the file, MAP_PRIVATE or not: a microVM must therefore have no device that discards RAM, such
as a virtio-balloon, or one clone could zero pages of the snapshot under all the others.)

Boot templates (``templates_dir``, the node's ``vm-templates`` unless DSEC_VM_TEMPLATES_DIR says
where; DSEC_VM_BOOT_TEMPLATES=0: none): the first VM of an image and shape (memory, vCPUs, the
kernel and its command line: ``template_id``) boots, and its memory is saved as a snapshot is,
right after its agent first answers (paused about 0.15 s under TCG) and before anything ran in
it; every later VM of that shape restores it instead of booting (0.6 s against 4.5 s under TCG),
then takes a host name and a reseeded random number generator of its own (``ident``) and the
host's clock (``clock``: a restored guest wakes with the clock it had when saved). Its RAM maps
the template's file copy-on-write, as a snapshot's clones do, so the page cache holds one copy
of what the clones have not written. A VM with protected paths always boots (they are mounted at
boot); a template that cannot be restored (damaged, or made by another QEMU) is removed and the
VM boots, keeping a new one. A dir keeps at most ``TEMPLATES_KEPT``, the least lately used going.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import time
from dataclasses import replace
from pathlib import Path

from libdsec import BackendError, InvalidRequest, LimitOutOfRange

from ... import settings
from ...resources import ksm
from ..base import Capability, Handle, SandboxSpec
from . import machine, ramsplit
from .agent import AgentFailure, AgentGone
from .backend import VMBackend
from .qmp import QMP, QMPError

MiB = 1 << 20
log = logging.getLogger(__name__)

TAIL_RAM_MB = 32
INITRD_MAX_MB = 2048  # the guest kernel's initrd_addr_max: QEMU loads the initrd below it
MIN_HEAD_RAM_MB = 128  # the RAM before the layers: where the kernel is loaded and starts
# microvm keeps guest memory below 4 GiB in one piece only up to here.
MAX_GUEST_SPAN_MB = 2816
SNAPSHOT_ID = re.compile(r"^s[0-9a-f]{16}\Z")
TEMPLATE_ID = re.compile(r"^t[0-9a-f]{16}\Z")
TEMPLATES_KEPT = 8  # boot templates a templates dir keeps (the least lately used go)
MIGRATION_TIMEOUT_S = 300.0
# QEMU throttles a migration to 128 MiB/s unless told otherwise (MAX_THROTTLE), stopped VM or
# not: a 384 MB guest's save took 2.5 s of that cap with its vCPUs stopped. Into a local file
# there is nothing to spare; this is QEMU's own ceiling for the parameter, in bytes/s.
MIGRATION_BANDWIDTH = 1 << 40
# Identical guests should hold identical pages, for KSM to merge them: with the guest kernel's
# layout randomized (KASLR) every pointer differs between VMs, and so does every page holding
# one (page tables, slab, struct pages). Clones of a snapshot share their layout anyway.
# docs/SECURITY.md weighs it; docs/BENCHMARKS.md measures it.
GUEST_SHARING_ARGS = "nokaslr"


class SnapshotNotFound(InvalidRequest):
    pass


class SnapshotDamaged(InvalidRequest):
    """A snapshot's files are not as saved (a RAM file cut short or rewritten)."""


class SnapshotIncompatible(InvalidRequest):
    """A snapshot made by another QEMU, or of a guest running another kernel, than this node has."""


class MicroVMBackend(VMBackend):
    kind = "microvm"
    capabilities = frozenset({Capability.KEPT_LAYER, Capability.SNAPSHOT, Capability.PIPED_STDIN, Capability.WATCHED,
                              Capability.PROTECTED_PATHS, Capability.PORTS, Capability.NEW_IDENTITY, Capability.DESKTOP})

    def __init__(self, node_dir: Path, store, assets_dir: Path | None = None, *, layer_mode: str = "pmem",
                 use_ksm: bool | None = None, templates_dir: Path | None = None, **kw) -> None:
        super().__init__(node_dir, store, assets_dir, **kw)
        # Boot templates (``_create_from_template``): None, every VM boots its kernel.
        self.templates_dir = templates_dir
        self._templating: set[str] = set()
        if layer_mode not in ("pmem", "private"):
            raise ValueError(f"layer_mode must be pmem or private, not {layer_mode!r}")
        self.layer_mode = layer_mode
        # Private layers are the comparison without sharing: no KSM for them.
        if use_ksm is None:  # KSM is node-wide; DSEC_VM_KSM=0 leaves the host's settings alone (tests)
            use_ksm = settings.current().vm_ksm
        self._ksm_wanted = use_ksm and layer_mode == "pmem"
        self._ksm_on = False
        self._ksm_before: dict[str, str] = {}
        self.snapshots_dir = self.node_dir / "snapshots"
        self.snapshots_dir.mkdir(parents=True, exist_ok=True)

    def describe(self) -> str:
        return super().describe() + f", layers as {'pmem with DAX' if self.layer_mode == 'pmem' else 'private disks'}"

    async def _layer_files(self, layers: tuple[str, ...]) -> list[Path]:
        """The files QEMU maps (pmem: the DAX variants) or attaches (private: the layers), read
        through the node's layer cache when it has one (``VMBackend.layer_file``)."""
        made = self.store.check_layer if self.layer_mode == "private" else self.store.dax_layer
        return [await self.layer_file(await asyncio.to_thread(made, d)) for d in layers]

    def _ram_blocks(self, ram_mb: int, layers_mb: int = 0) -> list[tuple[str, int]]:
        """The guest RAM's memory backends, (id, MiB) in guest-address order. Their ids name
        the RAM blocks in a snapshot, so a clone's must be the same (and, for the same memory
        and layers, so are their sizes).

        pmem: the RAM before the layers and the tail after them. QEMU puts the initrd at the
        top of the RAM below the kernel's ``initrd_addr_max`` (2 GiB): when memory and layers
        reach past that, the tail must too, or the initrd lands inside a layer and the guest
        finds no root (a 1 GB microVM of the 1.3 GB ``desktop`` image did)."""
        if self.layer_mode == "private":
            return [("ram0", ram_mb)]
        head = ram_mb - TAIL_RAM_MB
        if head + layers_mb + TAIL_RAM_MB > INITRD_MAX_MB:
            head = min(head, INITRD_MAX_MB - TAIL_RAM_MB - layers_mb)
            if head < MIN_HEAD_RAM_MB:
                raise LimitOutOfRange(f"{layers_mb} MB of layers leave a microVM too little memory below "
                                      f"{INITRD_MAX_MB} MB to boot from (at most {INITRD_MAX_MB - TAIL_RAM_MB - MIN_HEAD_RAM_MB} "
                                      f"MB of layers)")
        return [("ram0", head), ("ramtail", ram_mb - head)]

    def _ram_object(self, block: str, size_mb: int, ram_file: Path | None) -> str:
        merge = "off" if self.layer_mode == "private" else "on"
        if ram_file is None:
            return f"memory-backend-ram,id={block},size={size_mb}M,merge={merge}"
        # A clone maps the snapshot's RAM file privately: pages it only reads stay the host's
        # one cached copy, pages it writes become its own (copy-on-write).
        return f"memory-backend-file,id={block},mem-path={ram_file},size={size_mb}M,share=off,merge={merge}"

    async def warm_up(self) -> None:
        await super().warm_up()
        await self._start_ksm()

    async def _start_ksm(self) -> None:
        if self._ksm_wanted and not self._ksm_on:
            if ksm.available():
                self._ksm_before = await asyncio.to_thread(ksm.take)
            self._ksm_on = await asyncio.to_thread(ksm.enable)
            self._ksm_wanted = self._ksm_on  # tried once: a node without KSM is told once

    def release_unused(self) -> None:
        """Also give the host its KSM settings back once no VM is left (a stopping edge)."""
        super().release_unused()
        if self._ksm_on and not self._live and self._ksm_before:
            try:
                ksm.give_back(self._ksm_before)
            except OSError as exc:
                log.warning("cannot restore the host's KSM settings: %s", exc)
            self._ksm_on, self._ksm_wanted = False, True

    async def _prepare(self, cid: str, spec: SandboxSpec, vm_dir: Path) -> list[str]:
        await self._start_ksm()
        assets = await self.assets()
        accel = await self.accel()
        ram_mb, vcpus = self.memory_mb(spec), self.vcpus(spec)
        memory: Path | None = None
        saved_ram: dict = {}
        if spec.snapshot is not None:  # a restore: the machine must be the one saved
            meta = self._memory_meta(spec.snapshot)
            ram_mb, vcpus = meta["memory_mb"], meta["vcpus"]
            # (A snapshot from before RAM files has its pages in the stream: private RAM.)
            memory, saved_ram = self._memory_dir(spec.snapshot), meta.get("ram", {})
        (vm_dir / "machine.json").write_text(json.dumps({"memory_mb": ram_mb, "vcpus": vcpus}))
        files = await self._layer_files(spec.layers)
        return self._argv(spec, vm_dir, files, assets, accel, ram_mb, vcpus,
                          {block: memory / f"{block}.ram" for block in saved_ram} if memory else {})

    def _argv(self, spec: SandboxSpec, vm_dir: Path, files: list[Path], assets, accel: str, ram_mb: int, vcpus: int,
              ram_files: dict[str, Path]) -> list[str]:
        """QEMU's arguments: a boot of ``spec`` (its layers as ``files``), or, when it names a
        memory snapshot, its restore from the RAM files ``ram_files`` (a RAM block's file each)."""
        argv = [*self._common_args(vm_dir, accel, "virtio-serial-device"), "-smp", str(vcpus)]
        machine_opts = "microvm,pcie=on"
        sizes = [-(-f.stat().st_size // (2 * MiB)) * 2 for f in files]  # MiB, 2 MiB steps
        ram = [(block, mb, self._ram_object(block, mb, ram_files.get(block)))
               for block, mb in self._ram_blocks(ram_mb, sum(sizes) if self.layer_mode == "pmem" else 0)]
        if self.layer_mode == "private":
            (block, _, obj), = ram
            machine_opts += f",mem-merge=off,memory-backend={block}"
            argv += ["-m", f"{ram_mb}M", "-object", obj]
            for i, f in enumerate(files):
                argv += ["-drive", f"file={f},if=none,id=layer{i},format=raw,readonly=on,cache.direct=on",
                         "-device", f"virtio-blk-device,drive=layer{i}"]
            extra = f"dsec.mode=microvm dsec.layers={len(files)} dsec.layerdev=vd"
        else:
            (head, head_mb, head_obj), (tail, _, tail_obj) = ram
            total = ram_mb + sum(sizes)
            if total > MAX_GUEST_SPAN_MB:
                raise BackendError(f"image {spec.image!r} needs {sum(sizes)} MB of pmem: with {ram_mb} MB of "
                                   f"memory that is over the {MAX_GUEST_SPAN_MB} MB a microVM maps")
            argv += ["-m", f"{total}M", "-object", head_obj, "-numa", f"node,nodeid=0,memdev={head}"]
            memmap = []
            addr = head_mb
            for i, (f, size) in enumerate(zip(files, sizes, strict=True)):
                argv += ["-object", f"memory-backend-file,id=layer{i},mem-path={f},size={size}M,share=on,readonly=on",
                         "-numa", f"node,nodeid={i + 1},memdev=layer{i}"]
                memmap.append(f"memmap={size}M!{addr}M")
                addr += size
            argv += ["-object", tail_obj, "-numa", f"node,nodeid={len(files) + 1},memdev={tail}"]
            extra = " ".join([*memmap, f"dsec.mode=microvm dsec.layers={len(files)}"])
        extra += " " + GUEST_SHARING_ARGS + self.protect_arg(spec)
        argv += ["-M", machine_opts]
        if spec.snapshot is None:
            argv += self._kernel_args(assets, accel, extra)
        else:
            # No kernel: the guest's is in the memory restored. QEMU would read the kernel and
            # initrd into its own memory for the firmware to load (14 MB of each clone's own,
            # never used again: a clone that reboots is ended, -no-reboot).
            argv += ["-incoming", "defer", "-S"]
        return argv

    # -- snapshots -------------------------------------------------------------------------

    def snapshot_dir(self, snapshot_id: str) -> Path:
        if not SNAPSHOT_ID.match(snapshot_id):
            raise SnapshotNotFound(f"malformed snapshot id {snapshot_id!r}")
        return self.snapshots_dir / snapshot_id

    def snapshot_meta(self, snapshot_id: str) -> dict:
        """The snapshot's metadata, once its files are checked: a missing, cut or rewritten RAM
        file is an error here, before any QEMU maps it."""
        self.snapshot_dir(snapshot_id)  # (a snapshot's id, not a boot template's)
        return self._memory_meta(snapshot_id)

    def _memory_dir(self, memory_id: str) -> Path:
        """Where the memory image a VM restores is kept: a snapshot's, or a boot template's."""
        if self.templates_dir is not None and TEMPLATE_ID.match(memory_id):
            return self.templates_dir / memory_id
        return self.snapshot_dir(memory_id)

    def _memory_meta(self, snapshot_id: str) -> dict:
        d = self._memory_dir(snapshot_id)
        try:
            meta = json.loads((d / "meta.json").read_text())
        except (OSError, ValueError):
            raise SnapshotNotFound(f"no snapshot {snapshot_id} on this node") from None
        if not (d / "state").is_file():
            raise SnapshotNotFound(f"snapshot {snapshot_id} has lost its state file")
        for block, saved in meta.get("ram", {}).items():
            path = d / f"{block}.ram"
            try:
                st = path.stat()
            except OSError:
                raise SnapshotNotFound(f"snapshot {snapshot_id} has lost its memory file {path.name}") from None
            if st.st_size != saved["size"]:
                raise SnapshotDamaged(f"snapshot {snapshot_id}: memory file {path.name} is {st.st_size} bytes, "
                                      f"{saved['size']} were saved (cut short or overwritten)")
            if st.st_mtime_ns != saved["mtime_ns"]:
                raise SnapshotDamaged(f"snapshot {snapshot_id}: memory file {path.name} was modified after "
                                      "the snapshot was taken")
        return meta

    async def snapshot(self, handle: Handle) -> dict:
        """Save memory and device state; the VM runs on afterwards. Returns the snapshot's
        metadata (``id``, ``size_bytes``, …). Whoever keeps it records its id (the snapshot
        catalogue); one no record holds is removed when the node starts again
        (``memory_snapshots``: a fork's, or one whose record a crash cut short).

        The VM is paused while QEMU writes its migration stream; then (the VM running again)
        the guest RAM's pages are split out of the stream into one sparse file per RAM block,
        which clones map copy-on-write (``ramsplit``)."""
        live = self._get(handle, "snapshot")
        snap_id = "s" + secrets.token_hex(8)
        tmp = self.snapshots_dir / f".{snap_id}"
        try:
            tmp.mkdir()
            meta = await self._save(handle, live, snap_id, tmp)
            tmp.rename(self.snapshots_dir / snap_id)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is kept, nor ever restored
            if self._disk_full(exc):
                raise BackendError(f"cannot snapshot {handle.cid}: no space left on the disk of {self.snapshots_dir} "
                                   f"for its memory (ENOSPC); nothing was kept") from None
            if isinstance(exc, QMPError):
                raise BackendError(f"cannot snapshot {handle.cid}: {exc}") from exc
            if isinstance(exc, ramsplit.StreamError):
                raise BackendError(f"cannot snapshot {handle.cid}: QEMU's migration stream: {exc}") from exc
            raise
        return meta

    def _disk_full(self, exc: BaseException) -> bool:
        """An error of writing the snapshot that came of its disk being full (an ``OSError``
        saying so, or QEMU's migration failing with the disk out of room)."""
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(exc, (QMPError, ramsplit.StreamError)):
            try:
                return os.statvfs(self.snapshots_dir).f_bavail * os.statvfs(self.snapshots_dir).f_frsize < 4 * MiB
            except OSError:
                return False
        return False

    async def _save(self, handle: Handle, live, snap_id: str, tmp: Path) -> dict:
        start = time.perf_counter()
        qmp = live.qmp
        await qmp.execute("migrate-set-capabilities", {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})
        await qmp.execute("migrate-set-parameters", {"max-bandwidth": MIGRATION_BANDWIDTH})
        await qmp.execute("stop")
        live.paused = True
        try:
            await qmp.execute("migrate", {"uri": f"exec:cat > {shlex.quote(str(tmp / 'stream'))}"})
            await self._wait_migration(qmp, handle.pid, "saving")
        finally:
            await qmp.execute("cont")
            live.paused = False
        paused_s = time.perf_counter() - start
        shape = json.loads((self.vm_dir(handle.cid) / "machine.json").read_text())
        blocks = dict(self._ram_blocks(shape["memory_mb"]))
        await asyncio.to_thread(ramsplit.split, tmp / "stream", tmp / "state",
                                {block: tmp / f"{block}.ram" for block in blocks})
        (tmp / "stream").unlink()
        ram = {}
        for block in blocks:
            path = tmp / f"{block}.ram"
            os.chmod(path, 0o400)
            st = path.stat()
            ram[block] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "allocated": st.st_blocks * 512}
        state_bytes = (tmp / "state").stat().st_size
        meta = {
            "id": snap_id, "kind": self.kind, "image": handle.image, "layers": list(handle.layers),
            "env": handle.env, "memory_mb": shape["memory_mb"], "vcpus": shape["vcpus"], "layer_mode": self.layer_mode,
            "accel": await self.accel(), "qemu": machine.qemu_version(),
            "kernel": (await self.assets()).kernel_version, "created_at": time.time(),
            "ram": ram, "state_bytes": state_bytes,
            "size_bytes": state_bytes + sum(r["allocated"] for r in ram.values()),
            "paused_s": paused_s, "save_s": time.perf_counter() - start,
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
        log.info("snapshot %s of %s: paused %.2f s, saved %.2f s", snap_id, handle.cid, paused_s, meta["save_s"])
        return meta

    async def recover(self, handles: list[Handle]) -> list[Handle]:
        alive = await super().recover(handles)
        # A snapshot cut short by a crash left its unfinished directory (with the raw stream).
        for unfinished in self.snapshots_dir.glob(".s*"):
            shutil.rmtree(unfinished, ignore_errors=True)
        # So did a boot template's (older than any save: the dir may be other servers' too).
        if self.templates_dir is not None and self.templates_dir.is_dir():
            for unfinished in self.templates_dir.glob(".t*"):
                with contextlib.suppress(OSError):
                    if time.time() - unfinished.stat().st_mtime > 2 * MIGRATION_TIMEOUT_S:
                        shutil.rmtree(unfinished, ignore_errors=True)
        return alive

    async def _wait_migration(self, qmp: QMP, pid: int, what: str) -> None:
        deadline = time.monotonic() + MIGRATION_TIMEOUT_S
        while True:
            info = await qmp.execute("query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise QMPError(f"{what} the memory state failed: {info.get('error-desc', status)}")
            if not machine.pid_alive(pid):
                raise QMPError(f"QEMU exited while {what} the memory state")
            if time.monotonic() > deadline:
                raise QMPError(f"{what} the memory state took over {MIGRATION_TIMEOUT_S:g}s")
            await asyncio.sleep(0.01)

    def memory_snapshots(self) -> list[str]:
        """The ids of the finished snapshots on this node."""
        return sorted(d.name for d in self.snapshots_dir.iterdir() if SNAPSHOT_ID.match(d.name))

    def delete_snapshot(self, snapshot_id: str) -> None:
        d = self.snapshot_dir(snapshot_id)
        if not d.exists():
            raise SnapshotNotFound(f"no snapshot {snapshot_id} on this node")
        shutil.rmtree(d, ignore_errors=True)

    async def create(self, cid: str, spec: SandboxSpec) -> Handle:
        if spec.snapshot is None:
            if self.templates_dir is None or spec.protected_paths:
                return await super().create(cid, spec)
            return await self._create_from_template(cid, spec)
        if spec.protected_paths:
            raise InvalidRequest("protected_paths cannot be given with a memory snapshot: a restored guest keeps "
                                 "the mounts it had when the snapshot was taken")
        meta = self.snapshot_meta(spec.snapshot)
        if tuple(meta["layers"]) != tuple(spec.layers):
            raise InvalidRequest(f"snapshot {spec.snapshot} was taken from image {meta['image']!r}, "
                                 f"whose layers differ from those of {spec.image!r}")
        if meta.get("layer_mode") != self.layer_mode:
            raise InvalidRequest(f"snapshot {spec.snapshot} has layers as {meta.get('layer_mode')}, this node as {self.layer_mode}")
        await self._check_made_here(spec.snapshot, meta)
        handle = await super().create(cid, spec)
        try:
            await self._set_clock(handle)
        except BaseException:
            await self.destroy(handle)
            raise
        return handle

    async def _set_clock(self, handle: Handle) -> None:
        """A restored guest wakes with the wall clock of the moment its memory was saved: set it
        to the host's (an agent from before ``clock``, in an old snapshot, keeps its own)."""
        live = self._get(handle, "set the clock of")
        if "clock" not in live.agent.features:
            return
        now = time.time_ns()
        try:
            await live.agent.request(f"clock {now // 10**9} {now % 10**9}", timeout=30.0)
        except AgentFailure as exc:
            raise BackendError(f"cannot set the clock of {self.kind} {handle.cid}: {exc.message}") from None
        except AgentGone as exc:
            raise self._gone(handle, live, exc) from None

    # -- boot templates ----------------------------------------------------------------------

    async def template_id(self, spec: SandboxSpec) -> str:
        """The boot template of a VM booted as ``spec`` asks: ``t`` and 16 hex digits of the
        digest of what makes its guest's memory what it is once booted — QEMU's arguments for the
        boot (the kernel command line with them, the layers named by their digests, the node's
        paths left out), the kernel file, the initramfs (named by the digest of what went in),
        QEMU's version and the accelerator."""
        assets, accel = await self.assets(), await self.accel()
        files = await self._layer_files(spec.layers)
        argv = self._argv(spec, Path("/vm"), files, assets, accel, self.memory_mb(spec), self.vcpus(spec), {})
        text = " ".join(argv)
        for digest, path in zip(spec.layers, files, strict=True):
            text = text.replace(str(path), f"layer:{digest}")
        kernel = assets.kernel.stat()
        text += f" kernel={kernel.st_size}:{kernel.st_mtime_ns} qemu={machine.qemu_version()}"
        return "t" + hashlib.sha256(text.encode()).hexdigest()[:16]

    async def _create_from_template(self, cid: str, spec: SandboxSpec) -> Handle:
        """A VM from its boot template when there is one (its memory restored: a fraction of a
        boot), made someone of its own (host name, a reseeded random number generator) and given
        the host's clock; else booted, and its memory then kept as the template (paused a
        moment, before anything ran in it). A template that cannot be restored is removed and the
        VM booted."""
        assert self.templates_dir is not None
        try:
            tid = await self.template_id(spec)
        except OSError:  # (the layers' files cannot be made: a boot says what went wrong, by name)
            return await super().create(cid, spec)
        tdir = self.templates_dir / tid
        if (tdir / "meta.json").exists():
            try:
                handle = await super().create(cid, replace(spec, snapshot=tid))
            except (InvalidRequest, BackendError, OSError) as exc:
                log.warning("boot template %s cannot be restored (%s): removed, %s boots", tid, exc, cid)
                shutil.rmtree(tdir, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.utime(tdir / "meta.json")  # (used: the last to go)
                try:
                    # (/etc/machine-id stays the image's, as a booted VM's: written, it would be
                    # a file in the upper that pack_diff and the tamper check see)
                    await self.new_identity(handle, spec.hostname, None, secrets.token_bytes(64))
                    await self._set_clock(handle)
                except BaseException:
                    await self.destroy(handle)
                    raise
                return handle
        handle = await super().create(cid, spec)
        if tid not in self._templating:
            self._templating.add(tid)
            try:
                await self._keep_template(handle, tid)
            except Exception as exc:  # (the VM is the caller's all the same)
                log.warning("cannot keep %s as boot template %s: %s", cid, tid, exc)
            except BaseException:  # cancelled: no one would ever be handed the VM
                await self.destroy(handle)
                raise
            finally:
                self._templating.discard(tid)
        return handle

    async def _keep_template(self, handle: Handle, tid: str) -> None:
        assert self.templates_dir is not None
        live = self._get(handle, "keep as a boot template")
        if not {"ident", "clock"} <= live.agent.features:
            return  # (its clones could not be made someone new)
        self.templates_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.templates_dir / f".{tid}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
            await self._save(handle, live, tid, tmp)
            try:
                tmp.rename(self.templates_dir / tid)
            except OSError:  # another server on this templates dir kept it first
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        await asyncio.to_thread(self._trim_templates)

    def _trim_templates(self) -> None:
        """At most ``TEMPLATES_KEPT`` templates: the least lately used go first."""
        assert self.templates_dir is not None
        kept = []
        for d in self.templates_dir.iterdir():
            with contextlib.suppress(OSError):
                if TEMPLATE_ID.match(d.name):
                    kept.append(((d / "meta.json").stat().st_mtime_ns, d))
        for _, d in sorted(kept, reverse=True)[TEMPLATES_KEPT:]:
            shutil.rmtree(d, ignore_errors=True)

    async def _check_made_here(self, snapshot_id: str, meta: dict) -> None:
        """A memory image is restored by the QEMU that saved it, into the guest kernel it holds:
        another QEMU may read its device state wrongly, and the guest's memory holds the old
        kernel's code, not the one this node would boot. Refused, naming both."""
        qemu, kernel = machine.qemu_version(), (await self.assets()).kernel_version
        saved_qemu, saved_kernel = meta.get("qemu", "unknown"), meta.get("kernel", kernel)
        if saved_qemu != qemu:
            raise SnapshotIncompatible(f"snapshot {snapshot_id} was made by QEMU {saved_qemu}; this node has QEMU "
                                       f"{qemu}, which cannot restore it (take the snapshot again here)")
        if saved_kernel != kernel:
            raise SnapshotIncompatible(f"snapshot {snapshot_id} holds a guest running kernel {saved_kernel}; this node "
                                       f"boots kernel {kernel}, whose VM it cannot resume (take the snapshot again here)")

    async def _before_agent(self, qmp: QMP, pid: int, spec: SandboxSpec) -> None:
        if spec.snapshot is None:
            return
        state = self._memory_dir(spec.snapshot) / "state"
        await qmp.execute("migrate-set-capabilities", {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})
        await qmp.execute("migrate-incoming", {"uri": f"exec:cat {shlex.quote(str(state))}"})
        try:
            await self._wait_migration(qmp, pid, "loading")
        except QMPError as exc:
            raise QMPError(f"cannot restore snapshot {spec.snapshot}: {exc}") from None
        await qmp.execute("cont")

