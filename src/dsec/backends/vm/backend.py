"""What both VM kinds share: QEMU per sandbox, driven over QMP, and the guest agent for exec and
files, with the container backend's semantics and errors.

Lifecycle as in ``dsec.backends.base``. ``create`` returns once the guest agent answers; a
guest that does not boot within ``boot_timeout_s`` (or a QEMU that dies first) is killed, its
directory removed, and ``BackendError`` raised with the tail of its console. A VM whose QEMU is
gone, or whose agent closed its channel or stopped answering, is not alive: calls on it raise
``SandboxStateError`` and the edge marks it failed. ``why_gone`` says why, from the guest's
console where it tells: the agent exited (the guest's init then powers off), the guest's OOM
killer took the agent, the guest kernel panicked.

Per node: ``<node_dir>/vms/<kind>/<cid>/`` holds ``qemu.pid``, ``qmp.sock``, ``agent.sock``,
``console.log`` and whatever the kind adds (a disk overlay); ``destroy`` removes it.

Each QEMU runs in a memory cgroup of its own, ``<parent>-<kind>/<cid>`` (``<parent>`` being the
node's container parent, see ``cgroups.parent_for``), started in it so that all its memory is
charged there. ``pause`` stops the vCPUs (QMP ``stop``) and then pushes the VM's memory out of
RAM as a paused container's is (``reclaim.push_out``: guest RAM and QEMU's own to swap, zram
here; clean file pages such as the layers' dropped); ``resume`` lets the vCPUs go again
(``cont``), and the guest faults its pages back in as it touches them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import shlex
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from libdsec import BackendError, CommandTimeout, InvalidRequest, LimitOutOfRange, SandboxFileNotFound, SandboxStateError
from libdsec.protocol import ExecRequest, ExecResult

from ...images import carry
from ...images.layercache import LayerCache
from ...images.mounts import configured_cache
from ...images.store import LayerStore
from ...resources import cgroups, reclaim
from ...resources.cgroups import Limits
from .. import portconn
from ..base import Capability, Emit, ExecContext, Handle, PackedDiff, SandboxSpec, numeric_user, user_from_passwd
from . import machine, pack
from ..capture import with_feeder
from .agent import AgentChannel, AgentFailure, AgentGone, Done
from .assets import AssetCache, GuestAssets
from .qmp import QMP, QMPError

log = logging.getLogger("dsec.backends.vm")

AGENT_BIN = "/dev/.dsec/bin"
# What a guest's console says when its agent went (guest/pid1.sh, the kernel's OOM killer, a panic).
_AGENT_EXITED = "dsec: guest agent exited"
_OOM_KILLED = re.compile(r"Out of memory: Killed process (\d+) \(([^)]*)\)[^\n]*")
_PANIC = re.compile(r"Kernel panic - not syncing:[^\n]*")
# QEMU run states of a VM whose vCPUs are stopped but that can run again (``cont``).
_STOPPED = ("paused", "postmigrate", "finish-migrate")
_MIGRATING = ("setup", "active", "pre-switchover", "device", "cancelling")
KILL_GRACE_S = 5.0
# A fed stdin goes to the agent in pieces of this size; one it refuses (its queue of 1 MiB is
# full: the command has not read it yet) is sent again after a wait.
_FEED_PIECE = 256 << 10
_FEED_WAIT_S = 0.005
MIN_MEMORY_MB = 64
# The longest path of a UNIX socket (sun_path, less its NUL): QEMU refuses a longer one.
MAX_SOCKET_PATH = 107
DEFAULT_MEMORY_MB = 256


class _Relay:
    """A streamed command's output (the agent's "sout"/"serr" frames) handed to ``emit`` in
    order, each chunk acked to the agent once ``emit`` returned: the agent sends at most its
    window ahead, so a slow consumer slows the command and holds at most that much here."""

    def __init__(self, agent: AgentChannel, rid: str, cap: int, emit: Emit) -> None:
        self.agent, self.rid, self.cap, self.emit = agent, rid, cap, emit
        self.kept = {"stdout": bytearray(), "stderr": bytearray()}
        self.chunks: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()
        agent.streams[rid] = lambda kind, data: self.chunks.put_nowait((kind, data))
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while (item := await self.chunks.get()) is not None:
            kind, data = item
            kept = self.kept[kind]
            if len(kept) < self.cap:
                kept += data[: self.cap - len(kept)]
            await self.emit(kind, data)
            await self.agent.post(f"ack {self.rid} {len(data)}")

    async def finish(self, timeout: float) -> None:
        """After the command's end (its frames are all in): hand on what is left."""
        self.chunks.put_nowait(None)
        await asyncio.wait_for(asyncio.shield(self.task), max(timeout, 0.001))

    def close(self) -> None:
        self.agent.streams.pop(self.rid, None)
        self.task.cancel()


