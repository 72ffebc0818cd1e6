"""The node's own calls: ``NodeCalls``, the part of ``dsec.edge.edge.Edge`` that answers for the
node rather than one sandbox: what it has and holds (``node_info``, ``layer_use``), what it
counted (``node_stats``), its layer store (images, their removal, layer GC, Dockerfile builds
through ``build.ImageBuilder``), and stateless function calls in the fncall warm pool
(``dsec.fncall``), which keep no record and have no sandbox id.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from libdsec import ImageNotFound, InvalidRequest, SandboxStateError
from libdsec.protocol import (
    BuildImageRequest,
    DSecFnCallArgs,
    ExecEvent,
    FnCallResult,
    ImageInfo,
    NodeInfo,
    NodeStats,
    SandboxKind,
)

from ..backends.container.criu import memory_fork_status
from ..images.index import page_limit
from ..images.store import ROLES
from ..isolation import apparmor
from ..resources import cgroups
from .fork import fork_kind
from .protocol import LayerUse
from .table import SandboxTable

if TYPE_CHECKING:
    from ..fncall.pool import FnCallPool
    from .build import ImageBuilder


class NodeCalls(SandboxTable):
    """The node's own calls (see the module)."""

    # Made by Edge.__init__.
    fncalls: FnCallPool | None
    builder: ImageBuilder

    # -- the node: what it has and holds, what it counted -------------------------------------

    async def node_info(self) -> NodeInfo:
        return NodeInfo(
            node=self.node, cgroup_version=cgroups.version(),
            runtime="; ".join([b.describe() for b in self.backends.values()]
                              + (["fncall"] if self.fncalls is not None else [])),
            sandboxes=len(self._records), memory_total_mb=self.admission.memory_total_mb,
            cpu_cores=self.admission.cpu_cores,
            layer_attach=next((v.layer_attach for b in self.backends.values() if (v := b.host_view()) is not None),
                              "file"),
            apparmor=apparmor.status(),
            forks={kind.value: fork_kind(b) for kind, b in self.backends.items()},
            container_memory_fork=(await asyncio.to_thread(memory_fork_status)
                                   if SandboxKind.container in self.backends else "unknown"),
            **self.admission.commitments(self._records.values()),
        )

    async def node_stats(self) -> NodeStats:
        return self.stats.report(await self.node_info(), self._records.values(), self.security.events, self.warm_pool)

    async def layer_use(self) -> LayerUse:
        """The image refs and layer digests this node's sandboxes hold, pooled ones included."""
        recs = list(self._records.values())
        refs = {r.image.name for r in recs}
        layers = {d for r in recs for d in r.image.layers}
        layers |= self.warm_pool.layers()
        return LayerUse(images=sorted(refs), layers=sorted(layers))

    # -- the layer store, as this node sees it ------------------------------------------------

    async def list_images(self, limit: str | None = None, after: str | None = None, prefix: str | None = None,
                          role: str | None = None) -> list[ImageInfo]:
        if role is not None and role not in ROLES:
            raise InvalidRequest(f"bad role {role!r}: one of {', '.join(ROLES)}")
        await self.store_health.check()
        names = self.store.index.names(limit=page_limit(limit), after=after, prefix=prefix, role=role)
        infos = []
        for name in names:
            try:
                infos.append(self.store.describe(self.store.get_image(name)))
            except (ImageNotFound, FileNotFoundError):
                continue  # removed since the index was read
        return infos

    async def inspect_image(self, ref: str) -> ImageInfo:
        await self.store_health.check()
        return self.store.describe(self.store.resolve(ref))

    async def remove_image(self, name: str, in_use: frozenset[str]) -> None:
        await self.store_health.check()
        self._check_snapshot_image(name)  # (dsec.edge.snapshots)
        self.store.remove_image(name, in_use=frozenset(in_use))

    async def gc_layers(self, in_use: frozenset[str]) -> list[str]:
        await self.store_health.check()
        return self.store.gc(in_use=frozenset(in_use))

    def build_image(self, build: BuildImageRequest, project: str = "root") -> AsyncIterator[ExecEvent]:
        return self.builder.build(build, project)

    # -- fncall: stateless calls in the warm pool (no record, no sandbox id) ------------------

    def _fncall_pool(self) -> FnCallPool:
        if self.fncalls is None:
            raise InvalidRequest(f"node {self.node} does not serve fncall")
        if self._closed:
            raise SandboxStateError(f"edge {self.node} is shutting down")
        return self.fncalls

    async def fncall(self, args: DSecFnCallArgs) -> FnCallResult:
        result = await self._fncall_pool().call(args)
        self.stats.fncall(result.duration_s, not result.ok)
        return result

    async def fncall_many(self, calls: list[DSecFnCallArgs]) -> list[FnCallResult]:
        results = await self._fncall_pool().call_many(calls)
        for result in results:
            self.stats.fncall(result.duration_s, not result.ok)
        return results
