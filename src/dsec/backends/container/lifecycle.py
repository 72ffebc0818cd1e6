"""A container sandbox's life: create, limits, pause and resume, destroy, and recovery after an
edge restart.

``create`` takes its steps in order (an id range, the cgroup, the root filesystem, the init's
channel, the config, ``crun run``, the init in its cgroup) and pushes each step's undo on one
stack as the step succeeds; a failure at any step (a cancellation too) undoes what was done,
in reverse, and the stack is dropped once the sandbox is whole. ``destroy`` kills the init
(its pid namespace goes with it) and removes the cgroup, the root and crun's state, without
spawning crun while it can. ``recover`` adopts the sandboxes still alive and removes the
remains of everything else the backend owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import socket
import time
import uuid
from pathlib import Path

from libdsec import BackendError

from ... import _sys
from ...images.compose import OverlayPlan
from ...images.mounts import LayerMounts
from ...images.store import LayerStore
from ...isolation import disk, userns
from ...resources import cgroups, reclaim
from ...resources import cpu as cpu_sched
from ...resources.cgroups import Limits
from ..base import Handle, SandboxSpec
from ..initchan import InitChannel
from ..procs import children, outlast_cancel, pid_in_cgroup, wait_exit
from .oci import BOOT_ID_FILE, INIT_PATH, MASK_DIR, SHM_DIR, BundleConfigs
from .rootfs import RootFilesystems

log = logging.getLogger("dsec.backends.container")


def _runs_init(pid: int) -> bool:
    """True once ``pid`` runs the sandbox's init (not crun still setting up its namespaces)."""
    try:
        return _sys.read_small(f"/proc/{pid}/cmdline").split(b"\0")[0] == INIT_PATH.encode()
    except OSError:
        return False


