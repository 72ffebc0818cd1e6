"""Wire models: one per operation, shared by the SDK and the server.

The server imports these; the OpenAPI document is generated from them. Every model forbids
unknown fields so a typo in a request is an error, not a silent default.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# Output kept per stream before truncation, unless a request asks for less.
DEFAULT_MAX_OUTPUT_BYTES = 1 << 20
MAX_OUTPUT_BYTES_LIMIT = 64 << 20
DEFAULT_COMMAND_TIMEOUT_S = 60.0
MAX_BATCH_COUNT = 10_000  # calls in one fncall batch
# Sandboxes in one batch create: a training job asks for tens of thousands at once, split over
# the cluster's nodes by the apiserver and streamed back as they come up.
MAX_SANDBOX_BATCH = 100_000


# A snapshot's id, and the names a caller may give one: a name that could be taken for an id
# is refused, so a reference is one or the other.
SNAPSHOT_ID = re.compile(r"^s[0-9a-f]{16}\Z")
SNAPSHOT_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}\Z")
SnapshotMode = Literal["full", "filesystem"]
# What a pause keeps: ``full``, the sandbox as it is (frozen, its memory pushed out: it resumes
# where it was); ``filesystem``, its files only (its processes end; a resume starts it afresh
# over them, as a machine boots from its disk).
PauseMode = Literal["full", "filesystem"]


def check_snapshot_name(name: str) -> str:
    """``name`` if a snapshot may be called so (``ValueError`` naming the rule, else)."""
    if not SNAPSHOT_NAME.match(name):
        raise ValueError(f"invalid snapshot name {name[:80]!r}: 1-64 of lowercase letters, digits, '.', '_' "
                         "or '-', starting with a letter or digit")
    if SNAPSHOT_ID.match(name):
        raise ValueError(f"invalid snapshot name {name!r}: it has the form of a snapshot id (s + 16 hex digits)")
    return name


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_LABELS = 64  # labels of a sandbox
MAX_PATHS = 64  # kept paths of a clean copy, protected paths of a sandbox


def sandbox_paths(paths: list[str], what: str) -> list[str]:
    """Absolute paths inside a sandbox, without ``..``: each checked (``ValueError`` naming the
    bad one) and normalized (``//`` and trailing ``/`` dropped)."""
    if len(paths) > MAX_PATHS:
        raise ValueError(f"at most {MAX_PATHS} {what}s, not {len(paths)}")
    out = []
    for path in paths:
        if not path.startswith("/") or "\0" in path:
            raise ValueError(f"{what} {path!r} is not an absolute path")
        if ".." in path.split("/"):
            raise ValueError(f"{what} {path!r} contains '..'")
        out.append("/" + "/".join(p for p in path.split("/") if p and p != "."))
    return out


class SandboxKind(str, Enum):
    container = "container"
    microvm = "microvm"
    fullvm = "fullvm"


class SandboxStatus(str, Enum):
    """Lifecycle: creating → running → stopping → stopped; any state may end in failed.
    running ⇄ paused: frozen, memory pushed out to swap; the next call resumes it."""

    creating = "creating"
    running = "running"
    paused = "paused"
    stopping = "stopping"
    stopped = "stopped"
    failed = "failed"


class DesktopSpec(_Model):
    """A screen for the sandbox (``sandbox.desktop``): an X server of this size and DPI and a
    desktop session, started with the sandbox and ready when its create returns. ``session``:
    ``xfce4`` (xfce4-session, as E2B Desktop's), ``wm`` (the window manager alone: lighter) or
    ``none`` (the X server alone). Needs an image with them (``desktop``)."""

    width: int = Field(1280, ge=64, le=7680)
    height: int = Field(800, ge=64, le=4320)
    dpi: int = Field(96, ge=24, le=600)
    session: Literal["xfce4", "wm", "none"] = "xfce4"


class DSecContainerRunArgs(_Model):
    """What a container sandbox is made of and may use.

    Ranges are checked by the node that admits the sandbox (``LimitOutOfRange`` names the
    field and the allowed range), so they can follow the node's real capacity.
    """

    # The image: a name, or a composition ``base+workspace+toolkit``. It may be left out when
    # ``snapshot`` names where to start (the snapshot's own image is then used).
    container_image: str = Field(default="", max_length=256)
    memory_limit_mb: int = 512
    cpu_cores_limit: float = 1.0
    # Seconds without a call after which the sandbox is stopped (or paused: ``on_ttl``).
    ttl_running_stop: float = 1800.0
    # What its idle TTL does: stop it, or pause it (a paused sandbox then ends after the node's
    # ``paused_ttl_s``, as any paused one does); ``pause_filesystem`` pauses it keeping its
    # files only (``PauseMode``).
    on_ttl: Literal["stop", "pause", "pause_filesystem"] = "stop"
    # A call to the sandbox while it is paused resumes it first; False: such a call is refused
    # (``SandboxStateError``, 409) until it is resumed explicitly. A sandbox paused keeping its
    # files only is never resumed by a call: its processes are gone, which a call must not find
    # out by surprise.
    auto_resume: bool = True
    # Named mirror services (or "domains") mapped to allowed or not. Default: no network.
    network_rules: dict[str, bool | list[str]] = Field(default_factory=dict)
    # The user and directory the sandbox's commands run as and in. None: the image's (a
    # Dockerfile's USER and WORKDIR; root and / for an image that sets neither).
    init_user: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    pids_limit: int = 1024
    # ``cpu_cores_limit`` is a weight (the sandbox's share when the node is busy), not a cap;
    # this is an optional hard cap in cores on top of it.
    cpu_cores_cap: float | None = None
    # Best effort: the sandbox runs under SCHED_IDLE (init and every command) and gets only
    # CPU time nobody else wants; it commits no CPU on its node or in its project's quota.
    best_effort: bool = False
    # An explicit composition: ``container_image`` is the base, then a workspace layer set and
    # toolkits stacked on top (``"python+repo-abc+harness"`` in ``container_image`` is the same).
    workspace: str | None = None
    toolkits: list[str] = Field(default_factory=list)
    # Paths (absolute, in the image) no process of the sandbox may write, root included:
    # read-only bind mounts it cannot remount or unmount. Containers only.
    protected_paths: list[str] = Field(default_factory=list)
    # Free-form labels of the caller's (E2B's ``metadata``): kept with the sandbox, listed with it.
    labels: dict[str, str] = Field(default_factory=dict)
    # A desktop (screen, mouse, keyboard) started with the sandbox: ``sandbox.desktop``.
    desktop: DesktopSpec | None = None
    # Start from this snapshot (``Sandbox.snapshot()``, by id or name) instead of the bare image:
    # a filesystem snapshot's files for any kind; a full one (microVMs) resumes its memory too.
    snapshot: str | None = None

    @model_validator(mode="after")
    def _image_or_snapshot(self):
        if not self.container_image and self.snapshot is None:
            raise ValueError("container_image is required (or snapshot, to start from one)")
        return self

    @field_validator("snapshot")
    @classmethod
    def _snapshot_ref(cls, ref: str | None) -> str | None:
        if ref is not None and not (SNAPSHOT_ID.match(ref) or SNAPSHOT_NAME.match(ref)):
            raise ValueError(f"{ref[:80]!r} is neither a snapshot id (s + 16 hex digits) nor a snapshot name")
        return ref

    @property
    def image_ref(self) -> str:
        return "+".join([self.container_image, *([self.workspace] if self.workspace else []), *self.toolkits])

    @field_validator("cpu_cores_limit", "ttl_running_stop")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("cpu_cores_cap")
    @classmethod
    def _finite_cap(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            if not name or "=" in name or "\0" in name or "\0" in value:
                raise ValueError(f"invalid environment variable name or value: {name!r}")
        return env

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        if len(labels) > MAX_LABELS:
            raise ValueError(f"at most {MAX_LABELS} labels, not {len(labels)}")
        for name, value in labels.items():
            if not name or len(name) > 256 or len(value) > 4096:
                raise ValueError(f"label {name[:40]!r}: a name of 1-256 characters and a value of at most 4096")
        return labels

    @field_validator("protected_paths")
    @classmethod
    def _protected(cls, paths: list[str]) -> list[str]:
        out = sandbox_paths(paths, "protected path")
        if "/" in out:
            raise ValueError("protected path '/' would make the whole root read-only: name directories")
        return out

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, path: str | None) -> str | None:
        if path is not None and (not path.startswith("/") or "\0" in path):
            raise ValueError("workdir must be an absolute path")
        return path


class TTLRequest(_Model):
    """A new ``ttl_running_stop`` for a sandbox (counted, as always, from its last call)."""

    ttl_running_stop: float

    @field_validator("ttl_running_stop")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class PackDiffRequest(_Model):
    # Name of the new image; default ``snap-<digest prefix>``.
    name: str | None = None
    # Role of the new layer: a snapshot of an episode, or a build step of an image.
    role: Literal["snapshot", "step", "workspace", "toolkit"] = "snapshot"


class PackDiffResult(_Model):
    """What ``pack_diff`` made: an image (pass ``image`` as ``container_image`` to restore or
    branch) whose top layer holds the sandbox's changes."""

    image: str
    layer: str
    layers: list[str]
    size_bytes: int
    scrubbed: list[str]


class DSecMicroVMRunArgs(DSecContainerRunArgs):
    """A microVM (QEMU ``microvm`` machine, its own kernel): the container's fields, where
    ``container_image`` names the image in the same layer store, ``memory_limit_mb`` is the
    guest's memory (at least 64) and ``cpu_cores_limit`` rounds up to vCPUs.

    ``snapshot``: a full snapshot of a microVM (``Sandbox.snapshot()``) is restored instead of
    booting: the VM resumes with its processes and files, and the memory and vCPUs it was saved
    with; a filesystem snapshot of a microVM boots with its files."""


class DSecFullVMRunArgs(DSecContainerRunArgs):
    """A full VM (QEMU ``q35``) booting the image's own init from a copy-on-write disk built
    from its layers; fields as for a container (``memory_limit_mb`` is the guest's memory)."""


RUN_ARGS_BY_KIND: dict[str, type[DSecContainerRunArgs]] = {
    "container": DSecContainerRunArgs, "microvm": DSecMicroVMRunArgs, "fullvm": DSecFullVMRunArgs,
}


class SnapshotRequest(_Model):
    """Take a snapshot of a running sandbox. ``mode``: ``full`` (memory, devices and files: the
    copies resume where it was; microVMs) or ``filesystem`` (its files as an image layer: the
    copies start afresh from them; every kind); unset, ``full`` where the kind can, else
    ``filesystem``. ``name``: a name unique among the snapshots, to start from it by."""

    mode: SnapshotMode | None = None
    name: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str | None) -> str | None:
        return None if name is None else check_snapshot_name(name)


