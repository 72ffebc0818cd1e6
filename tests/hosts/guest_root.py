"""The root filesystem of the Debian 12 host VM that ``test_debian12_vm.py`` boots.

A Debian bookworm made by debootstrap, as a stock Debian 12 server has it where DSec matters:
systemd as PID 1 (so pure cgroup v2, systemd's default), AppArmor, crun, erofs-utils, podman
(the peer ``dsec bench lifecycle`` measures against) and python3. Onto it go:

- the guest kernel's modules (the Debian cloud kernel DSec boots every VM with, see
  ``dsec.backends.vm.assets``), with their ``modules.dep`` made by ``depmod`` here;
- DSec itself: this checkout's ``src``, ``libdsec``, ``bench``, ``tests`` and ``pyproject.toml`` under ``/opt/dsec``, and
  the Python packages DSec and its tests import, copied from the venv that runs this (same
  CPython minor version as bookworm's python3: 3.11);
- the native programs (``dsec.native``), built here: the guest needs no C compiler;
- the test store's images (busybox, python), so no test in the guest needs the network;
- a systemd unit, ``dsec-hostvm.service``, that runs ``guest_run.sh`` once at boot (outside the
  agent's confinement: DSec needs root with every capability); its results land in
  ``/var/lib/dsec-hostvm``. The full-VM backend adds the agent's own unit (``dsec-agent.service``)
  when it builds the disk, as for any image whose init is systemd.

So that a run lays out only what changes, the guest's disk is one layer, ``base_layer``: the
debootstrap'ed tree and all of the above but the checkout, cached in a store of its own beside
the debootstrap tree, by what it is made of (and the full-VM backend's disk of it in a node
directory there). The checkout and its native programs (``checkout_tar``, a few MB, made each
run) are written into the booted guest through its agent; the unit's ``start.sh`` waits for
them and runs ``guest_run.sh`` from them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dsec.images.builders import apt_mirror

SUITE = "bookworm"
PACKAGES = (
    "systemd-sysv", "apparmor", "crun", "erofs-utils", "busybox-static", "python3", "kmod",
    # dbus: crun under podman (systemd cgroup manager) needs the system bus ("cannot open sd-bus");
    # every Debian server has it, minbase does not.
    "podman", "dbus", "containernetworking-plugins", "nftables", "iproute2", "procps", "util-linux", "ca-certificates",
)
REPO = Path(__file__).resolve().parents[2]
# What DSec and its test subsets import: pyproject's dependencies and its test extra, read from
# it (a dependency added there is in the guest too), but these (the guest runs no cluster and no linter).
NOT_IN_GUEST = frozenset({"ray", "ruff"})
# The distributions of this checkout (their sources go in with it; their dependencies are read).
CHECKOUT_PROJECTS = ("libdsec/pyproject.toml", "pyproject.toml", "bench/pyproject.toml")


def top_requirements() -> tuple[str, ...]:
    import tomllib

    reqs: list[str] = []
    for path in CHECKOUT_PROJECTS:
        project = tomllib.loads((REPO / path).read_text())["project"]
        reqs += [*project["dependencies"], *project.get("optional-dependencies", {}).get("test", ())]
    names = [re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-") for req in reqs]
    return tuple(n for n in dict.fromkeys(names) if n not in NOT_IN_GUEST)

HERE = Path(__file__).parent
# The test store's images the guest's tests use (the test fixtures build them on the host first).
GUEST_IMAGES = ("busybox", "python")
QUIET_UNITS = (
    "podman.service", "podman.socket", "podman-restart.service", "podman-auto-update.service",
    "podman-auto-update.timer", "apt-daily.timer", "apt-daily-upgrade.timer", "dpkg-db-backup.timer",
    "e2scrub_all.timer", "e2scrub_reap.service", "fstrim.timer",
)

RUN_UNIT = """\
[Unit]
Description=DSec host test subsets (tests/hosts/guest_run.sh)
# Not After=multi-user.target: the target waits for what it wants, and the two would make a cycle
# (which systemd breaks by dropping this unit's job).
After=basic.target apparmor.service systemd-modules-load.service
Wants=apparmor.service

[Service]
Type=oneshot
ExecStart=/bin/bash /usr/local/lib/dsec-hostvm/start.sh
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=infinity
Delegate=yes

