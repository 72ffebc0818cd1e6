"""The one interface every sandbox backend implements.

Lifecycle of a handle, as the edge drives it::

    create() ──▶ running ──exec/read_file/write_file──▶ running
                    │  pause() ▶ paused ── resume() ▶ running
                    └─ destroy() ▶ gone

- ``create`` returns a handle only once the sandbox can take ``exec``; if it fails it leaves
  nothing behind (no mount, cgroup or process) and raises ``BackendError``.
- ``exec``, ``read_file`` and ``write_file`` need a running sandbox; on a paused one the edge
  resumes first. A command past its timeout is killed (with everything it started) and
  ``CommandTimeout`` is raised. ``exec_stream`` is ``exec`` that also hands each chunk of
  output to ``emit`` as the command writes it, and reads no further until ``emit`` returned
  (backpressure); the result keeps what ``exec``'s would (caps apply to what is kept only).
- ``destroy`` is idempotent: a second call, or a call on a sandbox whose processes died, just
  makes sure everything is released.
- ``recover`` is called once when an edge starts: given the handles it had persisted, it says
  which are still alive (they are adopted as they are); the edge destroys the rest.
- ``pack_diff`` turns a running sandbox's changes into a layer in the store (consistent: the
  sandbox is frozen meanwhile; residue scrubbed) and returns a ``PackedDiff``: its digest, what
  was scrubbed, and how long the sandbox stood frozen for it.
- ``release_unused`` (edge shutdown) frees node-level resources no live sandbox holds.
- ``apply_limits`` changes limits of a live sandbox (the edge uses it to hand out pre-created
  sandboxes).
- ``describe`` is one line for ``dsec info``; ``host_view`` what of its sandboxes the edge's
  security accounting reads on the host (``HostView``, or None); ``warm_up`` (the server starts it in the
  background) prepares what the first create would otherwise wait for; ``close`` drops what
  the backend holds in this process (sandboxes keep running, to be re-adopted).
- ``open_pty`` starts a command on a new terminal of the sandbox's (its controlling terminal,
  ``cols`` x ``rows``) and returns a ``PtyProcess`` once it runs; the edge holds it (see
  ``PtyProcess`` for its lifecycle). A PTY is the edge's, not the sandbox's: it ends when the
  edge goes away, and ``destroy`` ends it with the sandbox.

What a backend can do beyond that it declares in ``capabilities`` (``Capability``); the edge
asks that set and never probes for methods, and ``check_backend`` (run when an edge is made)
refuses a backend that declares an ability without its hook:

- ``WARM_POOL``: sandboxes may be made ahead of demand, without their caller's limits, and
  handed out with ``apply_limits`` (not VMs: their memory is fixed when they boot).
- ``PROTECTED_PATHS``: ``SandboxSpec.protected_paths`` are read-only for every process of the
  sandbox, root included.
- ``CARRY`` (``CleanCopies``): ``check_kept`` says whether paths exist in a running sandbox with
  no link on the way (``InvalidRequest`` naming the one that does not); ``carry(source, target,
  keep)`` freezes ``source`` and replays its changes beneath ``keep`` into ``target``, a sandbox
  just made that has run nothing yet, then thaws it; ``tampered`` lists the system files a
  sandbox's writable layer replaces or adds (see ``dsec.images.carry``), in any state until
  ``destroy``.
- ``KEPT_LAYER`` (``KeptLayers``): ``kept_layer`` turns the paths a guest keeps into one layer
  (a VM's writable layer is in the guest), for clean copies made as a new sandbox on it;
  ``guest_tampered`` asks the guest for the system files its writable layer replaces or adds
  (``tampered``'s answer, for a running or paused sandbox; the edge asks it at stop).
- ``SNAPSHOT`` (``Snapshots``): ``snapshot`` saves a running sandbox's memory and devices.
- ``PIPED_STDIN`` (``PipedStdin``): ``exec_piped`` is ``exec_stream`` whose command reads its
  stdin from an async iterator of bytes, asked for its next chunk only once the last one is in
  the command's pipe (backpressure from the command to the source); an error of the source's
  kills the command and is raised.
- ``WATCHED`` (``Watched``): ``why_gone`` tells without a call into the sandbox whether it
  is gone and why (a VM: its QEMU exited, its agent's channel closed, what its console said
  last), cheap enough for every reaper round.
- ``HOST_PATHS`` (``HostPaths``): ``open_path`` opens a path of a running sandbox from the node
  (every component resolved inside the sandbox, no symlink followed: the paths it is used for
  are writable by the sandbox's user), for I/O that needs no command in the sandbox: FIFOs a
  session's shell holds (``dsec.edge.sessions``), files streamed in and out.
- ``NEW_IDENTITY`` (``Identities``): ``new_identity(handle, hostname, machine_id, seed)`` makes a
  sandbox just made as a fork's child, before anything of the caller's runs in it, someone new:
  ``hostname`` (a container's is its ``SandboxSpec.hostname`` already), ``/etc/machine-id``, and,
  in a guest restored from its parent's memory, ``seed`` mixed into its kernel's random number
  generator and the generator reseeded at once (``BackendError`` where the guest cannot).
- ``PORTS`` (``Ports``): ``connect_port`` is a TCP connection from the node to a port inside
  the sandbox, needing nothing of its image (``dsec.backends.portconn``): ``port_url``, the
  sandbox's host names and their WebSockets go over it.
- ``REBOOT`` (``Reboots``): ``halt`` ends every process of a running or paused sandbox and
  keeps its files (its root filesystem, its cgroup, its user ids; the handle's ``pid`` is 0
  then); ``boot`` starts a halted one afresh over them, as ``create`` started it (its init, a
  new boot id), and sets the handle's ``pid``. ``destroy`` takes a halted sandbox as any other,
  ``recover`` adopts one whose files are there, and ``is_alive`` is False for it.
- ``DESKTOP``: a sandbox can run a desktop (``dsec.edge.desktop``): its commands can start
  Xvfb and keep it running, and ``connect_port`` reaches the desktop agent; no hook of its own,
  but it needs ``PORTS``.

Handles are plain data (``to_json``/``from_json``) so an edge restart can re-adopt them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from libdsec import InvalidRequest
from libdsec.protocol import ExecRequest, ExecResult

from ..resources.cgroups import Limits


# What a streamed command hands on: ("stdout" | "stderr", bytes). The backend reads no more of
# that command's output until it returned (the consumer's pace is the command's).
Emit = Callable[[str, bytes], Awaitable[None]]


@dataclass(frozen=True)
class SandboxSpec:
    """What the edge asks a backend to create (image already resolved to layers)."""

    image: str
    layers: tuple[str, ...]
    env: dict[str, str]
    limits: Limits | None  # set them all before returning; None: none yet (pre-created for a pool)
    hostname: str = "sandbox"
    snapshot: str | None = None  # restore this memory snapshot (backends that take them)
    protected_paths: tuple[str, ...] = ()  # read-only for every process inside (protects_paths)
    # The image's setuid: its processes may gain privileges through setuid programs (sudo), up
    # to the sandbox's root. Only the container backend leaves no_new_privs off for it.
    setuid: bool = False


@dataclass
class Handle:
    cid: str  # backend-level id (the crun container id)
    image: str
    layers: tuple[str, ...]
    pid: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        # By hand: dataclasses.asdict deep-copies field by field, a third of persisting a record.
        return {"cid": self.cid, "image": self.image, "layers": list(self.layers), "pid": self.pid,
                "env": dict(self.env)}

    @classmethod
    def from_json(cls, data: dict) -> Handle:
        return cls(
            cid=data["cid"], image=data["image"], layers=tuple(data["layers"]),
            pid=int(data.get("pid", 0)), env=dict(data.get("env", {})),
        )


def numeric_user(user: str) -> tuple[int, int] | None:
    """``root``, ``UID`` or ``UID:GID`` as ids; None when a name must be looked up."""
    if user == "root":
        return 0, 0
    name, _, group = user.partition(":")
    if name.isdigit() and (not group or group.isdigit()):
        return int(name), int(group) if group else int(name)
    return None


def user_from_passwd(user: str, passwd: str) -> tuple[int, int]:
    """``NAME`` or ``NAME:GID`` looked up in the text of an image's /etc/passwd."""
    name, _, group = user.partition(":")
    for line in passwd.splitlines():
        fields = line.split(":")
        if len(fields) >= 4 and fields[0] == name:
            return int(fields[2]), int(group) if group.isdigit() else int(fields[3])
    raise InvalidRequest(f"unknown user {user!r}: not in the image's /etc/passwd")


