"""FnCall worker containers: the container backend's sandbox, locked down further.

A worker is a container sandbox (crun, EROFS layers under an overlay, dropped capabilities,
seccomp, no_new_privs, an empty network namespace, its own cgroup) whose root filesystem is
read-only; the only places a call can write are two small tmpfs mounts, ``/work`` (the call's
working directory) and ``/tmp``, plus ``/dev/shm`` from the base sandbox, all of which the
zygote wipes after a call that wrote there. SysV IPC and POSIX message queues, which would
outlive a call, are switched off with the IPC namespace's sysctls. The zygote script and its
per-call loop in C (``dsec/native/zygote.c``, built as a shared library) are bind-mounted
read-only.

Workers share the edge's node directory, crun root and cgroup parent with ordinary container
sandboxes, so an edge that restarts removes the remains of old workers with the rest.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from .. import native
from ..backends.base import SandboxSpec
from ..backends.container import ContainerBackend
from ..images.mounts import LayerMounts
from ..images.store import LayerStore
from ..resources import cgroups

ZYGOTE_SOURCE = Path(__file__).with_name("zygote.py")
ZYGOTE_PATH = "/dev/.dsec-zygote.py"
BOOT_SOURCE = Path(__file__).with_name("zygote_boot.py")
BOOT_PATH = "/dev/.dsec-zygote-boot.py"
LOOP_PATH = "/dev/.dsec-zygote.so"
WORKDIR = "/work"
BIND_NOW = "dsec-zygote"  # zygote.py's BIND_NOW
IPC_OFF = {"kernel.shmmni": "0", "kernel.msgmni": "0", "kernel.sem": "0 0 0 0", "fs.mqueue.queues_max": "0"}


class FnCallBackend(ContainerBackend):
    """``ContainerBackend`` with the worker's mounts (see the module docstring)."""

    kind = "fncall"
    # cpuacct too: the pool reads a worker's CPU time (cpu_usage_s).
    cgroup_controllers = (*cgroups.SANDBOX_CONTROLLERS, "cpuacct")

    def __init__(self, node_dir: Path, store: LayerStore, layer_mounts: LayerMounts | None = None,
                 cgroup_parent: str = cgroups.DEFAULT_PARENT, tmpfs_mb: int = 256, native_loop: bool = True) -> None:
        """``native_loop=False``: the zygotes serve with their Python loop (which they also fall
        back to where the C loop cannot be loaded)."""
        super().__init__(node_dir, store, layer_mounts=layer_mounts, cgroup_parent=cgroup_parent,
                         bundle_hook=self._worker_bundle)
        self.tmpfs_mb = tmpfs_mb
        self.loop_library = native.library("zygote") if native_loop else None

    @classmethod
    def beside(cls, backend: ContainerBackend, tmpfs_mb: int = 256, native_loop: bool = True) -> FnCallBackend:
        """A worker backend sharing ``backend``'s node dir, layer mounts and cgroup parent."""
        return cls(backend.node_dir, backend.store, layer_mounts=backend.layer_mounts,
                   cgroup_parent=backend.cgroup_parent, tmpfs_mb=tmpfs_mb, native_loop=native_loop)

    def _worker_bundle(self, config: dict, spec: SandboxSpec) -> None:
        config["root"]["readonly"] = True
        # SysV IPC objects and POSIX message queues would outlive a call: switch them off.
        config["linux"]["sysctl"] = dict(IPC_OFF)
        # Sizes and inode counts bound what a call can leave for the zygote to wipe.
        size, inodes = f"size={self.tmpfs_mb}m", "nr_inodes=65536"
        config["mounts"] += [
            {"destination": WORKDIR, "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=0700", size, inodes]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=1777", size, inodes]},
            {"destination": ZYGOTE_PATH, "type": "bind", "source": str(ZYGOTE_SOURCE),
             "options": ["bind", "ro", "nosuid", "nodev"]},
            {"destination": BOOT_PATH, "type": "bind", "source": str(BOOT_SOURCE),
             "options": ["bind", "ro", "nosuid", "nodev"]},
        ]
        if self.loop_library is not None:
            config["mounts"].append({"destination": LOOP_PATH, "type": "bind", "source": str(self.loop_library),
                                     "options": ["bind", "ro", "nosuid", "nodev"]})

    def zygote_argv(self, cid: str, uid: int, gid: int, env: dict[str, str], preload: tuple[str, ...],
                    nproc: int, fsize: int, nofile: int) -> list[str]:
        """The host command that starts the zygote in worker ``cid`` (its stdio is the channel):
        calls run as ``uid:gid`` under these limits (see ``zygote.py``)."""
        # crun exec does not take no_new_privs from the container's config: ask for it.
        argv = ["exec", "--no-new-privs", "--cwd", "/", "--user", "0:0"]
        if "LD_BIND_NOW" not in env:
            # The zygote's symbols bound at start, not in every call's child (see zygote.py,
            # BIND_NOW), which takes the variable out of the calls' environment again.
            env = {**env, "LD_BIND_NOW": BIND_NOW}
        for k, v in env.items():
            argv += ["--env", f"{k}={v}"]
        argv += [cid, "python3", "-I", BOOT_PATH, ZYGOTE_PATH, str(uid), str(gid), str(nproc), str(fsize),
                 str(nofile), ",".join(preload), LOOP_PATH if self.loop_library is not None else ""]
        return cgroups.join_argv(self.cgroup_parent, cid, self._crun(*argv), self.cgroup_controllers)




def set_memory_limit(parent: str, cid: str, limit_bytes: int) -> None:
    """Set a live worker's memory limit (memory and memory+swap alike, so it never swaps), in
    the order cgroup v1 needs (``cgroups.memory_writes``)."""
    for path, value in cgroups.memory_writes(parent, cid, limit_bytes, fresh=False):
        _write(Path(path), int(value))


def cpu_usage_s(parent: str, cid: str) -> float | None:
    """CPU time the worker's processes have used, in seconds."""
    try:
        if cgroups.is_v2():
            for line in (cgroups.CGROUP_ROOT / parent / cid / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
            return None
        return int((cgroups.CGROUP_ROOT / "cpuacct" / parent / cid / "cpuacct.usage").read_text()) / 1e9
    except (OSError, ValueError):
        return None


def _write(path: Path, value: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, str(value).encode())
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        raise OSError(exc.errno, f"cannot set {path.name} to {value}: {exc.strerror}") from None
    finally:
        os.close(fd)
