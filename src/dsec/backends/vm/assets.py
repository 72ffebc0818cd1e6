"""What a DSec VM boots: a Debian cloud kernel and an initramfs the project builds.

The kernel comes from Debian's cloud kernel package (``linux-image-cloud-amd64`` names the
current one): it is fetched with ``apt-get download`` into ``<assets>/tmp``, unpacked with
``dpkg-deb -x`` (never installed on the host) and kept under ``<assets>/kernel/<version>/``,
with its payload unpacked once to ``vmlinux``: QEMU starts that at its PVH entry, with no
firmware set-up and no decompressor to run in the guest (``pvh_kernel``).
The initramfs is a newc cpio of the host's busybox-static, the kernel modules a guest needs (with
their dependencies, read from each module's ``.modinfo`` section: the package ships no
modules.dep), the guest scripts (``guest/``), the guest agent (the static ``dsec-agent``,
``native/agent.c``) and what the agent confines each command with: the static ``dsec-jail``, the
sandbox seccomp profile compiled to BPF and the capability numbers to keep (see
``dsec.isolation.jail``). It is named by the digest of what went in, so a changed script,
program, profile or kernel makes a new one.

Both are made once per assets directory (under a file lock, so concurrent first uses wait for
one another) and reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from libdsec import BackendError

from ... import native, settings
from ...isolation.jail import GUEST_ALSO_ALLOWED, caps_argument, jail_binary, seccomp_bpf
from ...isolation.profile import seccomp_profile

STALE_S = 86400.0
BUSYBOX = Path("/bin/busybox")
GUEST_DIR = Path(__file__).parent / "guest"
# Loaded in this order by the guest's init; dependencies are added in front of what needs them.
GUEST_MODULES = (
    "virtio_mmio", "virtio_pci", "virtio_console", "virtio_blk",
    "libnvdimm", "nd_e820", "nd_pmem", "crc32c_generic", "erofs", "overlay",
)


@dataclass(frozen=True)
class GuestAssets:
    kernel: Path
    initramfs: Path
    kernel_version: str


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BackendError(f"{' '.join(cmd)} failed: {(proc.stdout + proc.stderr).strip()[-800:]}")
    return proc.stdout


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_MODULE_SUFFIXES = (".ko", ".ko.xz", ".ko.gz")  # Debian's kernels from 6.12 on ship theirs xz-compressed


def module_name(path: Path) -> str:
    """A module file's module name (``virtio_blk`` of ``virtio_blk.ko.xz``)."""
    name = path.name
    for suffix in _MODULE_SUFFIXES[::-1]:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


def module_bytes(path: Path) -> bytes:
    """A module file's ELF, decompressed (busybox's insmod in the initramfs takes plain ones)."""
    data = path.read_bytes()
    if path.name.endswith(".xz"):
        import lzma

        return lzma.decompress(data)
    if path.name.endswith(".gz"):
        import gzip

        return gzip.decompress(data)
    return data


def modinfo(path: Path) -> dict[str, list[str]]:
    """The key=value pairs of an ELF64 kernel module's ``.modinfo`` section."""
    data = module_bytes(path)
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise BackendError(f"{path} is not an ELF64 kernel module")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]
    info: dict[str, list[str]] = {}
    for name, _type, _flags, _addr, offset, size in sections:
        end = data.index(b"\0", names_at + name)
        if data[names_at + name:end] == b".modinfo":
            for item in data[offset:offset + size].split(b"\0"):
                key, sep, value = item.decode(errors="replace").partition("=")
                if sep:
                    info.setdefault(key, []).append(value)
    return info


def module_load_order(modules_dir: Path, wanted: tuple[str, ...]) -> list[Path]:
    """The module files for ``wanted`` and everything they depend on, dependencies first.
    Modules built into the kernel (in modules.builtin) need no file and are skipped."""
    files = {module_name(p).replace("-", "_"): p for suffix in _MODULE_SUFFIXES for p in modules_dir.rglob(f"*{suffix}")}
    order: list[Path] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        name = name.replace("-", "_")
        if name in seen:
            return
        seen.add(name)
        path = files.get(name)
        if path is None:
            return  # built in, or not in this kernel
        for deps in modinfo(path).get("depends", []):
            for dep in filter(None, deps.split(",")):
                visit(dep)
        order.append(path)

    for name in wanted:
        visit(name)
    return order


# A compressed kernel's payload, by its magic: the tool that unpacks it to standard output.
_PAYLOADS = ((b"\x02\x21\x4c\x18", ("lz4", "-dc")), (b"\x28\xb5\x2f\xfd", ("zstd", "-dcq")),
             (b"\x1f\x8b", ("gzip", "-dc")), (b"\xfd7zXZ\x00", ("xz", "-dc")))
