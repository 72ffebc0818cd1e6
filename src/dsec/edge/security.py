"""The edge's security side: network allowlists and security events of its sandboxes.

The edge calls in at a few points of a sandbox's life (``check_rules`` at admission, ``attach``
once it runs, ``watch_exec`` around each command, ``forget`` when it ends) and serves
``events`` and ``set_rules``. It is given what it reads (the node's backends by kind, its
directory, and the table of live records, read and never changed) and knows nothing of the edge.

A reader of the kernel's audit records turns seccomp and AppArmor refusals into events: the
audit record names the host uid, and each sandbox has a uid range of its own (an AppArmor record
without one is placed by its pid's cgroup).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import socket
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from libdsec import BackendError, CommandTimeout, InvalidRequest, SandboxStateError
from libdsec.protocol import ExecResult, SandboxKind, SecurityEvent

from ..backends.base import Capability
from ..isolation import apparmor
from ..isolation.events import SecurityEvents
from ..isolation.network import Allowed, SandboxNetworks

if TYPE_CHECKING:
    from ..backends.base import SandboxBackend
    from .lifecycle import Record

log = logging.getLogger("dsec.edge.security")

# How long a stop waits for a VM's agent to list its changed system files (a TCG guest answers
# in milliseconds; one that does not is stopped without the list).
GUEST_TAMPER_TIMEOUT_S = 5.0
_NETLINK_AUDIT = 9
_AUDIT_NLGRP_READLOG = 1
_AUDIT_SECCOMP_TYPE = 1326
_AUDIT_AVC_TYPE = 1400  # AppArmor's refusals (apparmor="DENIED")
_AUDIT_SECCOMP = re.compile(r"type=1326 .*?\buid=(\d+) .*?\bpid=(\d+) comm=\"([^\"]*)\".*?\bsyscall=(\d+)")


def _syscall_names() -> dict[int, str]:
    names = {}
    for header in ("/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h"):
        try:
            with open(header) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 3 and parts[0] == "#define" and parts[1].startswith("__NR_"):
                        names[int(parts[2])] = parts[1][5:]
            break
        except (OSError, ValueError):
            continue
    return names


@functools.cache
def _libseccomp_name(nr: int) -> str | None:
    """A syscall's name from libseccomp (crun's, so on every DSec host), for a host without the
    kernel's headers (a stock Debian has no linux-libc-dev)."""
    import ctypes
    import ctypes.util

    try:
        lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2")
    except OSError:
        return None
    lib.seccomp_syscall_resolve_num_arch.restype = ctypes.c_void_p
    lib.seccomp_syscall_resolve_num_arch.argtypes = (ctypes.c_uint32, ctypes.c_int)
    ptr = lib.seccomp_syscall_resolve_num_arch(0, nr)  # 0: SCMP_ARCH_NATIVE
    if not ptr:
        return None
    name = ctypes.string_at(ptr).decode()
    ctypes.CDLL(None).free(ctypes.c_void_p(ptr))
    return name