class Snapshot(_Model):
    """A named, kept state of a sandbox: pass ``id`` (or ``name``) as any run args' ``snapshot``
    to start sandboxes of the same ``kind`` from it. It outlives its sandbox, until removed.

    ``image`` is the image in the layer store a start uses (for ``filesystem``, the source's
    layers with ``layer`` on top: it may also be named as ``container_image`` by any kind);
    ``source_image`` the image the sandbox ran. A ``full`` snapshot's memory lies on ``node``."""

    id: str
    name: str | None = None
    mode: SnapshotMode = "full"
    kind: str
    sandbox_id: str
    node: str
    project: str = "root"
    image: str
    source_image: str | None = None
    layer: str | None = None
    size_bytes: int
    memory_mb: int | None = None
    save_s: float
    created_at: datetime


# The name it had when a snapshot was a microVM's memory only.
SnapshotInfo = Snapshot


class SnapshotList(_Model):
    snapshots: list[Snapshot]


class CreateBatchRequest(_Model):
    args: DSecContainerRunArgs
    count: int = Field(ge=1, le=MAX_SANDBOX_BATCH)


class SandboxInfo(_Model):
    id: str
    kind: SandboxKind = SandboxKind.container
    node: str
    image: str
    status: SandboxStatus
    created_at: datetime
    last_active_at: datetime
    memory_limit_mb: int
    cpu_cores_limit: float
    ttl_running_stop: float
    init_user: str
    workdir: str
    reason: str | None = None
    # Seconds the node took to bring the sandbox up.
    create_s: float | None = None
    project: str = "root"
    cpu_cores_cap: float | None = None
    best_effort: bool = False
    labels: dict[str, str] = Field(default_factory=dict)
    on_ttl: Literal["stop", "pause", "pause_filesystem"] = "stop"
    auto_resume: bool = True
    # How it is paused (``PauseMode``) while it is; None otherwise.
    pause_mode: PauseMode | None = None
    # The snapshot (id) it was started from, if any.
    snapshot: str | None = None


