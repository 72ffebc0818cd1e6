"""The root filesystem of the Debian 12 host VM that ``test_debian12_vm.py`` boots.

A Debian bookworm made by debootstrap, as a stock Debian 12 server has it where DSec matters:
systemd as PID 1 (so pure cgroup v2, systemd's default), AppArmor, crun, erofs-utils, podman
(the peer ``dsec bench lifecycle`` measures against) and python3. Onto it go:

- the guest kernel's modules (the Debian cloud kernel DSec boots every VM with, see
  ``dsec.backends.vm.assets``), with their ``modules.dep`` made by ``depmod`` here;
- DSec itself: this checkout's ``src``, ``tests`` and ``pyproject.toml`` under ``/opt/dsec``, and
  the Python packages DSec and its tests import, copied from the venv that runs this (same
  CPython minor version as bookworm's python3: 3.11);
- the native programs (``dsec.native``), built here: the guest needs no C compiler;
- the test store's images (busybox, python), so no test in the guest needs the network;
- a systemd unit, ``dsec-hostvm.service``, that runs ``guest_run.sh`` once at boot (outside the
  agent's confinement: DSec needs root with every capability); its results land in
  ``/var/lib/dsec-hostvm``. The full-VM backend adds the agent's own unit (``dsec-agent.service``)
  when it builds the disk, as for any image whose init is systemd.

The debootstrap'ed tree is cached by its package list (it takes a few minutes); the rest is laid
anew on a copy each time, since the checkout changes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
from pathlib import Path

from dsec.images.builders import apt_mirror

SUITE = "bookworm"
PACKAGES = (
    "systemd-sysv", "apparmor", "crun", "erofs-utils", "busybox-static", "python3", "kmod",
    "podman", "containernetworking-plugins", "nftables", "iproute2", "procps", "util-linux", "ca-certificates",
)
REPO = Path(__file__).resolve().parents[2]
# What DSec and its test subsets import (ray and the linters stay out: the guest runs no cluster).
TOP_REQUIREMENTS = ("httpx", "httptools", "sniffio", "pydantic", "fastapi", "uvicorn", "typer", "rich",
                    "asyncpg", "pytest", "pytest-asyncio")
HERE = Path(__file__).parent

RUN_UNIT = """\
[Unit]
Description=DSec host test subsets (tests/hosts/guest_run.sh)
# Not After=multi-user.target: the target waits for what it wants, and the two would make a cycle
# (which systemd breaks by dropping this unit's job).
After=basic.target apparmor.service systemd-modules-load.service
Wants=apparmor.service

[Service]
Type=oneshot
ExecStart=/bin/bash /opt/dsec/tests/hosts/guest_run.sh
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=infinity
Delegate=yes

[Install]
WantedBy=multi-user.target
"""


def _run(cmd: list[str], **kw) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} … failed: {(proc.stdout + proc.stderr)[-1500:]}")


def debootstrap_tree(cache: Path) -> Path:
    """The bare Debian tree (cached under ``cache`` by suite and package list)."""
    key = hashlib.sha256(f"{SUITE} {' '.join(PACKAGES)}".encode()).hexdigest()[:12]
    tree = cache / f"debootstrap-{SUITE}-{key}"
    if (tree / ".done").exists():
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(tree)]
    if mirror := apt_mirror(SUITE):
        cmd.append(mirror)
    _run(cmd)
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        shutil.rmtree(tree / junk, ignore_errors=True)
        (tree / junk).mkdir(parents=True, exist_ok=True)
    (tree / ".done").write_text("")
    return tree


def _requirement_closure(names: tuple[str, ...]) -> list[md.Distribution]:
    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = re.split(r"[\s<>=!~;\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if not name or name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen[name] = dist
        for req in dist.requires or ():
            if "extra ==" in req:
                continue
            todo.append(req)
    return list(seen.values())


def copy_python_packages(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for dist in _requirement_closure(TOP_REQUIREMENTS):
        for f in dist.files or ():
            src = Path(dist.locate_file(f)).resolve()
            if not src.is_file() or "__pycache__" in src.parts or not str(f).strip() or str(f).startswith(".."):
                continue
            target = dest / f
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def lay_out(tree: Path, root: Path, kernel_dir: Path, test_store: Path) -> None:
    """Copy ``tree`` to ``root`` and put the kernel's modules, DSec and the units in it."""
    shutil.rmtree(root, ignore_errors=True)
    _run(["cp", "-a", f"{tree}/.", str(root)])
    (root / ".done").unlink(missing_ok=True)
    version = kernel_dir.name
    (root / "usr/lib/modules").mkdir(parents=True, exist_ok=True)  # /lib is usr/lib (merged /usr)
    _run(["cp", "-a", str(kernel_dir / "modules"), str(root / "usr/lib/modules" / version)])
    _run(["chroot", str(root), "depmod", version])  # the guest's own kmod
    opt = root / "opt/dsec"
    opt.mkdir(parents=True)
    for part in ("src", "tests"):
        shutil.copytree(REPO / part, opt / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))
    shutil.copy2(REPO / "pyproject.toml", opt / "pyproject.toml")
    copy_python_packages(opt / "site")
    (root / "usr/lib/python3/dist-packages/dsec-hostvm.pth").write_text("/opt/dsec/src\n/opt/dsec/site\n")
    from dsec import native

    bins = root / str(native.CACHE).lstrip("/")
    bins.mkdir(parents=True, exist_ok=True)
    for name in ("agent", "init", "jail"):
        shutil.copy2(native.binary(name), bins)
    shutil.copy2(native.library("zygote"), bins)
    (root / "var/lib/dsec-test").mkdir(parents=True, exist_ok=True)
    _run(["cp", "-a", str(test_store), str(root / "var/lib/dsec-test/store")])
    units = root / "etc/systemd/system"
    (units / "dsec-hostvm.service").write_text(RUN_UNIT)
    wants = units / "multi-user.target.wants"
    wants.mkdir(exist_ok=True)
    (wants / "dsec-hostvm.service").symlink_to("/etc/systemd/system/dsec-hostvm.service")
    (root / "etc/hostname").write_text("dsec-debian12\n")
    # No getty on a console nobody reads; no network wait (the VM has none).
    for unit in ("getty@tty1.service", "serial-getty@ttyS0.service", "systemd-networkd-wait-online.service"):
        (units / unit).unlink(missing_ok=True)
        (units / unit).symlink_to("/dev/null")
    (root / "etc/fstab").write_text("")
    (root / "var/lib/dsec-hostvm").mkdir(parents=True, exist_ok=True)


if __name__ == "__main__":  # python tests/hosts/guest_root.py CACHE: make the debootstrap tree now
    print(debootstrap_tree(Path(sys.argv[1])))
