"""What this host's kernel offers DSec, checked once at start, and how layers are attached here.

``check_host`` (called by dsec.node.prepare_host) refuses to start, with a message naming what
is missing and what to install or enable, where a sandbox could not be made: rather that than a
failure at the first create. It checks, in order:

- ``mkfs.erofs`` (erofs-utils), and EROFS and overlayfs in /proc/filesystems (after one
  ``modprobe`` each);
- the layer stack exactly as a container sandbox uses it, on a tiny EROFS image in a temporary
  directory: the layer mounted the way this host attaches layers; then, with user namespaces on
  (``DSEC_USERNS``, default on), an idmapped clone of that mount (``mount_setattr``: Linux 5.12;
  EROFS allows it from 5.19) under an overlay (idmapped lower layers: 5.19); without, a plain
  overlay.

``layer_attach`` says how layers are attached: ``"file"`` (the EROFS file is mounted as it is:
Linux 6.12) or ``"loop"`` (through a read-only loop device each, dsec.images.loopdev). It reads
``DSEC_LAYER_ATTACH``: ``auto`` (the default: probe once a process, by mounting a tiny EROFS image
file, and use files where that works), ``file`` or ``loop`` (forced; ``loop`` runs the older
kernels' path on any kernel, for tests and benchmarks). The floor of every kernel feature DSec
uses, and what it does where one is missing, is in docs/HOSTS.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from libdsec import BackendError

from . import _sys
from . import settings
from .images import loopdev

ATTACH_ENV = "DSEC_LAYER_ATTACH"
ATTACH_SETTINGS = ("auto", "file", "loop")
USERNS_ENV = "DSEC_USERNS"

_PROBE_TEXT = b"dsec layer probe\n"
_NO_USERNS_HINT = (f"or set {USERNS_ENV}=0 to run sandboxes without a user namespace (weaker: root in a "
                   "sandbox is then uid 0 on the host, held back by capabilities, seccomp and Landlock alone)")


class ProbeFailed(Exception):
    """A step of the layer-stack probe failed: ``step`` is ``mount``, ``read``, ``userns``,
    ``idmap`` or ``overlay``; ``err`` the errno (None when there was none)."""

    def __init__(self, step: str, err: int | None, detail: str) -> None:
        super().__init__(f"{step}: {detail}")
        self.step, self.err, self.detail = step, err, detail


# -- how layers are attached ------------------------------------------------------------------


def attach_setting(environ: Mapping[str, str] | None = None) -> str:
    """``DSEC_LAYER_ATTACH`` as the server's settings say (or as ``environ`` does)."""
    try:
        return (settings.current() if environ is None else settings.Settings.from_env(environ)).layer_attach
    except settings.SettingsError as exc:
        raise BackendError(str(exc)) from None


def choose_attach(setting: str, mounts_files: Callable[[], bool]) -> str:
    """``"file"`` or ``"loop"`` for a setting of ``DSEC_LAYER_ATTACH``; ``mounts_files`` (the
    probe) is asked only for ``auto``."""
    if setting == "auto":
        return "file" if mounts_files() else "loop"
    if setting not in ("file", "loop"):
        raise BackendError(f"{ATTACH_ENV}={setting!r}: use auto, file or loop")
    return setting


@functools.cache
def erofs_mounts_files() -> bool:
    """Whether EROFS mounts a regular file here (Linux 6.12: before, the kernel wants a block
    device, ENOTBLK). Probed once a process, on a tiny image."""
    with _probe_dir() as work:
        image = tiny_erofs(work)
        target = work / "mnt"
        target.mkdir()
        try:
            _sys.mount(str(image), str(target), "erofs", _sys.MS_RDONLY | _sys.MS_NODEV | _sys.MS_NOSUID)
        except OSError:
            return False
        _sys.umount(str(target), _sys.MNT_DETACH)
        return True


@functools.cache
def layer_attach() -> str:
    """How this process attaches layers (``DSEC_LAYER_ATTACH``, probed once for ``auto``)."""
    return choose_attach(attach_setting(), erofs_mounts_files)


# -- the probe --------------------------------------------------------------------------------


@contextlib.contextmanager
def _probe_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dsec-probe-") as work:
        yield Path(work)