class PauseRequest(_Model):
    """Pause a running sandbox: ``mode`` says what it keeps (``PauseMode``); ``filesystem`` needs
    a kind that can start again over its kept files (containers)."""

    mode: PauseMode = "full"


class PauseResult(_Model):
    """What ``pause`` did: the sandbox (now paused) and the memory charged to it before and
    after its memory was pushed out (``None`` where the backend cannot tell)."""

    sandbox: SandboxInfo
    memory_before_bytes: int | None = None
    memory_after_bytes: int | None = None
    pause_s: float


class CleanCopyRequest(_Model):
    """Make a clean copy of a sandbox: a new one from the original image's layers with only the
    sandbox's changes beneath ``keep`` (absolute paths that exist in it, no link on the way)."""

    keep: list[str] = Field(min_length=1)

    @field_validator("keep")
    @classmethod
    def _keep(cls, paths: list[str]) -> list[str]:
        out = sandbox_paths(paths, "keep path")
        if "/" in out:
            raise ValueError("keep path '/' would carry all the sandbox's changes, tampering included: "
                             "name the directories that hold the work")
        return out


class CleanCopyResult(_Model):
    """The clean copy (a running sandbox of its own, to be stopped like any other) and what was
    carried into it: files (links and directories aside) and their bytes, the residue left
    out (``scrubbed``), and the system files the source had replaced or added (``tampered``,
    also recorded as a ``file.tampered`` security event of the source)."""

    sandbox: SandboxInfo
    source: str
    keep: list[str]
    files: int
    bytes: int
    scrubbed: list[str]
    tampered: list[str]
    copy_s: float


# Children of one fork, at most (a quota bounds it further: they count as sandboxes).
MAX_FORK_COUNT = 1000
# What a fork carried into its children: the parent's memory and running processes, or its
# filesystem alone (they start the image's command afresh).
ForkKind = Literal["memory", "filesystem"]


class ForkRequest(_Model):
    """Fork a running sandbox into ``count`` children. All or none by default: on any child's
    failure every child made is stopped and the fork fails; ``all_or_none=False`` answers one
    entry per child, a sandbox or its error. ``ttl_running_stop``: the children's idle TTL
    (None: the parent's)."""

    count: int = Field(1, ge=1, le=MAX_FORK_COUNT)
    all_or_none: bool = True
    ttl_running_stop: float | None = None

    @field_validator("ttl_running_stop")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class ForkChild(_Model):
    """One child of a fork: the running sandbox, or why it could not be made (``ErrorBody``'s
    code and message)."""

    sandbox: SandboxInfo | None = None
    error: ErrorBody | None = None


class ForkResult(_Model):
    """A fork: its children in order, which ``kind`` of fork they are (``memory``: restored
    from one memory image of the parent, processes and all; ``filesystem``: the parent's
    files, the image's command started afresh), what was taken of the parent once and shared
    by them all (``layer``: its writable layer as one read-only layer; ``snapshot``: its
    memory image), how long the parent was frozen for it and how long the fork took."""

    parent: str
    kind: ForkKind
    children: list[ForkChild]
    layer: str | None = None
    snapshot: str | None = None
    frozen_s: float
    fork_s: float


class ProjectUsage(_Model):
    """What a project's sandboxes (running or paused) hold on a node, or in all."""

    sandboxes: int = 0
    cpu_cores: float = 0.0
    memory_mb: int = 0


class SandboxList(_Model):
    sandboxes: list[SandboxInfo]


class BatchEvent(_Model):
    """One line of the NDJSON stream answering a batch create."""

    event: Literal["created", "done", "error"]
    index: int | None = None
    sandbox: SandboxInfo | None = None
    error: dict | None = None