@dataclass(frozen=True)
class ExecContext:
    """Who runs a command and where: from the sandbox's run args, overridable per call."""

    uid: int
    gid: int
    workdir: str
    env: dict[str, str]


@dataclass(frozen=True)
class HostView:
    """What the edge's security accounting reads of a backend's sandboxes on the host
    (``SandboxBackend.host_view``: the container backend's; VMs and the fake have none): the
    parent of their cgroups (OOM and pids events), a directory a sandbox (its disk use), and the
    uid ranges it hands out, if any (whose sandbox a kernel message names); and how its layers
    are attached (``"file"``: file-backed EROFS, or ``"loop"``), for the node's report."""

    cgroup_parent: str
    sandboxes_dir: Path
    id_ranges: Any | None
    layer_attach: str = "file"


@dataclass(frozen=True)
class PackedDiff:
    """What ``SandboxBackend.pack_diff`` made: the layer's ``digest``, the paths ``scrubbed``
    (left out as residue), and ``frozen_s``, how long the sandbox stood frozen for it (a fork
    reports it: a backend that lets the sandbox run again once its layer is read, before the
    layer's sums are taken and it is placed, says so here)."""

    digest: str
    scrubbed: list[str]
    frozen_s: float


class Capability(str, Enum):
    """What a backend can do beyond ``SandboxBackend`` (see the module docstring)."""

    WARM_POOL = "warm_pool"
    PROTECTED_PATHS = "protected_paths"
    CARRY = "carry"
    KEPT_LAYER = "kept_layer"
    SNAPSHOT = "snapshot"
    HOST_PATHS = "host_paths"
    PIPED_STDIN = "piped_stdin"
    WATCHED = "watched"
    PORTS = "ports"
    NEW_IDENTITY = "new_identity"
    REBOOT = "reboot"
    DESKTOP = "desktop"


