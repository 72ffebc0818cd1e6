"""Full VM sandboxes: QEMU ``q35`` booting the image's own init from a disk built from its layers.

The first VM of an image builds its base disk: the layers composed (overlayfs, read-only) and
copied into an ext4 image (``mkfs.ext4 -d``), kept in ``<node_dir>/vms/fullvm/.disks/`` by the
digest of the layers. Every VM of the image attaches that disk read-only (``/dev/vda``) and a
disk of its own (``/dev/vdb``: a qcow2 overlay over an empty ext4 template, so it starts at a
few hundred KB); the guest's initramfs mounts an overlay of the two as the root (the base never
changes; the VM's writes land in ``/dev/vdb``'s ``upper/``), and hands PID 1 to the image's
``/sbin/init``. An image whose init is busybox gets an inittab line that keeps the DSec agent
running (respawned if it dies); one whose init is systemd (a Debian with ``systemd-sysv``) gets a
unit, ``dsec-agent.service``, that does the same. An image with no init of its own boots the agent as PID 1.

Why an overlay in the guest rather than one ext4 disk written in place: ``pack_diff`` then has
the VM's changes as they are, file by file, with deletions as whiteouts and replaced
directories marked opaque, exactly as a container's or a microVM's upper, instead of having to
work them out by comparing a whole disk against the base tree.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from libdsec import BackendError

from ...images.layercache import LayerCache
from ..base import SandboxSpec
from .backend import VMBackend

INITTAB = """\
# Written by DSec: the image's busybox init keeps the DSec guest agent running.
::sysinit:/bin/hostname sandbox
::respawn:/dev/.dsec/agent
::shutdown:/bin/sync
"""
# An image whose init is systemd gets this unit (enabled early: the host waits for the agent).
AGENT_UNIT = """\
# Written by DSec: systemd keeps the DSec guest agent running.
[Unit]
Description=DSec guest agent
DefaultDependencies=no
After=systemd-remount-fs.service

[Service]
ExecStart=/dev/.dsec/agent
Restart=always
RestartSec=0.2
# The agent puts each command in a cgroup of its own (/sys/fs/cgroup/dsec/job*, outside
# systemd's tree), and systemd must leave those alone.
Delegate=yes
KillMode=process

[Install]
WantedBy=sysinit.target
"""
# The base disk is read-only: a little room for ext4's own metadata is all it needs.
FREE_SPACE_MB = 32
# Each VM's own disk (sparse: it takes on the host what the guest writes).
UPPER_DISK_MB = 4096


def _sh(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BackendError(f"{' '.join(cmd[:3])} … failed: {(proc.stdout + proc.stderr).strip()[-600:]}")


def build_base_disk(store, layers: tuple[str, ...], dest: Path, cache: LayerCache | None = None) -> None:
    """Compose ``layers`` and write them as an ext4 image at ``dest`` (atomically), reading the
    layers through the node's layer ``cache`` when it has one (the disk is kept on the node:
    its VMs read nothing of the store after)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as work:
        w = Path(work)
        mounts: list[Path] = []
        try:
            for i, digest in enumerate(layers):
                m = w / f"l{i}"
                m.mkdir()
                source = store.check_layer(digest)
                _sh(["mount", "-t", "erofs", "-o", "ro", str(cache.path(source) if cache else source), str(m)])
                mounts.append(m)
            if len(mounts) == 1:
                merged = mounts[0]
            else:
                merged = w / "merged"
                merged.mkdir()
                lower = ":".join(str(m) for m in reversed(mounts))
                _sh(["mount", "-t", "overlay", "-o", f"ro,lowerdir={lower}", "overlay", str(merged)])
                mounts.append(merged)
            root = w / "root"
            _sh(["cp", "-a", f"{merged}/.", str(root)])
        finally:
            for m in reversed(mounts):
                subprocess.run(["umount", str(m)], capture_output=True)
        init = root / "sbin/init"
        if init.is_symlink() and "busybox" in os.readlink(init):
            (root / "etc").mkdir(exist_ok=True)
            (root / "etc/inittab").write_text(INITTAB)
        elif init.is_symlink() and "systemd" in os.readlink(init):
            units = root / "etc/systemd/system"
            (units / "sysinit.target.wants").mkdir(parents=True, exist_ok=True)
            (units / "dsec-agent.service").write_text(AGENT_UNIT)
            wanted = units / "sysinit.target.wants/dsec-agent.service"
            wanted.unlink(missing_ok=True)
            wanted.symlink_to("/etc/systemd/system/dsec-agent.service")
        (root / "dev").mkdir(exist_ok=True)
        used = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())
        size_mb = used * 13 // 10 // (1 << 20) + FREE_SPACE_MB
        tmp = w / "disk.raw"
        _sh(["mkfs.ext4", "-q", "-F", "-E", "root_owner=0:0", "-d", str(root), str(tmp), f"{size_mb}M"])
        os.chmod(tmp, 0o444)
        os.rename(tmp, dest)