class EdgeSecurity:
    """``backends``: the node's, by sandbox kind; ``records``: its live sandboxes by id (the
    edge's table, read here to place an event and to list a sandbox's)."""

    def __init__(self, backends: Mapping[SandboxKind, SandboxBackend], node_dir: str | Path,
                 records: Mapping[str, Record]) -> None:
        self.backends = backends
        self.records = records
        container = backends.get(SandboxKind.container)
        view = container.host_view() if container is not None else None
        self.cgroup_parent = view.cgroup_parent if view is not None else None
        self.id_ranges = view.id_ranges if view is not None else None
        self.events = SecurityEvents(self.cgroup_parent)
        self.networks = SandboxNetworks(node_dir, record=self.events.record)
        self._kmsg_fd: int | None = None
        self._netlink = False
        self._syscalls = _syscall_names()
        # System files each live sandbox was seen to have replaced or added (file.tampered).
        self._tampered: dict[str, set[str]] = {}

    # -- start / close -------------------------------------------------------------------------

    async def start(self, adopted: Iterable[Record]) -> None:
        self._open_kmsg()
        if self.id_ranges is not None:  # a real container backend: clear what a crash left
            self.networks.reset()
        for rec in list(adopted):  # links do not outlive an edge: give them back (a halted one's: when it boots)
            if rec.args.network_rules and rec.pause_mode != "filesystem":
                try:
                    await self.attach(rec)
                except Exception as exc:  # noqa: BLE001 - the sandbox runs on, without network
                    log.warning("cannot give %s its network back: %s", rec.id, exc)

    def close(self) -> None:
        if self._kmsg_fd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._kmsg_fd)
            os.close(self._kmsg_fd)
            self._kmsg_fd = None
        self.networks.close()

    # -- network -------------------------------------------------------------------------------

    def check_rules(self, rules: dict) -> Allowed:
        return self.networks.check(rules)

    async def attach(self, rec: Record) -> None:
        allowed = self.networks.check(rec.args.network_rules)
        if allowed.empty:
            return
        if rec.kind is not SandboxKind.container:
            raise InvalidRequest(f"network allowlists are for container sandboxes; {rec.kind.value} sandboxes have no "
                                 "network")
        backend = self.backends[rec.kind]

        async def write_resolv_conf(data: bytes) -> None:
            await backend.write_file(rec.handle, "/etc/resolv.conf", data, 0o644, 0, 0)

        await self.networks.attach(rec.id, rec.handle.pid, allowed, write_resolv_conf)

    def halted(self, rec: Record) -> None:
        """Its processes end (a filesystem-only pause): its network link goes with its network
        namespace (``attach`` makes it again when it starts)."""
        self.networks.collect(rec.id)
        self.networks.detach(rec.id)

    async def set_rules(self, rec: Record, rules: dict) -> None:
        allowed = self.networks.check(rules)
        rec.args = rec.args.model_copy(update={"network_rules": rules})
        if rec.id in self.networks.links():
            if allowed.empty:
                self.networks.detach(rec.id)
            else:
                await self.networks.update(rec.id, allowed)
        elif not allowed.empty:
            await self.attach(rec)

    # -- events --------------------------------------------------------------------------------

    async def watch_exec(self, rec: Record, call) -> ExecResult:
        try:
            result = await call
        except CommandTimeout as exc:
            self.events.record(rec.id, "limit.timeout", str(exc)[:200])
            self.collect(rec, network=False)
            raise
        for stream in ("stdout", "stderr"):
            if getattr(result, f"{stream}_truncated"):
                total = getattr(result, f"{stream}_bytes")
                self.events.record(rec.id, "limit.output", f"{stream}: {total} bytes written, cut at the output cap")
        self.collect(rec, network=False)
        return result

    def collect(self, rec: Record, network: bool = True) -> None:
        """Turn counters into events. After each command only the cheap ones (file reads); the
        nftables set (a process spawn) when events are asked for and when the sandbox ends."""
        self._drain_kmsg()
        self.events.collect_cgroup(rec.id, rec.handle.cid)
        backend = self.backends.get(rec.kind)
        view = backend.host_view() if backend is not None else None
        if view is not None and rec.handle.cid:
            self.events.collect_disk(rec.id, view.sandboxes_dir / rec.handle.cid)
        if network:
            self.networks.collect(rec.id)

    def list(self, sandbox_id: str) -> list[SecurityEvent]:
        rec = self.records.get(sandbox_id)
        if rec is not None:
            self.collect(rec)
            self.check_tampering(rec)
        else:
            self._drain_kmsg()
        return self.events.list(sandbox_id)

    def check_tampering(self, rec: Record) -> list[str]:
        """The system files the sandbox's writable layer replaces or adds (``carry.tampered``);
        those not seen before become a ``file.tampered`` event. Backends that cannot tell
        (VMs: the writable layer is in the guest) answer nothing."""
        backend = self.backends.get(rec.kind)
        if not rec.handle.cid or backend is None or Capability.CARRY not in backend.capabilities:
            return []
        try:
            paths = backend.tampered(rec.handle)
        except OSError as exc:
            log.warning("cannot look for tampering in %s: %s", rec.id, exc)
            return []
        return self.record_tampered(rec, paths)

    async def check_guest_tampering(self, rec: Record) -> list[str]:
        """``check_tampering`` for a sandbox whose writable layer is in its guest (a VM): its
        agent lists what the layer holds in the system paths (names only), within
        ``GUEST_TAMPER_TIMEOUT_S``; a guest that cannot tell is logged, not waited for."""
        backend = self.backends.get(rec.kind)
        if backend is None or Capability.KEPT_LAYER not in backend.capabilities:
            return []
        try:
            paths = await backend.guest_tampered(rec.handle, GUEST_TAMPER_TIMEOUT_S)
        except (BackendError, SandboxStateError) as exc:
            log.warning("cannot look for tampering in %s: %s", rec.id, exc)
            return []
        return self.record_tampered(rec, paths)

    def record_tampered(self, rec: Record, paths: list[str]) -> list[str]:
        """Record the system files of ``paths`` not recorded before as a ``file.tampered`` event."""
        seen = self._tampered.setdefault(rec.id, set())
        new = [p for p in paths if p not in seen]
        if new:
            seen.update(new)
            shown = ", ".join(new[:20]) + (f" and {len(new) - 20} more" if len(new) > 20 else "")
            self.events.record(rec.id, "file.tampered", f"system files replaced or added: {shown}", len(new))
        return paths

    def forget(self, rec: Record) -> None:
        self._tampered.pop(rec.id, None)
        self.networks.collect(rec.id)  # what was blocked stays readable after the sandbox ends
        self.networks.detach(rec.id)
        self.events.forget(rec.id)  # its counters go; its events are packed, kept a while

    # -- seccomp refusals from the kernel log ----------------------------------------------------

    def _open_kmsg(self) -> None:
        """Listen to the kernel's audit records: on the audit netlink socket's read-only
        multicast group (every record, not rate-limited, needs no audit daemon), else on the
        kernel log (where records are rate-limited when no audit daemon runs)."""
        if (self.id_ranges is None and apparmor.loaded_profile() is None) or self._kmsg_fd is not None:
            return
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                                 _NETLINK_AUDIT)
            sock.bind((0, _AUDIT_NLGRP_READLOG))
            self._kmsg_fd, self._netlink = sock.detach(), True
        except OSError:
            try:
                fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                os.lseek(fd, 0, os.SEEK_END)
            except OSError as exc:
                log.warning("no audit records (%s): denied syscalls will not be recorded", exc)
                return
            self._kmsg_fd, self._netlink = fd, False
        asyncio.get_running_loop().add_reader(self._kmsg_fd, self._drain_kmsg)

    def _drain_kmsg(self) -> None:
        if self._kmsg_fd is None:
            return
        while True:
            try:
                data = os.read(self._kmsg_fd, 65536)
            except BlockingIOError:
                return
            except OSError as exc:  # EPIPE/ENOBUFS: records were lost before we read them
                if exc.errno in (32, 105):
                    continue
                return
            if self._netlink:
                lines = []
                while len(data) >= 16:
                    length, kind = struct.unpack_from("=IH", data)
                    if kind in (_AUDIT_SECCOMP_TYPE, _AUDIT_AVC_TYPE):
                        lines.append(f"type={kind} " + data[16:length].decode(errors="replace"))
                    data = data[max(16, (length + 3) & ~3):]
            else:
                lines = [data.decode(errors="replace")]
            for line in lines:
                for record in line.splitlines() if not self._netlink else (line,):
                    m = _AUDIT_SECCOMP.search(record)
                    if m:
                        self._syscall_denied(int(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4)))
                    elif (denial := apparmor.parse_denial(record)) is not None:
                        self._apparmor_denied(denial)

    def _owner(self, uid: int | None, pid: int):
        """The record of the sandbox that a host uid (its id range) or else a pid (its cgroup) is in."""
        cid = self.id_ranges.owner(uid) if self.id_ranges is not None and uid is not None else None
        if cid is None and pid > 0:
            try:
                cgroup = Path(f"/proc/{pid}/cgroup").read_text()
            except OSError:
                cgroup = ""
            names = {part for row in cgroup.splitlines() for part in row.split(":", 2)[-1].split("/")}
            cid = next((r.handle.cid for r in self.records.values() if r.handle.cid in names), None)
        if cid is None:
            return None
        return next((r for r in self.records.values() if r.handle.cid == cid), None)

    def _apparmor_denied(self, denial: apparmor.Denial) -> None:
        rec = self._owner(denial.fsuid, denial.pid)
        if rec is not None:
            self.events.record(rec.id, "apparmor.denied", apparmor.describe(denial))

    def _syscall_denied(self, uid: int, pid: int, comm: str, nr: int) -> None:
        cid = self.id_ranges.owner(uid) if self.id_ranges is not None else None
        if cid is None:
            return
        rec = next((r for r in self.records.values() if r.handle.cid == cid), None)
        if rec is None:
            return
        name = self._syscalls.get(nr) or _libseccomp_name(nr) or f"syscall {nr}"
        self.events.record(rec.id, "syscall.denied", f"{name} denied to {comm!r}")