[Install]
WantedBy=multi-user.target
"""
# The checkout is not in the guest's disk (which is then the same from run to run, and cached):
# the host writes it through the guest agent once the agent answers, as a tar, and "go" last.
CHECKOUT_TAR = "/var/lib/dsec-hostvm/checkout.tar"
START = f"""\
#!/bin/bash
# Waits for the host's checkout (test_debian12_vm.py writes it through the agent), unpacks it
# and runs its tests/hosts/guest_run.sh.
for _ in $(seq 600); do
    [ -e /var/lib/dsec-hostvm/go ] && break
    sleep 1
done
tar -xf {CHECKOUT_TAR} -C / || {{ echo "dsec-hostvm: no checkout" > /dev/ttyS0; exit 1; }}
exec /bin/bash /opt/dsec/tests/hosts/guest_run.sh
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
    for dist in _requirement_closure(top_requirements()):
        for f in dist.files or ():
            src = Path(dist.locate_file(f)).resolve()
            if not src.is_file() or "__pycache__" in src.parts or not str(f).strip() or str(f).startswith(".."):
                continue
            target = dest / f
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def copy_images(store: Path, dest: Path, names: tuple[str, ...]) -> None:
    """The images ``names`` of the store at ``store`` (manifests and EROFS layers), to a new store
    at ``dest``: the shared test store also holds other tests' images and their builds in progress."""
    from dsec.images.store import LayerStore

    src = LayerStore(store)
    for name in names:
        image = src.get_image(name)
        for digest in image.layers:
            target = dest / "layers" / src.layer_path(digest).name
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                shutil.copy2(src.layer_path(digest), target)
        (dest / "images").mkdir(parents=True, exist_ok=True)
        shutil.copy2(src.images_dir / f"{name}.json", dest / "images" / f"{name}.json")


def _lay_out_base(tree: Path, root: Path, kernel_dir: Path, test_store: Path) -> None:
    """Copy ``tree`` to ``root`` and put in it all but DSec's checkout: the kernel's modules, the
    Python packages, the test images and the units."""
    shutil.rmtree(root, ignore_errors=True)
    _run(["cp", "-a", f"{tree}/.", str(root)])
    (root / ".done").unlink(missing_ok=True)
    version = kernel_dir.name
    (root / "usr/lib/modules").mkdir(parents=True, exist_ok=True)  # /lib is usr/lib (merged /usr)
    _run(["cp", "-a", str(kernel_dir / "modules"), str(root / "usr/lib/modules" / version)])
    _run(["chroot", str(root), "depmod", version])  # the guest's own kmod
    if (kernel_dir / "config").exists():  # as the kernel package installs it (tests judge by it)
        shutil.copy(kernel_dir / "config", root / "boot" / f"config-{version}")
    copy_python_packages(root / "opt/dsec/site")
    # Compiled once here, by the guest's own python3: under TCG, compiling fastapi, pydantic and
    # the rest on each import took minutes per dsec process (servers then missed their start
    # timeout). A file that does not compile (none DSec imports) is left to the source.
    subprocess.run(["chroot", str(root), "python3", "-m", "compileall", "-q", "/opt/dsec/site"],
                   capture_output=True)
    (root / "usr/lib/python3/dist-packages/dsec-hostvm.pth").write_text("/opt/dsec/src\n/opt/dsec/libdsec/src\n/opt/dsec/bench/src\n/opt/dsec/site\n")
    copy_images(test_store, root / "var/lib/dsec-test/store", GUEST_IMAGES)
    units = root / "etc/systemd/system"
    (units / "dsec-hostvm.service").write_text(RUN_UNIT)
    start = root / "usr/local/lib/dsec-hostvm/start.sh"
    start.parent.mkdir(parents=True)
    start.write_text(START)
    wants = units / "multi-user.target.wants"
    wants.mkdir(exist_ok=True)
    (wants / "dsec-hostvm.service").symlink_to("/etc/systemd/system/dsec-hostvm.service")
    (root / "etc/hostname").write_text("dsec-debian12\n")
    # No getty on a console nobody reads; no network wait (the VM has none); none of the timers
    # and podman's boot units (nothing to restart or update), which would only take TCG's time
    # in the middle of a measurement (podman's storage is mounted later, by guest_run.sh).
    for unit in ("getty@tty1.service", "serial-getty@ttyS0.service", "systemd-networkd-wait-online.service",
                 *QUIET_UNITS):
        (units / unit).unlink(missing_ok=True)
        (units / unit).symlink_to("/dev/null")
    (root / "etc/fstab").write_text("")
    (root / "var/lib/dsec-hostvm").mkdir(parents=True, exist_ok=True)