class ExecRequest(_Model):
    command: str = Field(min_length=1)
    timeout: float = DEFAULT_COMMAND_TIMEOUT_S
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    stdin: str | None = None
    max_output_bytes: int = Field(default=DEFAULT_MAX_OUTPUT_BYTES, ge=0, le=MAX_OUTPUT_BYTES_LIMIT)

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, value: float) -> float:
        if not math.isfinite(value) or value <= 0 or value > 24 * 3600:
            raise ValueError("timeout must be between 0 and 86400 seconds")
        return value


class ExecResult(_Model):
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    # Bytes the command wrote in all, kept or not.
    stdout_bytes: int = 0
    stderr_bytes: int = 0


MAX_BUILD_CONTEXT_BYTES = 64 << 20


class BuildImageRequest(_Model):
    """``POST /v1/images:build``: image ``name`` from a Dockerfile (``client.build_image``).
    ``context_b64``: the build context as a tar archive (plain or gzip), base64. The answer is
    NDJSON ``ExecEvent``s: ``started``, the build's log as ``stdout`` lines, then ``exit``
    whose ``result.stdout`` is the ``BuildResult`` as JSON, or ``error``."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,127}$")
    dockerfile: str = Field(min_length=1, max_length=1 << 20)
    context_b64: str = Field(default="", max_length=(MAX_BUILD_CONTEXT_BYTES * 4) // 3 + 4)
    build_args: dict[str, str] = Field(default_factory=dict)
    # Build again even when an image of the same content key is in the store.
    no_cache: bool = False
    memory_limit_mb: int = Field(default=2048, ge=16, le=1 << 20)
    cpu_cores_limit: float = Field(default=1.0, gt=0, le=1024)
    timeout: float = Field(default=3600.0, gt=0, le=24 * 3600)
    # Kept with the image (part of its cache key): what its sandboxes run as they start, and
    # the command that says they are ready (an E2B template's start and ready commands).
    start_cmd: str | None = Field(default=None, max_length=1 << 16)
    ready_cmd: str | None = Field(default=None, max_length=1 << 16)


class BuildResult(_Model):
    """A Dockerfile build: the image, whether it came from the cache (an image of the same
    content key was in the store: nothing ran), and that key (sha256 of the Dockerfile's steps,
    the build args they read, the bytes of the files they copy and the base image's layers)."""

    image: str
    cached: bool
    key: str
    layers: int = 0
    duration_s: float = 0.0


class ExecEvent(_Model):
    """One line of a streamed command (``POST …/exec:stream``, NDJSON): ``started`` once it
    runs, then ``stdout``/``stderr`` text chunks as it writes them, then ``exit`` with the
    result (its kept output capped as ``run_shell``'s) or ``error`` (a wire error body)."""

    event: Literal["started", "stdout", "stderr", "exit", "error"]
    data: str = ""
    result: ExecResult | None = None
    error: dict | None = None


class StartProcessRequest(_Model):
    """A background process: ``sh -c command``, started and left running (``start_shell``)."""

    command: str = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None


class ProcessInfo(_Model):
    pid: int  # in the sandbox's pid namespace
    command: str  # (its first 200 characters)
    running: bool
    exit_code: int | None = None  # once it ended (128 + N: killed by signal N)
    stdout_bytes: int = 0  # written so far (all kept, in the sandbox: see docs/INSIDE.md)
    stderr_bytes: int = 0


class ProcessList(_Model):
    processes: list[ProcessInfo]


class ProcessStdinRequest(_Model):
    data: str = ""
    close: bool = False  # then close its stdin (after ``data``)


class ProcessSignalRequest(_Model):
    signal: int = Field(ge=1, le=64)


class ProcessWaitRequest(_Model):
    timeout: float = DEFAULT_COMMAND_TIMEOUT_S

    _timeout = field_validator("timeout")(ExecRequest._timeout.__func__)  # type: ignore[attr-defined]


class ProcessStreamRequest(_Model):
    """Stream a background process's output from these offsets until it ends (``ExecEvent``s:
    ``stdout``/``stderr``, then ``exit`` whose result has only the exit code)."""

    stdout_offset: int = Field(default=0, ge=0)
    stderr_offset: int = Field(default=0, ge=0)
    timeout: float = 24 * 3600.0

    _timeout = field_validator("timeout")(ExecRequest._timeout.__func__)  # type: ignore[attr-defined]


class OpenSessionRequest(_Model):
    """A shell whose state (cwd, environment, functions, an activated venv) persists from one
    command to the next. One a session no command came to for ``idle_timeout`` seconds ends."""

    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    idle_timeout: float = Field(default=600.0, ge=1, le=7 * 24 * 3600)
    # The shell: POSIX ``sh``, or ``bash`` (an image without it fails the open).
    shell: Literal["sh", "bash"] = "sh"


class SessionInfo(_Model):
    id: int  # the pid of its shell (it is listed with the background processes)


MAX_PTY_SIDE = 4096  # columns or rows of a PTY, at most (the kernel's field is 16 bits)


class OpenPtyRequest(_Model):
    """A command on a terminal in the sandbox (``sandbox.open_pty``): ``sh -c command`` with a
    new terminal of ``cols`` x ``rows`` as its controlling terminal. An open PTY with no
    stream reading it and no call for ``idle_timeout`` seconds is closed."""

    cols: int = Field(default=80, ge=1, le=MAX_PTY_SIDE)
    rows: int = Field(default=24, ge=1, le=MAX_PTY_SIDE)
    command: str = Field(default="/bin/sh", min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    idle_timeout: float = Field(default=600.0, ge=1, le=7 * 24 * 3600)


class PtyInfo(_Model):
    id: int  # the node's, for this sandbox's PTY calls; PTYs end with the node's edge
    cols: int
    rows: int


class PtyResizeRequest(_Model):
    cols: int = Field(ge=1, le=MAX_PTY_SIDE)
    rows: int = Field(ge=1, le=MAX_PTY_SIDE)


class PtyStreamRequest(_Model):
    """Read the PTY's output (``ExecEvent``s: ``started``, ``stdout`` chunks as written, then
    ``exit`` with the exit code). One stream at a time. ``encoding``: each chunk's ``data`` as
    text (UTF-8 decoded across chunks, invalid bytes replaced) or as the base64 of its bytes,
    exactly."""

    timeout: float = 7 * 24 * 3600.0
    encoding: Literal["utf-8", "base64"] = "utf-8"

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, value: float) -> float:
        if not math.isfinite(value) or value <= 0 or value > 7 * 24 * 3600:
            raise ValueError("timeout must be between 0 and 604800 seconds")
        return value


class PtyInputRequest(_Model):
    # bytes as base64 in JSON (a keystroke is any byte: Ctrl-C is 0x03)
    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")

    data: bytes = Field(max_length=1 << 20)


class FileEntry(_Model):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int  # permission bits (0o755 …)
    mtime: float
    uid: int
    gid: int
    target: str | None = None  # a symlink's target, as it is written (never followed)


class FileList(_Model):
    entries: list[FileEntry]


class FileRemoveRequest(_Model):
    path: str
    recursive: bool = False


MAX_WATCH_WAIT_S = 60.0


class OpenWatchRequest(_Model):
    """Watch a directory of the sandbox (``sandbox.watch_dir``): what changes in it, and with
    ``recursive`` in the tree below it, is told as ``FsEvent``s (inotify: no polling)."""

    path: str
    recursive: bool = False


class WatchInfo(_Model):
    id: int  # the node's, for this sandbox's watch calls; watches end with the node's edge
    path: str
    recursive: bool


class FsEvent(_Model):
    """A change in a watched directory, as E2B's envd tells it: ``create`` (a name made or moved
    in), ``write``, ``remove``, ``rename`` (a name moved away), ``chmod`` (mode or owner)."""

    type: Literal["create", "write", "remove", "rename", "chmod"]
    name: str  # relative to the watched directory


class WatchEventsRequest(_Model):
    wait: float = Field(default=0.0, ge=0.0, le=MAX_WATCH_WAIT_S)  # for a first event, when none is held


class WatchEvents(_Model):
    events: list[FsEvent]
    dropped: int = 0  # events lost because nobody read them in time (the oldest go first)
    ended: bool = False  # the directory went (removed or moved) or the sandbox stopped: the watch is closed


class FileRenameRequest(_Model):
    src: str
    dst: str


class MakeDirRequest(_Model):
    path: str


class TreeDownloadRequest(_Model):
    """``download_dir``: the tree at ``path`` as a tar, streamed as ``ExecEvent`` stdout lines
    of base64 text, then ``exit``."""

    path: str


class ImageInfo(_Model):
    name: str
    layers: list[str]
    roles: list[str] = Field(default_factory=list)
    layer_sizes: list[int] = Field(default_factory=list)
    parent: str | None = None
    size_bytes: int
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str = "/"
    user: str = "root"
    setuid: bool = False  # sandboxes may gain privileges through setuid programs (sudo)
    start_cmd: str | None = None  # run in the background as a sandbox starts (an E2B template's)
    ready_cmd: str | None = None  # then run until it exits 0 (E2B's create waits for it)


class ImageList(_Model):
    images: list[ImageInfo]


class NodeInfo(_Model):
    node: str
    cgroup_version: str
    runtime: str
    sandboxes: int
    memory_total_mb: int
    cpu_cores: int
    # Admission: the most sandboxes, the overcommit ratios and what is committed (creating,
    # running and paused sandboxes; best-effort ones commit no CPU).
    max_sandboxes: int | None = None
    cpu_overcommit: float = 1.0
    memory_overcommit: float = 1.0
    committed_cpu: float = 0.0
    committed_memory_mb: int = 0
    paused: int = 0
    swap_total_mb: int = 0
    sched_idle: bool = False
    # "supported", or "unsupported: <why>" (e.g. a kernel built without CONFIG_SCHED_CORE).
    core_scheduling: str = "unknown"
    # How container layers are attached: "file" (file-backed EROFS) or "loop" (loop devices).
    layer_attach: str = "file"
    # "enforce" (container sandboxes run under the dsec-sandbox profile), or "unsupported: <why>".
    apparmor: str = "unknown"
    projects: dict[str, ProjectUsage] = Field(default_factory=dict)
    # What a fork of each kind served here carries ("memory" or "filesystem"), and whether
    # containers could fork their memory: "supported" where ``criu check`` passes, else
    # "unsupported: <why>" (their forks are then of the filesystem).
    forks: dict[str, ForkKind] = Field(default_factory=dict)
    container_memory_fork: str = "unknown"
    # "ready" (serving), or, listed only when asked (``node_info(include_unready=True)``): "lost"
    # (it left the cluster) or "failed" (found, but its edge did not start), with why in ``problem``.
    state: Literal["ready", "lost", "failed"] = "ready"
    problem: str = ""

    @classmethod
    def unready(cls, node: str, state: str, problem: str) -> NodeInfo:
        """The line of a node that is not serving: nothing is known of it but why."""
        return cls(node=node, cgroup_version="", runtime="", sandboxes=0, memory_total_mb=0, cpu_cores=0,
                   state=state, problem=problem)


class ErrorBody(_Model):
    code: str
    message: str
    # ``overloaded`` (429) only: seconds to wait before sending the same call again.
    retry_after: float | None = None


class ErrorResponse(_Model):
    error: ErrorBody


class SecurityEvent(_Model):
    """A denied action the platform saw in a sandbox (see ``Sandbox.security_events``).

    ``kind``: ``network.blocked``, ``dns.refused``, ``syscall.denied``, ``limit.memory``,
    ``limit.pids``, ``limit.disk``, ``limit.output``, ``limit.timeout``, ``file.tampered``
    (system files replaced or added: shells, ``PATH`` directories, libraries, start-up hooks) or
    ``apparmor.denied`` (where the host has AppArmor); ``count``: how many times."""

    kind: str
    detail: str
    count: int = 1
    at: datetime


class SecurityEventList(_Model):
    events: list[SecurityEvent]


class NetworkRulesRequest(_Model):
    """New ``network_rules`` for a running sandbox: named services mapped to allowed or not,
    and ``"domains"``: a list of names. ``{}`` takes all network away."""

    network_rules: dict[str, bool | list[str]] = Field(default_factory=dict)


# -- FnCall: stateless calls in a warm pool ------------------------------------------------------

FNCALL_LANGUAGES = ("python", "bash")
DEFAULT_FNCALL_TIMEOUT_S = 10.0
DEFAULT_FNCALL_MEMORY_MB = 256
DEFAULT_FNCALL_OUTPUT_BYTES = 1 << 20


class _BytesModel(_Model):
    # bytes travel as base64 in JSON: URL-safe when written, either alphabet when read (the
    # server parses these bodies with model_validate_json, which decodes it).
    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")


class DSecFnCallArgs(_BytesModel):
    """One stateless call: run ``code`` in a fresh process forked from a warm interpreter.

    ``language`` is ``python`` (the code runs as ``python3 -c`` would) or ``bash`` (``bash -c``).
    The call starts in an empty working directory (``/work``, also ``HOME``) holding ``files``
    (relative paths), reads ``stdin``, and may write only there and in ``/tmp``; ``fetch_files``
    are read back from the working directory when it ends. Nothing of one call is visible to
    another. No network. Ranges (timeout, memory, sizes) are checked by the node, which answers
    ``LimitOutOfRange``; an unknown language is ``InvalidRequest``.
    """

    code: str
    language: str = "python"
    stdin: str | None = None
    files: dict[str, bytes] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)
    timeout: float = DEFAULT_FNCALL_TIMEOUT_S
    memory_limit_mb: int = DEFAULT_FNCALL_MEMORY_MB
    image: str = "python"
    env: dict[str, str] = Field(default_factory=dict)
    # Output kept per stream; past it the stream is cut and marked truncated.
    max_output_bytes: int = DEFAULT_FNCALL_OUTPUT_BYTES

    @field_validator("timeout")
    @classmethod
    def _finite_timeout(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("files", mode="before")
    @classmethod
    def _text_files(cls, files: object, info: ValidationInfo) -> object:
        # In Python a str is the file's text; in JSON every value is base64.
        if info.mode == "python" and isinstance(files, dict):
            return {k: v.encode() if isinstance(v, str) else v for k, v in files.items()}
        return files


class FnCallResult(_BytesModel):
    """What a call did. ``exit_code`` is negative when the process was killed by a signal (−9:
    killed at the timeout, or for memory). ``duration_s`` is the call's own run (fork to exit),
    ``worker_s`` its whole turn in the worker (with clean-up), ``queued_s`` its wait for a free
    worker. In a batch, a call that could not run at all has ``error`` set (the others are
    unaffected); ``DSecClient.fncall`` raises instead."""

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    # Bytes the call wrote in all, kept or not.
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    timed_out: bool = False
    memory_exceeded: bool = False
    files: dict[str, bytes] = Field(default_factory=dict)
    # fetch_files that could not be fetched, with the reason ("no such file", …).
    file_errors: dict[str, str] = Field(default_factory=dict)
    duration_s: float = 0.0
    cpu_s: float = 0.0
    worker_s: float = 0.0
    queued_s: float = 0.0
    error: ErrorBody | None = None

    @property
    def ok(self) -> bool:
        """It ran, exited 0 and was not killed."""
        return self.error is None and self.exit_code == 0 and not self.timed_out


class FnCallBatchRequest(_BytesModel):
    calls: list[DSecFnCallArgs] = Field(min_length=1, max_length=MAX_BATCH_COUNT)


class FnCallBatchResult(_BytesModel):
    results: list[FnCallResult]


# -- Run args by sandbox kind ---------------------------------------------------------------------
# (The node seam's own models, for calls the SDK never makes, are ``dsec.edge.protocol``'s.)


def run_args_of(kind: str, args: dict | DSecContainerRunArgs) -> DSecContainerRunArgs:
    """``args`` as the run-args model of sandbox ``kind`` (a dict is validated against it)."""
    model = RUN_ARGS_BY_KIND.get(kind)
    if model is None:
        raise ValueError(f"unknown sandbox kind {kind!r}: one of {', '.join(RUN_ARGS_BY_KIND)}")
    if isinstance(args, model) and type(args) is model:
        return args
    return model.model_validate(args if isinstance(args, dict) else args.model_dump())


# -- Observability: what a node has counted, and the cluster's figures ------------------------------

# Upper bounds (seconds) of the latency histograms' buckets; the last bucket is everything above.
LATENCY_BOUNDS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                     10.0, 30.0, 60.0)


