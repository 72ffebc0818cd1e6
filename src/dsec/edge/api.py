"""The apiserver → node seam: every call the apiserver makes on a node, and sandbox ids that
name their node.

The apiserver holds one ``EdgeAPI`` per node and routes a call to the node named in the sandbox
id (``<node>-<hex>``), so it needs no table of sandboxes. It reaches a node only through this
interface: never the node's layer store, cgroups or records. Two implementations:

- ``dsec.edge.edge.Edge``: the edge itself, in-process (the embedded ``dsec serve``);
- ``dsec.edge.remote.RemoteEdge``: an edge in another process or on another machine, reached
  over HTTP (``dsec.edge.server`` serves it there).

Both pass one conformance suite (``tests/conformance/test_node_seam.py``). Each operation is
declared once in ``dsec.edge.ops`` (its path, models, shapes and timeout), from which the
server's routes and ``RemoteEdge``'s methods are made; its arguments here are named as its path
parameters and its request model's fields. Requests and answers are the models of
``libdsec.protocol`` (one per operation) or, for calls only nodes take, ``dsec.edge.protocol``;
errors are the SDK's error tree, and cross the wire as its codes. A node that cannot be reached makes a sandbox call fail with
``SandboxLost`` (and a create fail with ``NodeUnreachable``, on which placement tries another).

Lifecycle: a node is usable once its owner started it (``Edge.start()``; a ``RemoteEdge`` once
its server answers); ``close()`` on either ends this side of it, and a second ``close()`` does
nothing.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import AsyncIterator
from typing import Protocol

from libdsec import InvalidRequest, SandboxLost
from libdsec.protocol import (
    BuildImageRequest,
    CleanCopyResult,
    ForkResult,
    DSecContainerRunArgs,
    DSecFnCallArgs,
    DesktopAccessibilityTree,
    DesktopInfo,
    DesktopInput,
    DesktopLaunchRequest,
    DesktopWindow,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    FnCallResult,
    ImageInfo,
    NodeInfo,
    NodeStats,
    PackDiffResult,
    OpenPtyRequest,
    OpenWatchRequest,
    OpenSessionRequest,
    PauseMode,
    PauseResult,
    ProcessInfo,
    ProcessStreamRequest,
    PtyInfo,
    SandboxInfo,
    SandboxKind,
    SecurityEvent,
    SessionInfo,
    Snapshot,
    StartProcessRequest,
    WatchEvents,
    WatchInfo,
)

from .protocol import LayerUse

NODE_NAME = re.compile(r"^[a-z0-9]{1,32}\Z")
SANDBOX_ID = re.compile(r"^([a-z0-9]{1,32})-([0-9a-f]{16})\Z")


def new_sandbox_id(node: str) -> str:
    return f"{node}-{secrets.token_hex(8)}"


def node_of(sandbox_id: str) -> str:
    m = SANDBOX_ID.match(sandbox_id)
    if not m:
        raise InvalidRequest(f"malformed sandbox id {sandbox_id!r}: expected <node>-<16 hex digits>")
    return m.group(1)


class NodeUnreachable(SandboxLost):
    """The node did not answer (refused, reset, timed out, or answered garbage). For a sandbox
    call this is the caller's ``SandboxLost``; a create that meets it goes to another node."""


