"""Node providers: where the apiserver's nodes come from, and how it learns that one joined or
left.

    provider.start(cluster)   begin: nodes that join are added (``Cluster.add_edge``), nodes that
                              leave are marked lost (``Cluster.mark_lost``); returns once the
                              nodes there at start are known (or raises, naming the problem)
    provider.close()          stop following; close this side of every node (a second call does
                              nothing). Nodes themselves keep running: their sandboxes are theirs.

- ``dsec.nodes.static.StaticNodes``: a fixed list of node endpoints (simulated nodes in
  benchmarks; a hand-made cluster).
- ``dsec.nodes.ray.RayNodes``: one edge on every alive node of a Ray cluster that offers the
  custom resource ``dsec_edge`` (Ray gives membership, health, launching and autoscaling).

The embedded ``dsec serve`` has no provider: its one edge lives in the server's process.
"""

from __future__ import annotations

from typing import Protocol

from ..apiserver.cluster import Cluster


class NodeProvider(Protocol):
    async def start(self, cluster: Cluster) -> None: ...

    async def close(self) -> None: ...
