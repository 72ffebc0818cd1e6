"""The apiserver → edge seam: typed calls, and sandbox ids that name their edge.

The apiserver holds ``EdgeAPI`` objects by node name and routes a call to the edge named in the
sandbox id (``<node>-<hex>``), so it needs no table of sandboxes. ``Edge`` (embedded) implements
it in-process; a remote edge (a later Ray node) implements the same methods over the wire.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator
from typing import Protocol

from libdsec import InvalidRequest
from libdsec.protocol import (
    DSecContainerRunArgs,
    ExecRequest,
    ExecResult,
    NodeInfo,
    PackDiffResult,
    PauseResult,
    SandboxInfo,
)
from libdsec.protocol import DSecFnCallArgs, FnCallResult

NODE_NAME = re.compile(r"^[a-z0-9]{1,32}\Z")
SANDBOX_ID = re.compile(r"^([a-z0-9]{1,32})-([0-9a-f]{16})\Z")


def new_sandbox_id(node: str) -> str:
    return f"{node}-{secrets.token_hex(8)}"


def node_of(sandbox_id: str) -> str:
    m = SANDBOX_ID.match(sandbox_id)
    if not m:
        raise InvalidRequest(f"malformed sandbox id {sandbox_id!r}: expected <node>-<16 hex digits>")
    return m.group(1)


class EdgeAPI(Protocol):
    node: str

    async def create(self, args: DSecContainerRunArgs, project: str = "root") -> SandboxInfo: ...

    def create_batch(
        self, args: DSecContainerRunArgs, count: int, project: str = "root"
    ) -> AsyncIterator[tuple[int, SandboxInfo]]: ...

    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    async def list(self) -> list[SandboxInfo]: ...

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult: ...

    async def read_file(self, sandbox_id: str, path: str) -> bytes: ...

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None: ...

    async def stop(self, sandbox_id: str, reason: str = "stopped by request") -> SandboxInfo: ...

    async def pause(self, sandbox_id: str) -> PauseResult: ...

    async def resume(self, sandbox_id: str) -> SandboxInfo: ...

    async def pack_diff(self, sandbox_id: str, name: str | None = None, role: str = "snapshot") -> PackDiffResult: ...

    async def security_events(self, sandbox_id: str) -> list: ...

    async def set_network_rules(self, sandbox_id: str, rules: dict) -> None: ...

    def in_use(self) -> tuple[frozenset[str], frozenset[str]]: ...

    async def node_info(self) -> NodeInfo: ...

    async def fncall(self, args: DSecFnCallArgs) -> FnCallResult: ...

    async def fncall_many(self, calls: list[DSecFnCallArgs]) -> list[FnCallResult]: ...