class LatencyHistogram(_Model):
    """Observations counted per bucket of ``LATENCY_BOUNDS`` (``counts[i]``: above bound i−1 and
    at most bound i; the last one: above the last bound), as Prometheus buckets them."""

    counts: list[int] = Field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS) + 1))
    sum_s: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def plus(self, other: LatencyHistogram) -> LatencyHistogram:
        return LatencyHistogram(counts=[a + b for a, b in zip(self.counts, other.counts)], sum_s=self.sum_s + other.sum_s)

    def minus(self, earlier: LatencyHistogram) -> LatencyHistogram:
        """What was observed since ``earlier`` (a reading of the same counters)."""
        return LatencyHistogram(counts=[max(0, a - b) for a, b in zip(self.counts, earlier.counts)],
                                sum_s=max(0.0, self.sum_s - earlier.sum_s))

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1), interpolated within its bucket as Prometheus'
        ``histogram_quantile`` does; ``None`` with no observations."""
        total = self.count
        if total == 0:
            return None
        rank = q * total
        seen = 0
        for i, n in enumerate(self.counts):
            if n and seen + n >= rank:
                if i == len(LATENCY_BOUNDS):
                    return LATENCY_BOUNDS[-1]
                low = LATENCY_BOUNDS[i - 1] if i else 0.0
                return low + (LATENCY_BOUNDS[i] - low) * max(0.0, rank - seen) / n
            seen += n
        return LATENCY_BOUNDS[-1]


class SandboxCount(_Model):
    """How many of a node's sandboxes are in ``status``, of ``kind``, for ``project``."""

    status: SandboxStatus
    kind: SandboxKind
    project: str
    count: int


