"""A sandbox's lifecycle on its node: the one table of what may be done in which state, and the
record the edge keeps of each sandbox.

    creating ──▶ running ──▶ stopping ──▶ stopped
        │          ▲  │ pause
        │   resume │  ▼
        │         paused ─────▶ stopping
        └──────────┴────────────┴──────▶ failed

What a caller asks of a sandbox (an ``Action``) is allowed in these states and leads to these:

    action                     creating  running   paused     stopping   stopped   failed
    exec, read/write a file    ✗         running   running¹   ✗          ✗         ✗
    pack, snapshot, net rules,
    clean copy                 ✗         running   ✗          ✗          ✗         ✗
    pause                      ✗         paused    ✗ already  ✗          ✗         ✗
    resume                     ✗         ✗         running    ✗          ✗         ✗
    stop                       ✗²        stopping  stopping   stopping³  stopped⁴  failed³

    ¹ the call resumes it first (not one paused keeping its files only: ``SandboxStateError``,
      resume it explicitly)    ² "still being created"    ⁴ nothing left to do
    ³ waits for the end under way (the stop's, or the clean-up of the failure)

``check(action, …)`` is the table's one gate: it answers the state the action leads to, or
raises ``SandboxStateError("cannot <verb>: sandbox <id> is <state>")``. Every edge method that
acts on a sandbox asks it first. Reading a sandbox (its info, its security events) is allowed in
every state. The other steps are the edge's own, not asked for (``STEPS``): creating → running
when its create completes (a create that fails leaves no record), stopping → stopped when its
backend has destroyed it, running → failed when its processes are found dead, stopping → failed
when the destroy fails, paused → running when a pause fails (and, on an edge restart, failed for
a sandbox found gone). The edge drops the record of a stopped or failed sandbox once it is
cleaned up, and keeps its last info in the ``Finished`` table (bounded: the oldest go first).

``move(rec, to, reason)`` is the one place a record's state changes: a move that is neither an
action's nor one of the edge's steps raises ``IllegalMove`` (a fault of the edge, never the
caller's: ``check`` refused what a caller may not do before anything moved).
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum

import pydantic_core

from libdsec import SandboxStateError
from libdsec.protocol import RUN_ARGS_BY_KIND, DSecContainerRunArgs, SandboxInfo, SandboxKind, SandboxStatus

from ..backends.base import Handle
from ..images.store import Image

# A sandbox kind, named by its wire value or as the enum, to the enum the edge keeps (a kind
# that is neither stays as it came, to be refused by name).
KINDS: dict[str, SandboxKind] = {kind.value: kind for kind in SandboxKind}


class Action(str, Enum):
    """What a caller may ask of a sandbox; the value is its verb in a refusal."""

    exec = "exec"
    read_file = "read a file"
    write_file = "write a file"
    pack_diff = "pack"
    clean_copy = "make a clean copy of"
    fork = "fork"
    snapshot = "snapshot"
    set_network_rules = "change network rules"
    set_ttl = "change the TTL of"
    pause = "pause"
    resume = "resume"
    stop = "stop"


# The state an action leads to, in each state it is allowed in; what is not here is refused.
TRANSITIONS: dict[SandboxStatus, dict[Action, SandboxStatus]] = {
    SandboxStatus.creating: {},
    SandboxStatus.running: {
        Action.exec: SandboxStatus.running,
        Action.read_file: SandboxStatus.running,
        Action.write_file: SandboxStatus.running,
        Action.pack_diff: SandboxStatus.running,
        Action.clean_copy: SandboxStatus.running,
        Action.fork: SandboxStatus.running,
        Action.snapshot: SandboxStatus.running,
        Action.set_network_rules: SandboxStatus.running,
        Action.set_ttl: SandboxStatus.running,
        Action.pause: SandboxStatus.paused,
        Action.stop: SandboxStatus.stopping,
    },
    SandboxStatus.paused: {
        # A call resumes a paused sandbox first; a pack, a clean copy, a fork, a snapshot or new rules do not.
        Action.exec: SandboxStatus.running,
        Action.read_file: SandboxStatus.running,
        Action.write_file: SandboxStatus.running,
        Action.resume: SandboxStatus.running,
        Action.set_ttl: SandboxStatus.paused,
        Action.stop: SandboxStatus.stopping,
    },
    SandboxStatus.stopping: {Action.stop: SandboxStatus.stopping},  # under way: a second stop waits for its end
    SandboxStatus.stopped: {Action.stop: SandboxStatus.stopped},  # nothing left to do
    SandboxStatus.failed: {Action.stop: SandboxStatus.failed},  # its end under way: a stop waits for it
}

# Refusals that say more than "is <state>".
_REFUSALS: dict[tuple[SandboxStatus, Action], str] = {
    (SandboxStatus.paused, Action.pause): "is paused already",
    (SandboxStatus.creating, Action.stop): "is still being created",
}

# States in which a sandbox holds its node's resources (and counts against its project's quota).
HOLDING = (SandboxStatus.creating, SandboxStatus.running, SandboxStatus.paused)


def refusal(action: Action, sandbox_id: str, status: SandboxStatus, reason: str | None = None) -> SandboxStateError:
    """The error that refuses ``action`` on a sandbox in ``status`` (``reason``: why it ended)."""
    said = _REFUSALS.get((status, action))
    if said is None:
        said = f"is {status.value}, not paused" if action is Action.resume else f"is {status.value}"
    return SandboxStateError(f"cannot {action.value}: sandbox {sandbox_id} {said}" + (f": {reason}" if reason else ""))


def check(action: Action, sandbox_id: str, status: SandboxStatus, reason: str | None = None) -> SandboxStatus:
    """The state ``action`` leads a sandbox in ``status`` to; ``SandboxStateError`` if the table
    does not allow it there."""
    to = TRANSITIONS[status].get(action)
    if to is None:
        raise refusal(action, sandbox_id, status, reason)
    return to


# The edge's own steps, asked for by no caller (see above).
STEPS: dict[SandboxStatus, frozenset[SandboxStatus]] = {
    SandboxStatus.creating: frozenset({SandboxStatus.running}),  # its create completed
    SandboxStatus.running: frozenset({SandboxStatus.failed}),  # found dead
    SandboxStatus.paused: frozenset({SandboxStatus.running,  # its pause failed: undone
                                     SandboxStatus.failed}),  # found gone on an edge restart
    SandboxStatus.stopping: frozenset({SandboxStatus.stopped,  # destroyed
                                       SandboxStatus.failed}),  # its destroy failed
    SandboxStatus.stopped: frozenset(),
    SandboxStatus.failed: frozenset(),
}

# Every move a state may make: to where an action leads (but itself: nothing moves) or a step.
MOVES: dict[SandboxStatus, frozenset[SandboxStatus]] = {
    status: frozenset(to for to in TRANSITIONS[status].values() if to is not status) | STEPS[status]
    for status in SandboxStatus
}


class IllegalMove(RuntimeError):
    """The edge moved a sandbox where its lifecycle does not go (a fault in the edge)."""


def move(rec: Record, to: SandboxStatus, reason: str | None = None) -> None:
    """Move ``rec`` to ``to`` (and, if given, say why: ``reason``); ``IllegalMove`` if its
    lifecycle has no such move from where it is."""
    if to not in MOVES[rec.status]:
        raise IllegalMove(f"sandbox {rec.id} cannot move from {rec.status.value} to {to.value}")
    rec.status = to
    if reason is not None:
        rec.reason = reason


@dataclass
class Record:
    """The edge's record of one sandbox; its JSON (``to_json``) is what the journal keeps."""

    id: str
    kind: SandboxKind
    handle: Handle
    args: DSecContainerRunArgs
    image: Image
    status: SandboxStatus
    created_at: float
    last_active: float
    uid: int = 0
    gid: int = 0
    reason: str | None = None
    calls: int = 0
    create_s: float | None = None
    project: str = "root"
    paused_at: float | None = None
    # How it is paused (``PauseMode``: ``filesystem``, its processes ended), None while it is not.
    pause_mode: str | None = None
    # The batch it belongs to until that batch is committed (``Edge.commit_batch``): a sandbox
    # of a batch never committed is stopped (all or none holds across a crash too).
    batch: str | None = None
    # Serialises pause and resume (and the implicit resume of a call) on one sandbox.
    transition: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def info(self, node: str) -> SandboxInfo:
        return SandboxInfo(
            id=self.id, kind=self.kind, node=node, image=self.image.name, status=self.status,
            created_at=datetime.fromtimestamp(self.created_at, timezone.utc),
            last_active_at=datetime.fromtimestamp(self.last_active, timezone.utc),
            memory_limit_mb=self.args.memory_limit_mb, cpu_cores_limit=self.args.cpu_cores_limit,
            ttl_running_stop=self.args.ttl_running_stop, init_user=self.args.init_user or self.image.user,
            workdir=self.args.workdir or self.image.workdir, reason=self.reason, create_s=self.create_s, project=self.project,
            cpu_cores_cap=self.args.cpu_cores_cap, best_effort=self.args.best_effort,
            labels=self.args.labels, on_ttl=self.args.on_ttl, auto_resume=self.args.auto_resume,
            snapshot=self.args.snapshot, pause_mode=self.pause_mode,
        )

    def to_json(self) -> str:
        # pydantic_core writes the args model as it is: a sixth of dumping it to a dict for json.dumps.
        return pydantic_core.to_json({
            "id": self.id, "kind": self.kind, "handle": self.handle.to_json(), "args": self.args,
            "image": {"name": self.image.name, "layers": list(self.image.layers), "env": self.image.env,
                      "workdir": self.image.workdir, "user": self.image.user, "roles": list(self.image.roles)},
            "created_at": self.created_at, "uid": self.uid, "gid": self.gid,
            "project": self.project, "paused_at": self.paused_at, "batch": self.batch,
            **({"pause_mode": self.pause_mode} if self.pause_mode else {}),
        }).decode()

    @classmethod
    def from_json(cls, text: str) -> Record:
        """A record read back on restart: running, or paused if it was (``paused_at``)."""
        d = json.loads(text)
        img = d["image"]
        now = time.time()
        return cls(
            id=d["id"], kind=SandboxKind(d.get("kind", "container")), handle=Handle.from_json(d["handle"]),
            args=RUN_ARGS_BY_KIND.get(d.get("kind", "container"), DSecContainerRunArgs).model_validate(d["args"]),
            image=Image(name=img["name"], layers=tuple(img["layers"]), env=img["env"],
                        workdir=img["workdir"], user=img["user"], roles=tuple(img.get("roles", ()))),
            status=SandboxStatus.paused if d.get("paused_at") else SandboxStatus.running,
            created_at=d["created_at"], last_active=now, uid=d["uid"], gid=d["gid"],
            project=d.get("project", "root"), paused_at=d.get("paused_at"), batch=d.get("batch"),
            pause_mode=(d.get("pause_mode") or "full") if d.get("paused_at") else None,
        )