_PVH_NOTE = 18  # XEN_ELFNOTE_PHYS32_ENTRY: the kernel's 32-bit entry point for a PVH boot


def pvh_kernel(kdir: Path) -> Path | None:
    """``kdir/vmlinux``: the kernel ``kdir/vmlinuz`` holds, unpacked once, which QEMU starts at
    its PVH entry: no firmware's real-mode set-up and no decompressor in the guest (about half a
    second of every boot under TCG). None when the kernel has no PVH entry or its payload's
    unpacker is not installed (asked again at the next start): the VMs then boot ``vmlinuz``.
    Call it under the cache's lock."""
    out = kdir / "vmlinux"
    if out.exists():
        return out
    if (kdir / "vmlinux.none").exists():
        return None
    image = (kdir / "vmlinuz").read_bytes()
    try:
        if image[0x202:0x206] != b"HdrS":
            raise ValueError("not a bzImage")
        setup_sects = image[0x1F1] or 4
        offset, length = struct.unpack_from("<II", image, 0x248)  # the bzImage's payload_offset, _length
        payload = image[(setup_sects + 1) * 512 + offset:][:length]
        tool = next((argv for magic, argv in _PAYLOADS if payload.startswith(magic)), None)
        if tool is None:
            raise ValueError(f"a payload of no known format ({payload[:6].hex()})")
        if shutil.which(tool[0]) is None:
            return None
        # (its exit status is not looked at: lz4 and zstd complain of the size field after the
        # frames, with the kernel out by then; a kernel cut short fails the check below)
        elf = subprocess.run(tool, input=payload, capture_output=True).stdout
        if not _whole_with_pvh_note(elf):
            raise ValueError("no whole ELF kernel with a PVH entry in the payload")
    except (ValueError, IndexError, struct.error):
        (kdir / "vmlinux.none").touch()  # this kernel boots as vmlinuz for good
        return None
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(elf)
    os.rename(tmp, out)
    return out


