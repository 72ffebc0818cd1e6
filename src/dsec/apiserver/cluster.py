"""The apiserver's view of the cluster: the edges by node, where new sandboxes go, and the
project quotas in front of them.

A create goes: quota (the project's, and the ancestors' it draws on) → placement over the last
view of the nodes (gathered afresh in the background once older than ``view_max_age_s``), plus
what this apiserver placed since (``dsec.placement``: power of k choices) → the chosen edge,
which admits or refuses against its real state; on ``CapacityExceeded`` the view is dropped
and the next choice excludes that node. When the view says no node has room, the least loaded
one is asked anyway: its answer is the authoritative one (a size out of range, or "cannot
admit").

Quota usage is what the edges report their projects' running and paused sandboxes hold, plus
the creates this apiserver has in flight (reserved before placing, released as they land).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import re
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NoReturn

from datetime import datetime, timezone

from libdsec import CapacityExceeded, DSecError, InvalidRequest, Overloaded, QuotaExceeded, SandboxLost, SandboxNotFound, SnapshotConflict
from libdsec.protocol import (
    CleanCopyResult,
    ForkResult,
    ClusterStats,
    DSecContainerRunArgs,
    DSecFnCallArgs,
    DesktopStream,
    ExecRequest,
    ExecResult,
    FnCallResult,
    NodeInfo,
    NodeStats,
    SandboxInfo,
)

from .. import placement
from ..batch import Part, all_or_none
from ..edge.api import EdgeAPI, NodeUnreachable, node_of
from .auth import Caller
from .jobs import Jobs
from .metrics import ApiMetrics
from .projects import OwedStop, ProjectStore, open_project_store
from .quota import RESOURCES, Amount, check_create

if TYPE_CHECKING:
    from .streams import StreamKeys

log = logging.getLogger("dsec.apiserver.cluster")

MAX_NODES_TRIED = 4


def demand_of(args: DSecContainerRunArgs) -> placement.Demand:
    return placement.Demand(cpu_cores=0.0 if args.best_effort else args.cpu_cores_limit, memory_mb=args.memory_limit_mb)


def amount_of(args: DSecContainerRunArgs, count: int = 1) -> Amount:
    d = demand_of(args)
    return Amount(sandboxes=count, cpu_cores=d.cpu_cores * count, memory_mb=d.memory_mb * count)


def load_of(info: NodeInfo) -> placement.NodeLoad:
    return placement.NodeLoad(
        node=info.node, cpu_cores=info.cpu_cores, memory_mb=info.memory_total_mb, max_sandboxes=info.max_sandboxes,
        committed_cpu=info.committed_cpu, committed_memory_mb=info.committed_memory_mb, sandboxes=info.sandboxes,
    )


@functools.lru_cache(maxsize=64)
def _kinds(runtime: str) -> frozenset[str]:
    """The sandbox kinds a node's ``runtime`` line names ("container; microvm: QEMU …")."""
    return frozenset(part.split()[0].rstrip(":") for part in re.split(r"[;,]", runtime) if part.strip())


class _Reservation:
    """Quota held for creates in flight; released in full at the end, or one sandbox at a
    time as they land. What landed is noted in ``landed`` as ``(usage gatherings started by
    then, project, amount)``: a gathering that began before it may not have seen it."""

    def __init__(self, pending: dict[str, Amount], landed: deque | None, seq: Callable[[], int], project: str,
                 one: Amount, count: int) -> None:
        self.pending, self.landed, self.seq = pending, landed, seq  # landed: None, not noted (no quota)
        self.project, self.one, self.left = project, one, count

    def release(self, n: int = 1, landed: bool = True) -> None:
        n = min(n, self.left)
        if n <= 0:
            return
        self.left -= n
        rest = self.pending[self.project] - self.one.times(n)
        if self.left == 0 and all(abs(rest.get(r)) < 1e-9 for r in RESOURCES):
            self.pending.pop(self.project, None)
        else:
            self.pending[self.project] = rest
        if landed and self.landed is not None:
            self.landed.append((self.seq(), self.project, self.one.times(n)))


@dataclass
class _KindView:
    infos: list[NodeInfo]  # the reports it was made from
    loads: list[placement.NodeLoad]
    index: dict[str, int]  # node -> its place in loads