def wait_for_images(test_store: Path, timeout: float = 1800.0) -> None:
    """Until the test store has the guest's images: the runner starts at the suite's first test,
    beside the build of ``python`` there, and needs them only once its own tree is made."""
    from dsec.images.store import LayerStore

    store = LayerStore(test_store)
    deadline = time.monotonic() + timeout
    while missing := [name for name in GUEST_IMAGES if not store.has_image(name)]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test store {test_store} has no image {', '.join(missing)} after {timeout:.0f} s")
        time.sleep(2)


def _base_key(tree: Path, kernel_dir: Path, test_store: Path) -> str:
    """What the base layer is made of: the debootstrap tree, the kernel, the Python packages'
    versions, the test images' layers, and this file (the units and the lay-out)."""
    from dsec.images.store import LayerStore

    store = LayerStore(test_store)
    parts = [tree.name, kernel_dir.name, Path(__file__).read_text(),
             *sorted(f"{d.metadata['Name']}=={d.version}" for d in _requirement_closure(top_requirements())),
             *(digest for name in GUEST_IMAGES for digest in store.get_image(name).layers)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def base_layer(cache: Path, store, kernel_dir: Path, test_store: Path) -> str:
    """The guest's root without DSec's checkout, as a layer of ``store`` (a store of the cache's own):
    made once per ``_base_key`` (about a minute, and a few more for the debootstrap tree the
    first time), then reused. This kernel's base layers of older keys are removed from ``store``."""
    tree = debootstrap_tree(cache)
    wait_for_images(test_store)
    key = _base_key(tree, kernel_dir, test_store)
    marker = cache / f"base-{kernel_dir.name}-{key}.layer"  # one kept per kernel (one per row of the test)
    if marker.exists() and store.has_layer(digest := marker.read_text().strip()):
        return digest
    for left in cache.glob("base-*.tmp"):  # a killed run's
        shutil.rmtree(left, ignore_errors=True)
    root = cache / f"base-{key}.tmp"
    try:
        _lay_out_base(tree, root, kernel_dir, test_store)
        digest = store.add_dir(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for old in cache.glob("base-*.layer"):
        # this kernel's of other keys, and those named by key alone (before the kernel was in the name)
        if old != marker and (old.name.startswith(f"base-{kernel_dir.name}-")
                              or re.fullmatch(r"base-[0-9a-f]+\.layer", old.name)):
            store.remove_layer(old.read_text().strip())
            old.unlink()
    marker.write_text(digest + "\n")
    return digest


def checkout_tar(env: dict[str, str]) -> bytes:
    """This checkout (``src``, ``libdsec``, ``bench``, ``tests`` and ``pyproject.toml`` under ``/opt/dsec``), the native
    programs built from it, and ``/etc/dsec-hostvm.env`` (``env``: the runner's settings), as a
    tar to unpack at the guest's ``/``: a few MB, made anew each run."""
    import io
    import tarfile

    from dsec import native, settings

    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if "__pycache__" in info.name or info.name.endswith(".pyc") or ".pytest_cache" in info.name:
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for part in ("src", "libdsec", "bench", "tests", "pyproject.toml"):
            tar.add(REPO / part, f"opt/dsec/{part}", filter=clean)
        bins = str(settings.current().native_cache).lstrip("/")
        for path in (*(native.binary(name) for name in ("agent", "init", "jail")), native.library("zygote")):
            tar.add(path, f"{bins}/{path.name}", filter=clean)
        data = "".join(f"export {k}={v!r}\n" for k, v in sorted(env.items())).encode()
        info = tarfile.TarInfo("etc/dsec-hostvm.env")
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


if __name__ == "__main__":  # python tests/hosts/guest_root.py CACHE: make the debootstrap tree now
    print(debootstrap_tree(Path(sys.argv[1])))