class EdgeAPI(Protocol):
    """One node, as the apiserver sees it."""

    node: str

    # -- sandboxes ---------------------------------------------------------------------------
    async def create(self, args: DSecContainerRunArgs, kind: SandboxKind = SandboxKind.container,
                     project: str = "root") -> SandboxInfo:
        """A sandbox of ``kind`` (the enum; its string, ``"microvm"``, names it as well)."""
        ...

    def create_batch(
        self, args: DSecContainerRunArgs, count: int, kind: SandboxKind = SandboxKind.container,
        project: str = "root", batch: str | None = None,
    ) -> AsyncIterator[tuple[int, SandboxInfo]]:
        """Yields (index, info) as each comes up; all or none (``dsec.batch``). With ``batch``
        (an id the caller chose) the sandboxes are held for that batch until
        ``commit_batch(batch)``: ones never committed — the caller went away, or the node
        restarted — are stopped, ``batch_commit_s`` after the stream's end at the latest."""
        ...

    async def commit_batch(self, batch: str) -> None:
        """The batch is whole: its sandboxes here are the caller's for good. ``SandboxLost``
        when they are gone (the node restarted, or the wait for the commit ran out)."""
        ...

    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    async def list(self) -> list[SandboxInfo]: ...

    async def stop(self, sandbox_id: str, reason: str = "stopped by request") -> SandboxInfo: ...

    async def pause(self, sandbox_id: str, mode: PauseMode = "full") -> PauseResult: ...

    async def resume(self, sandbox_id: str) -> SandboxInfo: ...

    async def snapshot(self, sandbox_id: str, mode: str | None = None, name: str | None = None) -> Snapshot:
        """Keep the sandbox's state as a named snapshot (``dsec.edge.snapshots``); it runs on."""
        ...

    async def pack_diff(self, sandbox_id: str, name: str | None = None, role: str = "snapshot") -> PackDiffResult: ...

    async def clean_copy(self, sandbox_id: str, keep: list[str]) -> CleanCopyResult:
        """A new sandbox on the same node (the source's project and run args) from the source's
        image with only its changes beneath ``keep``."""
        ...

    async def fork(self, sandbox_id: str, count: int = 1, all_or_none: bool = True,
                   ttl_running_stop: float | None = None) -> ForkResult:
        """``count`` new running sandboxes on the same node (the parent's project and run args),
        each someone new (its own id, hostname, machine id, address; a VM's random number
        generator reseeded) with the parent's memory (where the kind forks it) or filesystem.
        The parent, frozen meanwhile, runs on untouched. All or none unless ``all_or_none`` is
        false (then one entry per child, a sandbox or its error)."""
        ...

    # -- inside a sandbox --------------------------------------------------------------------
    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult: ...

    def exec_stream(self, sandbox_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        """``started`` (the node took the command; errors before it are raised), then
        ``stdout``/``stderr`` chunks as written, then ``exit`` or ``error`` (errors after the
        start come as that event). Closing the iterator early kills the command. The consumer's
        pace is the command's: nothing is buffered for a slow one (``dsec.edge.stream``)."""
        ...

    # Background processes (``dsec.edge.processes``): ``ProcessNotFound`` for a pid DSec did
    # not start there; ``SandboxStateError`` for stdin or a signal to one that ended.
    async def start_process(self, sandbox_id: str, request: StartProcessRequest) -> ProcessInfo: ...

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]: ...

    async def get_process(self, sandbox_id: str, pid: int) -> ProcessInfo: ...

    async def signal_process(self, sandbox_id: str, pid: int, signal: int) -> None: ...

    async def process_stdin(self, sandbox_id: str, pid: int, data: str, close: bool) -> None: ...

    async def wait_process(self, sandbox_id: str, pid: int, timeout: float) -> ProcessInfo: ...

    def stream_process(self, sandbox_id: str, pid: int, request: ProcessStreamRequest) -> AsyncIterator[ExecEvent]:
        """As ``exec_stream``: ``started``, output chunks, then ``exit`` (its code only)."""
        ...

    def start_process_stream(self, sandbox_id: str, request: StartProcessRequest) -> AsyncIterator[ExecEvent]:
        """``start_process`` then ``stream_process`` from its start, in one call: ``started``
        carries the pid (its ``data``). Closing the iterator ends the following, not the process."""
        ...

    # Sessions: a shell whose state persists (``SessionClosed`` once it ended; ``ProcessNotFound``
    # for an id that was never one). A command past its timeout is interrupted as Ctrl-C would.
    async def open_session(self, sandbox_id: str, request: OpenSessionRequest) -> SessionInfo: ...

    async def session_exec(self, sandbox_id: str, session: int, request: ExecRequest) -> ExecResult: ...

    def session_exec_stream(self, sandbox_id: str, session: int, request: ExecRequest) -> AsyncIterator[ExecEvent]: ...

    async def interrupt_session(self, sandbox_id: str, session: int) -> None: ...

    async def close_session(self, sandbox_id: str, session: int) -> None: ...

    # PTYs (``dsec.edge.pty``): a command on a terminal, held by the node's edge (it ends with
    # it). ``SessionClosed`` for an id that is not open (closed, ended, or the edge restarted).
    async def open_pty(self, sandbox_id: str, request: OpenPtyRequest) -> PtyInfo: ...

    async def pty_input(self, sandbox_id: str, pty: int, data: bytes) -> None: ...

    async def resize_pty(self, sandbox_id: str, pty: int, cols: int, rows: int) -> None: ...

    def pty_stream(self, sandbox_id: str, pty: int, encoding: str = "utf-8") -> AsyncIterator[ExecEvent]:
        """``started``, then ``stdout`` chunks as the command writes them (``encoding``: text,
        or base64 of the exact bytes), then ``exit``; one stream at a time. Leaving it early
        leaves the PTY open."""
        ...

    async def close_pty(self, sandbox_id: str, pty: int) -> None: ...

    # Directory watches (``dsec.edge.watches``): inotify from the node, for sandboxes whose
    # files the node reaches (containers); ``SessionClosed`` for a watch that is not open.
    async def open_watch(self, sandbox_id: str, request: OpenWatchRequest) -> WatchInfo: ...

    async def watch_events(self, sandbox_id: str, watch: int, wait: float = 0.0) -> WatchEvents:
        """The events since the last call, waiting up to ``wait`` seconds for a first one."""
        ...

    async def close_watch(self, sandbox_id: str, watch: int) -> None: ...

    # A file's extended attributes in one ``user.`` namespace (``dsec.edge.xattrs``), from the
    # node, for sandboxes whose files the node reaches (containers).
    async def get_xattrs(self, sandbox_id: str, paths: list[str], prefix: str) -> list[dict[str, str]]: ...

    async def set_xattrs(self, sandbox_id: str, path: str, prefix: str, values: dict[str, str]) -> None: ...

    async def read_file(self, sandbox_id: str, path: str) -> bytes: ...

    # -- a sandbox's desktop (made with desktop=DesktopSpec) --------------------------------------

    async def desktop_screenshot(self, sandbox_id: str, format: str = "png") -> bytes: ...

    async def desktop_info(self, sandbox_id: str) -> DesktopInfo: ...

    async def desktop_input(self, sandbox_id: str, request: DesktopInput) -> DesktopInfo: ...

    async def desktop_windows(self, sandbox_id: str) -> list[DesktopWindow]: ...

    async def desktop_focus(self, sandbox_id: str, window: int) -> None: ...

    async def desktop_launch(self, sandbox_id: str, request: DesktopLaunchRequest) -> ProcessInfo: ...

    async def desktop_stream(self, sandbox_id: str) -> None: ...

    async def desktop_accessibility_tree(self, sandbox_id: str, max_chars: int = 100_000) -> DesktopAccessibilityTree: ...

    async def connect_port(self, sandbox_id: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A TCP connection to 127.0.0.1:``port`` inside the sandbox, as asyncio streams that
        carry bytes both ways until either side closes (``write_eof`` half-closes); the pair is
        the caller's to close. ``PortUnreachable`` when nothing listens there, ``InvalidRequest``
        for a port outside 1-65535. A paused sandbox is resumed first, as for a command."""
        ...

    # File trees (``dsec.edge.files``): as the sandbox's user; ``SandboxFileNotFound`` for a
    # missing path, ``InvalidRequest`` naming what is wrong with a path or a tar member.
    async def list_dir(self, sandbox_id: str, path: str) -> list[FileEntry]: ...

    async def stat_path(self, sandbox_id: str, path: str) -> FileEntry: ...

    async def remove_path(self, sandbox_id: str, path: str, recursive: bool) -> None: ...

    async def make_dir(self, sandbox_id: str, path: str) -> None: ...

    async def rename_path(self, sandbox_id: str, src: str, dst: str) -> None: ...

    async def upload_tree(self, sandbox_id: str, path: str, data: bytes | AsyncIterator[bytes]) -> None:
        """Unpack a tar (whole, or as its chunks: read only as the sandbox's ``tar x`` takes
        them) at ``path``; each member is checked before it is passed on."""
        ...

    def download_tree(self, sandbox_id: str, path: str) -> AsyncIterator[ExecEvent]:
        """``started``, then the tar as base64 text in ``stdout`` events, then ``exit``."""
        ...

    def download_tree_tar(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """The tar of the tree at ``path``, its bytes as ``tar c`` writes them (at the consumer's
        pace); errors before the first chunk are raised from it, a failure later breaks off."""
        ...

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None: ...

    def read_file_stream(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """The file's bytes at the consumer's pace, no size limit (errors before the first
        chunk raised from it; a failure later breaks off)."""
        ...

    async def write_file_stream(self, sandbox_id: str, path: str, data: bytes | AsyncIterator[bytes], mode: int) -> None:
        """The file written from its chunks as they come (no size limit where the backend feeds
        a stream, ``max_file_bytes`` where it does not)."""
        ...

    async def security_events(self, sandbox_id: str) -> list[SecurityEvent]: ...

    async def set_network_rules(self, sandbox_id: str, network_rules: dict) -> None: ...

    async def set_ttl(self, sandbox_id: str, ttl_running_stop: float) -> SandboxInfo:
        """A new idle TTL, counted from now (the call is the sandbox's latest)."""
        ...

    # -- the node ----------------------------------------------------------------------------
    async def node_info(self) -> NodeInfo: ...

    async def node_stats(self) -> NodeStats:
        """What the node counted since its edge started, and holds now (``dsec.edge.stats``)."""
        ...

    async def layer_use(self) -> LayerUse: ...

    # The layer store as this node sees it (one store may be shared by every node).
    async def list_images(self, limit: str | None = None, after: str | None = None, prefix: str | None = None,
                          role: str | None = None) -> list[ImageInfo]:
        """Images in name order: at most ``limit`` (a number; None: all), after the name
        ``after``, starting with ``prefix``, whose top layer has ``role``. A full page's next
        one starts after its last name."""
        ...

    async def inspect_image(self, ref: str) -> ImageInfo: ...

    async def remove_image(self, name: str, in_use: frozenset[str]) -> None: ...

    async def gc_layers(self, in_use: frozenset[str]) -> list[str]: ...

    # Snapshots, kept in the layer store (any node finds them; a full one's memory is on its node).
    async def list_snapshots(self) -> list[Snapshot]: ...

    async def get_snapshot(self, ref: str) -> Snapshot: ...

    async def remove_snapshot(self, ref: str, users: list[str]) -> Snapshot:
        """Remove it, unless sandboxes started from it run (``users``: those on other nodes)."""
        ...

    def build_image(self, build: BuildImageRequest, project: str = "root") -> AsyncIterator[ExecEvent]:
        """An image from a Dockerfile (``dsec.edge.build``): ``started``, the build's log as
        ``stdout`` events, then ``exit`` (its ``BuildResult`` as JSON in ``result.stdout``) or
        ``error``. A Dockerfile or context it cannot take raises before ``started``."""
        ...

    # -- stateless calls (FnCall) ------------------------------------------------------------
    async def fncall(self, args: DSecFnCallArgs) -> FnCallResult: ...

    async def fncall_many(self, calls: list[DSecFnCallArgs]) -> list[FnCallResult]: ...

    async def close(self) -> None: ...
