"""The apiserver → node seam: every call the apiserver makes on a node, and sandbox ids that
name their node.

The apiserver holds one ``EdgeAPI`` per node and routes a call to the node named in the sandbox
id (``<node>-<hex>``), so it needs no table of sandboxes. It reaches a node only through this
interface: never the node's layer store, cgroups or records. Two implementations:

- ``dsec.edge.edge.Edge``: the edge itself, in-process (the embedded ``dsec serve``);
- ``dsec.edge.remote.RemoteEdge``: an edge in another process or on another machine, reached
  over HTTP (``dsec.edge.server`` serves it there).

Both pass one conformance suite (``tests/conformance/test_node_seam.py``). Requests and answers
are the models of ``libdsec.protocol`` (one per operation); errors are the SDK's error tree, and
cross the wire as its codes. A node that cannot be reached makes a sandbox call fail with
``SandboxLost`` (and a create fail with ``NodeUnreachable``, on which placement tries another).

Lifecycle: a node is usable once its owner started it (``Edge.start()``; a ``RemoteEdge`` once
its server answers); ``close()`` on either ends this side of it, and a second ``close()`` does
nothing.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator
from typing import Protocol

from libdsec import InvalidRequest, SandboxLost
from libdsec.protocol import (
    DSecContainerRunArgs,
    DSecFnCallArgs,
    ExecRequest,
    ExecResult,
    FnCallResult,
    ImageInfo,
    LayerUse,
    NodeInfo,
    NodeStats,
    PackDiffResult,
    PauseResult,
    SandboxInfo,
    SecurityEvent,
    SnapshotInfo,
)

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
    async def create(self, args: DSecContainerRunArgs, kind: str = "container",
                     project: str = "root") -> SandboxInfo: ...

    def create_batch(
        self, args: DSecContainerRunArgs, count: int, kind: str = "container", project: str = "root"
    ) -> AsyncIterator[tuple[int, SandboxInfo]]:
        """Yields (index, info) as each comes up; all or none (``dsec.batch``)."""
        ...

    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    async def list(self) -> list[SandboxInfo]: ...

    async def stop(self, sandbox_id: str, reason: str = "stopped by request") -> SandboxInfo: ...

    async def pause(self, sandbox_id: str) -> PauseResult: ...

    async def resume(self, sandbox_id: str) -> SandboxInfo: ...

    async def snapshot(self, sandbox_id: str) -> SnapshotInfo: ...

    async def pack_diff(self, sandbox_id: str, name: str | None = None, role: str = "snapshot") -> PackDiffResult: ...

    # -- inside a sandbox --------------------------------------------------------------------
    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult: ...

    async def read_file(self, sandbox_id: str, path: str) -> bytes: ...

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None: ...

    async def security_events(self, sandbox_id: str) -> list[SecurityEvent]: ...

    async def set_network_rules(self, sandbox_id: str, rules: dict) -> None: ...

    # -- the node ----------------------------------------------------------------------------
    async def node_info(self) -> NodeInfo: ...

    async def node_stats(self) -> NodeStats:
        """What the node counted since its edge started, and holds now (``dsec.edge.stats``)."""
        ...

    async def layer_use(self) -> LayerUse: ...

    # The layer store as this node sees it (one store may be shared by every node).
    async def list_images(self) -> list[ImageInfo]: ...

    async def inspect_image(self, ref: str) -> ImageInfo: ...

    async def remove_image(self, name: str, in_use: frozenset[str]) -> None: ...

    async def gc_layers(self, in_use: frozenset[str]) -> list[str]: ...

    # -- stateless calls (FnCall) ------------------------------------------------------------
    async def fncall(self, args: DSecFnCallArgs) -> FnCallResult: ...

    async def fncall_many(self, calls: list[DSecFnCallArgs]) -> list[FnCallResult]: ...

    async def close(self) -> None: ...
