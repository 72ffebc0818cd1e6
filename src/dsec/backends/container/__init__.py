"""Container sandboxes: an OCI bundle run by crun over EROFS layers and a private overlay upper.

No Python process stays with a sandbox: crun starts ``dsec-init`` (dsec/native/init.c, a small
static program that reaps zombies) as the sandbox's init and exits, so an idle sandbox costs the
host its init, its namespaces and its cgroups. The cgroup is the backend's own, made with its
limits before crun runs (crun is told not to manage cgroups; see dsec.resources.cgroups); the
init is moved into it before it is asked to run anything. ``exec`` asks that init, over a
socketpair only it holds (dsec.backends.initchan), to fork the command with our pipes as its
stdio: it inherits the namespaces, cgroup, capabilities, no_new_privs and seccomp filter the init
has. A sandbox adopted after a server restart has lost its channel; its commands go through
``crun exec`` (which enters the namespaces and applies the same profile), started by a shell that
first joins the sandbox's cgroup. Pause is the cgroup freezer. Files are read and written
from the host through the sandbox's own root with openat2(RESOLVE_IN_ROOT), so a symlink inside
the sandbox can never point outside it.

Per node (``node_dir``): ``layers/<digest>`` (the shared layer mounts) and ``run/``, a tmpfs the
backend mounts, with ``crun/`` (crun's state) and ``sandboxes/<cid>/`` (``config.json``,
``upper``, ``work``, ``rootfs``; ``rootfs``, the overlay, is unmounted on the host once the
sandbox's init runs on its own namespace's copy). A sandbox's writes thus live in memory, charged to the sandbox's
own memory limit, and making or removing a sandbox costs no disk metadata operations (on a
disk those are a sizeable part of a create). The tmpfs outlives an edge restart, like the
sandboxes in it, and is unmounted when the last sandbox is gone.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import json
import logging
import os
import resource
import select
import shutil
import signal
import stat
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from libdsec import BackendError, CommandTimeout, InvalidRequest, SandboxFileNotFound, SandboxStateError
from libdsec.protocol import ExecRequest, ExecResult

from ... import _sys
from ...images import carry, scrub
from ...images.compose import OverlayPlan, compose
from ...images.mounts import LayerMounts
from ...images.store import Image, LayerBuildError, LayerStore
from ...isolation import apparmor, disk, userns
from ...isolation.profile import CAPABILITIES, MASKED_PATHS, READONLY_PATHS, seccomp_profile
from ...resources import cgroups, reclaim
from ...resources import cpu as cpu_sched
from ...resources.cgroups import Limits
from ... import native
from .. import portconn, terminal
from ..base import Capability, Emit, ExecContext, Handle, HostView, SandboxSpec, numeric_user, user_from_passwd
from ..capture import Capture, Flow, PipeReader, PipeStream, feed_pipe, wait_pipes, with_feeder
from ..procs import (
    children, kill_session_of, kill_tree, pid_in_cgroup, sealed_copy, spawn_wait, wait_exit, wait_process,
)
from ..initchan import MAX_REQUEST, ChannelClosed, InitChannel, StartFailed, TooLarge, exit_code

log = logging.getLogger("dsec.backends.container")

CRUN = shutil.which("crun") or "/usr/bin/crun"
CHRT = shutil.which("chrt") or "/usr/bin/chrt"
INIT_PATH = "/dev/.dsec-init"
# A command ranks above the sandbox's init (crun gives the init 500) for the OOM killer, so that
# an overrun takes a command and not the sandbox (dsec-init sets the same for the commands it
# starts; this is for those started by `crun exec`).
COMMAND_OOM_SCORE_ADJ = 1000
# How long a command whose init channel closed waits for the init to be seen dead (a killed
# pid namespace init closes its files well before it counts as exited).
_INIT_EXIT_GRACE_S = 1.0
# A sandbox may not raise its open-file limit above the host's own.
_NOFILE_HARD = min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])


# Where the seccomp profile goes in a config's JSON (see ContainerBackend._config_json).
_SECCOMP_SLOT = "@dsec-seccomp-profile@"


def _compiled_seccomp(state: Path) -> str | None:
    """The seccomp program crun compiled for a container (its state dir's seccomp.bpf), base64."""
    try:
        program = (state / "seccomp.bpf").read_bytes()
    except OSError:
        return None
    return base64.b64encode(program).decode() if program else None


async def _feed_stream(writer: asyncio.StreamWriter, chunks: AsyncIterator[bytes]) -> None:
    try:
        async for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
    except (BrokenPipeError, ConnectionResetError):
        return  # the command stopped reading
    finally:
        writer.close()


def _runs_init(pid: int) -> bool:
    """True once ``pid`` runs the sandbox's init (not crun still setting up its namespaces)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0] == INIT_PATH.encode()
    except OSError:
        return False


class _ContainerPty:
    """A container's PTY (``SandboxBackend.open_pty``): the master here, the command's end
    (``ended``: its exit code) and how to kill all it started."""

    def __init__(self, master: terminal.Master, ended, kill: Callable[[], None]) -> None:
        self.master = master
        self.kill = kill
        self.ended = asyncio.ensure_future(ended)

    async def read(self) -> bytes:
        return await self.master.read()

    def _check(self, what: str) -> None:
        if self.master.closed:
            raise SandboxStateError(f"cannot {what}: the PTY is closed")
        if self.ended.done():
            raise SandboxStateError(f"cannot {what}: the PTY's command has exited (exit code {self._code()})")

    async def write(self, data: bytes) -> None:
        self._check("write to the PTY")
        try:
            await self.master.write(data)
        except OSError as exc:
            raise SandboxStateError(f"cannot write to the PTY: {exc.strerror or exc}") from None

    async def resize(self, cols: int, rows: int) -> None:
        self._check("resize the PTY")
        self.master.resize(cols, rows)

    def _code(self) -> int:
        if self.ended.cancelled() or self.ended.exception() is not None:
            return -1
        return self.ended.result()

    async def wait(self) -> int:
        with contextlib.suppress(Exception):
            await asyncio.shield(self.ended)
        return self._code()

    async def close(self) -> None:
        if self.master.closed:
            return
        if not self.ended.done():
            self.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self.ended), 5)
        self.master.close()
        if not self.ended.done():
            self.ended.cancel()


class ContainerBackend:
    """crun + overlayfs over shared EROFS layer mounts. See the module docstring."""

    kind = "container"
    # PROTECTED_PATHS: read-only binds (see _protected_mounts); CARRY: check_kept, carry, tampered.
    capabilities = frozenset({Capability.WARM_POOL, Capability.PROTECTED_PATHS, Capability.CARRY, Capability.HOST_PATHS,
                              Capability.PIPED_STDIN, Capability.PORTS})
    # The v1 controllers of a sandbox's cgroup (see dsec.resources.cgroups).
    cgroup_controllers: tuple[str, ...] = cgroups.SANDBOX_CONTROLLERS

    def __init__(self, node_dir: Path, store: LayerStore, layer_mounts: LayerMounts | None = None,
                 cgroup_parent: str = cgroups.DEFAULT_PARENT,
                 bundle_hook: Callable[[dict, SandboxSpec], None] | None = None) -> None:
        """``bundle_hook(config, spec)``: changes each sandbox's OCI config in place before it
        is written (the FnCall workers' read-only root and mounts); it must leave
        ``config["linux"]["seccomp"]`` as it found it."""
        self.node_dir = Path(node_dir)
        self.bundle_hook = bundle_hook
        self.cgroup_parent = cgroup_parent
        self.store = store
        self.run_dir = self.node_dir / "run"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not os.path.ismount(self.run_dir):
            _sys.mount("dsec-run", str(self.run_dir), "tmpfs", _sys.MS_NODEV | _sys.MS_NOSUID, "mode=0700")
        self.crun_root = self.run_dir / "crun"
        self.sandboxes_dir = self.run_dir / "sandboxes"
        for d in (self.crun_root, self.sandboxes_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.layer_mounts = layer_mounts or LayerMounts(self.node_dir / "layers", layers_dir=store.layers_dir)
        self._seccomp = seccomp_profile()
        self._seccomp_json: str | None = None
        # The overlay plan of each live sandbox made here: paths, worked out once.
        self._plans: dict[str, OverlayPlan] = {}
        # The profile as the BPF program crun compiled it for the first sandbox, handed to crun
        # for every later one (its run.oci.seccomp_bpf_data annotation): crun then loads it as is
        # instead of building it again with libseccomp, a tenth of its CPU per sandbox (its own
        # cache of compiled profiles needs a libgcrypt build Debian's crun lacks). The profile's
        # section stays in the config: crun takes the filter's flags (FLAG_LOG) from it.
        self._seccomp_bpf: str | None = None
        self.init_binary = native.binary("init")
        # Each sandbox's init channel (see dsec.backends.initchan); none for a sandbox adopted
        # after a restart, whose commands go through `crun exec`.
        self.channels: dict[str, InitChannel] = {}
        # A pidfd on the init of each sandbox this process started: liveness without reading
        # /proc, and a kill that cannot hit a reused pid.
        self._pidfds: dict[str, int] = {}
        # The host's overlay mounts of sandboxes that have started, to unmount (_detach_started).
        self._started: list[Path] = []
        self._crun_exe = sealed_copy(CRUN)
        # Root inside is not root outside: each sandbox gets a user namespace and a host uid
        # range of its own (see dsec.isolation.userns); DSEC_USERNS=0 turns it off.
        self.id_ranges = userns.IdRanges() if os.environ.get("DSEC_USERNS", "1") != "0" else None

    @property
    def layer_attach(self) -> str:
        """How this node attaches layers: ``"file"`` (file-backed EROFS) or ``"loop"``."""
        return self.layer_mounts.attach

    def describe(self) -> str:
        """One line for ``dsec info``."""
        how = "file-backed" if self.layer_attach == "file" else "on read-only loop devices"
        return f"{self.kind}: crun, EROFS layers {how}"

    def host_view(self) -> HostView:
        return HostView(self.cgroup_parent, self.sandboxes_dir, self.id_ranges, self.layer_attach)

    async def warm_up(self) -> None:
        """Nothing to prepare: layers are mounted at the first create that needs them."""

    async def close(self) -> None:
        """Nothing held in this process outlives it but what the sandboxes themselves hold."""

    def _host_ids(self, handle: Handle, uid: int, gid: int) -> tuple[int, int]:
        """A sandbox's uid/gid as the host sees them (files written from the host)."""
        idmap = self.id_ranges.of(handle.cid) if self.id_ranges else None
        if idmap is None:
            return uid, gid
        return idmap.host(uid), idmap.host(gid)

    # -- helpers ---------------------------------------------------------------------------

    def _crun(self, *args: str) -> list[str]:
        # DSec makes the sandbox's cgroup itself (see dsec.resources.cgroups).
        return [CRUN, "--root", str(self.crun_root), "--cgroup-manager=disabled", *args]

    async def _run_crun(self, *args: str, timeout: float = 30.0, log: Path | None = None,
                        stdin: int | None = None) -> tuple[int, str]:
        """Run crun; returns (exit code, output). Output goes to a file, ``log`` or an anonymous
        one: ``run --detach`` hands its stdio to the sandbox's init, which keeps it open (its
        stdin, ``stdin`` here, is the init's channel)."""
        if log is not None:
            out = os.open(log, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        else:
            out = os.memfd_create("crun-output", os.MFD_CLOEXEC)
        try:
            rc = await spawn_wait([self._crun_exe, *self._crun(*args)[1:]], stdin, out, timeout)
            if rc is None:
                return -1, f"crun {args[0]} timed out after {timeout}s"
            return rc, os.pread(out, 1 << 20, 0).decode(errors="replace").strip()
        finally:
            os.close(out)

    def _plan(self, cid: str, layers: tuple[str, ...], image: str) -> OverlayPlan:
        plan = self._plans.get(cid)
        if plan is None:
            img = Image(name=image, layers=layers)
            plan = compose(img, self.store, self.layer_mounts.mount_dir, self.sandboxes_dir / cid)
        return plan

    def _config(self, cid: str, plan: OverlayPlan, spec: SandboxSpec) -> dict:
        idmap = self.id_ranges.of(cid) if self.id_ranges else None
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
                {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                 "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
                {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
                 "options": ["nosuid", "noexec", "nodev"]},
                {"destination": "/sys", "type": "sysfs", "source": "sysfs",
                 "options": ["nosuid", "noexec", "nodev", "ro"]},
                {"destination": INIT_PATH, "type": "bind", "source": str(self.init_binary),
                 "options": ["bind", "ro", "nosuid", "nodev"]},
                *self._protected_mounts(plan, spec, idmap is not None),
            ],
            "linux": {
                "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]
                + ([{"type": "user"}] if idmap else []),
                **(idmap.oci() if idmap else {}),
                "maskedPaths": MASKED_PATHS,
                "readonlyPaths": READONLY_PATHS,
                "seccomp": self._seccomp,
                "rootfsPropagation": "private",
            },
            **({"annotations": {"run.oci.seccomp_bpf_data": self._seccomp_bpf}} if self._seccomp_bpf else {}),
        }

    def _protected_mounts(self, plan: OverlayPlan, spec: SandboxSpec, relative: bool) -> list[dict]:
        """A read-only bind of each protected path onto itself (the root must be mounted on the
        host). Links on the way are resolved inside the root (``/bin`` → ``/usr/bin``), so what
        is bound is what the path names in the sandbox, never something of the host. Root in
        the sandbox cannot undo a bind: no CAP_SYS_ADMIN, and seccomp refuses mount, umount and
        the new mount API."""
        mounts = []
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

    def _config_json(self, cid: str, plan: OverlayPlan, spec: SandboxSpec) -> str:
        """``_config`` as JSON, with the seccomp profile (two thirds of it) serialized once."""
        config = self._config(cid, plan, spec)
        if self.bundle_hook is not None:
            self.bundle_hook(config, spec)
        if config["linux"].get("seccomp") is not self._seccomp:
            return json.dumps(config)  # the hook changed it
        if self._seccomp_json is None:
            self._seccomp_json = json.dumps(self._seccomp)
        config["linux"]["seccomp"] = _SECCOMP_SLOT
        return json.dumps(config).replace(f'"{_SECCOMP_SLOT}"', self._seccomp_json, 1)

    def _mount_rootfs(self, plan: OverlayPlan, limits: Limits | None) -> None:
        self._detach_started()
        # The bundle (and so the writable layer) is a tmpfs of its own: its size is the
        # sandbox's disk limit (ENOSPC past it), set again with the memory limit.
        disk.mount_bundle(plan.target.parent,
                          disk.INITIAL_BYTES if limits is None else disk.cap_for(limits.memory_bytes))
        for d in (plan.upper, plan.work, plan.target):
            d.mkdir(parents=True, exist_ok=True)
        self.layer_mounts.acquire(plan.layers)
        try:
            if self.id_ranges is None:
                _sys.mount("overlay", str(plan.target), "overlay", _sys.MS_NODEV, plan.options)
            else:
                idmap = self.id_ranges.take(plan.target.parent.name)
                with self.layer_mounts.idmapped(tuple(reversed(plan.layers)), idmap) as lowers:
                    userns.mount_shifted_overlay(idmap, lowers, plan.upper, plan.work, plan.target, _sys.MS_NODEV)
        except BaseException:
            self.layer_mounts.release(plan.layers)
            disk.unmount_bundle(plan.target.parent)
            raise

    def _detach_started(self) -> None:
        """Unmount, on the host, the overlays of sandboxes that have started since the last
        call (see create). Blocks (each unmount waits for an RCU grace period): called in the
        thread that mounts the next sandbox's root, so it costs no extra hop to a thread."""
        while self._started:
            with contextlib.suppress(OSError):  # torn down meanwhile
                _sys.umount(str(self._started.pop()), _sys.MNT_DETACH)

    def _release_rootfs(self, plan: OverlayPlan, held: bool = True) -> None:
        # The bundle's tmpfs stays mounted until here (the overlay may be gone from the host
        # already, see create): while it is, the sandbox still holds its layers.
        mounted = os.path.ismount(plan.target.parent)
        with contextlib.suppress(OSError):  # detached after the start (EINVAL) or never made (ENOENT)
            _sys.umount(str(plan.target), _sys.MNT_DETACH)
        if held and mounted:
            self.layer_mounts.release(plan.layers)
        disk.unmount_bundle(plan.target.parent)
        shutil.rmtree(plan.target.parent, ignore_errors=True)
        if self.id_ranges is not None:
            self.id_ranges.release(plan.target.parent.name)

    # -- lifecycle -------------------------------------------------------------------------

    async def create(self, cid: str, spec: SandboxSpec) -> Handle:
        for digest in spec.layers:
            if not self.store.has_layer(digest):
                raise BackendError(f"layer {digest} of image {spec.image!r} is missing from the store")
        plan = self._plan(cid, spec.layers, spec.image)
        bundle = plan.target.parent
        if self.id_ranges is not None:
            self.id_ranges.take(cid)  # here, on the event loop: ranges are handed out in order
        try:
            cgroups.make_sandbox_cgroup(self.cgroup_parent, cid, spec.limits, self.cgroup_controllers)
        except OSError as exc:
            if self.id_ranges is not None:
                self.id_ranges.release(cid)
            raise BackendError(f"cannot make the cgroup of {cid}: {exc}") from exc
        try:
            # Mounting (idmapped layer clones, the overlay, a tmpfs) blocks: off the event loop.
            await asyncio.to_thread(self._mount_rootfs, plan, spec.limits)
        except OSError as exc:
            if self.id_ranges is not None:
                self.id_ranges.release(cid)
            cgroups.remove_cgroup(self.cgroup_parent, cid)
            shutil.rmtree(bundle, ignore_errors=True)
            raise BackendError(f"cannot mount the root filesystem of {cid}: {exc}") from exc
        pidfile = bundle / "init.pid"
        host_end, init_end = InitChannel.pair()
        try:
            (bundle / "config.json").write_text(self._config_json(cid, plan, spec))
            try:
                rc, out = await self._run_crun("run", "--detach", "--bundle", str(bundle), "--pid-file", str(pidfile),
                                               cid, log=bundle / "crun.log", stdin=init_end.fileno())
            finally:
                init_end.close()
            if rc != 0:
                raise BackendError(f"crun could not start {cid}: {out[-800:]}")
            if self._seccomp_bpf is None:
                self._seccomp_bpf = _compiled_seccomp(self.crun_root / cid)
            pid = int(pidfile.read_text())
            # The init waits for its first command: nothing runs before it is in its cgroup.
            try:
                cgroups.enter(self.cgroup_parent, cid, pid, self.cgroup_controllers)
            except OSError as exc:  # ESRCH: the init is gone already
                raise BackendError(f"cannot move the init of {cid} into its cgroup: {exc}") from exc
            # `crun run --detach` may return while the first process is still crun setting up
            # the namespaces; a `crun exec` then fails (setns: EPERM). Wait for the init.
            deadline = time.monotonic() + 10
            while not _runs_init(pid):
                if time.monotonic() > deadline:
                    raise BackendError(f"the init of {cid} did not start within 10s")
                await asyncio.sleep(0.002)
        except BaseException:
            host_end.close()
            await self._run_crun("delete", "--force", cid)
            cgroups.remove_cgroup(self.cgroup_parent, cid)
            self._release_rootfs(plan)
            raise
        # The init runs in its own mount namespace, on that namespace's copy of the overlay; the
        # host's copy is only one more mount that every later `crun run` copies into its new
        # namespace and unmounts again, a cost that grows with the sandboxes alive (the
        # benchmark's crun took ~30% more CPU with 150 mounts more on the host). It is unmounted
        # with the next sandbox's mount (_detach_started); the bundle's tmpfs, which holds the
        # writable layer (pack, resize), stays.
        self._started.append(plan.target)
        self.channels[cid] = InitChannel(host_end)
        with contextlib.suppress(OSError):  # gone already: is_alive reads /proc and says so
            self._pidfds[cid] = os.pidfd_open(pid)
        handle = Handle(cid=cid, image=spec.image, layers=spec.layers, pid=pid, env=dict(spec.env))
        self._plans[cid] = plan
        # The cgroup got its limits and the bundle its size; SCHED_IDLE for a best-effort
        # sandbox's init is what is left (its commands get it in exec).
        if spec.limits is not None and spec.limits.best_effort:
            with contextlib.suppress(ProcessLookupError):
                cpu_sched.set_idle(pid, True)
        return handle

    async def apply_limits(self, handle: Handle, limits: Limits) -> None:
        try:
            cgroups.apply_limits(self.cgroup_parent, handle.cid, limits)
            # The init too (a best-effort sandbox's commands get SCHED_IDLE in exec).
            with contextlib.suppress(ProcessLookupError):
                cpu_sched.set_idle(handle.pid, limits.best_effort)
            disk.resize_bundle(self.sandboxes_dir / handle.cid, disk.cap_for(limits.memory_bytes))
        except OSError as exc:
            raise BackendError(f"cannot set limits of {handle.cid}: {exc}") from exc

    async def is_alive(self, handle: Handle) -> bool:
        fd = self._pidfds.get(handle.cid)
        if fd is not None:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return not poller.poll(0)  # a pidfd turns readable when its process exits
        return handle.pid > 0 and pid_in_cgroup(handle.pid, handle.cid)

    async def connect_port(self, handle: Handle, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """127.0.0.1:``port`` in the sandbox's network namespace (``dsec.backends.portconn``)."""
        if handle.pid <= 0 or not pid_in_cgroup(handle.pid, handle.cid):
            raise SandboxStateError(f"cannot connect to port {port}: sandbox {handle.cid}'s processes are gone")
        return await portconn.connect_in_netns(handle.pid, port)

    async def _alive_after(self, handle: Handle, grace: float) -> bool:
        """Whether the init still lives ``grace`` seconds on (or once it is gone, if sooner). A
        pid namespace's init that was killed closes its files first, then waits for all else in
        the namespace to die before it counts as exited: its channel closes well before that."""
        fd = self._pidfds.get(handle.cid)
        if fd is None:
            return await self.is_alive(handle)
        return not await wait_exit(fd, grace, tick=self._reap_orphans)

    def _why_gone(self, handle: Handle) -> str:
        kills = cgroups.oom_kills(self.cgroup_parent, handle.cid)
        return f" ({kills} out-of-memory kill(s) in its cgroup)" if kills else ""

    async def _freeze(self, handle: Handle) -> bool:
        """Freeze the sandbox; False if it was frozen already."""
        try:
            return await asyncio.to_thread(cgroups.freeze, self.cgroup_parent, handle.cid)
        except (OSError, TimeoutError) as exc:
            raise BackendError(f"cannot freeze {handle.cid}: {exc}") from exc

    async def pause(self, handle: Handle) -> None:
        await self._freeze(handle)
        # Frozen, nothing in it touches its pages: push them all out (to swap, which v2 must
        # allow it first).
        try:
            cgroups.lift_swap(self.cgroup_parent, handle.cid, True)
            await asyncio.to_thread(reclaim.push_out, self.cgroup_parent, handle.cid)
        except OSError as exc:
            log.warning("paused %s but could not push its memory out: %s", handle.cid, exc)

    async def resume(self, handle: Handle) -> None:
        with contextlib.suppress(OSError):
            cgroups.lift_swap(self.cgroup_parent, handle.cid, False)
        cgroups.thaw(self.cgroup_parent, handle.cid)

    async def pack_diff(self, handle: Handle) -> tuple[str, list[str]]:
        """Freeze the sandbox, turn its writable layer (minus residue) into a layer in the
        store, thaw it. Whiteouts and opaque directories travel as overlay markers."""
        if not await self.is_alive(handle):
            raise SandboxStateError(f"cannot pack: sandbox process of {handle.cid} is gone")
        upper = self._plan(handle.cid, handle.layers, handle.image).upper
        was_paused = not await self._freeze(handle)
        try:
            with contextlib.ExitStack() as stack:
                idmap = self.id_ranges.of(handle.cid) if self.id_ranges else None
                if idmap is not None:  # the layer holds the ids as the sandbox saw them
                    upper = stack.enter_context(userns.shifted_view(idmap, upper, upper.parent / "packview", self.store.tmp_dir))
                skip = await asyncio.to_thread(scrub.residue, upper)
                digest = await asyncio.to_thread(self.store.add_dir, upper, skip)
        except LayerBuildError as exc:
            # The sandbox's own files, packed by the node: a failure here (the store's disk
            # full, mkfs.erofs failing) is the node's, not a bad request.
            raise BackendError(f"cannot pack {handle.cid}: {exc}") from None
        finally:
            if not was_paused:
                cgroups.thaw(self.cgroup_parent, handle.cid)
        return digest, sorted("/" + p for p in skip)

    # -- clean copies and tampering ------------------------------------------------------------

    def _upper(self, handle: Handle) -> Path:
        return self._plan(handle.cid, handle.layers, handle.image).upper

    async def check_kept(self, handle: Handle, keep: list[str]) -> None:
        """Each kept path exists in the running sandbox, with no link on the way."""
        root = self._root_fd(handle)
        try:
            for path in keep:
                carry.check_in_root(root, path, "keep path", "the sandbox")
        finally:
            os.close(root)

    async def carry(self, source: Handle, target: Handle, keep: list[str]) -> carry.Carried:
        """Freeze ``source``, replay its changes beneath ``keep`` into ``target`` (which has
        run nothing yet) through ``target``'s own root, thaw ``source``."""
        if not await self.is_alive(source):
            raise SandboxStateError(f"cannot make a clean copy: sandbox process of {source.cid} is gone")
        src = self.id_ranges.of(source.cid) if self.id_ranges else None
        dst = self.id_ranges.of(target.cid) if self.id_ranges else None

        def ids(host_id: int) -> int:
            inside = host_id if src is None else host_id - src.base
            if not 0 <= inside < (src.count if src else 1 << 32):
                inside = 65534  # not one of the sandbox's ids: nobody
            return inside if dst is None else dst.host(inside)

        upper = self._upper(source)
        root = self._root_fd(target)
        was_paused = not await self._freeze(source)
        try:
            return await asyncio.to_thread(carry.carry, upper, root, keep, ids)
        except OSError as exc:
            raise BackendError(f"cannot carry the kept paths into the clean copy: {exc}") from exc
        finally:
            if not was_paused:
                cgroups.thaw(self.cgroup_parent, source.cid)
            os.close(root)

    def tampered(self, handle: Handle) -> list[str]:
        return carry.tampered(self._upper(handle))

    async def destroy(self, handle: Handle) -> None:
        if (channel := self.channels.pop(handle.cid, None)) is not None:
            channel.close()
        fd = self._pidfds.pop(handle.cid, None)
        if fd is None and handle.pid > 0 and pid_in_cgroup(handle.pid, handle.cid):
            with contextlib.suppress(ProcessLookupError):
                fd = os.pidfd_open(handle.pid)
        if fd is not None:
            try:
                # Killing the pid namespace's init takes every process of the sandbox with it.
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                cgroups.thaw(self.cgroup_parent, handle.cid)  # a frozen (paused) task dies once thawed
                if not await wait_exit(fd, timeout=10, tick=self._reap_orphans):
                    log.warning("the init of %s did not exit within 10s of SIGKILL", handle.cid)
            finally:
                os.close(fd)
        # When we are the init's subreaper (see dsec.server), reap it now: a zombie still
        # counts in a v1 cgroup, which cannot be removed until it is reaped.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(handle.pid, os.WNOHANG)
        # What `crun delete` does for a dead container, without spawning it: drop its cgroups
        # and its state directory; then the root filesystem. Off the event loop: rmdir of a
        # cgroup in each v1 hierarchy and the unmounts are kernel work the loop need not wait on.
        if not await asyncio.to_thread(self._teardown, handle):
            await self._run_crun("delete", "--force", handle.cid)
            await asyncio.to_thread(self._remove_cgroup, handle.cid)

    def _teardown(self, handle: Handle) -> bool:
        """Remove a dead sandbox's cgroups, root filesystem and crun state; False if its
        cgroups would not go (crun delete is tried then)."""
        removed = self._remove_cgroup(handle.cid)
        self._release_rootfs(self._plan(handle.cid, handle.layers, handle.image))
        self._plans.pop(handle.cid, None)
        shutil.rmtree(self.crun_root / handle.cid, ignore_errors=True)
        return removed

    def _reap_orphans(self) -> None:
        """Reap zombies that were reparented to us (we are the subreaper) from inside our
        sandboxes, e.g. a command whose ``crun exec`` died first. Only processes in our sandbox
        cgroups: asyncio reaps the ``crun`` processes it spawned, which live outside them."""
        for pid in children():
            try:
                if _sys.proc_stat(pid)[0] != "Z":
                    continue
                with open(f"/proc/{pid}/cgroup") as f:
                    if f"/{self.cgroup_parent}/" not in f.read():
                        continue
                os.waitpid(pid, os.WNOHANG)
            except (OSError, IndexError, ValueError, ChildProcessError):
                continue

    def _remove_cgroup(self, cid: str, timeout: float = 5.0) -> bool:
        """rmdir the sandbox's cgroups; exiting processes may hold them for a moment. Blocks:
        call it from a thread."""
        deadline = time.monotonic() + timeout
        reaped = False
        while True:
            try:
                cgroups.remove_cgroup(self.cgroup_parent, cid)
                return True
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    log.warning("cannot remove cgroup of %s: %s", cid, exc)
                    return False
            if not reaped:
                self._reap_orphans()
                reaped = True
                continue
            time.sleep(0.005)

    async def recover(self, handles: list[Handle]) -> list[Handle]:
        """Adopt the live ones; remove the remains of everything else this backend owns."""
        alive = []
        for h in handles:
            if await self.is_alive(h) and os.path.ismount(self.sandboxes_dir / h.cid):
                alive.append(h)
                if self.id_ranges is not None:
                    self.id_ranges.adopt(h.cid, h.pid)
        self.layer_mounts.adopt([self._plan(h.cid, h.layers, h.image).layers for h in alive])
        keep = {h.cid for h in alive}
        for h in handles:
            if h.cid not in keep:
                await self._remove_remains(h.cid)
        for d in self.sandboxes_dir.iterdir():
            if d.name not in keep:
                await self._remove_remains(d.name)
        for state in self.crun_root.iterdir():
            if state.is_dir() and state.name not in keep:
                await self._remove_remains(state.name)
        for d in cgroups.sandbox_cgroup_dirs(self.cgroup_parent):
            if d.name not in keep:
                await self._remove_remains(d.name)
        self.layer_mounts.release_unused()
        return alive

    async def _remove_remains(self, cid: str) -> None:
        cgroups.thaw(self.cgroup_parent, cid)
        await self._run_crun("kill", cid, "KILL")
        await self._run_crun("delete", "--force", cid)
        try:
            if killed := await asyncio.to_thread(cgroups.kill_all, self.cgroup_parent, cid):
                log.warning("killed %d process(es) left in the cgroup of %s", killed, cid)
        except TimeoutError as exc:
            log.warning("%s", exc)
        await asyncio.to_thread(self._remove_cgroup, cid)  # (a zombie of ours is reaped first)
        target = self.sandboxes_dir / cid / "rootfs"
        if os.path.ismount(target):
            _sys.umount(str(target), _sys.MNT_DETACH)
        disk.unmount_bundle(self.sandboxes_dir / cid)
        shutil.rmtree(self.sandboxes_dir / cid, ignore_errors=True)
        if self.id_ranges is not None:
            self.id_ranges.release(cid)

    def release_unused(self) -> None:
        """After the last sandbox is gone: unmount unused layers, drop empty parent cgroups."""
        self.layer_mounts.release_unused()
        if not any(self.sandboxes_dir.iterdir()):
            cgroups.remove_parent(self.cgroup_parent)
            if os.path.ismount(self.run_dir):
                _sys.umount(str(self.run_dir), _sys.MNT_DETACH)

    def memory_usage(self, handle: Handle) -> int | None:
        return cgroups.memory_usage_bytes(self.cgroup_parent, handle.cid)

    # -- exec and files --------------------------------------------------------------------

    async def exec(self, handle: Handle, request: ExecRequest, ctx: ExecContext) -> ExecResult:
        return await self._exec(handle, request, ctx, None)

    async def exec_stream(self, handle: Handle, request: ExecRequest, ctx: ExecContext, emit: Emit) -> ExecResult:
        return await self._exec(handle, request, ctx, emit)

    async def exec_piped(self, handle: Handle, request: ExecRequest, ctx: ExecContext,
                         stdin: AsyncIterator[bytes] | None, emit: Emit) -> ExecResult:
        """``exec_stream`` with the command's stdin fed from ``stdin`` as the command reads it."""
        return await self._exec(handle, request, ctx, emit, stdin)

    async def _exec(self, handle: Handle, request: ExecRequest, ctx: ExecContext, emit: Emit | None,
                    feed: AsyncIterator[bytes] | None = None) -> ExecResult:
        flow = Flow(emit) if emit is not None else None
        if not await self.is_alive(handle):
            raise SandboxStateError(f"cannot exec: sandbox process of {handle.cid} is gone")
        self._check_dir(handle, ctx.workdir)
        channel = self.channels.get(handle.cid)
        if channel is not None and not channel.closed:
            job_id, message = channel.encode(["/bin/sh", "-c", request.command], ctx.env, ctx.workdir, ctx.uid, ctx.gid)
            if len(message) <= MAX_REQUEST:
                try:
                    return await self._exec_init(channel, job_id, message, request, flow, feed)
                except TooLarge:
                    pass  # this command alone goes through crun exec
                except ChannelClosed:
                    if not await self._alive_after(handle, _INIT_EXIT_GRACE_S):
                        raise SandboxStateError(f"sandbox process of {handle.cid} is gone{self._why_gone(handle)}") from None
                    log.warning("init channel of %s closed; commands go through crun exec", handle.cid)
        return await self._exec_crun(handle, request, ctx, flow, feed)

    async def _exec_init(self, channel: InitChannel, job_id: int, message: bytes, request: ExecRequest,
                         emit: Flow | None = None, feed: AsyncIterator[bytes] | None = None) -> ExecResult:
        """Run a command through the sandbox's init: it forks it with our pipes as its stdio."""
        loop = asyncio.get_running_loop()
        cap = request.max_output_bytes
        out, err = Capture(cap), Capture(cap)
        ours: list[int] = []
        theirs: list[int] = []
        transports: list[asyncio.BaseTransport] = []
        pipes: list[PipeReader | PipeStream] = []
        try:
            if request.stdin is not None or feed is not None:
                stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
                theirs.append(stdin_r)
                ours.append(stdin_w)
            else:
                theirs.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            for capture, kind in ((out, "stdout"), (err, "stderr")):
                r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
                os.set_blocking(w, True)  # the command's end
                theirs.append(w)
                ours.append(r)
                pipes.append(PipeReader(loop, r, capture) if emit is None else PipeStream(loop, r, capture, kind, emit))
                ours.remove(r)  # the reader owns it now
            start = time.perf_counter()
            try:
                await channel.start(job_id, message, (theirs[0], theirs[1], theirs[2]))
            except StartFailed as exc:
                raise BackendError(f"cannot start the command: {exc}") from None
            finally:
                for fd in theirs:
                    os.close(fd)
                theirs.clear()
            feeder = None
            if feed is not None:
                feeder = feed_pipe(loop, ours.pop(), feed)
            elif request.stdin is not None:
                wt, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(ours.pop(), "wb", 0))
                transports.append(wt)
                wt.write(request.stdin.encode())
                wt.close()  # after the buffered data is written (or the reader is gone)
            try:
                status = await asyncio.wait_for(with_feeder(channel.wait(job_id), feeder), request.timeout)
            except TimeoutError:
                channel.kill(job_id)
                with contextlib.suppress(TimeoutError, ChannelClosed):
                    await asyncio.wait_for(channel.wait(job_id), 5)
                tail = out.text[-500:]
                raise CommandTimeout(
                    f"command timed out after {request.timeout:g}s and was killed"
                    + (f"; last output: {tail!r}" if tail else "")
                ) from None
            except BaseException:
                channel.kill(job_id)
                raise
            # Output still in the pipes is read at once; a background process that keeps them
            # open is not waited for.
            await wait_pipes(emit, [p.done for p in pipes])
        finally:
            for pipe in pipes:
                pipe.close()
            for t in transports:
                t.close()
            for fd in theirs + ours:
                os.close(fd)
        return Capture.result(exit_code(status), out, err, start)

    async def _exec_crun(self, handle: Handle, request: ExecRequest, ctx: ExecContext,
                         emit: Flow | None = None, feed: AsyncIterator[bytes] | None = None) -> ExecResult:
        """Run a command through `crun exec` (a sandbox adopted after a restart has no channel)."""
        # Beside the bundles, on the node's own tmpfs: in the bundle it sat on the sandbox's capped
        # disk, and a sandbox that had filled it could run no command (not even an rm).
        exec_dir = self.run_dir / "exec"
        exec_dir.mkdir(mode=0o700, exist_ok=True)
        pidfile = exec_dir / f"{handle.cid}-{os.urandom(4).hex()}.pid"
        # crun exec does not take no_new_privs from the container's config: ask for it.
        argv = ["exec", "--no-new-privs", "--cwd", ctx.workdir, "--user", f"{ctx.uid}:{ctx.gid}", "--pid-file", str(pidfile)]
        for k, v in ctx.env.items():
            argv += ["--env", f"{k}={v}"]
        argv += [handle.cid, "/bin/sh", "-c", request.command]
        command = cgroups.join_argv(self.cgroup_parent, handle.cid, self._crun(*argv), self.cgroup_controllers,
                                    oom_score_adj=COMMAND_OOM_SCORE_ADJ)
        if cgroups.cpu_idle(self.cgroup_parent, handle.cid):
            # Best effort: crun exec, and the command it starts, run under SCHED_IDLE.
            command = [CHRT, "--idle", "0", *command]
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE if request.stdin is not None or feed is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        cap = request.max_output_bytes
        out, err = Capture(cap), Capture(cap)
        readers = [asyncio.ensure_future(out.drain(proc.stdout, emit, "stdout")),
                   asyncio.ensure_future(err.drain(proc.stderr, emit, "stderr"))]
        timed_out = False
        feeder = None
        try:
            if feed is not None:
                feeder = asyncio.ensure_future(_feed_stream(proc.stdin, feed))
            elif request.stdin is not None:
                try:
                    proc.stdin.write(request.stdin.encode())
                    await proc.stdin.drain()
                    proc.stdin.close()
                except (BrokenPipeError, ConnectionResetError):
                    pass
            try:
                rc = await asyncio.wait_for(with_feeder(wait_process(proc, request.timeout + 1), feeder), request.timeout)
            except TimeoutError:
                timed_out = True
                kill_session_of(pidfile, handle.cid)
                self._kill_exec(pidfile, proc)
                try:
                    rc = await wait_process(proc, 5)
                except TimeoutError:
                    kill_tree(proc.pid)
                    rc = await wait_process(proc, 60)
            # Output still in the pipes is read at once; a background process that keeps them
            # open is not waited for.
            await wait_pipes(emit, readers)
        except BaseException:
            self._kill_exec(pidfile, proc)
            raise
        finally:
            for task in readers:
                task.cancel()
            pidfile.unlink(missing_ok=True)
        if timed_out:
            tail = out.text[-500:]
            raise CommandTimeout(
                f"command timed out after {request.timeout:g}s and was killed"
                + (f"; last output: {tail!r}" if tail else "")
            )
        return Capture.result(rc, out, err, start)

    async def open_pty(self, handle: Handle, command: str, ctx: ExecContext, cols: int, rows: int) -> _ContainerPty:
        """The command on a terminal in the sandbox's devpts, started as any command is (through
        the init, or ``crun exec`` without a channel) with the slave as its stdio; ``dsec-init
        --ctty`` makes it the controlling terminal of the command's session."""
        if not await self.is_alive(handle):
            raise SandboxStateError(f"cannot open a PTY: sandbox process of {handle.cid} is gone")
        self._check_dir(handle, ctx.workdir)
        argv = [INIT_PATH, "--ctty", "/bin/sh", "-c", command]
        master, slave = terminal.open_pair(handle.pid, cols, rows)
        try:
            channel = self.channels.get(handle.cid)
            if channel is not None and not channel.closed:
                job_id, message = channel.encode(argv, ctx.env, ctx.workdir, ctx.uid, ctx.gid)
                if len(message) <= MAX_REQUEST:
                    try:
                        await channel.start(job_id, message, (slave, slave, slave))
                    except StartFailed as exc:
                        raise BackendError(f"cannot start the PTY's command: {exc}") from None
                    async def exited() -> int:
                        return exit_code(await channel.wait(job_id))

                    return _ContainerPty(terminal.Master(master), exited(), lambda: channel.kill(job_id))
            pidfile = self.sandboxes_dir / handle.cid / f"pty-{os.urandom(4).hex()}.pid"
            args = ["exec", "--no-new-privs", "--cwd", ctx.workdir, "--user", f"{ctx.uid}:{ctx.gid}", "--pid-file", str(pidfile)]
            for k, v in ctx.env.items():
                args += ["--env", f"{k}={v}"]
            proc = await asyncio.create_subprocess_exec(
                *cgroups.join_argv(self.cgroup_parent, handle.cid, self._crun(*args, handle.cid, *argv),
                                   self.cgroup_controllers, oom_score_adj=COMMAND_OOM_SCORE_ADJ),
                stdin=slave, stdout=slave, stderr=slave)

            async def ended() -> int:
                try:
                    rc = await proc.wait()
                    return 128 - rc if rc < 0 else rc
                finally:
                    pidfile.unlink(missing_ok=True)

            def kill() -> None:
                kill_session_of(pidfile, handle.cid)
                self._kill_exec(pidfile, proc)

            return _ContainerPty(terminal.Master(master), ended(), kill)
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)

    def _kill_exec(self, pidfile: Path, proc: asyncio.subprocess.Process) -> None:
        """Kill what a command started. ``crun exec`` itself is left to reap its child and
        exit; only if it had not started the command yet is it killed too."""
        try:
            kill_tree(int(pidfile.read_text()))
        except (OSError, ValueError):
            if proc.returncode is None:
                kill_tree(proc.pid)

    def _root_fd(self, handle: Handle) -> int:
        try:
            return os.open(f"/proc/{handle.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise SandboxStateError(f"sandbox process of {handle.cid} is gone") from exc

    def open_path(self, handle: Handle, path: str, flags: int, mode: int = 0o644) -> int:
        """A path of the sandbox from the node: resolved in its root, no symlink followed."""
        root = self._root_fd(handle)
        try:
            fd = _sys.openat2(root, path, flags | os.O_NOFOLLOW, mode if flags & os.O_CREAT else 0,
                              _sys.RESOLVE_IN_ROOT | _sys.RESOLVE_NO_SYMLINKS | _sys.RESOLVE_NO_MAGICLINKS)
        finally:
            os.close(root)
        if flags & os.O_CREAT and flags & os.O_EXCL:
            try:
                os.fchown(fd, *self._host_ids(handle, 0, 0))
            except OSError:
                os.close(fd)
                raise
        return fd

    def _check_dir(self, handle: Handle, path: str) -> None:
        root = self._root_fd(handle)
        try:
            fd = _sys.openat2(root, path, os.O_PATH | os.O_DIRECTORY, 0, _sys.RESOLVE_IN_ROOT)
            os.close(fd)
        except OSError as exc:
            raise InvalidRequest(f"workdir {path!r} is not a directory in the sandbox: {exc.strerror}") from None
        finally:
            os.close(root)

    async def read_file(self, handle: Handle, path: str, max_bytes: int) -> bytes:
        return await asyncio.to_thread(self._read_file, handle, path, max_bytes)

    def _read_file(self, handle: Handle, path: str, max_bytes: int) -> bytes:
        root = self._root_fd(handle)
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer.
            fd = _sys.openat2(root, path, os.O_RDONLY | os.O_NONBLOCK, 0,
                              _sys.RESOLVE_IN_ROOT | _sys.RESOLVE_NO_MAGICLINKS)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise SandboxFileNotFound(f"no such file in sandbox: {path}") from None
            raise InvalidRequest(f"cannot read {path}: {exc.strerror}") from None
        finally:
            os.close(root)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)  # (os.fdopen refuses a directory)
            kind = "is a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise InvalidRequest(f"cannot read {path}: {kind}")
        with os.fdopen(fd, "rb") as f:
            if st.st_size > max_bytes:
                raise InvalidRequest(f"cannot read {path}: {st.st_size} bytes is over the {max_bytes}-byte limit")
            return f.read(max_bytes + 1)[:max_bytes]

    async def write_file(self, handle: Handle, path: str, data: bytes, mode: int, uid: int, gid: int) -> None:
        uid, gid = self._host_ids(handle, uid, gid)
        await asyncio.to_thread(self._write_file, handle, path, data, mode, uid, gid)

    def _write_file(self, handle: Handle, path: str, data: bytes, mode: int, uid: int, gid: int) -> None:
        if not path.startswith("/"):
            raise InvalidRequest(f"path must be absolute: {path!r}")
        root = self._root_fd(handle)
        try:
            parent, _, name = path.rstrip("/").rpartition("/")
            if not name:
                raise InvalidRequest(f"cannot write {path!r}: not a file path")
            self._makedirs(root, parent or "/", uid, gid)
            resolve = _sys.RESOLVE_IN_ROOT | _sys.RESOLVE_NO_MAGICLINKS
            try:
                # A new file belongs to the sandbox's user; an existing one keeps its owner (as
                # with a shell's `>`). O_NONBLOCK: opening a FIFO must not wait for a reader.
                try:
                    fd = _sys.openat2(root, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NONBLOCK, mode, resolve)
                    created = True
                except FileExistsError:
                    fd = _sys.openat2(root, path, os.O_WRONLY | os.O_TRUNC | os.O_NONBLOCK, 0, resolve)
                    created = False
            except OSError as exc:
                raise InvalidRequest(f"cannot write {path}: {exc.strerror}") from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise InvalidRequest(f"cannot write {path}: not a regular file")
            try:
                if created:
                    os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            except OSError as exc:
                raise InvalidRequest(f"cannot write {path}: {exc.strerror}") from None
            finally:
                os.close(fd)
        finally:
            os.close(root)

    def _makedirs(self, root: int, directory: str, uid: int, gid: int) -> None:
        parts = [p for p in directory.split("/") if p]
        for i in range(len(parts)):
            sub = "/" + "/".join(parts[: i + 1])
            try:
                os.close(_sys.openat2(root, sub, os.O_PATH | os.O_DIRECTORY, 0, _sys.RESOLVE_IN_ROOT))
                continue
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise InvalidRequest(f"cannot create directory {sub}: {exc.strerror}") from None
            parent = _sys.openat2(root, "/" + "/".join(parts[:i]), os.O_PATH | os.O_DIRECTORY, 0, _sys.RESOLVE_IN_ROOT)
            try:
                os.mkdir(parts[i], 0o755, dir_fd=parent)
                fd = _sys.openat2(parent, parts[i], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, 0)
                os.fchown(fd, uid, gid)
                os.close(fd)
            except FileExistsError:
                pass
            finally:
                os.close(parent)

    async def make_dir(self, handle: Handle, path: str, uid: int, gid: int) -> None:
        uid, gid = self._host_ids(handle, uid, gid)
        root = self._root_fd(handle)
        try:
            self._makedirs(root, path, uid, gid)
        finally:
            os.close(root)

    async def resolve_user(self, handle: Handle, user: str) -> tuple[int, int]:
        """``root``, ``UID``, ``UID:GID`` or a name from the image's /etc/passwd."""
        ids = numeric_user(user)
        if ids is not None:
            return ids
        try:
            passwd = self._read_file(handle, "/etc/passwd", 1 << 20).decode(errors="replace")
        except (SandboxFileNotFound, InvalidRequest):
            passwd = ""
        return user_from_passwd(user, passwd)