class Lifecycle:
    """``ContainerBackend``'s lifecycle calls: the state they use is made in the backend's
    ``__init__``, and crun is run by its ``_run_crun``."""

    cgroup_parent: str
    cgroup_controllers: tuple[str, ...]
    store: LayerStore
    run_dir: Path
    crun_root: Path
    sandboxes_dir: Path
    layer_mounts: LayerMounts
    id_ranges: userns.IdRanges | None
    rootfs: RootFilesystems
    oci: BundleConfigs
    channels: dict[str, InitChannel]
    cgroups_made: set[str]

    def _mount_rootfs(self, plan: OverlayPlan, limits: Limits | None) -> None:
        """Create's mount step (``RootFilesystems.mount``): whole, or not at all. Blocks."""
        self.rootfs.mount(plan, limits)

    def _make_cgroup_and_root(self, cid: str, plan: OverlayPlan, limits: Limits | None) -> None:
        """Create's cgroup and mount steps, in one trip to a thread: both are kernel work (a
        v1 host makes a directory in each of four hierarchies, the memory one the dearest),
        which on the event loop held up every other request (a sixth of its time in the
        lifecycle benchmark). The cgroup is removed again if the mount fails. Blocks."""
        self.cgroups_made.add(cid)  # (before: a partly made one is in those hierarchies too)
        try:
            cgroups.make_sandbox_cgroup(self.cgroup_parent, cid, limits, self.cgroup_controllers)
        except OSError as exc:
            raise BackendError(f"cannot make the cgroup of {cid}: {exc}") from exc
        try:
            self._mount_rootfs(plan, limits)
        except BaseException as exc:
            self._remove_cgroup(cid)
            if isinstance(exc, OSError):
                raise BackendError(f"cannot mount the root filesystem of {cid}: {exc}") from exc
            raise

    async def create(self, cid: str, spec: SandboxSpec) -> Handle:
        for digest in spec.layers:
            if not self.store.has_layer(digest):
                raise BackendError(f"layer {digest} of image {spec.image!r} is missing from the store")
        plan = self.rootfs.plan(cid, spec.layers, spec.image)
        bundle = plan.target.parent
        async with contextlib.AsyncExitStack() as undo:
            idmap = None
            if self.id_ranges is not None:
                idmap = self.id_ranges.take(cid)  # here, on the event loop: ranges are handed out in order
                undo.callback(self.id_ranges.release, cid)
            # (A thread: the init, once killed, may hold the cgroup for a moment.) Pushed first:
            # a cancellation while the thread runs must not leave the cgroup behind; removing
            # one never made does nothing.
            undo.push_async_callback(asyncio.to_thread, self._remove_cgroup, cid)
            # The cgroup and the mounts (idmapped layer clones, the overlay, a tmpfs) block: off
            # the event loop. A thread cannot be stopped: a create cancelled meanwhile waits for
            # it, so that the undo removes what it made.
            making = asyncio.ensure_future(asyncio.to_thread(self._make_cgroup_and_root, cid, plan, spec.limits))
            cancelled = await outlast_cancel(making)
            making.result()  # or its BackendError (it undid its own steps)
            undo.callback(self.rootfs.release, plan)
            if cancelled:
                raise asyncio.CancelledError
            (bundle / "config.json").write_text(self.oci.json(plan, spec, idmap))
            pid, host_end = await self._run_init(cid, bundle, undo)
            undo.pop_all()  # the sandbox is whole
        self.rootfs.started(plan)
        handle = Handle(cid=cid, image=spec.image, layers=spec.layers, pid=pid, env=dict(spec.env))
        self._adopt_init(handle, host_end)
        self.rootfs.plans[cid] = plan
        # The cgroup got its limits and the bundle its size; SCHED_IDLE for a best-effort
        # sandbox's init is what is left (its commands get it in exec).
        if spec.limits is not None and spec.limits.best_effort:
            with contextlib.suppress(ProcessLookupError):
                cpu_sched.set_idle(pid, True)
        return handle

    async def _run_init(self, cid: str, bundle: Path, undo: contextlib.AsyncExitStack) -> tuple[int, socket.socket]:
        """``crun run`` the bundle's config, with a boot id of its own (new at each start), and
        wait until its init runs in the sandbox's cgroup: the init's pid and the host's end of
        its channel. What is undone on a failure is pushed on ``undo``."""
        pidfile = bundle / "init.pid"
        boot_id = bundle / BOOT_ID_FILE
        boot_id.write_text(f"{uuid.uuid4()}\n")
        boot_id.chmod(0o444)
        # The empty directory bound over protected ones, and /dev/shm, empty at each start as a
        # tmpfs of the init's own would be (see oci.MASK_DIR).
        (bundle / MASK_DIR).mkdir(mode=0o555, exist_ok=True)
        shutil.rmtree(bundle / SHM_DIR, ignore_errors=True)
        (bundle / SHM_DIR).mkdir()
        (bundle / SHM_DIR).chmod(0o1777)
        host_end, init_end = InitChannel.pair()
        undo.callback(host_end.close)
        with init_end:  # the init's, once crun has handed it over
            undo.push_async_callback(self._run_crun, "delete", "--force", cid)
            rc, out = await self._run_crun("run", "--detach", "--bundle", str(bundle), "--pid-file", str(pidfile),
                                           cid, log=bundle / "crun.log", stdin=init_end.fileno())
        if rc != 0:
            raise BackendError(f"crun could not start {cid}: {out[-800:]}")
        self.oci.learn_compiled(self.crun_root / cid)
        pid = int(_sys.read_small(str(pidfile)))
        # The init waits for its first command: nothing runs before it is in its cgroup. In a
        # thread: on v1 each write to cgroup.procs waits for the kernel's cgroup lock, which
        # every other sandbox's cgroup mkdir and rmdir take too (under load, the event loop
        # stood still behind them).
        try:
            await asyncio.to_thread(cgroups.enter, self.cgroup_parent, cid, pid, self.cgroup_controllers)
        except OSError as exc:  # ESRCH: the init is gone already
            raise BackendError(f"cannot move the init of {cid} into its cgroup: {exc}") from exc
        # `crun run --detach` may return while the first process is still crun setting up
        # the namespaces; a `crun exec` then fails (setns: EPERM). Wait for the init.
        deadline = time.monotonic() + 10
        while not _runs_init(pid):
            if time.monotonic() > deadline:
                raise BackendError(f"the init of {cid} did not start within 10s")
            await asyncio.sleep(0.002)
        return pid, host_end

    def _adopt_init(self, handle: Handle, host_end: socket.socket) -> None:
        """Hold the channel of an init just started (``_run_init``). No pidfd is held for it:
        that would be a second open file a sandbox, and 10,000 idle sandboxes would need
        20,000; one is opened for a wait or a kill (``_pidfd``)."""
        self.channels[handle.cid] = InitChannel(host_end)

    async def halt(self, handle: Handle) -> None:
        """End every process of the sandbox (its init, its pid namespace with it) and keep its
        files, cgroup and user ids for ``boot``."""
        await self._kill_init(handle)
        with contextlib.suppress(OSError):  # (a paused one's memory may go back to swap-less)
            cgroups.lift_swap(self.cgroup_parent, handle.cid, False)
        if killed := await asyncio.to_thread(cgroups.kill_all, self.cgroup_parent, handle.cid):
            log.warning("killed %d process(es) left in the cgroup of %s as it halted", killed, handle.cid)
        shutil.rmtree(self.crun_root / handle.cid, ignore_errors=True)  # (what `crun delete` would drop)
        handle.pid = 0

    async def boot(self, handle: Handle) -> None:
        """Start a halted sandbox afresh over its kept files: its init, as ``create`` started it."""
        if handle.pid:
            raise BackendError(f"cannot boot {handle.cid}: it is not halted (its init is {handle.pid})")
        plan = self.rootfs.plan(handle.cid, handle.layers, handle.image)
        bundle = plan.target.parent
        if not os.path.ismount(bundle):
            raise BackendError(f"cannot boot {handle.cid}: its files are gone ({bundle} is not mounted)")
        try:
            await asyncio.to_thread(self.rootfs.mount_again, plan)
        except OSError as exc:
            raise BackendError(f"cannot mount the root filesystem of {handle.cid} again: {exc}") from exc
        async with contextlib.AsyncExitStack() as undo:
            handle.pid, host_end = await self._run_init(handle.cid, bundle, undo)
            undo.pop_all()
        self.rootfs.started(plan)
        self.rootfs.plans[handle.cid] = plan
        self._adopt_init(handle, host_end)

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
        return handle.pid > 0 and pid_in_cgroup(handle.pid, handle.cid)

    @staticmethod
    def _pidfd(handle: Handle) -> int | None:
        """A pidfd of the sandbox's init while it lives in the sandbox's cgroup (a zombie is not
        reaped but by us, so its pid cannot be another's meanwhile); the caller closes it."""
        if handle.pid > 0 and pid_in_cgroup(handle.pid, handle.cid):
            with contextlib.suppress(OSError):
                return os.pidfd_open(handle.pid)
        return None

    async def _alive_after(self, handle: Handle, grace: float) -> bool:
        """Whether the init still lives ``grace`` seconds on (or once it is gone, if sooner). A
        pid namespace's init that was killed closes its files first, then waits for all else in
        the namespace to die before it counts as exited: its channel closes well before that."""
        fd = self._pidfd(handle)
        if fd is None:
            return False
        try:
            return not await wait_exit(fd, grace, tick=self._reap_orphans)
        finally:
            os.close(fd)

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

    async def destroy(self, handle: Handle) -> None:
        await self._kill_init(handle)
        # What `crun delete` does for a dead container, without spawning it: drop its cgroups
        # and its state directory; then the root filesystem. Off the event loop: rmdir of a
        # cgroup in each v1 hierarchy and the unmounts are kernel work the loop need not wait on.
        if not await asyncio.to_thread(self._teardown, handle):
            await self._run_crun("delete", "--force", handle.cid)
            await asyncio.to_thread(self._remove_cgroup, handle.cid)

    async def _kill_init(self, handle: Handle) -> None:
        """Kill the sandbox's init (every process of its pid namespace goes with it) and wait
        for it; nothing for a halted one."""
        if (channel := self.channels.pop(handle.cid, None)) is not None:
            channel.close()
        if (fd := self._pidfd(handle)) is not None:
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
        if handle.pid > 0:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(handle.pid, os.WNOHANG)

    def _teardown(self, handle: Handle) -> bool:
        """Remove a dead sandbox's cgroups, root filesystem and crun state; False if its
        cgroups would not go (crun delete is tried then)."""
        removed = self._remove_cgroup(handle.cid)
        self.rootfs.release(self.rootfs.plan(handle.cid, handle.layers, handle.image))
        if self.id_ranges is not None:
            self.id_ranges.release(handle.cid)
        self.rootfs.plans.pop(handle.cid, None)
        shutil.rmtree(self.crun_root / handle.cid, ignore_errors=True)
        return removed

    def _reap_orphans(self) -> None:
        """Reap zombies that were reparented to us (we are the subreaper) from inside our
        sandboxes, e.g. a command whose ``crun exec`` died first. Only processes in our sandbox
        cgroups or in a pid namespace below ours (a process ``crun exec`` started that failed
        before it joined the sandbox's cgroup, as when its program is missing): asyncio reaps
        the ``crun`` processes it spawned, which are in neither."""
        for pid in children():
            try:
                if _sys.proc_stat(pid)[0] != "Z":
                    continue
                with open(f"/proc/{pid}/cgroup") as f:
                    ours = f"/{self.cgroup_parent}/" in f.read()
                if not ours:
                    with open(f"/proc/{pid}/status") as f:
                        nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
                    ours = len(nspid) > 1
                if ours:
                    os.waitpid(pid, os.WNOHANG)
            except (OSError, IndexError, ValueError, ChildProcessError):
                continue

    def _remove_cgroup(self, cid: str, timeout: float = 5.0) -> bool:
        """rmdir the sandbox's cgroups; exiting processes may hold them for a moment. Blocks:
        call it from a thread. Cgroups this process made (``cgroups_made``) are in the
        hierarchies of ``cgroup_controllers`` only; for any other (adopted after a restart, an
        older DSec's, remains) every hierarchy is tried."""
        controllers = self.cgroup_controllers if cid in self.cgroups_made else None
        deadline = time.monotonic() + timeout
        reaped = False
        while True:
            try:
                cgroups.remove_cgroup(self.cgroup_parent, cid, controllers)
                self.cgroups_made.discard(cid)
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
            halted = h.pid == 0  # (``halt``: its files kept for a boot)
            if (halted or await self.is_alive(h)) and os.path.ismount(self.sandboxes_dir / h.cid):
                alive.append(h)
                if self.id_ranges is not None and not halted:
                    self.id_ranges.adopt(h.cid, h.pid)
                elif self.id_ranges is not None:
                    self._adopt_halted_ids(h)
        self.layer_mounts.adopt([self.rootfs.plan(h.cid, h.layers, h.image).layers for h in alive])
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

    def _adopt_halted_ids(self, handle: Handle) -> None:
        """Take back a halted sandbox's user ids from its bundle's config."""
        try:
            config = json.loads((self.sandboxes_dir / handle.cid / "config.json").read_text())
            first = config["linux"]["uidMappings"][0]
            self.id_ranges.adopt_mapped(handle.cid, int(first["containerID"]), int(first["hostID"]))
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            log.warning("cannot take back the user ids of halted sandbox %s: %s", handle.cid, exc)

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
        self.rootfs.remove_remains(cid)
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
