"""A fixed list of nodes, each behind its own endpoint: ``{"token": T, "nodes": {name: url}}``."""

from __future__ import annotations

import json
from pathlib import Path

from libdsec import InvalidRequest

from ..apiserver.cluster import Cluster
from ..edge.api import NODE_NAME
from ..edge.remote import RemoteEdge


class StaticNodes:
    def __init__(self, nodes: dict[str, str], token: str) -> None:
        for name in nodes:
            if not NODE_NAME.match(name):
                raise InvalidRequest(f"node name {name!r}: lowercase letters and digits, at most 32")
        self.nodes, self.token = nodes, token
        self._edges: list[RemoteEdge] = []

    @classmethod
    def from_file(cls, path: Path) -> StaticNodes:
        try:
            spec = json.loads(Path(path).read_text())
            return cls(dict(spec["nodes"]), str(spec["token"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InvalidRequest(f"cannot read the node list {path}: {exc!r} "
                                 '(expected {"token": "...", "nodes": {"name": "http://host:port"}})') from None

    async def start(self, cluster: Cluster) -> None:
        for name, url in self.nodes.items():
            edge = RemoteEdge(name, url, self.token)
            self._edges.append(edge)
            cluster.add_edge(edge)

    async def close(self) -> None:
        edges, self._edges = self._edges, []
        for edge in edges:
            await edge.close()
