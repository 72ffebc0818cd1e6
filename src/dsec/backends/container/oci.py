"""The OCI runtime config of a container sandbox (its bundle's ``config.json``): the init, the
namespaces, the user mapping, the mounts (protected paths among them), capabilities, rlimits,
seccomp and AppArmor.

One ``BundleConfigs`` per backend, for its life: it holds the seccomp profile, serialized once,
and the BPF program crun compiled from it for the first sandbox (``learn_compiled``), which
every later config hands back to crun. Configs are made on the event loop, once per create.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import resource
from collections.abc import Callable
from pathlib import Path

from libdsec import InvalidRequest

from ... import _sys
from ...images.compose import OverlayPlan
from ...isolation import apparmor
from ...isolation.profile import CAPABILITIES, MASKED_PATHS, READONLY_PATHS, seccomp_profile
from ...isolation.userns import IdMap
from ..base import SandboxSpec

INIT_PATH = "/dev/.dsec-init"
# The sandbox's boot id (``/proc/sys/kernel/random/boot_id``, the host's otherwise): a file in
# its bundle, new each time its init starts (``Lifecycle._run_init``), as a machine's is at each
# boot: what runs in it can tell a sandbox started afresh (a boot after a filesystem-only pause)
# from one that was frozen and thawed.
BOOT_ID_FILE = "boot_id"
# Two directories in the bundle (on its tmpfs) that the sandbox sees bound in place of a
# filesystem of its own: an empty read-only one over each protected directory of /proc and
# /sys (crun would mount a read-only tmpfs over each), and the sandbox's /dev/shm (a tmpfs of
# its own otherwise). Every filesystem a sandbox mounts is a superblock, and each superblock
# registers a shrinker every memory cgroup keeps a slot for (the kernel's shrinker_info): with
# N sandboxes that is N cgroups × k·N superblocks of kernel memory, the cost that grows fastest
# as a node fills. Binds add no superblock: 6 fewer a sandbox.
MASK_DIR = "masked"
SHM_DIR = "shm"
# A sandbox may not raise its open-file limit above the host's own.
_NOFILE_HARD = min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
# Where the seccomp profile goes in a config's JSON (see BundleConfigs.json).
_SECCOMP_SLOT = "@dsec-seccomp-profile@"


@functools.cache
def masked_dirs() -> tuple[str, ...]:
    """The protected paths that are directories on this kernel (bound over with ``MASK_DIR``;
    crun masks the rest, files, with /dev/null, which adds no superblock)."""
    return tuple(p for p in MASKED_PATHS if os.path.isdir(p))


def compiled_seccomp(state: Path) -> str | None:
    """The seccomp program crun compiled for a container (its state dir's seccomp.bpf), base64."""
    try:
        program = (state / "seccomp.bpf").read_bytes()
    except OSError:
        return None
    return base64.b64encode(program).decode() if program else None


class BundleConfigs:
    """The config of each sandbox a backend makes. ``hook(config, spec)`` changes each config
    in place before it is written (the FnCall workers' read-only root and mounts); it must leave
    ``config["linux"]["seccomp"]`` as it found it."""

    def __init__(self, init_binary: Path, hook: Callable[[dict, SandboxSpec], None] | None = None) -> None:
        self.init_binary = init_binary
        self.hook = hook
        self.seccomp = seccomp_profile()
        self._seccomp_json: str | None = None
        # The profile as the BPF program crun compiled it for the first sandbox, handed to crun
        # for every later one (its run.oci.seccomp_bpf_data annotation): crun then loads it as is
        # instead of building it again with libseccomp, a tenth of its CPU per sandbox (its own
        # cache of compiled profiles needs a libgcrypt build Debian's crun lacks). The profile's
        # section stays in the config: crun takes the filter's flags (FLAG_LOG) from it.
        self.seccomp_bpf: str | None = None

    def learn_compiled(self, state: Path) -> None:
        """After a sandbox started: keep the program crun compiled (its state dir ``state``)."""
        if self.seccomp_bpf is None:
            self.seccomp_bpf = compiled_seccomp(state)

    def config(self, plan: OverlayPlan, spec: SandboxSpec, idmap: IdMap | None) -> dict:
        """The config of a sandbox whose root is ``plan.target`` (mounted on the host: the
        protected paths are resolved in it), in a user namespace when ``idmap`` is given."""

        def bundled(name: str) -> str:
            return name if idmap else str(plan.target.parent / name)

        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": 0, "gid": 0},
                "args": [INIT_PATH],
                "env": [f"{k}={v}" for k, v in spec.env.items()],
                "cwd": "/",
                "capabilities": {k: CAPABILITIES for k in ("bounding", "effective", "permitted")},
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": _NOFILE_HARD, "soft": min(1024, _NOFILE_HARD)}],
                "noNewPrivileges": not spec.setuid,
                "oomScoreAdj": 500,
                **({"apparmorProfile": profile} if (profile := apparmor.loaded_profile()) else {}),
            },
            # Relative to the bundle: crun sets the root up from inside the user namespace, whose
            # root may not search the directories above the bundle.
            "root": {"path": plan.target.name if idmap else str(plan.target), "readonly": False},
            "hostname": spec.hostname,
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc",
                 "options": ["nosuid", "noexec", "nodev"]},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
                 "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
                {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
                 "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
                {"destination": "/dev/shm", "type": "bind", "source": bundled(SHM_DIR),
                 "options": ["bind", "nosuid", "noexec", "nodev"]},
                {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
                 "options": ["nosuid", "noexec", "nodev"]},
                {"destination": "/sys", "type": "sysfs", "source": "sysfs",
                 "options": ["nosuid", "noexec", "nodev", "ro"]},
                {"destination": INIT_PATH, "type": "bind", "source": str(self.init_binary),
                 "options": ["bind", "ro", "nosuid", "nodev"]},
                {"destination": "/proc/sys/kernel/random/boot_id", "type": "bind",
                 "source": bundled(BOOT_ID_FILE),
                 "options": ["bind", "ro", "nosuid", "nodev", "noexec"]},
                *({"destination": path, "type": "bind", "source": bundled(MASK_DIR),
                   "options": ["bind", "ro", "nosuid", "nodev", "noexec"]} for path in masked_dirs()),
                *protected_mounts(plan, spec, idmap is not None),
            ],
            "linux": {
                "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]
                + ([{"type": "user"}] if idmap else []),
                **(idmap.oci() if idmap else {}),
                "maskedPaths": [p for p in MASKED_PATHS if p not in masked_dirs()],
                "readonlyPaths": READONLY_PATHS,
                "seccomp": self.seccomp,
                "rootfsPropagation": "private",
            },
            **({"annotations": {"run.oci.seccomp_bpf_data": self.seccomp_bpf}} if self.seccomp_bpf else {}),
        }

    def json(self, plan: OverlayPlan, spec: SandboxSpec, idmap: IdMap | None) -> str:
        """``config`` (after the hook) as JSON, with the seccomp profile (two thirds of it)
        serialized once."""
        config = self.config(plan, spec, idmap)
        if self.hook is not None:
            self.hook(config, spec)
        if config["linux"].get("seccomp") is not self.seccomp:
            return json.dumps(config)  # the hook changed it
        if self._seccomp_json is None:
            self._seccomp_json = json.dumps(self.seccomp)
        config["linux"]["seccomp"] = _SECCOMP_SLOT
        return json.dumps(config).replace(f'"{_SECCOMP_SLOT}"', self._seccomp_json, 1)