def _whole_with_pvh_note(elf: bytes) -> bool:
    """Whether ``elf`` is an ELF64 whose segments are all there and whose PT_NOTE segments hold
    Xen's PHYS32_ENTRY note."""
    if elf[:5] != b"\x7fELF\x02":
        return False
    phoff = struct.unpack_from("<Q", elf, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    headers = [struct.unpack_from("<IIQQQQ", elf, phoff + i * phentsize) for i in range(phnum)]
    if not headers or any(offset + size > len(elf) for _type, _flags, offset, _vaddr, _paddr, size in headers):
        return False
    for p_type, _flags, p_offset, _vaddr, _paddr, p_filesz in headers:
        if p_type != 4:  # PT_NOTE
            continue
        at, end = p_offset, p_offset + p_filesz
        while at + 12 <= end:
            namesz, descsz, kind = struct.unpack_from("<III", elf, at)
            name = elf[at + 12:at + 12 + namesz].rstrip(b"\0")
            if name == b"Xen" and kind == _PVH_NOTE:
                return True
            at += 12 + -(-namesz // 4) * 4 + -(-descsz // 4) * 4
    return False


def _cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc archive of (name, mode, data) entries; a symlink's data is its target."""
    out = io.BytesIO()
    for ino, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        raw = name.encode() + b"\0"
        nlink = 2 if mode & 0o170000 == 0o040000 else 1
        fields = (ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(raw), 0)
        out.write(b"070701" + b"".join(b"%08X" % f for f in fields) + raw)
        out.write(b"\0" * (-(110 + len(raw)) % 4))
        out.write(data)
        out.write(b"\0" * (-len(data) % 4))
    return out.getvalue()


class AssetCache:
    """Guest kernel and initramfs under ``root`` (e.g. ``<state dir>/vm``)."""

    def __init__(self, root: Path, kernel_package: str | None = None) -> None:
        self.root = Path(root)
        # The kernel package fetched when ``root`` has no kernel yet (a root keeps the first it got).
        self.kernel_package = kernel_package or settings.current().guest_kernel_package

    def ensure(self) -> GuestAssets:
        with _locked(self.root / ".lock"):
            kdir = self._kernel_dir()
            version = kdir.name
            initramfs = self._initramfs(kdir)
            kernel = pvh_kernel(kdir) or kdir / "vmlinuz"
        return GuestAssets(kernel=kernel, initramfs=initramfs, kernel_version=version)

    # -- kernel ----------------------------------------------------------------------------

    def _kernel_dir(self) -> Path:
        kernels = self.root / "kernel"
        ready = sorted(p for p in kernels.glob("*") if (p / "vmlinuz").exists() and (p / "modules").is_dir())
        if ready:
            return ready[-1]
        for tool in ("apt-get", "apt-cache", "dpkg-deb"):
            if shutil.which(tool) is None:
                raise BackendError(f"{tool} not found: the guest kernel comes from a Debian package")
        package = self._kernel_package()
        tmp = self.root / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=tmp) as work:
            work_dir = Path(work)
            os.chmod(work_dir, 0o755)  # apt's download sandbox user must be able to write there
            _run(["apt-get", "download", "-q", package], cwd=work_dir)
            debs = list(work_dir.glob("*.deb"))
            if not debs:
                raise BackendError(f"apt-get download {package} left no .deb")
            tree = work_dir / "tree"
            _run(["dpkg-deb", "-x", str(debs[0]), str(tree)])
            vmlinuz = sorted((tree / "boot").glob("vmlinuz-*"))
            mods = sorted((tree / "lib/modules").glob("*"))
            if not vmlinuz or not mods:
                raise BackendError(f"{package} holds no kernel image or modules")
            version = mods[0].name
            staged = work_dir / version
            staged.mkdir()
            shutil.move(str(vmlinuz[0]), staged / "vmlinuz")
            shutil.move(str(mods[0]), staged / "modules")
            for config in (tree / "boot").glob("config-*"):
                shutil.move(str(config), staged / "config")
            kernels.mkdir(parents=True, exist_ok=True)
            os.rename(staged, kernels / version)
        return kernels / version

    def _kernel_package(self) -> str:
        """The versioned kernel package the meta package currently points at."""
        package = self.kernel_package
        out = _run(["apt-cache", "depends", package])
        for line in out.splitlines():
            m = re.match(r"\s*Depends:\s*(linux-image-\S+)", line)
            if m:
                return m.group(1)
        if "linux-image-" in package and re.search(r"\d", package):
            return package
        raise BackendError(
            f"cannot resolve {package}: run `apt-get update` (apt-cache knows no such package)"
        )

    # -- initramfs -------------------------------------------------------------------------

    def _initramfs(self, kdir: Path) -> Path:
        if not BUSYBOX.exists():
            raise BackendError(f"{BUSYBOX} not found: install busybox-static")
        modules = module_load_order(kdir / "modules", GUEST_MODULES)
        scripts = {name: (GUEST_DIR / name).read_bytes() for name in ("init.sh", "pack.sh", "pid1.sh")}
        busybox = BUSYBOX.read_bytes()
        programs = ("agent", "jail")
        confinement = {"agent": native.binary("agent", self.root).read_bytes(),
                       "jail": jail_binary(self.root).read_bytes(),
                       "seccomp.bpf": seccomp_bpf(seccomp_profile(GUEST_ALSO_ALLOWED)),
                       "caps": caps_argument().encode()}
        h = hashlib.sha256(kdir.name.encode() + busybox)
        for name, data in sorted({**scripts, **confinement}.items()):
            h.update(name.encode() + data)
        for m in modules:
            h.update(m.name.encode())
        path = self.root / f"initramfs-{h.hexdigest()[:16]}.cpio"
        if path.exists():
            os.utime(path)  # in use: see below
            return path
        entries: list[tuple[str, int, bytes]] = [
            (d, 0o040755, b"") for d in ("bin", "dev", "proc", "sys", "dsec", "lib", "lib/modules")
        ]
        entries.append(("bin/busybox", 0o100755, busybox))
        entries.append(("bin/sh", 0o120777, b"busybox"))
        entries.append(("init", 0o100755, scripts["init.sh"]))
        for name in ("pack.sh", "pid1.sh"):
            entries.append((f"dsec/{name}", 0o100644, scripts[name]))
        for name, data in confinement.items():
            entries.append((f"dsec/{name}", 0o100755 if name in programs else 0o100644, data))
        for m in modules:
            entries.append((f"lib/modules/{module_name(m)}.ko", 0o100644, module_bytes(m)))
        load = "".join(module_name(m) + "\n" for m in modules)
        entries.append(("lib/modules/load", 0o100644, load.encode()))
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(_cpio_newc(entries))
        os.rename(tmp, path)
        # Others go once unused for a day: another checkout of DSec may share this directory
        # (its scripts make another initramfs) and boot from its own right now.
        for old in self.root.glob("initramfs-*.cpio"):
            with contextlib.suppress(OSError):
                if old != path and time.time() - old.stat().st_mtime > STALE_S:
                    old.unlink()
        return path