class PtyProcess(Protocol):
    """A command on a terminal (``SandboxBackend.open_pty``).

    ``read`` hands on what the command writes to the terminal as it comes (one reader at a
    time; nothing more is read from the terminal until it is called again: the command writes
    at its reader's pace) and returns ``b""`` once the command ended and all of it was read.
    ``write`` types at the terminal, ``resize`` changes its size (the command gets SIGWINCH):
    both raise ``SandboxStateError`` once the command ended. ``wait`` returns its exit code
    (128 + N for signal N). ``close`` kills what the command started and releases the
    terminal; a second ``close`` does nothing."""

    async def read(self) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def resize(self, cols: int, rows: int) -> None: ...

    async def wait(self) -> int: ...

    async def close(self) -> None: ...


class SandboxBackend(Protocol):
    kind: str
    capabilities: frozenset[Capability]

    def describe(self) -> str: ...

    def host_view(self) -> HostView | None: ...

    async def warm_up(self) -> None: ...

    async def close(self) -> None: ...

    async def create(self, cid: str, spec: SandboxSpec) -> Handle: ...

    async def apply_limits(self, handle: Handle, limits: Limits) -> None: ...

    async def exec(self, handle: Handle, request: ExecRequest, ctx: ExecContext) -> ExecResult: ...

    async def exec_stream(self, handle: Handle, request: ExecRequest, ctx: ExecContext, emit: Emit) -> ExecResult: ...

    async def open_pty(self, handle: Handle, command: str, ctx: ExecContext, cols: int, rows: int) -> PtyProcess: ...

    async def read_file(self, handle: Handle, path: str, max_bytes: int) -> bytes: ...

    async def write_file(self, handle: Handle, path: str, data: bytes, mode: int, uid: int, gid: int) -> None: ...

    async def make_dir(self, handle: Handle, path: str, uid: int, gid: int) -> None: ...

    async def resolve_user(self, handle: Handle, user: str) -> tuple[int, int]: ...

    async def pack_diff(self, handle: Handle, once: bool = False) -> PackedDiff: ...

    async def pause(self, handle: Handle) -> None: ...

    async def resume(self, handle: Handle) -> None: ...

    async def is_alive(self, handle: Handle) -> bool: ...

    async def destroy(self, handle: Handle) -> None: ...

    async def recover(self, handles: list[Handle]) -> list[Handle]: ...

    def release_unused(self) -> None: ...

    def memory_usage(self, handle: Handle) -> int | None: ...