def protected_mounts(plan: OverlayPlan, spec: SandboxSpec, relative: bool) -> list[dict]:
    """A read-only bind of each protected path onto itself (the root must be mounted on the
    host). Links on the way are resolved inside the root (``/bin`` → ``/usr/bin``), so what
    is bound is what the path names in the sandbox, never something of the host. Root in
    the sandbox cannot undo a bind: no CAP_SYS_ADMIN, and seccomp refuses mount, umount and
    the new mount API."""
    mounts: list[dict] = []
    if not spec.protected_paths:
        return mounts
    root = os.open(plan.target, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for path in spec.protected_paths:
            try:
                fd = _sys.openat2(root, path, os.O_PATH | os.O_CLOEXEC, 0,
                                  _sys.RESOLVE_IN_ROOT | _sys.RESOLVE_NO_MAGICLINKS)
            except OSError as exc:
                raise InvalidRequest(f"protected path {path!r} cannot be protected in image "
                                     f"{spec.image!r}: {exc.strerror}") from None
            try:
                real = os.readlink(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
            inside = os.path.relpath(real, plan.target)
            if inside.startswith(".."):
                raise InvalidRequest(f"protected path {path!r} resolves outside the sandbox's root")
            inside = "" if inside == "." else inside
            # Relative to the bundle when crun sets the root up inside the user namespace.
            source = f"{plan.target.name}/{inside}" if relative else str(plan.target / inside)
            mounts.append({"destination": "/" + inside, "type": "bind", "source": source,
                           "options": ["rbind", "ro", "nosuid", "nodev"]})
    finally:
        os.close(root)
    return mounts