def tiny_erofs(directory: Path) -> Path:
    """A one-file EROFS image (4 KiB) in ``directory``."""
    source = directory / "source"
    source.mkdir()
    (source / "probe").write_bytes(_PROBE_TEXT)
    image = directory / "probe.erofs"
    mkfs = shutil.which("mkfs.erofs")
    if mkfs is None:
        raise BackendError("mkfs.erofs not found: install erofs-utils")
    proc = subprocess.run([mkfs, "--quiet", str(image), str(source)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BackendError(f"mkfs.erofs failed on a one-file directory: {proc.stderr.strip()[:300]}")
    return image


def _mount_layer(image: Path, target: Path, attach: str) -> None:
    flags = _sys.MS_RDONLY | _sys.MS_NODEV | _sys.MS_NOSUID
    if attach == "file":
        _sys.mount(str(image), str(target), "erofs", flags)
    else:
        with loopdev.attached(image) as device:
            _sys.mount(device, str(target), "erofs", flags)


def _errno(exc: OSError) -> int | None:
    return exc.errno if isinstance(exc.errno, int) else None


def probe_layer_stack(attach: str, idmapped: bool) -> None:
    """Mount a tiny EROFS layer as sandboxes do (``attach``; an idmapped clone under the overlay
    when ``idmapped``), read its file through the overlay, take it all down. Raises
    ProbeFailed naming the step that failed."""
    from .isolation import userns

    with _probe_dir() as work:
        image = tiny_erofs(work)
        lower, rw, top = work / "lower", work / "rw", work / "top"
        for d in (lower, rw, top):
            d.mkdir()
        mounted: list[Path] = []
        try:
            try:
                _mount_layer(image, lower, attach)
            except OSError as exc:
                raise ProbeFailed("mount", _errno(exc), str(exc)) from None
            mounted.append(lower)
            # The writable layer on a tmpfs of its own, as a sandbox's (dsec.isolation.disk).
            _sys.mount("dsec-probe", str(rw), "tmpfs", _sys.MS_NODEV | _sys.MS_NOSUID, "size=1m")
            mounted.append(rw)
            upper, wd = rw / "upper", rw / "work"
            upper.mkdir()
            wd.mkdir()
            if idmapped:
                idmap = userns.IdMap()
                try:  # the namespace alone first, to tell its failure from the idmapping's
                    userns.prepare(idmap)
                except OSError as exc:
                    raise ProbeFailed("userns", _errno(exc), str(exc)) from None
                try:
                    clone = userns.idmapped_clone(lower, idmap)
                except OSError as exc:
                    raise ProbeFailed("idmap", _errno(exc), str(exc)) from None
                if not userns.detached_layers():  # as LayerMounts.idmapped does there
                    try:
                        userns.attach_clone(clone, work / "clone")
                    except OSError as exc:
                        os.close(clone)
                        raise ProbeFailed("idmap", _errno(exc), str(exc)) from None
                    mounted.append(work / "clone")
                try:
                    userns.mount_shifted_overlay(idmap, [clone], upper, wd, top, _sys.MS_NODEV)
                except OSError as exc:
                    raise ProbeFailed("overlay", _errno(exc), str(exc)) from None
                finally:
                    os.close(clone)
                owner = idmap.base
            else:
                options = f"lowerdir={lower},upperdir={upper},workdir={wd}"
                try:
                    _sys.mount("overlay", str(top), "overlay", _sys.MS_NODEV, options)
                except OSError as exc:
                    raise ProbeFailed("overlay", _errno(exc), str(exc)) from None
                owner = 0
            mounted.append(top)
            probe = top / "probe"
            if probe.read_bytes() != _PROBE_TEXT or probe.stat().st_uid != owner:
                raise ProbeFailed("read", None, f"the probe file read back wrong (owner {probe.stat().st_uid})")
        finally:
            for m in reversed(mounted):
                with contextlib.suppress(OSError):
                    _sys.umount(str(m), _sys.MNT_DETACH)


# -- the checks -------------------------------------------------------------------------------


def filesystems(path: Path = Path("/proc/filesystems")) -> set[str]:
    """Filesystem types the kernel knows now (built in or loaded)."""
    try:
        return {line.split()[-1] for line in Path(path).read_text().splitlines() if line.strip()}
    except OSError:
        return set()


def modprobe(module: str) -> bool:
    """Load a kernel module; True if modprobe said it is there now."""
    exe = shutil.which("modprobe") or "/sbin/modprobe"
    try:
        return subprocess.run([exe, "-q", module], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_FILESYSTEMS = {
    "erofs": ("EROFS", "erofs", "CONFIG_EROFS_FS (Linux 5.4; EROFS is in the kernel of every distribution "
              "DSec supports, as a module on Debian and Ubuntu)"),
    "overlay": ("overlayfs", "overlay", "CONFIG_OVERLAY_FS"),
}


def _userns_problem(user_ns: Path, max_user_namespaces: Path) -> str | None:
    if not user_ns.exists():
        return (f"the kernel has no user namespaces ({user_ns} is missing): it needs CONFIG_USER_NS=y; "
                + _NO_USERNS_HINT)
    try:
        limit = int(max_user_namespaces.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if limit == 0:
        return ("user namespaces are turned off (user.max_user_namespaces = 0): turn them on with "
                "`sysctl -w user.max_user_namespaces=65536` (and in /etc/sysctl.d to keep it), " + _NO_USERNS_HINT)
    return None


def _probe_problem(failed: ProbeFailed, attach: str, idmapped: bool) -> str:
    why = failed.detail
    if failed.step == "mount" and attach == "file":
        return (f"EROFS cannot mount a layer file on this kernel ({why}): file-backed EROFS needs Linux 6.12; "
                f"set {ATTACH_ENV}=loop (or auto) to attach layers through loop devices")
    if failed.step == "mount":
        return (f"a layer on a read-only loop device did not mount ({why}): loop devices set up with "
                "LOOP_CONFIGURE need Linux 5.8 and CONFIG_BLK_DEV_LOOP (`modprobe loop`)")
    if failed.step == "userns":
        return f"no user namespace for the sandboxes' ids could be made ({why}): " + _NO_USERNS_HINT
    if failed.step == "idmap":
        return (f"EROFS layer mounts cannot be idmapped on this kernel ({why}): idmapped mounts need Linux "
                "5.12, and EROFS supports them from Linux 5.19; use a newer kernel, " + _NO_USERNS_HINT)
    if failed.step == "overlay" and idmapped:
        return (f"overlayfs does not take idmapped lower layers on this kernel ({why}): that needs Linux 5.19; "
                "use a newer kernel, " + _NO_USERNS_HINT)
    if failed.step == "overlay":
        return f"overlayfs did not mount over an EROFS layer ({why})"
    return f"the layer probe failed at {failed.step}: {why}"


def check_host(
    *,
    attach: str | None = None,
    idmapped: bool | None = None,
    filesystems_path: Path = Path("/proc/filesystems"),
    load_module: Callable[[str], bool] = modprobe,
    probe: Callable[[str, bool], None] = probe_layer_stack,
    loop_control: Path = loopdev.LOOP_CONTROL,
    user_ns: Path = Path("/proc/self/ns/user"),
    max_user_namespaces: Path = Path("/proc/sys/user/max_user_namespaces"),
    mkfs: str = "mkfs.erofs",
) -> list[str]:
    """Check that this host can run container sandboxes (see the module docstring). Returns
    notes for the log; raises BackendError listing every problem found, each with its fix.

    ``attach`` (default: ``layer_attach()``), ``idmapped`` (default: ``DSEC_USERNS`` is not 0)
    and the rest are seams for tests: where the host's answers come from."""
    problems: list[str] = []
    notes: list[str] = []
    if shutil.which(mkfs) is None:
        problems.append("mkfs.erofs not found: install erofs-utils (layers are EROFS images)")
    known = filesystems(filesystems_path)
    for fstype, (name, module, config) in _FILESYSTEMS.items():
        if fstype in known:
            continue
        if load_module(module) and fstype in filesystems(filesystems_path):
            notes.append(f"loaded the {module} kernel module")
            continue
        problems.append(f"the kernel has no {name} (no {fstype} in {filesystems_path}, and `modprobe {module}` "
                        f"did not load it): install the kernel's modules package or use a kernel built with {config}")
    if idmapped is None:
        idmapped = settings.current().userns
    if idmapped and (problem := _userns_problem(Path(user_ns), Path(max_user_namespaces))):
        problems.append(problem)
    if problems:  # the probe would only fail on the same causes
        raise BackendError(_report(problems))
    if attach is None:
        attach = layer_attach()
    if attach == "loop" and not Path(loop_control).exists() and not (
            load_module("loop") and Path(loop_control).exists()):
        raise BackendError(_report([
            f"layers go through loop devices here ({_attach_reason(attach)}), but there is no {loop_control}: "
            "`modprobe loop`, or a kernel built with CONFIG_BLK_DEV_LOOP"]))
    try:
        probe(attach, idmapped)
    except ProbeFailed as failed:
        raise BackendError(_report([_probe_problem(failed, attach, idmapped)])) from None
    notes.append(f"layers: {describe_attach(attach)} ({_attach_reason(attach)})")
    if not idmapped:
        notes.append(f"{USERNS_ENV}=0: sandboxes run without a user namespace (root inside is root outside)")
    return notes


def describe_attach(attach: str) -> str:
    return "file-backed EROFS mounts" if attach == "file" else "EROFS on read-only loop devices, one per layer"


def _attach_reason(attach: str) -> str:
    setting = attach_setting()
    if setting != "auto":
        return f"{ATTACH_ENV}={setting}"
    return "this kernel mounts EROFS files" if attach == "file" else "this kernel cannot mount EROFS files: Linux < 6.12"


def _report(problems: list[str]) -> str:
    if len(problems) == 1:
        return f"this host cannot run DSec sandboxes: {problems[0]}"
    return "this host cannot run DSec sandboxes:\n" + "\n".join(f"  - {p}" for p in problems)