class NodeSecurityEvent(_Model):
    """A security event with the sandbox it was seen in (a node's recent ones)."""

    sandbox_id: str
    event: SecurityEvent


class NodeStats(_Model):
    """What a node counted since its edge started (``started_at``), and what it holds now: its
    report (``info``), its sandboxes by state, kind and project, and the host's CPU and memory
    in use. Counters only grow while the edge runs; a restarted edge counts from zero again."""

    info: NodeInfo
    started_at: datetime
    # Sandboxes made, and creates that failed (refusals apart), by kind.
    creates: dict[str, int] = Field(default_factory=dict)
    create_failures: dict[str, int] = Field(default_factory=dict)
    # Seconds from a create's arrival to its sandbox running, and a command's run, by kind.
    create_seconds: dict[str, LatencyHistogram] = Field(default_factory=dict)
    command_seconds: dict[str, LatencyHistogram] = Field(default_factory=dict)
    # Creates refused by admission: "capacity" (no room) or "limit" (a limit out of range).
    admission_refusals: dict[str, int] = Field(default_factory=dict)
    # Creates served from the warm pool, and those that had to make their sandbox.
    pool_hits: int = 0
    pool_misses: int = 0
    fncalls: int = 0
    fncall_failures: int = 0
    fncall_seconds: LatencyHistogram = Field(default_factory=LatencyHistogram)
    pauses: int = 0
    resumes: int = 0
    security_events: dict[str, int] = Field(default_factory=dict)
    recent_security_events: list[NodeSecurityEvent] = Field(default_factory=list)
    sandboxes: list[SandboxCount] = Field(default_factory=list)
    # The host: cores busy over the time since the last report (or since boot), memory in use
    # (MemTotal − MemAvailable).
    cpu_used_cores: float = 0.0
    memory_used_mb: int = 0


