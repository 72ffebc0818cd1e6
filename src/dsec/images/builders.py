"""Builders for the images that exist after set-up: ``busybox`` and ``python``.

``busybox`` is made from the host's busybox-static in well under a second. ``python`` is a
Debian bookworm minbase made by debootstrap with python3, bash and git; it takes about half a
minute and is cached (``ensure_default_images`` skips images that exist). ``swe-agent``
(``python`` plus what SWE-agent's commands assume), ``e2b-base`` (E2B's ``base`` template: user
``user`` with passwordless sudo), ``desktop`` (E2B's ``desktop`` template, on ``e2b-base``) and
the toolchain images (``LANGUAGE_IMAGES``: ``lang-cpp`` …) are built on demand (``dsec image
build NAME``) as one layer over the image below them (``derive``): apt-get in a chroot of the
lower image's layers under an overlay, whose upper becomes the layer. That takes seconds where a
debootstrap of its own took a minute (the g++ image: about 5 s of apt against 57 s), and the
images share their lower layers on disk and in the page cache.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from .store import Image, LayerBuildError, LayerStore

BUSYBOX_BIN = Path("/bin/busybox")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PYTHON_PACKAGES = ("python3", "bash", "git", "ca-certificates")
# SWE-agent's commands and SWE-ReX's tests call `python` (python-is-python3 links it) and page with `less`.
SWE_AGENT_PACKAGES = (*PYTHON_PACKAGES, "python-is-python3", "less")
# E2B's base template: what its SDK's tests and its ReadyCmd helpers call (curl, sudo, `ss` of
# iproute2 for wait_for_port, `pgrep` of procps for wait_for_process, `python -m http.server`).
E2B_BASE_PACKAGES = (*PYTHON_PACKAGES, "python-is-python3", "curl", "sudo", "iproute2", "procps")
# The desktop: Xvfb and the parts of xfce4 that E2B Desktop's start-up waits for (xfce4-session,
# xfwm4, xfdesktop) with its panel, not the whole xfce4 (no Thunar, power manager, screensaver
# or sound plugin: nothing a screen of 1280x800 without a person needs, each one memory in every
# sandbox); what E2B Desktop's calls run (xdotool, scrot, xrandr, xdpyinfo, x11vnc, noVNC with
# websockify, gtk-launch, xdg-open); a browser, an editor, fonts; the AT-SPI bus and pyatspi
# for accessibility trees; python3-xlib for DSec's own desktop agent (one X connection).
DESKTOP_PACKAGES = (
    *E2B_BASE_PACKAGES, "xvfb", "xauth", "x11-utils", "x11-xserver-utils", "xfce4-session", "xfwm4", "xfdesktop4",
    "xfce4-panel", "xfce4-terminal", "dbus", "dbus-x11", "at-spi2-core", "python3-pyatspi", "python3-xlib",
    "xdotool", "scrot", "x11vnc", "novnc", "websockify", "fonts-dejavu-core", "fonts-liberation2", "firefox-esr",
    "mousepad", "xdg-utils", "libgtk-3-bin",
    # (a virtual package python3-cryptography needs, through websockify, which debootstrap does not resolve)
    "python3-cffi-backend",
)

Log = Callable[[str], None]


def _write_etc(root: Path) -> None:
    etc = root / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
        "agent:x:1000:1000:agent:/home/agent:/bin/sh\n"
    )
    (etc / "group").write_text("root:x:0:\nnogroup:x:65534:\nagent:x:1000:\n")
    (etc / "hostname").write_text("sandbox\n")
    (etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")


def build_busybox(store: LayerStore, name: str = "busybox") -> Image:
    if not BUSYBOX_BIN.exists():
        raise LayerBuildError(f"{BUSYBOX_BIN} not found: install busybox-static")
    with tempfile.TemporaryDirectory(dir=store.tmp_dir) as work:
        root = Path(work)
        root.chmod(0o755)
        for d in ("bin", "sbin", "usr/bin", "usr/sbin", "proc", "sys", "dev", "root", "home/agent", "var", "run"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "tmp").mkdir(mode=0o1777)
        (root / "tmp").chmod(0o1777)
        shutil.chown(root / "home/agent", 1000, 1000)
        shutil.copy2(BUSYBOX_BIN, root / "bin/busybox")
        applets = subprocess.run(
            [str(BUSYBOX_BIN), "--list-full"], capture_output=True, text=True, check=True
        ).stdout.split()
        for applet in applets:
            link = root / applet
            if applet == "bin/busybox" or link.exists():
                continue
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to("/bin/busybox")
        _write_etc(root)
        digest = store.add_dir(root)
    return store.put_image(Image(name=name, layers=(digest,), env={"PATH": DEFAULT_PATH}, workdir="/"))


def apt_mirror(suite: str = "bookworm") -> str | None:
    """The Debian mirror the machine's apt uses, or None to take debootstrap's default."""
    candidates: list[str] = []
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.suffix == ".sources":
            for block in text.split("\n\n"):
                if re.search(rf"^Suites:.*\b{re.escape(suite)}\b", block, re.M) and "debian-security" not in block:
                    if m := re.search(r"^URIs:\s*(\S+)", block, re.M):
                        candidates.append(m.group(1))
        else:
            for line in text.splitlines():
                m = re.match(rf"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+{re.escape(suite)}\s", line)
                if m and "security" not in m.group(1):
                    candidates.append(m.group(1))
    return candidates[0] if candidates else None


# What apt and debootstrap leave that must not ship in a layer.
RESIDUE = ("var/cache/apt/archives", "var/lib/apt/lists", "var/log", "tmp")


def _check_packages(packages: tuple[str, ...]) -> None:
    for package in packages:
        if not re.fullmatch(r"[a-z0-9][a-z0-9+.-]+", package):
            raise LayerBuildError(f"invalid package name {package!r}")


def build_debian(
    store: LayerStore, name: str, suite: str = "bookworm", packages: tuple[str, ...] = (),
    log: Log | None = None, workdir: str = "/root", account: str = "agent", sudoer: bool = False,
    user: str = "root", setuid: bool = False, finish: Callable[[Path], None] | None = None,
) -> Image:
    """A Debian base made by debootstrap (minbase + ``packages``), from the machine's own apt
    mirror (or debootstrap's default); about a minute for bookworm with python3. ``account``
    is a user of uid 1000 with a home of its own (its ``/etc/skel`` files), given passwordless
    sudo when ``sudoer``; ``user`` and ``workdir`` are the image's (a sandbox's defaults);
    ``setuid``: its sandboxes may gain privileges through setuid programs (sudo); ``finish(root)``
    completes the tree before it becomes the layer."""
    if shutil.which("debootstrap") is None:
        raise LayerBuildError("debootstrap not found: install it (make demo does)")
    if not re.fullmatch(r"[a-z]+", suite):
        raise LayerBuildError(f"invalid Debian suite {suite!r}")
    _check_packages(packages)
    with tempfile.TemporaryDirectory(dir=store.tmp_dir) as work:
        root = Path(work, "rootfs")
        # Packages downloaded once per store: the next Debian image takes them from here.
        cache = store.root / "debootstrap-cache" / suite
        cache.mkdir(parents=True, exist_ok=True)
        cmd = ["debootstrap", "--variant=minbase", f"--cache-dir={cache}"]
        if packages:
            cmd.append(f"--include={','.join(packages)}")
        cmd += [suite, str(root)]
        if mirror := apt_mirror(suite):
            cmd.append(mirror)
        if log:
            log(f"debootstrap {suite} minbase + {', '.join(packages) or 'nothing else'} (about a minute)")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise LayerBuildError(f"debootstrap failed: {(proc.stdout + proc.stderr)[-1500:]}")
        for junk in RESIDUE:
            shutil.rmtree(root / junk, ignore_errors=True)
            (root / junk).mkdir(parents=True, exist_ok=True)
        (root / "tmp").chmod(0o1777)
        hosts = root / "etc/hosts"  # (debootstrap writes none: `localhost` would not resolve)
        if not hosts.exists():
            hosts.write_text("127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n")
        _add_account(root, account, sudoer)
        if finish is not None:
            finish(root)
        if log:
            log("mkfs.erofs")
        digest = store.add_dir(root)
    return store.put_image(
        Image(name=name, layers=(digest,), env={"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"}, workdir=workdir,
              user=user, setuid=setuid)
    )


def _add_account(root: Path, account: str, sudoer: bool) -> None:
    """``account`` (uid and gid 1000, bash, ``/home/ACCOUNT`` with /etc/skel's files, all its own)."""
    with open(root / "etc/passwd", "a") as f:
        f.write(f"{account}:x:1000:1000:{account}:/home/{account}:/bin/bash\n")
    with open(root / "etc/group", "a") as f:
        f.write(f"{account}:x:1000:\n")
    if (root / "etc/shadow").exists():
        with open(root / "etc/shadow", "a") as f:
            f.write(f"{account}:*:19000:0:99999:7:::\n")
    home = root / "home" / account
    home.mkdir(parents=True, exist_ok=True)
    skel = root / "etc/skel"
    if skel.is_dir():
        shutil.copytree(skel, home, symlinks=True, dirs_exist_ok=True)
    for path in (home, *home.rglob("*")):
        os.lchown(path, 1000, 1000)
    if sudoer:
        sudoers = root / "etc/sudoers.d" / account
        sudoers.parent.mkdir(parents=True, exist_ok=True)
        sudoers.write_text(f"{account} ALL=(ALL:ALL) NOPASSWD: ALL\n")
        sudoers.chmod(0o440)


def build_python(store: LayerStore, name: str = "python", log: Log | None = None) -> Image:
    """Debian bookworm minbase with python3, bash and git."""
    return build_debian(store, name, "bookworm", PYTHON_PACKAGES, log=log)


_BASE_LOCK = threading.RLock()  # (two derived builds at once make one ``python``; desktop's takes it twice)


def _lower(store: LayerStore, name: str, log: Log | None) -> Image:
    """Image ``name`` (one of ``BUILDERS``), built first when the store lacks it."""
    with _BASE_LOCK:
        if not store.has_image(name):
            BUILDERS[name](store, log=log)
        return store.get_image(name)


def derive(store: LayerStore, name: str, lower: str, packages: tuple[str, ...], log: Log | None = None,
           workdir: str | None = None, account: str | None = None, sudoer: bool = False, user: str | None = None,
           setuid: bool | None = None, finish: Callable[[Path], None] | None = None) -> Image:
    """Image ``name``: the layers of image ``lower`` (built first if missing) and one more,
    ``packages`` installed by apt-get (no recommends, as debootstrap's ``--include``) in a chroot
    of them under an overlay; its upper (whiteouts and all) becomes that layer. ``account``:
    the uid-1000 user, put in place of the lower image's; ``finish(root)`` completes the tree
    (the merged view). The other arguments default to the lower image's."""
    _check_packages(packages)
    base = _lower(store, lower, log)
    with tempfile.TemporaryDirectory(dir=store.tmp_dir) as work, _overlay(store, base, Path(work)) as (root, upper):
        if log:
            log(f"apt-get install {', '.join(packages)} over {lower!r}")
        _apt_install(root, packages)
        if account is not None:
            _replace_account(root, account, sudoer)
        if finish is not None:
            finish(root)
        _drop_residue(upper)
        if log:
            log("mkfs.erofs")
        digest = store.add_dir(upper)
    return store.put_image(Image(
        name=name, layers=(*base.layers, digest), env=dict(base.env), workdir=workdir or base.workdir,
        user=user or base.user, setuid=base.setuid if setuid is None else setuid, parent=lower))


@contextlib.contextmanager
def _overlay(store: LayerStore, image: Image, work: Path) -> Iterator[tuple[Path, Path]]:
    """The image's layers (read-only loop mounts) under an overlay at ``work/root``, with
    /proc and the host's resolv.conf (apt reaches the mirror the host's apt does) in it:
    (the merged root, its upper)."""
    root, upper, scratch = work / "root", work / "upper", work / "work"
    with contextlib.ExitStack() as undo:
        lowers = []
        for i, digest in enumerate(image.layers):
            target = work / f"lower{i}"
            target.mkdir()
            _mount(["-t", "erofs", "-o", "ro,loop", str(store.layer_path(digest)), str(target)])
            undo.callback(_umount, target)
            lowers.append(str(target))
        for d in (root, upper, scratch):
            d.mkdir()
        _mount(["-t", "overlay", "-o", f"lowerdir={':'.join(reversed(lowers))},upperdir={upper},workdir={scratch}",
                "overlay", str(root)])
        undo.callback(_umount, root)
        _mount(["-t", "proc", "proc", str(root / "proc")])
        undo.callback(_umount, root / "proc")
        resolv = root / "etc/resolv.conf"
        if Path("/etc/resolv.conf").exists():
            if not (resolv.exists() or resolv.is_symlink()):
                resolv.write_text("")  # (a mount point only: gone again before the upper is read)
                undo.callback(resolv.unlink)
            if resolv.is_file() and not resolv.is_symlink():
                _mount(["--bind", "/etc/resolv.conf", str(resolv)])
                undo.callback(_umount, resolv)
        yield root, upper


def _mount(args: list[str]) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise LayerBuildError(f"mount {' '.join(args)}: {proc.stderr.strip()}")


def _umount(target: Path) -> None:
    subprocess.run(["umount", str(target)], capture_output=True)


def _apt_install(root: Path, packages: tuple[str, ...]) -> None:
    """apt-get install ``packages`` in the chroot ``root``: no service starts (policy-rc.d), no
    questions, the release files' dates not checked (as debootstrap does not)."""
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive", "HOME": "/root"}
    options = ["-o", "Acquire::Check-Valid-Until=false", "-o", "Acquire::Check-Date=false", "-o", "Dpkg::Use-Pty=0"]
    steps = {"apt-get update": [*options, "-q", "update"],
             f"apt-get install {' '.join(packages)}": [*options, "-q", "-y", "--no-install-recommends", "install",
                                                        *packages],
             "apt-get clean": ["clean"]}
    try:
        for what, args in steps.items():
            proc = subprocess.run(["chroot", str(root), "apt-get", *args], capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise LayerBuildError(f"{what} failed: {(proc.stdout + proc.stderr)[-1500:]}")
    finally:
        policy.unlink(missing_ok=True)


def _replace_account(root: Path, account: str, sudoer: bool) -> None:
    """The uid-1000 user of the tree (its entries and home, its sudoers file) replaced by ``account``."""
    old = None
    for table in ("passwd", "group", "shadow"):
        path = root / "etc" / table
        if not path.exists():
            continue
        lines = path.read_text().splitlines(keepends=True)
        if table == "passwd":
            old = next((line.split(":")[0] for line in lines if line.split(":")[2:3] == ["1000"]), None)
        if old is not None:
            path.write_text("".join(line for line in lines if line.split(":")[0] != old))
    if old is not None:
        shutil.rmtree(root / "home" / old, ignore_errors=True)
        (root / "etc/sudoers.d" / old).unlink(missing_ok=True)
    _add_account(root, account, sudoer)


def _drop_residue(upper: Path) -> None:
    """``RESIDUE`` and the old copies apt and dpkg keep, out of the upper (only the upper's own
    files go: the lower layers have none of them)."""
    for junk in (*RESIDUE, "var/cache/apt", "var/cache/debconf/config.dat-old",
                 "var/cache/debconf/templates.dat-old", "var/lib/dpkg/status-old"):
        path = upper / junk
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def build_swe_agent(store: LayerStore, name: str = "swe-agent", log: Log | None = None) -> Image:
    """The ``python`` image's packages plus a ``python`` on PATH and ``less``."""
    return derive(store, name, "python", SWE_AGENT_PACKAGES, log=log)


def build_e2b_base(store: LayerStore, name: str = "e2b-base", log: Log | None = None) -> Image:
    """E2B's ``base`` template: python3 (also as ``python``), bash, git, curl, sudo, iproute2 and procps; sandboxes
    start as ``user`` (uid 1000, passwordless sudo) in ``/home/user``, which it owns."""
    return derive(store, name, "python", E2B_BASE_PACKAGES, log=log, workdir="/home/user", account="user",
                  sudoer=True, user="user", setuid=True)


def _finish_desktop(root: Path) -> None:
    """noVNC also at ``/opt/noVNC`` with ``utils/novnc_proxy`` (where E2B Desktop runs it)."""
    novnc = root / "usr/share/novnc"
    if not (novnc / "vnc.html").exists():
        raise LayerBuildError("the novnc package left no /usr/share/novnc/vnc.html")
    (root / "opt").mkdir(exist_ok=True)
    (root / "opt/noVNC").symlink_to("/usr/share/novnc")
    proxy = novnc / "utils/novnc_proxy"
    if not (proxy.is_symlink() or proxy.exists()):
        proxy.parent.mkdir(exist_ok=True)
        # noVNC's own launcher takes --vnc, --listen and --web; websockify does the same job.
        proxy.write_text(
            '#!/bin/sh\n# As noVNC: serve --web, proxy --listen to the VNC server at --vnc.\n'
            'vnc=localhost:5900 listen=6080 web=/usr/share/novnc\n'
            'while [ $# -gt 0 ]; do case "$1" in\n'
            '  --vnc) vnc=$2; shift 2;; --listen) listen=$2; shift 2;; --web) web=$2; shift 2;; *) shift;;\n'
            'esac; done\n'
            'exec websockify --web "$web" "$listen" "$vnc"\n'
        )
        proxy.chmod(0o755)


def build_desktop(store: LayerStore, name: str = "desktop", log: Log | None = None) -> Image:
    """E2B's ``desktop`` template on ``e2b-base``'s terms (user ``user``, passwordless sudo): Xvfb,
    a light xfce4, xdotool, scrot, x11vnc, noVNC (also at ``/opt/noVNC``), firefox-esr, mousepad,
    fonts and the AT-SPI bus (``DESKTOP_PACKAGES``): a layer over ``e2b-base``'s, about 1 GB unpacked."""
    return derive(store, name, "e2b-base", DESKTOP_PACKAGES, log=log, finish=_finish_desktop)


# Toolchain images, one a language (SandboxFusion's run_code runs in them on the FnCall pool,
# which needs python3 in every image): the ``python`` image and a layer of the language's
# packages, built once, with ``dsec image build NAME`` or on first use, and kept in the layer store.
LANGUAGE_IMAGES: dict[str, tuple[str, ...]] = {
    "lang-cpp": ("g++",),
    "lang-nodejs": ("nodejs",),
    "lang-go": ("golang-go",),
    "lang-java": ("default-jdk-headless",),
}


def build_language(store: LayerStore, name: str, log: Log | None = None) -> Image:
    """One of ``LANGUAGE_IMAGES``: the ``python`` image plus the language's toolchain."""
    if name not in LANGUAGE_IMAGES:
        raise LayerBuildError(f"no toolchain image {name!r}: one of {', '.join(LANGUAGE_IMAGES)}")
    return derive(store, name, "python", LANGUAGE_IMAGES[name], log=log)


BUILDERS: dict[str, Callable[..., Image]] = {
    "busybox": build_busybox, "python": build_python, "swe-agent": build_swe_agent, "e2b-base": build_e2b_base,
    "desktop": build_desktop,
    **{name: (lambda store, name=name, log=None: build_language(store, name, log=log)) for name in LANGUAGE_IMAGES},
}


def ensure_default_images(store: LayerStore, names: tuple[str, ...] = ("busybox", "python"), log: Log | None = None) -> None:
    for name in names:
        if store.has_image(name):
            continue
        if name == "busybox":
            build_busybox(store)
        else:
            BUILDERS[name](store, log=log)