@runtime_checkable
class CleanCopies(Protocol):
    """``Capability.CARRY``: clean copies replayed from the host."""

    async def check_kept(self, handle: Handle, keep: list[str]) -> None: ...

    async def carry(self, source: Handle, target: Handle, keep: list[str]) -> Any: ...

    def tampered(self, handle: Handle) -> list[str]: ...


@runtime_checkable
class KeptLayers(Protocol):
    """``Capability.KEPT_LAYER``: the kept paths of a guest as one layer (digest, seconds, tampered)."""

    async def kept_layer(self, handle: Handle, keep: list[str]) -> Any: ...

    async def guest_tampered(self, handle: Handle, timeout: float) -> list[str]: ...


@runtime_checkable
class Snapshots(Protocol):
    """``Capability.SNAPSHOT``: memory snapshots of running sandboxes."""

    async def snapshot(self, handle: Handle) -> dict: ...


@runtime_checkable
class HostPaths(Protocol):
    """``Capability.HOST_PATHS``: ``open_path(handle, path, flags, mode)`` is an fd of the
    absolute ``path`` in the running sandbox (``os.open`` flags, always close-on-exec and
    without following a symlink anywhere on the way: ``OSError`` ELOOP for one), or
    ``SandboxStateError`` if its processes are gone. A file it creates belongs to the
    sandbox's root. The fd is the caller's to close."""

    def open_path(self, handle: Handle, path: str, flags: int, mode: int = 0o644) -> int: ...


@runtime_checkable
class PipedStdin(Protocol):
    """``Capability.PIPED_STDIN``: a command fed a stream as its stdin."""

    async def exec_piped(self, handle: Handle, request: ExecRequest, ctx: ExecContext,
                         stdin: AsyncIterator[bytes] | None, emit: Emit) -> ExecResult: ...


@runtime_checkable
class Watched(Protocol):
    """``Capability.WATCHED``: ``why_gone(handle)`` is ``None`` while the sandbox lives, else
    why it went (from what the host knows, with no call into it)."""

    def why_gone(self, handle: Handle) -> str | None: ...


@runtime_checkable
class Ports(Protocol):
    """``Capability.PORTS``: ``connect_port(handle, port)`` is a TCP connection to
    127.0.0.1:``port`` inside the running sandbox (its own network namespace, or the VM's), as
    an asyncio (reader, writer) pair carrying bytes both ways; the writer's ``write_eof`` half-
    closes it. ``PortUnreachable`` when nothing listens there, ``SandboxStateError`` if the
    sandbox's processes are gone. The pair is the caller's to close."""

    async def connect_port(self, handle: Handle, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]: ...


@runtime_checkable
class Reboots(Protocol):
    """``Capability.REBOOT``: a sandbox halted with its files kept, and booted again over them
    (see the module)."""

    async def halt(self, handle: Handle) -> None: ...

    async def boot(self, handle: Handle) -> None: ...


@runtime_checkable
class Identities(Protocol):
    """``Capability.NEW_IDENTITY``: a fork's child made someone new (see the module)."""

    async def new_identity(self, handle: Handle, hostname: str, machine_id: str, seed: bytes) -> None: ...


_HOOKS: dict[Capability, type] = {Capability.CARRY: CleanCopies, Capability.KEPT_LAYER: KeptLayers,
                                  Capability.SNAPSHOT: Snapshots, Capability.HOST_PATHS: HostPaths,
                                  Capability.PIPED_STDIN: PipedStdin, Capability.WATCHED: Watched,
                                  Capability.PORTS: Ports, Capability.NEW_IDENTITY: Identities,
                                  Capability.REBOOT: Reboots}


def check_backend(backend: SandboxBackend) -> None:
    """``TypeError`` if ``backend`` declares an ability without the hook it needs, or lacks a
    method every backend has."""
    for name in ("describe", "host_view", "warm_up", "close"):
        if not callable(getattr(backend, name, None)):
            raise TypeError(f"{type(backend).__name__} has no {name}(): every backend has one (dsec.backends.base)")
    if Capability.DESKTOP in backend.capabilities and Capability.PORTS not in backend.capabilities:
        raise TypeError(f"{type(backend).__name__} declares desktop but not ports: the node reaches a desktop's "
                        f"agent by connect_port")
    for capability in backend.capabilities:
        hook = _HOOKS.get(capability)
        if hook is not None and not isinstance(backend, hook):
            raise TypeError(f"{type(backend).__name__} declares {capability.value} but does not implement "
                            f"{hook.__name__}")