class ApiserverStats(_Model):
    """What passed through this apiserver since it started: creates by kind and outcome
    (``ok``; ``refused``: no room or over quota; ``invalid``: a bad request, such as a limit out
    of range or an unknown image; ``error``), their latency as its callers saw it,
    commands, and refusals by reason (``capacity``, ``quota``)."""

    started_at: datetime
    creates: dict[str, dict[str, int]] = Field(default_factory=dict)
    create_seconds: dict[str, LatencyHistogram] = Field(default_factory=dict)
    commands: int = 0
    command_seconds: LatencyHistogram = Field(default_factory=LatencyHistogram)
    refusals: dict[str, int] = Field(default_factory=dict)
    fncalls: int = 0
    batch_sandboxes: int = 0


class ClusterStats(_Model):
    """``GET /v1/stats`` (root only): every reachable node's ``NodeStats``, the nodes that left,
    and this apiserver's own counters."""

    at: datetime
    nodes: list[NodeStats]
    lost_nodes: list[str] = Field(default_factory=list)
    apiserver: ApiserverStats
    # The histograms' bucket bounds (``LATENCY_BOUNDS``), for readers that sum or interpolate them.
    latency_bounds: list[float] = Field(default_factory=lambda: list(LATENCY_BOUNDS))


# -- idempotency keys and job logs --------------------------------------------------------------

# Sent as request headers (the create routes' bodies are the run args themselves).
JOB_HEADER = "x-dsec-job"
KEY_HEADER = "idempotency-key"
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_KEY = re.compile(r"[A-Za-z0-9._:/@+=-]{1,200}")


