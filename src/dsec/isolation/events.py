"""Security events: every denied action the platform can see, recorded against its sandbox.

What is visible, and where it comes from:

- ``network.blocked``: a packet from the sandbox to an address/port not on its allowlist (the
  host, the edge, other sandboxes, unlisted mirrors). The nftables chain of the sandbox adds the
  destination to a per-sandbox set as it drops it (see dsec.isolation.network).
- ``dns.refused``: a name the sandbox asked the edge's resolver for that is not allowed.
- ``limit.memory``: OOM kills in the sandbox's memory cgroup; ``limit.pids``: forks refused at
  the pids limit (both read from the cgroup's counters).
- ``limit.disk``: the sandbox's writable layer is full (its tmpfs has no space left).
- ``limit.output``: a command's output went past the cap and was cut.
- ``limit.timeout``: a command ran past its timeout and was killed.
- ``syscall.denied``: seccomp refusals logged by the kernel (the profile sets
  SECCOMP_FILTER_FLAG_LOG, so an EPERM from a denied syscall is written to the kernel log as an
  audit record); attributed to the sandbox whose cgroup holds the pid when the edge reads it.
- ``apparmor.denied``: what the host's AppArmor refused under the ``dsec-sandbox`` profile (a
  file written under /proc or /sys, a read of a kernel file, a mount), from the same audit
  records (see dsec.isolation.apparmor); only where the host has AppArmor.

Not visible: what a command was denied by plain permissions (EACCES on a read-only or masked
path, a capability the process lacks) — the kernel reports those only to the caller.

Counters are read when events are asked for (and after each command), so the cost is a few file
reads per call, nothing per packet or syscall on the hot path.
"""

from __future__ import annotations

import os
import time
import zlib
from collections import OrderedDict, deque
from datetime import datetime, timezone
from pathlib import Path

from pydantic import TypeAdapter

from libdsec.protocol import NodeSecurityEvent, SecurityEvent

from ..resources import cgroups

MAX_EVENTS_PER_SANDBOX = 1000
RECENT_EVENTS = 50  # the node's latest events, over all its sandboxes (for the dashboard)
# What the logs of ended sandboxes may hold in all, compressed; the oldest go first.
ENDED_LOGS_BYTES = 8 << 20

_EVENT_LIST = TypeAdapter(list[SecurityEvent])