def _empty_ext4(dest: Path, size_mb: int) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        _sh(["mkfs.ext4", "-q", "-F", "-E", "root_owner=0:0", "-J", "size=16", str(tmp), f"{size_mb}M"])
        os.chmod(tmp, 0o444)
        os.rename(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


class FullVMBackend(VMBackend):
    kind = "fullvm"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.disks_dir = self.vms_dir / ".disks"
        self._disk_locks: dict[str, asyncio.Lock] = {}

    def describe(self) -> str:
        return super().describe() + ", q35 with a copy-on-write disk"

    async def upper_template(self) -> Path:
        """An empty ext4 image that every VM's own disk starts as (made once per node)."""
        path = self.disks_dir / f"upper-{UPPER_DISK_MB}m.raw"
        async with self._disk_locks.setdefault(path.name, asyncio.Lock()):
            if not path.exists():
                await asyncio.to_thread(_empty_ext4, path, UPPER_DISK_MB)
        return path

    async def base_disk(self, layers: tuple[str, ...]) -> Path:
        key = hashlib.sha256(("\n".join(layers) + INITTAB + AGENT_UNIT).encode()).hexdigest()[:24]
        path = self.disks_dir / f"{key}.raw"
        async with self._disk_locks.setdefault(key, asyncio.Lock()):
            if not path.exists():
                await asyncio.to_thread(build_base_disk, self.store, layers, path, self.layer_cache)
        return path

    async def _prepare(self, cid: str, spec: SandboxSpec, vm_dir: Path) -> list[str]:
        if spec.snapshot is not None:
            raise BackendError("full VMs take no memory snapshots here: restore one into a microvm")
        assets = await self.assets()
        accel = await self.accel()
        base = await self.base_disk(spec.layers)
        disk = vm_dir / "disk.qcow2"
        proc = await asyncio.create_subprocess_exec(
            "qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(await self.upper_template()), str(disk),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise BackendError(f"qemu-img could not make the disk overlay: {out.decode(errors='replace')[-400:]}")
        return [
            *self._common_args(vm_dir, accel, "virtio-serial-pci"),
            "-M", "q35", "-m", f"{self.memory_mb(spec)}M", "-smp", str(self.vcpus(spec)),
            "-drive", f"file={base},if=none,id=base,format=raw,readonly=on",
            "-device", "virtio-blk-pci,drive=base",
            "-drive", f"file={disk},if=none,id=disk0,format=qcow2,discard=unmap",
            "-device", "virtio-blk-pci,drive=disk0",
            *self._kernel_args(assets, accel, "dsec.mode=fullvm" + self.protect_arg(spec)),
        ]

    def release_unused(self) -> None:
        """Base disks stay cached."""
        super().release_unused()


def remove_disk_cache(backend: FullVMBackend) -> None:
    shutil.rmtree(backend.disks_dir, ignore_errors=True)