def check_job_name(name: str) -> str:
    """``ValueError`` naming what is wrong with a job name."""
    if not isinstance(name, str) or not _JOB_NAME.fullmatch(name):
        raise ValueError(f"invalid job name {name!r}: 1 to 128 letters, digits, '.', '_' and '-', "
                         "starting with a letter or digit")
    return name


def check_key(key: str) -> str:
    """``ValueError`` naming what is wrong with an idempotency key."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"invalid idempotency key {key!r}: 1 to 200 letters, digits and ._:/@+=-")
    return key


JobOp = Literal["create", "create_batch", "exec", "write_file", "read_file", "pause", "resume", "set_network_rules",
                "set_ttl", "stop", "clean_copy", "pack_diff", "fork", "pause_sandboxes", "resume_sandboxes",
                "unrecorded"]


class JobEntry(_Model):
    """One call of a job, as its log holds it: ``seq`` orders the job's calls; ``request`` is
    what was asked (the run args and ``kind`` of a create, an ``ExecRequest``, a file write's
    path, mode, size and SHA-256, with its bytes base64 in ``data_b64``, a ``CleanCopyRequest``,
    a ``PackDiffRequest``, a read's path, a ``NetworkRulesRequest``, a ``TTLRequest``, a group's
    ``SandboxGroupRequest`` (``pause_sandboxes``, ``resume_sandboxes``: ``sandbox`` is None); for an
    ``unrecorded`` call, one logged only as made, its method and path in ``call``), ``result``
    what came back (``SandboxInfo``, a list of them for a batch, ``ExecResult``,
    ``CleanCopyResult``, ``PackDiffResult``, ``PauseResult``, ``SandboxGroupResult``, a read's size, SHA-256 and bytes
    base64 in ``data_b64``), or ``error`` (the wire error body's ``error``) when the call failed."""

    seq: int
    at: datetime
    op: JobOp
    sandbox: str | None = None
    key: str | None = None
    request: dict
    result: dict | list | None = None
    error: dict | None = None


class JobInfo(_Model):
    name: str
    project: str
    created_at: datetime
    updated_at: datetime
    entries: int


class JobList(_Model):
    jobs: list[JobInfo]


class JobLog(_Model):
    """``GET /v1/jobs/{job}``: the job and its entries from ``after`` on, in order."""

    job: JobInfo
    entries: list[JobEntry]


# -- desktops ----------------------------------------------------------------------------------

MAX_TYPED_TEXT = 65536  # characters one ``type`` call sends


class DesktopInput(_Model):
    """One input action on a sandbox's desktop. ``action`` and the fields it reads:
    ``move`` (x, y), ``click`` (x, y optional, button, count), ``mouse_down`` / ``mouse_up``
    (x, y optional, button), ``drag`` (x, y to to_x, to_y, button), ``scroll`` (dx, dy in
    wheel clicks, down and right positive; x, y optional), ``type`` (text), ``press`` (keys:
    ``ctrl+s``, ``Return``, ``F5``)."""

    action: Literal["move", "click", "mouse_down", "mouse_up", "drag", "scroll", "type", "press"]
    x: int | None = None
    y: int | None = None
    to_x: int | None = None
    to_y: int | None = None
    button: Literal["left", "middle", "right", "back", "forward"] = "left"
    count: int = Field(1, ge=1, le=10)
    dx: int = Field(0, ge=-100, le=100)
    dy: int = Field(0, ge=-100, le=100)
    text: str | None = Field(None, max_length=MAX_TYPED_TEXT)
    keys: str | None = Field(None, min_length=1, max_length=200)


class DesktopInfo(_Model):
    """A desktop's screen and where its pointer is."""

    width: int
    height: int
    dpi: int
    display: str
    cursor_x: int
    cursor_y: int


class DesktopWindow(_Model):
    id: int
    title: str
    app: str  # its WM_CLASS class ("Mousepad", "firefox-esr")
    x: int
    y: int
    width: int
    height: int
    pid: int | None = None
    focused: bool = False


class DesktopWindowList(_Model):
    windows: list[DesktopWindow]


class DesktopFocusRequest(_Model):
    window: int


class DesktopAccessibilityRequest(_Model):
    """``sandbox.desktop.accessibility_tree(max_chars=…)``: at most this many characters."""

    max_chars: int = Field(100_000, ge=1000, le=2_000_000)


class DesktopAccessibilityTree(_Model):
    """The AT-SPI tree as text: one line per accessible (``[role] "name"``, a text field's
    ``text="…"``, the states that matter in parentheses, ``@x,y WxH`` on the screen), children
    indented two spaces under their parent, applications at the top. ``truncated``: the tree
    was cut at ``max_chars`` (its last line says so); ``count``: the accessibles shown."""

    tree: str
    count: int
    truncated: bool


class DesktopStreamRequest(_Model):
    """``sandbox.desktop.stream_url()``: a live view of the desktop (noVNC in the browser),
    its key valid ``ttl_s`` seconds."""

    ttl_s: float = Field(3600.0, gt=0, le=7 * 86400)


class DesktopStream(_Model):
    """The live view's page: ``path`` under the API's endpoint (it carries the key that opens
    it, made for the caller's project and this sandbox only) and when the key expires."""

    path: str
    expires_at: float


class DesktopLaunchRequest(_Model):
    """Start an application by its desktop entry (``gtk-launch APP [URI]``), or open a file or
    URL with its default application (``xdg-open TARGET``): one of ``app`` and ``open``."""

    app: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._+-]+$")
    uri: str | None = Field(None, max_length=4096)
    open: str | None = Field(None, min_length=1, max_length=4096)