class SecurityEvents:
    """Per-sandbox event logs of one edge, kept in memory so an episode can be reviewed after it
    ended. A live sandbox has a log once it has an event, and counters (what its cgroup's OOM and
    pids counts were when last read) from its first command; ``forget`` at its end drops the
    counters and packs the log (compressed JSON, kept for at most ``kept`` ended sandboxes and
    ``ENDED_LOGS_BYTES`` in all). A sandbox with no event leaves nothing behind."""

    def __init__(self, cgroup_parent: str | None = None, kept: int = 10_000) -> None:
        self.cgroup_parent = cgroup_parent
        self.kept = kept
        self._logs: dict[str, deque[SecurityEvent]] = {}
        self._counters: dict[str, dict[str, int]] = {}
        self._ended: OrderedDict[str, bytes] = OrderedDict()
        self._ended_bytes = 0
        # Events by kind since the edge started (repeats counted), and the latest ones.
        self.totals: dict[str, int] = {}
        self._recent: deque[tuple[str, SecurityEvent]] = deque(maxlen=RECENT_EVENTS)

    def record(self, sandbox_id: str, kind: str, detail: str, count: int = 1) -> None:
        log = self._logs.get(sandbox_id)
        if log is None:
            log = self._logs[sandbox_id] = deque(maxlen=MAX_EVENTS_PER_SANDBOX)
            if (packed := self._take_ended(sandbox_id)) is not None:  # an event after its end
                log.extend(_unpack(packed))
            while len(self._logs) > self.kept:  # only if forget is never called
                self._logs.pop(next(iter(self._logs)))
        self.totals[kind] = self.totals.get(kind, 0) + count
        now = datetime.fromtimestamp(time.time(), timezone.utc)
        last = log[-1] if log else None
        if last is not None and last.kind == kind and last.detail == detail:
            # A repeat (a loop of denied syscalls, a retrying connect) counts on the last event.
            last.count += count
            last.at = now
            if not self._recent or self._recent[-1][1] is not last:
                self._recent.append((sandbox_id, last))
            return
        event = SecurityEvent(kind=kind, detail=detail, count=count, at=now)
        log.append(event)
        self._recent.append((sandbox_id, event))

    def forget(self, sandbox_id: str) -> None:
        """The sandbox ended: its counters go, its log (if it has events) is packed."""
        self._counters.pop(sandbox_id, None)
        log = self._logs.pop(sandbox_id, None)
        if not log:
            return
        packed = zlib.compress(_EVENT_LIST.dump_json(list(log)))
        self._ended[sandbox_id] = packed
        self._ended_bytes += len(packed)
        while self._ended and (len(self._ended) > self.kept or self._ended_bytes > ENDED_LOGS_BYTES):
            self._ended_bytes -= len(self._ended.popitem(last=False)[1])

    def _take_ended(self, sandbox_id: str) -> bytes | None:
        packed = self._ended.pop(sandbox_id, None)
        if packed is not None:
            self._ended_bytes -= len(packed)
        return packed

    def recent_events(self) -> list[NodeSecurityEvent]:
        """The latest events over every sandbox, newest last (a repeat moves its event there)."""
        seen, out = set(), []
        for sandbox_id, event in reversed(self._recent):
            if id(event) not in seen:
                seen.add(id(event))
                out.append(NodeSecurityEvent(sandbox_id=sandbox_id, event=event))
        return out[::-1]

    def list(self, sandbox_id: str) -> list[SecurityEvent]:
        log = self._logs.get(sandbox_id)
        if log is not None:
            return list(log)
        packed = self._ended.get(sandbox_id)
        return _unpack(packed) if packed is not None else []

    def kept_logs(self) -> tuple[int, int]:
        """(live logs, ended logs) held now."""
        return len(self._logs), len(self._ended)

    def counter_delta(self, sandbox_id: str, name: str, value: int) -> int:
        """How much the counter ``name`` grew since it was last seen (first sight: all of it)."""
        counters = self._counters.setdefault(sandbox_id, {})
        before = counters.get(name, 0)
        counters[name] = value
        return max(0, value - before)

    def collect_cgroup(self, sandbox_id: str, cid: str) -> None:
        """Turn growth of the sandbox's OOM-kill and pids-refusal counters into events."""
        if self.cgroup_parent is None or not cid:
            return
        oom = cgroups.oom_kills(self.cgroup_parent, cid)
        if oom is not None and (n := self.counter_delta(sandbox_id, "oom_kill", oom)):
            self.record(sandbox_id, "limit.memory", f"{n} process(es) killed at the memory limit", n)
        pids = _pids_refused(self.cgroup_parent, cid)
        if pids is not None and (n := self.counter_delta(sandbox_id, "pids_max", pids)):
            self.record(sandbox_id, "limit.pids", f"{n} fork(s) refused at the pids limit", n)


    def collect_disk(self, sandbox_id: str, bundle: Path) -> None:
        """Record the writable layer filling up (once per time it fills)."""
        try:
            st = os.statvfs(bundle)
        except OSError:
            return
        full = int(st.f_bavail * st.f_frsize < (1 << 20))
        if self.counter_delta(sandbox_id, "disk_full", full):
            size = st.f_blocks * st.f_frsize >> 20
            self.record(sandbox_id, "limit.disk", f"the writable layer is full ({size} MB cap)")


def _unpack(packed: bytes) -> list[SecurityEvent]:
    return _EVENT_LIST.validate_json(zlib.decompress(packed))


def _pids_refused(parent: str, cid: str) -> int | None:
    if cgroups.is_v2():
        return cgroups.read_key(f"{cgroups.CGROUP_ROOT}/{parent}/{cid}/pids.events", b"max")
    return cgroups.read_key(f"{cgroups.CGROUP_ROOT}/pids/{parent}/{cid}/pids.events", b"max")