class Cluster:
    """The edges the apiserver can reach, by node name; placement and quotas for creates."""

    def __init__(
        self,
        edges: list[EdgeAPI],
        *,
        projects: ProjectStore | None = None,
        overcommit: placement.Overcommit | None = None,
        k: int = placement.DEFAULT_K,
        rng: random.Random | None = None,
        view_max_age_s: float = 0.2,
    ) -> None:
        self.edges = {e.node: e for e in edges}
        # Who makes the keys of desktops' live views (set by the app that serves them).
        self.stream_keys: StreamKeys | None = None
        # Nodes that left the cluster (died, or stopped answering): node -> (since, why). Their
        # sandboxes answer SandboxLost until the node comes back (``add_edge``) and re-adopts them.
        self.lost: dict[str, tuple[float, str]] = {}
        # Nodes a provider found whose edge did not start (``note_failed``): node -> (since, why).
        # Said where a user looks (``/v1/nodes?all=true``, ``dsec info``, a create's refusal).
        self.failed: dict[str, tuple[float, str]] = {}
        # What a provider tells a user with no node at all (how nodes join it).
        self.join_hint = ""
        # Stops that could not reach a lost node (the sandboxes of a batch that failed with it)
        # are owed to it, as the batch's all-or-none rule says: kept in the project store (they
        # outlive this apiserver; another one may be the one the node comes back to) and made
        # when it comes back (``add_edge``).
        self._tasks: set[asyncio.Task] = set()
        self.projects = projects or open_project_store()
        self.jobs = Jobs(self.projects)  # idempotency keys and job logs, kept in the project store
        self.overcommit = overcommit or placement.Overcommit()
        self.k = k
        self.rng = rng or random.Random()
        # Quota: what creates in flight hold, and what landed since the usage gatherings that
        # may not have seen it began; gatherings of usage run one at a time, and the quota
        # checks that arrive meanwhile share the next one (see _usage_since_now).
        self._pending: dict[str, Amount] = {}
        self._landed: deque[tuple[int, str, Amount]] = deque()
        self._usage_started = 0
        self._usage_next: asyncio.Future | None = None
        self._usage_running: asyncio.Task | None = None
        # Placement may use a view this old (edges refuse what they cannot hold, and the next
        # choice is tried); quota checks always ask the edges afresh.
        self.view_max_age_s = view_max_age_s
        self._infos: tuple[float, list[NodeInfo]] = (float("-inf"), [])
        # Bumped when a node joins or leaves: a gathering begun before is not kept as the view
        # (it would stay "fresh" without the new node, or with the gone one).
        self._members_seen = 0
        self._placed: dict[str, list] = {}
        # The edges' reports being gathered for the view: creates that find the view stale at
        # once share one gathering instead of asking every edge once each.
        self._refresh: asyncio.Task[list[NodeInfo]] | None = None
        # By kind: the view placement reads, made from those reports plus what was placed since
        # (kept up to date as creates are placed, so that a create costs O(k), not O(nodes)).
        self._loads: dict[str, _KindView] = {}
        # Set by a node provider that bursts (``dsec.nodes.ray_burst``): draining nodes take no
        # new sandboxes (they keep serving theirs); overflow nodes take only what the others
        # have no room for.
        self.draining: frozenset[str] = frozenset()
        self.overflow: frozenset[str] = frozenset()
        self.metrics = ApiMetrics()  # what passes through this apiserver (dsec.apiserver.metrics)

    # -- routing ---------------------------------------------------------------------------

    def edge_for(self, sandbox_id: str) -> EdgeAPI:
        node = node_of(sandbox_id)
        edge = self.edges.get(node)
        if edge is None:
            if node in self.lost:
                since, why = self.lost[node]
                raise SandboxLost(f"sandbox {sandbox_id} is lost: its node {node} left the cluster "
                                  f"{time.monotonic() - since:.1f} s ago ({why})")
            raise SandboxNotFound(f"no sandbox {sandbox_id}: node {node!r} is not in this cluster")
        return edge

    # -- membership ------------------------------------------------------------------------

    def add_edge(self, edge: EdgeAPI) -> None:
        """A node joined (or came back, with the sandboxes it re-adopted)."""
        self.edges[edge.node] = edge
        self.lost.pop(edge.node, None)
        self.failed.pop(edge.node, None)
        self._members_changed()
        self._spawn(self._stop_owed(edge))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stop_owed(self, edge: EdgeAPI) -> None:
        """Make the stops owed to ``edge``'s node; the ones it cannot take now stay owed."""
        try:
            stops = await self.projects.owed_stops(edge.node)
            if not stops:
                return
            owed = sorted(stops)
            log.info("node %s is back: stopping the %d sandboxes it was owed stops for", edge.node, len(owed))
            results = await asyncio.gather(*(self._make_owed(edge, sid, stops[sid]) for sid in owed),
                                           return_exceptions=True)
            await self.projects.settle_stops(
                sid for sid, r in zip(owed, results) if not isinstance(r, (NodeUnreachable, SandboxLost)))
        except Exception as exc:  # noqa: BLE001 - they stay owed: made when the node joins next
            log.warning("the stops owed to node %s were not all made: %s", edge.node, exc)

    async def _make_owed(self, edge: EdgeAPI, sandbox_id: str, owed: OwedStop) -> None:
        if owed.project is not None:  # asked by a project while the node was away: is it theirs?
            info = await edge.get(sandbox_id)
            if not Caller(owed.project).sees(self.projects, info.project):
                log.warning("not stopping %s: project %s asked while node %s was away, and it is %s's",
                            sandbox_id, owed.project, edge.node, info.project)
                return
        await edge.stop(sandbox_id, reason=owed.reason)

    async def _owe(self, node: str, sandbox_ids: list[str], reason: str, project: str | None = None) -> None:
        await self.projects.owe_stops(node, sandbox_ids, reason, project)
        if (edge := self.edges.get(node)) is not None:  # it came back meanwhile
            self._spawn(self._stop_owed(edge))

    async def stop(self, sandbox_id: str, reason: str = "stopped by request") -> SandboxInfo:
        """Its owner's stop. One that cannot reach the sandbox's node (lost, or breaking off in
        the middle of the call, when the stop may have been made already) is kept
        (``keep_stop``): a sandbox stopped while its node was away does not come back running
        with it."""
        try:
            return await self.edge_for(sandbox_id).stop(sandbox_id, reason)
        except SandboxLost as lost:
            await self.keep_stop(sandbox_id, lost, reason)

    async def keep_stop(self, sandbox_id: str, lost: SandboxLost, reason: str = "stopped by request",
                        caller: Caller | None = None) -> NoReturn:
        """Owe the stop of a sandbox whose node is away (``lost``) to the node, and raise
        ``SandboxLost`` saying so. ``caller``: a project whose stop could not be checked
        against the sandbox (whose it is, only its node knows), checked when it is back."""
        node = node_of(sandbox_id)
        project = None if caller is None or caller.is_root else caller.project
        await self._owe(node, [sandbox_id], f"{reason}, while its node was away", project)
        whose = "" if project is None else f" (if the sandbox is project {project}'s)"
        raise SandboxLost(f"{lost}; the stop is kept, and made when node {node} is back{whose}") from None

    async def stop_ids(self, sandbox_ids: list[str], reason: str) -> None:
        """``stop_for_batch`` by ids (their nodes looked up; a node not in the cluster now is
        owed its stops)."""
        made, owed = [], {}
        for sid in sandbox_ids:
            node = node_of(sid)
            if node in self.edges:
                made.append((self.edges[node], sid))
            else:
                owed.setdefault(node, []).append(sid)
        for node, ids in owed.items():
            await self._owe(node, ids, reason)
        await self.stop_for_batch(made, reason)

    async def stop_for_batch(self, made: list[tuple[EdgeAPI, str]], reason: str) -> None:
        """Stop what an unfinished batch made; a stop its node cannot take now is owed to it."""
        results = await asyncio.gather(*(edge.stop(sid, reason=reason) for edge, sid in made), return_exceptions=True)
        owed: dict[str, list[str]] = {}
        for (edge, sid), result in zip(made, results):
            if isinstance(result, (NodeUnreachable, SandboxLost)):
                owed.setdefault(edge.node, []).append(sid)
        for node, ids in owed.items():
            await self._owe(node, ids, reason)

    def remove_edge(self, node: str) -> EdgeAPI | None:
        """A node holding no sandbox left on purpose (a burst node let go); returns its edge."""
        edge = self.edges.pop(node, None)
        self._members_changed()
        return edge

    def note_failed(self, node: str, why: str) -> None:
        """A node was found but its edge did not start (the provider tries again)."""
        self.failed[node] = (time.monotonic(), why)

    def forget_failed(self, node: str) -> None:
        """A node whose edge never started left."""
        self.failed.pop(node, None)

    def no_node_ready(self) -> CapacityExceeded:
        """The refusal of a call no node can take because none is ready, naming why: none
        joined, every one is lost, or their edges did not start."""
        why = []
        if self.failed:
            why.append("the edge did not start on " + "; ".join(
                f"{node} ({reason})" for node, (_, reason) in sorted(self.failed.items())))
        if self.lost:
            why.append("lost: " + "; ".join(
                f"{node} ({reason}, {time.monotonic() - since:.0f} s ago)"
                for node, (since, reason) in sorted(self.lost.items())))
        if not why:
            return CapacityExceeded("no node has joined the cluster" + (f": {self.join_hint}" if self.join_hint else ""))
        return CapacityExceeded("no node is ready: " + "; ".join(why))

    def unready_infos(self) -> list[NodeInfo]:
        """A line for each node that is not serving (lost, or whose edge did not start)."""
        now = time.monotonic()
        return [NodeInfo.unready(node, state, f"{reason} ({now - since:.0f} s ago)")
                for state, table in (("lost", self.lost), ("failed", self.failed))
                for node, (since, reason) in sorted(table.items()) if node not in self.edges]

    def mark_lost(self, node: str, why: str) -> EdgeAPI | None:
        """A node left: its sandboxes are lost (and stop counting against quotas, which are
        summed from the nodes' own reports); new creates go elsewhere. Returns its edge (for
        the caller to close), if it was in the cluster."""
        edge = self.edges.pop(node, None)
        if edge is not None or node not in self.lost:
            self.lost[node] = (time.monotonic(), why)
            log.warning("node %s lost: %s", node, why)
        self._members_changed()
        return edge

    async def edge_for_caller(self, sandbox_id: str, caller: Caller) -> EdgeAPI:
        """The sandbox's edge, if the caller may see the sandbox; else ``SandboxNotFound``,
        just as for one that does not exist."""
        edge = self.edge_for(sandbox_id)
        if not caller.is_root:
            info = await edge.get(sandbox_id)
            if not caller.sees(self.projects, info.project):
                raise SandboxNotFound(f"no sandbox {sandbox_id} on node {edge.node}")
        return edge

    def any_edge(self) -> EdgeAPI:
        """A node to ask about the layer store (every node reads the same one)."""
        if not self.edges:
            raise self.no_node_ready()
        return self.rng.choice(list(self.edges.values()))

    async def list_sandboxes(self) -> list[SandboxInfo]:
        """Every reachable node's sandboxes (a node that does not answer is left out)."""
        results = await asyncio.gather(*(e.list() for e in self.edges.values()), return_exceptions=True)
        found = []
        for edge, result in zip(list(self.edges.values()), results):
            if isinstance(result, BaseException):
                log.warning("node %s did not list its sandboxes: %s", edge.node, result)
            else:
                found.extend(result)
        return found

    async def layer_use(self) -> tuple[frozenset[str], frozenset[str]]:
        """(image refs, layer digests) that some node's sandboxes hold. A node that cannot
        answer makes this fail: what it holds must not be removed from under it."""
        uses = await asyncio.gather(*(e.layer_use() for e in self.edges.values()))
        return (frozenset(i for u in uses for i in u.images), frozenset(d for u in uses for d in u.layers))

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        edge = self.edge_for(sandbox_id)
        if not self.metrics.enabled:
            return await edge.exec(sandbox_id, request)
        start = time.perf_counter()
        try:
            return await edge.exec(sandbox_id, request)
        finally:
            self.metrics.command(time.perf_counter() - start)

    async def fncall(self, args: DSecFnCallArgs) -> FnCallResult:
        if self.metrics.enabled:
            self.metrics.fncalls += 1
        return await (await self.fncall_edge()).fncall(args)

    async def fncall_many(self, calls: list[DSecFnCallArgs]) -> list[FnCallResult]:
        if self.metrics.enabled:
            self.metrics.fncalls += len(calls)
        return await (await self.fncall_edge()).fncall_many(calls)

    async def stats(self) -> ClusterStats:
        """Every reachable node's counters and holdings (one that does not answer is left out,
        and logged), the nodes that left, and this apiserver's own counters."""
        edges = list(self.edges.values())
        results = await asyncio.gather(*(e.node_stats() for e in edges), return_exceptions=True)
        nodes: list[NodeStats] = []
        for edge, result in zip(edges, results):
            if isinstance(result, BaseException):
                log.warning("edge %s gave no stats: %s", edge.node, result)
            else:
                nodes.append(result)
        return ClusterStats(at=datetime.now(timezone.utc), nodes=nodes, lost_nodes=sorted(self.lost),
                            apiserver=self.metrics.report())

    async def fncall_edge(self) -> EdgeAPI:
        """A node that serves fncall, by the last view."""
        serving = [i.node for i in await self._view_infos()
                   if "fncall" in _kinds(i.runtime) and i.node in self.edges and i.node not in self.draining]
        if not serving:
            raise self.no_node_ready() if not self.edges else CapacityExceeded("no node in the cluster serves fncall")
        return self.edges[self.rng.choice(serving)]

    # -- the view --------------------------------------------------------------------------

    async def node_infos(self, max_age_s: float = 0.0) -> list[NodeInfo]:
        """Every reachable edge's report (an edge that fails to answer is left out); one taken
        less than ``max_age_s`` ago is reused. With no ``max_age_s`` (quota checks) the edges
        are always asked afresh."""
        taken, cached = self._infos
        if max_age_s > 0 and time.monotonic() - taken < max_age_s:
            return cached
        return await self._gather_infos()

    def _members_changed(self) -> None:
        """A node joined or left: the view is dropped, and so is a gathering in flight (its
        caller still gets its answer; the next create gathers afresh)."""
        self._members_seen += 1
        self._infos = (float("-inf"), [])
        self._loads.clear()
        self._refresh = None

    async def _gather_infos(self) -> list[NodeInfo]:
        members = self._members_seen
        edges = list(self.edges.values())
        results = await asyncio.gather(*(e.node_info() for e in edges), return_exceptions=True)
        infos = []
        for edge, result in zip(edges, results):
            if isinstance(result, BaseException):
                log.warning("edge %s did not report: %s", edge.node, result)
            else:
                infos.append(result)
        if members == self._members_seen:
            self._infos = (time.monotonic(), infos)
            self._placed.clear()
        return infos

    def _refreshing(self) -> asyncio.Task[list[NodeInfo]]:
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self._gather_infos(), name="dsec-view-refresh")
        return self._refresh

    async def _view_infos(self) -> list[NodeInfo]:
        """The reports placement works on: the last ones while less than ``view_max_age_s``
        old; past that, the last ones still while fresh ones are gathered for the next creates,
        so that no create waits on the edges' reports (placement adds what this apiserver placed
        since, and an edge refuses what it cannot hold: then the view is dropped). With none,
        every create waiting shares one gathering."""
        taken, cached = self._infos
        if time.monotonic() - taken < self.view_max_age_s:
            return cached
        refresh = self._refreshing()
        return cached if cached else await asyncio.shield(refresh)

    async def view(self, kind: str = "container") -> list[placement.NodeLoad]:
        """The nodes that serve ``kind``, with their capacity and commitments (all of them when
        none says it does: then an edge's answer explains), plus what this apiserver placed
        there since. The list is shared and kept current as creates are placed: read it, do
        not change it."""
        infos = await self._view_infos()
        view = self._loads.get(kind)
        if view is None or view.infos is not infos:
            serving = [i for i in infos if kind in _kinds(i.runtime)]
            loads = [self._with_placed(load_of(i)) for i in serving or infos]
            view = self._loads[kind] = _KindView(infos, loads, {load.node: n for n, load in enumerate(loads)})
        if self.draining:
            return [load for load in view.loads if load.node not in self.draining]
        return view.loads

    def _with_placed(self, node: placement.NodeLoad) -> placement.NodeLoad:
        """A view entry plus what this apiserver placed there since the view was taken."""
        added = self._placed.get(node.node)
        if added is None:
            return node
        return replace(node, committed_cpu=node.committed_cpu + added[0],
                       committed_memory_mb=node.committed_memory_mb + added[1], sandboxes=node.sandboxes + added[2])

    def _note_placed(self, node: str, args: DSecContainerRunArgs, count: int = 1) -> None:
        d = demand_of(args)
        added = self._placed.setdefault(node, [0.0, 0.0, 0])
        added[0] += d.cpu_cores * count
        added[1] += d.memory_mb * count
        added[2] += count
        for view in self._loads.values():
            if (n := view.index.get(node)) is not None:
                load = view.loads[n]
                view.loads[n] = replace(load, committed_cpu=load.committed_cpu + d.cpu_cores * count,
                                        committed_memory_mb=load.committed_memory_mb + d.memory_mb * count,
                                        sandboxes=load.sandboxes + count)

    async def usage(self) -> dict[str, Amount]:
        """What each project's own sandboxes hold, over every node."""
        total: dict[str, Amount] = {}
        for info in await self.node_infos():
            for project, u in info.projects.items():
                total[project] = total.get(project, Amount()) + Amount(u.sandboxes, u.cpu_cores, u.memory_mb)
        return total

    # -- quota -----------------------------------------------------------------------------

    @asynccontextmanager
    async def _reserve(self, project: str, args: DSecContainerRunArgs, count: int) -> AsyncIterator[_Reservation]:
        one = amount_of(args)
        tree = self.projects.tree()
        if not tree.limited(project):
            yield _Reservation({project: one.times(count)}, None, int, project, one, count)
            return
        reservation = _Reservation(self._pending, self._landed, lambda: self._usage_started, project, one, count)
        seq, reported = await self._usage_since_now()
        # From here to the reservation, nothing awaits: no other check comes in between.
        usage = dict(reported)
        for p, amount in self._pending.items():
            usage[p] = usage.get(p, Amount()) + amount
        for landed_at, p, amount in self._landed:
            if landed_at >= seq:  # landed after that gathering began: it may not have seen it
                usage[p] = usage.get(p, Amount()) + amount
        check_create(tree, usage, project, one.times(count))
        self._pending[project] = self._pending.get(project, Amount()) + one.times(count)
        try:
            yield reservation
        finally:
            reservation.release(reservation.left, landed=False)

    async def _usage_since_now(self) -> tuple[int, dict[str, Amount]]:
        """What each project holds, from every node's report, gathered after this call began
        (quota is checked against the nodes' word, never a cached view), with the gathering's
        number. Gatherings run one at a time; the checks that arrive while one runs share the
        next: a burst of creates in a project with a quota costs a gathering or two, not one
        each, and none waits for another's check."""
        if self._usage_next is None:
            self._usage_next = asyncio.get_running_loop().create_future()
            self._spawn(self._gather_usage(self._usage_next))
        return await asyncio.shield(self._usage_next)

    async def _gather_usage(self, answer: asyncio.Future) -> None:
        running = self._usage_running
        if running is not None:
            await asyncio.gather(running, return_exceptions=True)
        self._usage_next = None  # the checks from now on wait for the next one
        self._usage_started += 1
        seq = self._usage_started
        self._usage_running = asyncio.current_task()
        try:
            usage = await self.usage()
        except BaseException as exc:  # noqa: BLE001 - every check waiting on it fails with it
            answer.set_exception(exc)
            answer.exception()  # (retrieved: no "never retrieved" warning when none waits)
            return
        while self._landed and self._landed[0][0] < seq:  # seen by this one (and all after)
            self._landed.popleft()
        answer.set_result((seq, usage))

    # -- creates ---------------------------------------------------------------------------

    def _pick(self, view: list[placement.NodeLoad], args: DSecContainerRunArgs, count: int,
              tried: Iterable[str]) -> list[str]:
        demand = demand_of(args)
        if not self.overflow:
            return placement.place(view, demand, count, overcommit=self.overcommit, k=self.k, rng=self.rng,
                                   exclude=tried)
        # The other nodes first, as far as they have room; the rest on the overflow nodes.
        tried = set(tried)
        chosen = placement.place(view, demand, count, overcommit=self.overcommit, k=self.k, rng=self.rng,
                                 exclude=tried | self.overflow)
        if len(chosen) < count:
            others = {n.node for n in view} - self.overflow
            chosen += placement.place(view, demand, count - len(chosen), overcommit=self.overcommit, k=self.k,
                                      rng=self.rng, exclude=tried | others)
        return chosen

    async def create(self, args: DSecContainerRunArgs, project: str, kind: str = "container") -> SandboxInfo:
        if not self.metrics.enabled:
            return await self._create(args, project, kind)
        start = time.perf_counter()
        outcome = "error"
        try:
            info = await self._create(args, project, kind)
            outcome = "ok"
            return info
        except CapacityExceeded:
            outcome = "refused"
            self.metrics.refused("capacity")
            raise
        except QuotaExceeded:
            outcome = "refused"
            self.metrics.refused("quota")
            raise
        except Overloaded:
            outcome = "refused"
            self.metrics.refused("overload")
            raise
        except DSecError as exc:
            outcome = "invalid" if exc.status < 500 else "error"
            raise
        finally:
            self.metrics.create(kind, outcome, time.perf_counter() - start)

    async def _create(self, args: DSecContainerRunArgs, project: str, kind: str) -> SandboxInfo:
        if not self.edges:
            raise self.no_node_ready()
        async with self._reserve(project, args, 1) as reservation:
            view = await self.view(kind)
            if args.snapshot is not None and (held_on := await self._memory_node(args.snapshot)) is not None:
                view = [load for load in view if load.node == held_on]
            tried: list[str] = []
            last: DSecError | None = None
            while len(tried) < MAX_NODES_TRIED:
                chosen = self._pick(view, args, 1, tried)
                node = chosen[0] if chosen else None
                if node is None and not tried:
                    node = placement.least_loaded(view, overcommit=self.overcommit)
                if node is None:
                    break
                self._note_placed(node, args)
                edge = self.edges.get(node)
                if edge is None:  # left the cluster since the view was taken
                    tried.append(node)
                    continue
                try:
                    info = await edge.create(args, kind, project)
                except (CapacityExceeded, NodeUnreachable, Overloaded) as exc:
                    self._infos = (float("-inf"), [])  # a refusal: look again next time
                    if not isinstance(last, Overloaded):  # what to say when no node took it
                        last = exc
                    tried.append(node)
                    continue
                reservation.release(1)
                return info
            if last is None and not view:
                raise CapacityExceeded(f"no node answered the apiserver's last look ({len(self.edges)} in the cluster: "
                                       f"{', '.join(sorted(self.edges))}); try again")
            raise last or CapacityExceeded(
                f"cannot admit a sandbox of {args.memory_limit_mb} MB and {args.cpu_cores_limit:g} cores: "
                f"no node in the cluster has room"
            )

    async def _memory_node(self, snapshot: str) -> str | None:
        """The node a create from ``snapshot`` must go to: a full snapshot's, whose memory is
        there (``SnapshotConflict`` if it is not in the cluster now); None for any node."""
        snap = await self.any_edge().get_snapshot(snapshot)
        if snap.mode != "full":
            return None
        if snap.node not in self.edges:
            raise SnapshotConflict(f"snapshot {snap.id} is a full snapshot: its memory is on node {snap.node}, "
                                   "which is not in the cluster now")
        return snap.node

    async def clean_copy(self, sandbox_id: str, keep: list[str]) -> CleanCopyResult:
        """A clean copy is made on its source's node (it reads the source's writable layer)
        and counts against the source's project like any create."""
        edge = self.edge_for(sandbox_id)
        info = await edge.get(sandbox_id)
        like = DSecContainerRunArgs(container_image=info.image, memory_limit_mb=info.memory_limit_mb,
                                    cpu_cores_limit=info.cpu_cores_limit, best_effort=info.best_effort)
        async with self._reserve(info.project, like, 1):
            result = await edge.clean_copy(sandbox_id, keep)
            self._note_placed(edge.node, like)
            return result

    async def desktop_stream(self, sandbox_id: str, ttl_s: float = 3600.0) -> DesktopStream:
        """The live view of the sandbox's desktop: started by its node, its page's key made here
        for the sandbox's project (``dsec.apiserver.streams``)."""
        if self.stream_keys is None:
            raise InvalidRequest("this apiserver does not serve desktops' live views")
        edge = self.edge_for(sandbox_id)
        info = await edge.get(sandbox_id)
        await edge.desktop_stream(sandbox_id)
        return self.stream_keys.stream(sandbox_id, info.project, ttl_s)

    async def fork(self, sandbox_id: str, count: int = 1, all_or_none: bool = True,
                   ttl_running_stop: float | None = None) -> ForkResult:
        """A fork is made on its parent's node (it reads the parent's memory or writable layer)
        and its children count against the parent's project like a batch create's."""
        edge = self.edge_for(sandbox_id)
        info = await edge.get(sandbox_id)
        like = DSecContainerRunArgs(container_image=info.image, memory_limit_mb=info.memory_limit_mb,
                                    cpu_cores_limit=info.cpu_cores_limit, best_effort=info.best_effort)
        async with self._reserve(info.project, like, count) as reservation:
            result = await edge.fork(sandbox_id, count, all_or_none, ttl_running_stop)
            made = sum(1 for child in result.children if child.sandbox is not None)
            if made:
                reservation.release(made)  # landed: held until the nodes' next report counts them
                self._note_placed(edge.node, like, made)
            return result

    async def create_batch(
        self, args: DSecContainerRunArgs, count: int, project: str
    ) -> AsyncIterator[tuple[int, SandboxInfo]]:
        """Yields (index, info) as sandboxes come up, spread over nodes by placement. All or
        none (``dsec.batch``): on a failure (or when the consumer goes away early) every
        sandbox made is stopped. A node that refuses its share before making any of it is
        replaced."""
        if not self.edges:
            raise self.no_node_ready()
        async with self._reserve(project, args, count) as reservation:
            view = await self.view()
            tried: set[str] = set()

            async def replace(part: Part, exc: BaseException) -> list[Part] | None:
                if not isinstance(exc, (CapacityExceeded, NodeUnreachable)):
                    return None
                tried.add(part.tag[0])
                self._infos = (float("-inf"), [])  # a refusal: look again
                again = self._pick(await self.view(), args, part.count, tried)
                if len(again) < part.count or len(tried) >= MAX_NODES_TRIED:
                    return None
                return self._shares(again, part.count, view, args, project, batch, part.offset)

            async def undo(made: list[tuple[Part, str]]) -> None:
                self._infos = (float("-inf"), [])  # what was noted as placed is not there
                await self.stop_ids([sid for _, sid in made], "batch create failed")

            async def commit(made: list[tuple[Part, str]]) -> None:
                # Each node holds its share for the batch until this (a node restarted since,
                # or one that gave up waiting, has stopped it: then the batch fails whole).
                held = sorted({part.tag for part, _ in made})
                results = await asyncio.gather(*(self._commit_share(node, held_as) for node, held_as in held),
                                               return_exceptions=True)
                for result in results:
                    if isinstance(result, BaseException):
                        raise result

            batch = secrets.token_hex(8)
            parts = self._shares(self._pick(view, args, count, ()), count, view, args, project, batch)
            async with aclosing(all_or_none(parts, undo, undoing=self._tasks, interruptible=True,
                                            replace=replace, commit=commit)) as events:
                async for item in events:
                    reservation.release(1)
                    if self.metrics.enabled:
                        self.metrics.batch_sandboxes += 1
                    yield item

    def _shares(self, nodes: list[str], count: int, view: list[placement.NodeLoad], args: DSecContainerRunArgs,
                project: str, batch: str, offset: int = 0) -> list[Part]:
        """A placement grouped into one part per node. When it placed fewer than ``count``,
        the whole batch goes to the least loaded node, whose edge answers for it."""
        if len(nodes) < count:
            fallback = placement.least_loaded(view, overcommit=self.overcommit) or next(iter(self.edges), None)
            if fallback is None:  # every node left since the batch began
                raise self.no_node_ready()
            return [self._share(fallback, count, offset, args, project, batch)]
        counts: dict[str, int] = {}
        for node in nodes:
            counts[node] = counts.get(node, 0) + 1
        shares = []
        for node, n in counts.items():
            shares.append(self._share(node, n, offset, args, project, batch))
            offset += n
        return shares

    def _share(self, node: str, count: int, offset: int, args: DSecContainerRunArgs, project: str,
               batch: str) -> Part:
        """``count`` of the batch's sandboxes on ``node``, as one batch of its own there."""

        held_as = f"{batch}-{offset}"  # the share's own batch on its node (a node may get two shares)

        async def make() -> AsyncIterator[tuple[int, SandboxInfo]]:
            edge = self.edges.get(node)
            if edge is None:  # left the cluster since the view was taken
                raise NodeUnreachable(f"node {node} left the cluster")
            self._note_placed(node, args, count)
            async with aclosing(edge.create_batch(args, count, "container", project, held_as)) as events:
                async for item in events:
                    yield item

        return Part(offset, count, make, tag=(node, held_as))

    async def _commit_share(self, node: str, held_as: str) -> None:
        edge = self.edges.get(node)
        if edge is None:
            raise SandboxLost(f"node {node} left the cluster before the batch was whole")
        await edge.commit_batch(held_as)