# A typical ended sandbox's info: the preset dictionary its kept copies are compressed against.
_TYPICAL_INFO = SandboxInfo(
    id="n0-0123456789abcdef", kind="container", node="n0", image="busybox", status=SandboxStatus.stopped,
    created_at=datetime(2026, 1, 1, tzinfo=timezone.utc), last_active_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
    memory_limit_mb=512, cpu_cores_limit=1.0, ttl_running_stop=600.0, init_user="root", workdir="/",
    reason="stopped by request", create_s=0.01, project="root", labels={"job": "x"},
).model_dump_json().encode() + b'"microvm""vm""failed""sandbox processes died""stopped by its TTL"'


class Finished:
    """What each ended sandbox was (its last ``SandboxInfo``: when and why it ended), so that a
    late ``get`` answers it and a call on it is refused with the reason. At most ``kept`` of them,
    the oldest forgotten first. Each is kept as its JSON, defaults left out and compressed
    against a typical one: about 100 bytes, where the ``SandboxInfo`` object held 1.5 KB (15 MB
    for 10,000 ended sandboxes, the soak's steady growth).

    The edge uses it as the mapping it replaced: ``table[id] = info``, ``get``/``table[id]``,
    ``in``, ``len``, ``popitem(last=False)`` (the oldest, packed)."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._infos: OrderedDict[str, bytes] = OrderedDict()

    def add(self, info: SandboxInfo) -> None:
        packer = zlib.compressobj(6, zdict=_TYPICAL_INFO)
        self._infos[info.id] = packer.compress(info.model_dump_json(exclude_defaults=True).encode()) + packer.flush()
        self._infos.move_to_end(info.id)
        while len(self._infos) > self.kept:
            self._infos.popitem(last=False)

    def __setitem__(self, sandbox_id: str, info: SandboxInfo) -> None:
        if sandbox_id != info.id:
            raise KeyError(f"the info of {info.id} kept as {sandbox_id}")
        self.add(info)

    def get(self, sandbox_id: str) -> SandboxInfo | None:
        packed = self._infos.get(sandbox_id)
        if packed is None:
            return None
        unpacker = zlib.decompressobj(zdict=_TYPICAL_INFO)
        return SandboxInfo.model_validate_json(unpacker.decompress(packed) + unpacker.flush())

    def __getitem__(self, sandbox_id: str) -> SandboxInfo:
        info = self.get(sandbox_id)
        if info is None:
            raise KeyError(sandbox_id)
        return info

    def popitem(self, last: bool = True) -> tuple[str, bytes]:
        return self._infos.popitem(last=last)

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self._infos

    def __len__(self) -> int:
        return len(self._infos)