class _VMPty:
    """A VM's PTY (``SandboxBackend.open_pty``): a job of the guest agent's whose output comes
    as "sout" frames (acked once read: the agent sends at most its window ahead), typed with
    ``ptyin``, resized with ``ptysz``, ended with ``kill``."""

    def __init__(self, backend: VMBackend, handle: Handle, live: _Live, rid: str) -> None:
        self.backend, self.handle, self.live, self.agent, self.rid = backend, handle, live, live.agent, rid
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.agent.streams[rid] = lambda kind, data: self.chunks.put_nowait(data)
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.closed = False
        self._code: int | None = None

    def release(self) -> None:
        self.agent.streams.pop(self.rid, None)

    def started(self, done: asyncio.Future) -> None:
        self.done = done
        # Its frames all came before its end: the end goes behind them.
        done.add_done_callback(lambda _: self.chunks.put_nowait(None))

    async def read(self) -> bytes:
        data = await self.chunks.get()
        if data is None:
            self.chunks.put_nowait(None)  # and for every later read
            return b""
        with contextlib.suppress(AgentGone):
            await self.agent.post(f"ack {self.rid} {len(data)}")
        return data

    async def _call(self, what: str, header: str, *payloads: bytes) -> None:
        if self.closed:
            raise SandboxStateError(f"cannot {what}: the PTY is closed")
        if self.done.done():
            raise SandboxStateError(f"cannot {what}: the PTY's command has exited (exit code {await self.wait()})")
        try:
            await self.agent.request(header, *payloads, timeout=30.0)
        except AgentFailure as exc:
            raise SandboxStateError(f"cannot {what}: {exc.message}") from None
        except AgentGone as exc:
            raise self.backend._gone(self.handle, self.live, exc) from None

    async def write(self, data: bytes) -> None:
        await self._call("write to the PTY", f"ptyin {self.rid} {len(data)}", data)

    async def resize(self, cols: int, rows: int) -> None:
        await self._call("resize the PTY", f"ptysz {self.rid} {cols} {rows}")

    async def wait(self) -> int:
        try:
            result = await asyncio.shield(self.done)
        except Exception:  # noqa: BLE001 - the agent went away: the command with it
            return -1
        return result.exit_code if isinstance(result, Done) else -1

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.done.done():
            with contextlib.suppress(AgentGone):
                await self.agent.send(self.agent.new_id(), f"kill {self.rid}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self.done), KILL_GRACE_S)
        self.release()
        self.chunks.put_nowait(None)


# Protected paths go on the guest kernel's command line (x86: 2048 bytes in all), hex-encoded;
# the guest's jail binds at most 64 paths read-only, its own directory one of them.
MAX_PROTECTED_PATHS = 63
GUEST_BUSYBOX = "/dev/.dsec/busybox"
MAX_PROTECTED_BYTES = 640


def _unescape_mountinfo(field: str) -> str:
    """A mount point as /proc/PID/mountinfo writes it (space, tab, newline, backslash octal-escaped)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


@dataclass
class _Live:
    """What the backend holds for a running VM (rebuilt on recover)."""

    pid: int
    qmp: QMP
    agent: AgentChannel
    paused: bool = False
    limits: Limits | None = None
    # Adopted with its vCPUs stopped: its agent has not answered yet (it is asked on resume).
    unverified: bool = False


class VMBackend:
    kind = "vm"
    # No WARM_POOL: the edge's pool pre-creates sandboxes without limits, and a VM's memory is
    # fixed when it boots, so VMs are made for each request instead. KEPT_LAYER: clean copies
    # through the guest agent (kept_layer).
    capabilities = frozenset({Capability.KEPT_LAYER, Capability.PIPED_STDIN, Capability.WATCHED, Capability.PROTECTED_PATHS,
                              Capability.PORTS, Capability.NEW_IDENTITY, Capability.DESKTOP})

    def __init__(self, node_dir: Path, store: LayerStore, assets_dir: Path | None = None, *,
                 accel: str | None = None, boot_timeout_s: float = 60.0, default_memory_mb: int = DEFAULT_MEMORY_MB,
                 tcg_tb_mb: int | None = None, layer_cache: LayerCache | None = None) -> None:
        """``layer_cache``: the node's layer cache the VMs read their layers through (None: the
        one the settings ask for, shared with the node's containers, if any)."""
        self.node_dir = Path(node_dir)
        self.store = store
        self.layer_cache = layer_cache or configured_cache(self.node_dir, None if store is None else store.layers_dir)
        self.vms_dir = self.node_dir / "vms" / self.kind
        self.vms_dir.mkdir(parents=True, exist_ok=True)
        self.assets_cache = AssetCache(Path(assets_dir) if assets_dir else self.node_dir.parent / "vm")
        self._assets: GuestAssets | None = None
        self._accel = accel
        self.boot_timeout_s = boot_timeout_s
        self.default_memory_mb = default_memory_mb
        self.tcg_tb_mb = tcg_tb_mb  # None: machine.TCG_TB_MB
        self._live: dict[str, _Live] = {}
        self.cgroup_parent = f"{cgroups.parent_for(self.node_dir.parent)}-{self.kind}"

    # -- node-level ------------------------------------------------------------------------

    async def assets(self) -> GuestAssets:
        if self._assets is None:
            self._assets = await asyncio.to_thread(self.assets_cache.ensure)
        return self._assets

    async def accel(self) -> str:
        if self._accel is None:
            assets = await self.assets()
            self._accel = await asyncio.to_thread(machine.probe_accel, assets, self.assets_cache.root)
        return self._accel

    async def warm_up(self) -> None:
        """Fetch the guest kernel, build the initramfs and probe the accelerator now rather
        than at the first create (the server starts this in the background)."""
        try:
            await self.accel()
        except Exception as exc:  # noqa: BLE001 - reported, retried at the first create
            log.warning("%s: cannot prepare VM assets yet: %s", self.kind, exc)

    def host_view(self) -> None:
        """A VM's processes and files are in its guest: nothing of them for the host's accounting."""
        return None

    def describe(self) -> str:
        """One line for ``dsec info``: the machine and the accelerator (once probed)."""
        return f"{self.kind}: QEMU {machine.qemu_version()}, accel {self._accel or 'not probed yet'}"

    def vm_dir(self, cid: str) -> Path:
        return self.vms_dir / cid

    async def layer_file(self, path: Path) -> Path:
        """Where a VM reads the store's layer file ``path`` (a layer, or its DAX variant): with a
        layer cache, its file there, so what the node's VMs read of it is fetched from the store
        once, checked against the store's sums, and kept on the node's disk (the cache's server
        started if it is not serving); else the store's file itself."""
        if self.layer_cache is None:
            return path
        return await asyncio.to_thread(self.layer_cache.path, path)

    # -- what each kind provides -----------------------------------------------------------

    async def _prepare(self, cid: str, spec: SandboxSpec, vm_dir: Path) -> list[str]:
        """Files the VM needs in ``vm_dir``, and QEMU's arguments (without -daemonize)."""
        raise NotImplementedError

    def _common_args(self, vm_dir: Path, accel: str, serial_bus: str) -> list[str]:
        """QEMU arguments every VM has; ``serial_bus`` is the virtio-serial device of the machine."""
        return [
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-name", vm_dir.name,
            *machine.accel_args(accel, self.tcg_tb_mb),
            "-serial", f"file:{vm_dir / 'console.log'}",
            "-chardev", f"socket,id=agent,path={vm_dir / 'agent.sock'},server=on,wait=off",
            "-device", serial_bus,
            "-device", "virtserialport,chardev=agent,name=dsec.agent",
            "-qmp", f"unix:{vm_dir / 'qmp.sock'},server=on,wait=off",
        ]

    def _kernel_args(self, assets: GuestAssets, accel: str, extra: str) -> list[str]:
        # cryptomgr.notests: no self-test of each crypto algorithm the kernel registers (they held
        # the boot in crypto_algapi_init for 0.46 s under TCG; a VM's kernel is Debian's, tested).
        cmdline = "console=ttyS0 quiet panic=-1 cryptomgr.notests " + extra
        khz = machine.tsc_khz()
        if accel == "tcg" and khz:
            cmdline += f" tsc_early_khz={khz}"
        return ["-kernel", str(assets.kernel), "-initrd", str(assets.initramfs), "-append", cmdline]

    def memory_mb(self, spec: SandboxSpec) -> int:
        mb = spec.limits.memory_mb if spec.limits is not None else self.default_memory_mb
        if mb < MIN_MEMORY_MB:
            raise LimitOutOfRange(f"memory_limit_mb={mb} is too small for a {self.kind}: at least {MIN_MEMORY_MB} MB")
        return mb

    def vcpus(self, spec: SandboxSpec) -> int:
        import math
        import os

        cores = spec.limits.cpu_cores if spec.limits is not None else 1.0
        return max(1, min(os.cpu_count() or 1, math.ceil(cores)))

    # -- lifecycle -------------------------------------------------------------------------

    async def create(self, cid: str, spec: SandboxSpec) -> Handle:
        for digest in spec.layers:
            if not self.store.has_layer(digest):
                raise BackendError(f"layer {digest} of image {spec.image!r} is missing from the store")
        vm_dir = self.vm_dir(cid)
        if len(socket := os.fsencode(vm_dir / "agent.sock")) > MAX_SOCKET_PATH:
            raise BackendError(f"a {self.kind}'s sockets would be at {vm_dir}/, {len(socket)} bytes with the socket's "
                               f"name, over the {MAX_SOCKET_PATH} a UNIX socket's path may hold: give the node a "
                               f"shorter state dir (dsec serve --state-dir)")
        pid = 0
        try:
            vm_dir.mkdir(parents=True)
            argv = await self._prepare(cid, spec, vm_dir)
            procs = await asyncio.to_thread(cgroups.make_memory_cgroup, self.cgroup_parent, cid)
            pid = await machine.launch(argv, vm_dir, cgroup_procs=procs)
            live = await self._attach(cid, pid, vm_dir, self.boot_timeout_s, spec)
        except BaseException as exc:
            await machine.kill(pid)
            await self._remove_cgroup(cid)
            if not self._live:
                cgroups.remove_parent(self.cgroup_parent)
            console = self._console_tail(vm_dir)
            shutil.rmtree(vm_dir, ignore_errors=True)
            if isinstance(exc, (AgentGone, QMPError)):
                raise BackendError(f"{self.kind} {cid} did not come up: {exc}" + (f"; console: {console}" if console else "")) from exc
            if isinstance(exc, OSError) and exc.errno is not None:  # a full disk (ENOSPC) above all
                raise BackendError(f"cannot make {self.kind} {cid}: {exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)})"
                                   + (f": {exc.filename}" if exc.filename else "")) from exc
            raise
        live.limits = spec.limits
        self._live[cid] = live
        handle = Handle(cid=cid, image=spec.image, layers=spec.layers, pid=pid, env=dict(spec.env))
        if spec.protected_paths:
            try:
                await self._check_protected(handle, spec)
            except BaseException:
                await self.destroy(handle)
                raise
        return handle

    # -- protected paths ---------------------------------------------------------------------

    def protect_arg(self, spec: SandboxSpec) -> str:
        """The kernel command line's ``dsec.protect=``: the hex of the protected paths,
        NUL-separated. The guest agent makes each a read-only bind mount in the commands' mount
        namespace before the first command (``native/agent.c``, ``dsec-jail --init --ro``)."""
        if not spec.protected_paths:
            return ""
        if len(spec.protected_paths) > MAX_PROTECTED_PATHS:
            raise InvalidRequest(f"a {self.kind} takes at most {MAX_PROTECTED_PATHS} protected paths, "
                                 f"not {len(spec.protected_paths)}")
        hexed = b"\0".join(os.fsencode(p) for p in spec.protected_paths).hex()
        if len(hexed) > 2 * MAX_PROTECTED_BYTES:
            raise InvalidRequest(f"the protected paths of a {self.kind} are at most {MAX_PROTECTED_BYTES} bytes "
                                 f"in all (they go on the guest kernel's command line), not {len(hexed) // 2}")
        return f" dsec.protect={hexed}"

    async def _check_protected(self, handle: Handle, spec: SandboxSpec) -> None:
        """Each protected path, as a command sees it, is a read-only mount point: what the
        agent made of ``dsec.protect``. A path the image lacks is ``InvalidRequest``."""
        # (The agent's busybox, which commands may run: the image need not have readlink or cat.)
        bb = f"{GUEST_BUSYBOX} "
        script = "; ".join(
            f"p={shlex.quote(p)}; if [ -e \"$p\" ]; then {bb}printf '%s\\0' \"$({bb}readlink -f -- \"$p\")\"; "
            f"else {bb}printf '\\0'; fi" for p in spec.protected_paths) + f"; {bb}cat /proc/self/mountinfo"
        ctx = ExecContext(uid=0, gid=0, workdir="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        result = await self.exec(handle, ExecRequest(command=script, timeout=60), ctx)
        parts = result.stdout.split("\0")
        if result.exit_code != 0 or len(parts) != len(spec.protected_paths) + 1:
            raise BackendError(f"cannot check the protected paths of {self.kind} {handle.cid}: "
                               f"exit {result.exit_code}: {result.stderr.strip()[-300:]}")
        read_only: dict[str, bool] = {}
        for line in parts[-1].splitlines():  # the last mount at a point is the one seen
            fields = line.split(" ")
            if len(fields) > 5:
                read_only[_unescape_mountinfo(fields[4])] = "ro" in fields[5].split(",")
        for path, real in zip(spec.protected_paths, parts, strict=False):
            if not real:
                raise InvalidRequest(f"protected path {path!r} cannot be protected in image {spec.image!r}: "
                                     f"No such file or directory")
            if not read_only.get(real):
                raise BackendError(f"protected path {path!r} ({real}) is not a read-only mount in "
                                   f"{self.kind} {handle.cid}: its guest agent does not protect paths")

    async def _before_agent(self, qmp: QMP, pid: int, spec: SandboxSpec) -> None:
        """Hook: a restored VM loads its state here."""

    async def _attach(self, cid: str, pid: int, vm_dir: Path, timeout: float, spec: SandboxSpec | None = None,
                      qmp: QMP | None = None) -> _Live:
        """Connect QMP (unless given) and the agent, and wait until the agent answers (or QEMU dies)."""
        qmp = qmp or await QMP.connect(vm_dir / "qmp.sock")
        agent = None
        try:
            # The agent's socket first: a restored guest then finds its host connected, as it
            # was when the snapshot was taken, instead of seeing it gone and looking again later.
            agent = await AgentChannel.connect(vm_dir / "agent.sock")
            if spec is not None:
                await self._before_agent(qmp, pid, spec)
        except BaseException:
            if agent is not None:
                await agent.close()
            await qmp.close()
            raise
        live = _Live(pid=pid, qmp=qmp, agent=agent)
        ready = asyncio.ensure_future(agent.wait_ready(timeout))
        try:
            while not ready.done():
                await asyncio.wait([ready], timeout=0.2)
                if not ready.done() and not machine.pid_alive(pid):
                    raise AgentGone("QEMU exited while the guest was booting")
            ready.result()
        except BaseException:
            ready.cancel()
            await self._close_live(live)
            raise
        return live

    async def _close_live(self, live: _Live) -> None:
        await live.agent.close()
        await live.qmp.close()

    def _console_tail(self, vm_dir: Path, n: int = 600) -> str:
        try:
            return (vm_dir / "console.log").read_text(errors="replace").strip()[-n:]
        except OSError:
            return ""

    async def apply_limits(self, handle: Handle, limits: Limits) -> None:
        live = self._get(handle, "set limits", paused_ok=True)
        live.limits = limits

    async def is_alive(self, handle: Handle) -> bool:
        live = self._live.get(handle.cid)
        return live is not None and not live.agent.closed and machine.pid_alive(live.pid)

    async def pause(self, handle: Handle) -> None:
        live = self._get(handle, "pause", paused_ok=True)
        try:
            await live.qmp.execute("stop")
        except QMPError as exc:
            raise BackendError(f"cannot pause {handle.cid}: {exc}") from exc
        live.paused = True
        # Stopped, the guest touches none of its pages: push them all out (to swap).
        try:
            await asyncio.to_thread(reclaim.push_out, self.cgroup_parent, handle.cid)
        except OSError as exc:
            log.warning("paused %s but could not push its memory out: %s", handle.cid, exc)

    async def resume(self, handle: Handle) -> None:
        live = self._get(handle, "resume", paused_ok=True)
        await self._cont(handle, live)
        if live.unverified:  # adopted stopped: its agent answers now, or it is gone
            try:
                await live.agent.wait_ready(10.0)
            except AgentGone as exc:
                raise self._gone(handle, live, exc) from None
            live.unverified = False

    async def _cont(self, handle: Handle, live, why: str = "") -> None:
        """Let a paused VM run again (QMP ``cont``)."""
        try:
            await live.qmp.execute("cont")
        except QMPError as exc:
            raise BackendError(f"cannot resume {handle.cid}{why}: {exc}") from exc
        live.paused = False

    async def pack_diff(self, handle: Handle, once: bool = False) -> PackedDiff:
        """The VM's writable layer, scrubbed, as a layer in the store (see ``pack``); the VM
        runs on (its commands are frozen while the agent reads the layer: ``frozen_s``).
        ``once``: named by its file (``LayerStore.add_dir``)."""
        return await self._pack_upper(handle, "pack", pack.pack_upper, once)

    async def kept_layer(self, handle: Handle, keep: list[str]):
        """A layer of the VM's changes beneath ``keep`` only, for a clean copy (see
        ``pack.kept_from_tar``): (digest, what was carried, system files tampered with)."""
        return await self._pack_upper(handle, "make a clean copy of", pack.kept_upper, keep)

    async def _pack_upper(self, handle: Handle, verb: str, packer, *args):
        live = self._get(handle, verb)
        try:
            return await packer(live.agent, self.store, *args)
        except AgentFailure as exc:
            raise BackendError(f"cannot pack {self.kind} {handle.cid}: {exc.message}") from None
        except AgentGone as exc:
            raise self._gone(handle, live, exc) from None

    async def guest_tampered(self, handle: Handle, timeout: float) -> list[str]:
        """The system files the guest's writable layer replaces or adds (``carry.system_files``
        of the paths the agent's ``changed`` lists: it reads only the upper's system trees and
        homes, names only). A paused VM is let run for it (it is being stopped). Raises
        ``BackendError`` if the agent cannot tell (an agent older than ``changed``, one that
        does not answer within ``timeout``: the channel stays usable)."""
        live = self._get(handle, "look for tampering in", paused_ok=True)
        if live.paused:
            await self._cont(handle, live, " to look for tampering")
        try:
            names = await live.agent.request("changed", timeout=timeout)
        except AgentFailure as exc:
            raise BackendError(f"cannot look for tampering in {self.kind} {handle.cid}: {exc.message}") from None
        except AgentGone as exc:
            raise BackendError(f"cannot look for tampering in {self.kind} {handle.cid}: {exc}") from None
        assert isinstance(names, bytes)
        return carry.system_files(os.fsdecode(n) for n in names.split(b"\0") if n)

    async def destroy(self, handle: Handle) -> None:
        live = self._live.pop(handle.cid, None)
        if live is not None:
            await self._close_live(live)
        await machine.kill(handle.pid if handle.pid else (live.pid if live else 0))
        await self._remove_cgroup(handle.cid)
        await asyncio.to_thread(shutil.rmtree, self.vm_dir(handle.cid), True)
        await self._release(handle)

    async def _remove_cgroup(self, cid: str) -> None:
        """Remove a VM's cgroup once its QEMU is gone (an exited one leaves it a moment later)."""
        d = self._memory_cgroup(cid)
        for _ in range(200):
            try:
                cgroups.remove_cgroup(self.cgroup_parent, cid)
                return
            except OSError:
                if not d.exists():
                    return
                with contextlib.suppress(OSError, ValueError):
                    for pid in (d / "cgroup.procs").read_text().split():
                        await machine.kill(int(pid))
                await asyncio.sleep(0.01)
        log.warning("cannot remove the cgroup of %s %s", self.kind, cid)

    def _memory_cgroup(self, cid: str) -> Path:
        if cgroups.is_v2():
            return cgroups.CGROUP_ROOT / self.cgroup_parent / cid
        return cgroups.CGROUP_ROOT / "memory" / self.cgroup_parent / cid

    async def _release(self, handle: Handle) -> None:
        """Hook: node-level things a VM held."""

    async def recover(self, handles: list[Handle]) -> list[Handle]:
        """Reconnect to the VMs still running; kill and remove everything else of this kind."""
        alive = []
        for h in handles:
            vm_dir = self.vm_dir(h.cid)
            if h.cid in self._live and await self.is_alive(h):
                alive.append(h)
                continue
            if machine.pid_alive(h.pid) and vm_dir.is_dir():
                try:
                    self._live[h.cid] = await self._reattach(h, vm_dir)
                    alive.append(h)
                    continue
                except (AgentGone, QMPError, OSError) as exc:
                    log.warning("cannot re-adopt %s %s: %s", self.kind, h.cid, exc)
        keep = {h.cid for h in alive}
        for h in handles:
            if h.cid not in keep:
                await self.destroy(h)
        for d in list(self.vms_dir.iterdir()):
            if d.name not in keep and not d.name.startswith("."):
                await self._remove_remains(d)
        for d in cgroups.sandbox_cgroup_dirs(self.cgroup_parent):
            if d.name not in keep:
                await self._remove_cgroup(d.name)
        if not keep:
            cgroups.remove_parent(self.cgroup_parent)
        return alive

    async def _reattach(self, h: Handle, vm_dir: Path) -> _Live:
        """Reconnect to a VM an earlier edge ran. One whose vCPUs are stopped (by its sandbox's
        pause, or by a snapshot that a crash cut short: the migration under way is cancelled)
        cannot answer its agent: it is adopted paused, its agent asked when it is resumed. The
        edge resumes each re-adopted sandbox its record says is running."""
        qmp = await QMP.connect(vm_dir / "qmp.sock")
        try:
            status = (await qmp.execute("query-status")).get("status")
            if status == "running":
                return await self._attach(h.cid, h.pid, vm_dir, 10.0, qmp=qmp)
            if status not in _STOPPED:
                raise QMPError(f"its QEMU is {status}")
            if (await qmp.execute("query-migrate")).get("status") in _MIGRATING:
                await qmp.execute("migrate_cancel")
                deadline = time.monotonic() + 10
                while (await qmp.execute("query-migrate")).get("status") in _MIGRATING:
                    if time.monotonic() > deadline:
                        raise QMPError("its snapshot's migration did not cancel within 10s")
                    await asyncio.sleep(0.05)
            agent = await AgentChannel.connect(vm_dir / "agent.sock")
        except BaseException:
            await qmp.close()
            raise
        log.info("re-adopted %s %s with its vCPUs stopped (%s)", self.kind, h.cid, status)
        return _Live(pid=h.pid, qmp=qmp, agent=agent, paused=True, unverified=True)

    async def _remove_remains(self, vm_dir: Path) -> None:
        with contextlib.suppress(OSError, ValueError):
            await machine.kill(int((vm_dir / "qemu.pid").read_text()))
        live = self._live.pop(vm_dir.name, None)
        if live is not None:
            await self._close_live(live)
        await self._remove_cgroup(vm_dir.name)
        shutil.rmtree(vm_dir, ignore_errors=True)

    def release_unused(self) -> None:
        """Nothing node-wide outlives the last VM but cached files (kernel, disks, layers) and,
        while a VM is left, the parent cgroup and the node's layer cache: its server is stopped
        only when no file of it is open or mapped (a VM re-adopted by a later edge, a
        container's layer mount), ``LayerCache.stop_unless_busy``."""
        if not self._live:
            cgroups.remove_parent(self.cgroup_parent)
            if self.layer_cache is not None:
                self.layer_cache.stop_unless_busy()

    def memory_usage(self, handle: Handle) -> int | None:
        """The memory charged to the VM's cgroup (QEMU's own pages and the page cache it read
        first), as a container's is; not QEMU's RSS, which counts pages of shared files mapped
        but charged elsewhere (a boot template's memory, the layers) that no push-out can take."""
        charged = cgroups.memory_usage_bytes(self.cgroup_parent, handle.cid)
        if charged is not None:
            return charged
        return machine.rss_bytes(handle.pid) if handle.pid else None

    async def close(self) -> None:
        """Drop the connections (VMs keep running, to be re-adopted); for tests and shutdown."""
        for live in list(self._live.values()):
            await self._close_live(live)
        self._live.clear()

    # -- exec and files --------------------------------------------------------------------

    def _get(self, handle: Handle, action: str, paused_ok: bool = False) -> _Live:
        live = self._live.get(handle.cid)
        if live is None:
            raise SandboxStateError(f"cannot {action}: {self.kind} {handle.cid} is gone")
        if live.agent.closed or not machine.pid_alive(live.pid):
            raise SandboxStateError(f"cannot {action}: {self.kind} {handle.cid} is gone ({self.why_gone(handle)})")
        if live.paused and not paused_ok:
            raise SandboxStateError(f"cannot {action}: {self.kind} {handle.cid} is paused")
        return live

    def _gone(self, handle: Handle, live: _Live, exc: Exception) -> SandboxStateError:
        # An agent that stopped answering is as good as dead: close its channel so that the
        # VM reads as not alive and the edge fails it.
        live.agent._shut(str(exc))
        return SandboxStateError(f"{self.kind} {handle.cid} is gone: {self.why_gone(handle) or exc}")

    def why_gone(self, handle: Handle) -> str | None:
        """Why a VM that is not alive went, from what is known on the host: its agent's channel,
        its QEMU, and what the guest wrote on its console last (``None``: it is not gone)."""
        live = self._live.get(handle.cid)
        if live is None:
            return None
        if not live.agent.closed and machine.pid_alive(live.pid):
            return None
        said = live.agent.reason if live.agent.closed else ""
        if not machine.pid_alive(live.pid):
            said = "its QEMU exited" + (f" ({said})" if said else "")
        console = self._console_tail(self.vm_dir(handle.cid), 4000)
        causes = []
        oom = list(_OOM_KILLED.finditer(console))
        agent_oom = [m for m in oom if m.group(2) in ("agent", "dsec-agent")]
        if agent_oom:
            causes.append(f"the guest's OOM killer killed its agent ({agent_oom[-1].group(0).strip()[:200]})")
        elif _AGENT_EXITED in console:
            causes.append("its guest agent exited")
        if oom and not agent_oom:
            causes.append(f"the guest ran out of memory ({oom[-1].group(0).strip()[:200]})")
        if panic := _PANIC.search(console):
            causes.append(f"the guest kernel panicked ({panic.group(0).strip()[:200]})")
        return "; ".join(causes + ([said] if said else [])) or "gone"

    async def exec(self, handle: Handle, request: ExecRequest, ctx: ExecContext) -> ExecResult:
        return await self._exec(handle, request, ctx, None)

    async def exec_stream(self, handle: Handle, request: ExecRequest, ctx: ExecContext, emit: Emit) -> ExecResult:
        if "srun" in self._get(handle, "exec").agent.features:
            return await self._exec(handle, request, ctx, emit)
        # The agent of a VM restored from an older snapshot: its output comes at the end.
        result = await self._exec(handle, request, ctx, None)
        for kind, text in (("stdout", result.stdout), ("stderr", result.stderr)):
            if text:
                await emit(kind, text.encode())
        return result

    async def exec_piped(self, handle: Handle, request: ExecRequest, ctx: ExecContext,
                         stdin: AsyncIterator[bytes] | None, emit: Emit) -> ExecResult:
        """``exec_stream`` fed ``stdin`` as the command reads it: the agent's ``srun`` with a
        pipe for stdin, filled with ``ptyin`` (the agent queues up to 1 MiB; past that it
        refuses and the next piece waits for the command to read) and ended with ``ptyeof``.
        An agent from before (a VM restored from an old snapshot) takes the stdin whole."""
        features = self._get(handle, "exec").agent.features
        if stdin is None:
            return await self.exec_stream(handle, request, ctx, emit)
        if "sin" not in features:
            held = bytearray()
            async for chunk in stdin:
                held += chunk
            return await self._exec(handle, request.model_copy(update={"stdin": None}), ctx,
                                    emit if "srun" in features else None, whole_stdin=bytes(held))
        return await self._exec(handle, request, ctx, emit, feed=stdin)

    async def _feed(self, agent: AgentChannel, rid: str, started: asyncio.Future, chunks: AsyncIterator[bytes]) -> None:
        await started  # (the job runs: its "part 0")
        async for chunk in chunks:
            for at in range(0, len(chunk), _FEED_PIECE):
                piece = chunk[at:at + _FEED_PIECE]
                while True:
                    try:
                        await agent.request(f"ptyin {rid} {len(piece)}", piece, timeout=60.0)
                        break
                    except AgentFailure as exc:
                        if "is full" not in exc.message:
                            return  # the command ended: what is left is not wanted
                        await asyncio.sleep(_FEED_WAIT_S)  # (the command has not read the last MiB yet)
        with contextlib.suppress(AgentFailure):
            await agent.request(f"ptyeof {rid}", timeout=60.0)

    async def _exec(self, handle: Handle, request: ExecRequest, ctx: ExecContext, emit: Emit | None,
                    feed: AsyncIterator[bytes] | None = None, whole_stdin: bytes | None = None) -> ExecResult:
        live = self._get(handle, "exec")
        if any("\0" in f"{k}{v}" or "=" in k for k, v in ctx.env.items()) or "\0" in ctx.workdir + request.command:
            raise InvalidRequest("a NUL byte in the command, workdir or environment, or '=' in a variable's name")
        workdir = ctx.workdir.encode()
        stdin = request.stdin.encode() if request.stdin is not None else whole_stdin
        stdin_len = len(stdin) if stdin is not None else -2 if feed is not None else -1
        agent = live.agent
        if "run" in agent.features:  # the agent runs the jail with the workdir, user and environment
            command = request.command.encode()
            env = b"".join(f"{k}={v}".encode() + b"\0" for k, v in ctx.env.items())
            header = (f"{'srun' if emit else 'run'} {request.max_output_bytes} {len(workdir)} {len(command)} {stdin_len} {len(env)} "
                      f"{ctx.uid} {ctx.gid}")
            payloads = (workdir, command, stdin or b"", env)
        else:  # the shell agent of a VM restored from an older snapshot: a script does it
            env_words = " ".join(shlex.quote(f"{k}={v}") for k, v in ctx.env.items())
            script = (
                f"cd -- {shlex.quote(ctx.workdir)} || exit 1\n"
                f"exec {AGENT_BIN}/env -i {env_words} {AGENT_BIN}/nsenter -S {ctx.uid} -G {ctx.gid} "
                f"/bin/sh -c {shlex.quote(request.command)}\n"
            ).encode()
            header = f"exec {request.max_output_bytes} {len(workdir)} {len(script)} {stdin_len}"
            payloads = (workdir, script, stdin or b"")
        start = time.perf_counter()
        rid = agent.new_id()
        relay = _Relay(agent, rid, request.max_output_bytes, emit) if emit is not None else None
        feeder = None
        if feed is not None:
            started = asyncio.get_running_loop().create_future()
            agent._sinks[rid] = lambda _: started.done() or started.set_result(None)
        try:
            fut = await agent.send(rid, header, *payloads)
            if feed is not None:
                fut.add_done_callback(lambda _: started.done() or started.set_result(None))
                feeder = asyncio.ensure_future(self._feed(agent, rid, started, feed))
            try:
                result = await asyncio.wait_for(with_feeder(asyncio.shield(fut), feeder), request.timeout)
                if relay is not None:
                    await relay.finish(request.timeout - (time.perf_counter() - start))
            except TimeoutError:
                await agent.send(agent.new_id(), f"kill {rid}")
                try:
                    result = await asyncio.wait_for(fut, KILL_GRACE_S)
                except TimeoutError:
                    raise AgentGone(f"the guest agent did not end a timed-out command within {KILL_GRACE_S:g}s") from None
                tail = result.stdout.decode(errors="replace")[-500:] if isinstance(result, Done) else ""
                raise CommandTimeout(
                    f"command timed out after {request.timeout:g}s and was killed"
                    + (f"; last output: {tail!r}" if tail else "")
                ) from None
        except AgentGone as exc:
            raise self._gone(handle, live, exc) from None
        except asyncio.CancelledError:
            with contextlib.suppress(AgentGone):
                await agent.send(agent.new_id(), f"kill {rid}")
            raise
        except BaseException:
            if feeder is not None and not fut.done():
                with contextlib.suppress(AgentGone):
                    await agent.send(agent.new_id(), f"kill {rid}")
            raise
        finally:
            if feeder is not None:
                feeder.cancel()
            if relay is not None:
                relay.close()
        if isinstance(result, AgentFailure):
            raise InvalidRequest(result.message)
        assert isinstance(result, Done)
        if relay is not None:
            result.stdout, result.stderr = bytes(relay.kept["stdout"]), bytes(relay.kept["stderr"])
        return ExecResult(
            exit_code=result.exit_code,
            stdout=result.stdout.decode(errors="replace"),
            stderr=result.stderr.decode(errors="replace"),
            duration_s=time.perf_counter() - start,
            stdout_truncated=result.stdout_total > len(result.stdout),
            stderr_truncated=result.stderr_total > len(result.stderr),
            stdout_bytes=result.stdout_total,
            stderr_bytes=result.stderr_total,
        )

    async def connect_port(self, handle: Handle, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """127.0.0.1:``port`` in the guest: a terminal of the agent's running the guest's busybox
        ``nc`` in raw mode (``dsec.backends.portconn.pty_tunnel``)."""
        ctx = ExecContext(uid=0, gid=0, workdir="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        pty = await self.open_pty(handle, portconn.tunnel_command(GUEST_BUSYBOX, port), ctx, 80, 24)
        return await portconn.pty_tunnel(pty, port)

    async def open_pty(self, handle: Handle, command: str, ctx: ExecContext, cols: int, rows: int) -> _VMPty:
        """The command on a terminal of the guest's: the agent's ``pty`` operation (its output
        comes as a streamed command's does, acked as it is read)."""
        live = self._get(handle, "open a PTY")
        agent = live.agent
        if "pty" not in agent.features:
            raise SandboxStateError(f"cannot open a PTY: the guest agent of {handle.cid} is older than PTYs "
                                    "(a VM restored from a snapshot taken before them)")
        if any("\0" in f"{k}{v}" or "=" in k for k, v in ctx.env.items()) or "\0" in ctx.workdir + command:
            raise InvalidRequest("a NUL byte in the command, workdir or environment, or '=' in a variable's name")
        workdir, cmd = ctx.workdir.encode(), command.encode()
        env = b"".join(f"{k}={v}".encode() + b"\0" for k, v in ctx.env.items())
        rid = agent.new_id()
        pty = _VMPty(self, handle, live, rid)
        running = asyncio.get_running_loop().create_future()
        agent._sinks[rid] = lambda _: running.done() or running.set_result(None)  # "part 0": it runs
        try:
            pty.started(await agent.send(rid, f"pty {cols} {rows} {len(workdir)} {len(cmd)} {len(env)} {ctx.uid} {ctx.gid}",
                                         workdir, cmd, env))
            await asyncio.wait_for(asyncio.wait([running, pty.done], return_when=asyncio.FIRST_COMPLETED), 30.0)
        except (AgentGone, TimeoutError) as exc:
            pty.release()
            raise self._gone(handle, live, AgentGone(str(exc) or "the guest agent did not start the PTY")) from None
        finally:
            agent._sinks.pop(rid, None)
        if not running.done():
            pty.release()
            failure = pty.done.exception() or pty.done.result()
            if isinstance(failure, AgentGone):
                raise self._gone(handle, live, failure)
            raise InvalidRequest(f"cannot open a PTY: {getattr(failure, 'message', failure)}")
        return pty

    async def _file_call(self, handle: Handle, action: str, header: str, *payloads: bytes, size: int = 0) -> bytes:
        live = self._get(handle, action)
        try:
            return await live.agent.request(header, *payloads, timeout=30.0 + size / (4 << 20))  # type: ignore[return-value]
        except AgentFailure as exc:
            if exc.code == "enoent":
                raise SandboxFileNotFound(exc.message) from None
            raise InvalidRequest(exc.message) from None
        except AgentGone as exc:
            raise self._gone(handle, live, exc) from None

    async def read_file(self, handle: Handle, path: str, max_bytes: int) -> bytes:
        if "\0" in path or "\n" in path:
            raise InvalidRequest(f"invalid path {path!r}")
        raw = path.encode()
        return await self._file_call(handle, "read a file", f"read {len(raw)} {max_bytes}", raw, size=max_bytes)

    async def write_file(self, handle: Handle, path: str, data: bytes, mode: int, uid: int, gid: int) -> None:
        if not path.startswith("/"):
            raise InvalidRequest(f"path must be absolute: {path!r}")
        if "\0" in path or "\n" in path or not path.rstrip("/").rpartition("/")[2]:
            raise InvalidRequest(f"cannot write {path!r}: not a file path")
        raw = path.encode()
        await self._file_call(handle, "write a file", f"write {len(raw)} {len(data)} {mode:o} {uid} {gid}",
                              raw, data, size=len(data))

    async def make_dir(self, handle: Handle, path: str, uid: int, gid: int) -> None:
        raw = path.encode()
        await self._file_call(handle, "make a directory", f"mkdir {len(raw)} {uid} {gid}", raw)

    async def new_identity(self, handle: Handle, hostname: str, machine_id: str | None, seed: bytes) -> None:
        """Through the guest agent: the host name and a reseeded random number generator (its
        ``ident``), then ``/etc/machine-id`` (None: the image's kept, as a boot template's clone
        keeps it). A guest whose agent predates ``ident`` (restored from an old snapshot) cannot
        be made someone new: ``BackendError``."""
        live = self._get(handle, "take a new identity")
        if "ident" not in live.agent.features:
            raise BackendError(f"{self.kind} {handle.cid} cannot take a new identity: its guest agent has no "
                               "'ident' (a VM restored from a snapshot taken before it)")
        name = hostname.encode()
        try:
            await live.agent.request(f"ident {len(name)} {len(seed)}", name, seed, timeout=30.0)
        except AgentFailure as exc:
            raise BackendError(f"{self.kind} {handle.cid} cannot take a new identity: {exc.message}") from None
        except AgentGone as exc:
            raise self._gone(handle, live, exc) from None
        if machine_id is not None:
            await self.write_file(handle, "/etc/machine-id", machine_id.encode() + b"\n", 0o444, 0, 0)

    async def resolve_user(self, handle: Handle, user: str) -> tuple[int, int]:
        """``root``, ``UID``, ``UID:GID`` or a name from the image's /etc/passwd."""
        ids = numeric_user(user)
        if ids is not None:
            return ids
        try:
            passwd = (await self.read_file(handle, "/etc/passwd", 1 << 20)).decode(errors="replace")
        except (SandboxFileNotFound, InvalidRequest):
            passwd = ""
        return user_from_passwd(user, passwd)
