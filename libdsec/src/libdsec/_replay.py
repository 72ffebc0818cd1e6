"""Fast-forward through a job's log: what ``DSecClient(job=…, resume=True)`` answers from it.

The log (read once, when the client opens) is split into its creates — by idempotency key, and
the ones without a key in their order — and, for each sandbox, the calls made on it (commands,
file writes, stop) in their order. A create is answered from the log when its key is there
(with the same kind and arguments), or, without a key, by the next keyless create logged; a call
on a sandbox (a command, a file write, a clean copy, a pack_diff, its stop) is answered by that
sandbox's next logged call when it is the same call (a command's timeout aside), its result
given back, or its error raised again; a clean copy answered so is the copy logged, whose own
calls follow in the log. When a sandbox's
calls run out (or a key was never logged) the call goes to the server: the job goes on live,
on the same sandboxes. A call that is not the one logged at its place raises
``ReplayDiverged`` naming both.

A group's pause or resume (``pause_sandboxes``, ``resume_sandboxes``) is answered by the next
group call logged when it is the same call; one that another job's caller made selecting this
job (logged with ``asked_by_job``) is not this run's and is left out.

Reads, pauses, resumes, network rules and TTLs are logged with their results too (a read's
bytes up to 8 MiB; past that the read goes live and must find the same bytes). The other calls
on a sandbox (streamed commands, background processes, sessions, PTYs, file-tree calls,
snapshots) the log holds only as *made* (an ``unrecorded`` entry, written before the call
runs): one of them cannot be answered, so ``ReplayIncomplete`` is raised when the run asks one
while the sandbox's log holds more (it would run now, against the sandbox as the log left it),
and when any call meets such an entry (it was made once and may have changed the sandbox).
Once a sandbox's log is used up they run live, as all calls do.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any

from ._errors import ReplayDiverged, ReplayIncomplete, error_from_wire
from .protocol import JobEntry, JobLog


def _describe(op: str, request: dict, key: str | None = None) -> str:
    if op == "exec":
        text = f"exec {request.get('command')!r}"
        extras = {k: v for k, v in request.items() if k not in ("command", "timeout") and v not in (None, {}, "")}
        return text + (f" {extras}" if extras else "")
    if op == "write_file":
        return f"write_file {request.get('path')!r} ({request.get('bytes')} bytes, mode {oct(request.get('mode', 0))})"
    if op == "clean_copy":
        return f"clean_copy keep={request.get('keep')}"
    if op == "fork":
        return f"fork count={request.get('count')} all_or_none={request.get('all_or_none')}"
    if op == "pack_diff":
        return f"pack_diff name={request.get('name')!r} role={request.get('role')!r}"
    if op == "read_file":
        return f"read_file {request.get('path')!r}"
    if op in ("set_network_rules", "set_ttl"):
        return f"{op} {request}"
    if op == "unrecorded":
        return f"{request.get('call')} (a call a job log does not record with its result)"
    if op in ("create", "create_batch"):
        args = request.get("args", {})
        count = f" x{request['count']}" if "count" in request else ""
        return (f"{op} {request.get('kind')} of {args.get('container_image')!r}{count}"
                + (f" (key {key!r})" if key else ""))
    return op


def _same_call(op: str, logged: dict, now: dict) -> bool:
    if op == "exec":
        return {k: v for k, v in logged.items() if k != "timeout"} == {k: v for k, v in now.items() if k != "timeout"}
    if op == "write_file":
        return all(logged.get(k) == now.get(k) for k in ("path", "mode", "bytes", "sha256"))
    if op == "pause":  # (logs from before pauses had a mode hold none: a full one)
        return logged.get("mode", "full") == now.get("mode", "full")
    return logged == now


class Replay:
    def __init__(self, log: JobLog) -> None:
        self.job = log.job.name
        self._by_key: dict[str, JobEntry] = {}
        self._keyless: deque[JobEntry] = deque()
        self._calls: dict[str, deque[JobEntry]] = {}
        self._groups: deque[JobEntry] = deque()
        self.answered = 0  # calls answered from the log
        for entry in log.entries:
            if entry.op in ("create", "create_batch"):
                if entry.key is not None:
                    self._by_key.setdefault(entry.key, entry)
                else:
                    self._keyless.append(entry)
            elif entry.op in _GROUP_OPS:
                if "asked_by_job" not in entry.request:
                    self._groups.append(entry)
            elif entry.sandbox is not None:
                self._calls.setdefault(entry.sandbox, deque()).append(entry)

    @property
    def remaining(self) -> int:
        return (len(self._by_key) + len(self._keyless) + len(self._groups)
                + sum(len(q) for q in self._calls.values()))

    def create(self, op: str, request: dict, key: str | None) -> Any:
        """The logged result of this create (a ``SandboxInfo`` dict, a list for a batch), or
        None: not in the log, make it."""
        if key is not None:
            entry = self._by_key.pop(key, None)
        else:
            entry = self._keyless.popleft() if self._keyless else None
        if entry is None:
            return None
        if entry.op != op or entry.request != request:
            raise ReplayDiverged(
                f"job {self.job!r}, log entry {entry.seq}: the log has {_describe(entry.op, entry.request, entry.key)}, "
                f"this run asks {_describe(op, request, key)}")
        self.answered += 1
        return entry.result

    def call(self, sandbox: str, op: str, request: dict) -> tuple[bool, Any]:
        """(True, the logged result) for a call the log answers (its logged error raised), or
        (False, None): this sandbox's log ran out, go live."""
        queue = self._calls.get(sandbox)
        if not queue:
            return False, None
        entry = queue[0]
        if entry.op == "unrecorded":
            raise ReplayIncomplete(
                f"job {self.job!r}, log entry {entry.seq} on sandbox {sandbox}: the log has "
                f"{_describe(entry.op, entry.request)}: it was made and may have changed the sandbox, and "
                f"this resume cannot answer it, nor go past it ({len(queue)} logged calls of the sandbox left); "
                f"this run asks {_describe(op, request)}")
        if entry.op != op or not _same_call(op, entry.request, request):
            raise ReplayDiverged(
                f"job {self.job!r}, log entry {entry.seq} on sandbox {sandbox}: the log has "
                f"{_describe(entry.op, entry.request)}, this run asks {_describe(op, request)}")
        queue.popleft()
        self.answered += 1
        if entry.error is not None:
            raise error_from_wire({"error": entry.error}, 500)
        return True, entry.result

    def group(self, op: str, request: dict) -> tuple[bool, Any]:
        """(True, the logged ``SandboxGroupResult`` dict) for a group pause or resume the log
        answers (its logged error raised), or (False, None): no group call left, go live."""
        if not self._groups:
            return False, None
        entry = self._groups[0]
        if entry.op != op or entry.request != request:
            raise ReplayDiverged(f"job {self.job!r}, log entry {entry.seq}: the log has {entry.op} {entry.request}, "
                                 f"this run asks {op} {request}")
        self._groups.popleft()
        self.answered += 1
        if entry.error is not None:
            raise error_from_wire({"error": entry.error}, 500)
        return True, entry.result

    def guard(self, method: str, path: str) -> None:
        """A request about to go to the server (one the log did not answer): refused with
        ``ReplayIncomplete`` while its sandbox's log holds more (it would run against the
        sandbox as the log left it, out of order; a call of a recorded kind only gets here once
        its sandbox's log is used up). The sandbox's own description and its security events
        (the platform's, not the sandbox's) are read live."""
        found = _SANDBOX_PATH.match(path)
        if found is None:
            return
        sandbox, rest = found.group(1), found.group(2) or ""
        queue = self._calls.get(sandbox)
        if not queue or (method == "GET" and rest in ("", "/security_events")):
            return
        entry = queue[0]
        raise ReplayIncomplete(
            f"job {self.job!r}: this run asks {method} {rest or '/'} of sandbox {sandbox}, a call a job log does not "
            f"record with its result, while the log holds {len(queue)} more calls of that sandbox (next, entry "
            f"{entry.seq}: {_describe(entry.op, entry.request)}); it cannot be fast-forwarded past it. Make it after "
            f"the logged calls, or record with calls the log answers (run_shell without callbacks, write_file, read_file)")


_GROUP_OPS = ("pause_sandboxes", "resume_sandboxes")
_SANDBOX_PATH = re.compile(r"^/v1/sandboxes/([^/:?]+)(/[^?]*)?")
