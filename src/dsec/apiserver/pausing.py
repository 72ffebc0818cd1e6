"""Pausing and resuming many sandboxes in one call (``POST /v1/sandboxes:pause`` and
``:resume``, the public table's ``pause_sandboxes`` and ``resume_sandboxes``, served by
``calls.ApiCalls``; the models are ``libdsec._pausing``'s).

The selector becomes a list of sandboxes with their nodes: a job's are the ids its log says it
made; a project's are those the nodes list for it and the projects below it; ``ids`` are taken
as given. Each node is asked for the live sandboxes it holds (one ``list`` a node, so the
current state of each is known without a call per sandbox), and then to pause or resume them,
``per_node`` at a time: a node's sandboxes pause in parallel with other nodes', and a slow or
failing sandbox holds up nobody else. Every sandbox gets an outcome; nothing here raises for
one sandbox's error. A job's or a project's sandboxes that already ended are left out; an id
given that names no live sandbox the caller may see is an error outcome. A job's sandboxes are
those its creates, batches, clean copies and forks made.

The call is written to job logs (``SandboxGroups._record``): the caller's own job, and the job it
selected, so a job's log shows the pauses and resumes of its sandboxes made as one call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from collections.abc import Awaitable, Callable
from typing import Literal

from libdsec import DSecError, SandboxLost, SandboxNotFound, SandboxStateError
from libdsec._pausing import SandboxGroupRequest, SandboxGroupResult, SandboxOutcome
from libdsec.protocol import PauseResult, SandboxInfo, SandboxStatus

from ..edge.api import EdgeAPI
from .auth import Caller
from .cluster import Cluster
from .jobs import Jobs

log = logging.getLogger("dsec.apiserver.pausing")

Action = Literal["pause", "resume"]


def _error(exc: BaseException) -> dict:
    if isinstance(exc, DSecError):
        return exc.to_wire()["error"]
    return {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}


class _Target:
    """One selected sandbox: its id, and its edge and info once its node has listed it."""

    __slots__ = ("id", "edge", "info", "outcome")

    def __init__(self, sandbox_id: str) -> None:
        self.id = sandbox_id
        self.edge: EdgeAPI | None = None
        self.info: SandboxInfo | None = None
        self.outcome: SandboxOutcome | None = None

    def fail(self, exc: BaseException) -> None:
        self.outcome = SandboxOutcome(id=self.id, outcome="error", node=None if self.edge is None else self.edge.node,
                                      status=None if self.info is None else self.info.status, error=_error(exc))


class SandboxGroups:
    """Pauses and resumes the sandboxes a ``SandboxGroupRequest`` selects (see the module)."""

    def __init__(self, cluster: Cluster, jobs: Jobs) -> None:
        self.cluster = cluster
        self.jobs = jobs

    async def run(self, action: Action, request: SandboxGroupRequest, caller: Caller) -> SandboxGroupResult:
        start = time.perf_counter()
        targets = await self._select(request, caller)
        by_node: dict[str, list[_Target]] = {}
        for target in targets:
            if target.outcome is None:
                assert target.edge is not None
                by_node.setdefault(target.edge.node, []).append(target)
        act = self._pause if action == "pause" else self._resume
        await asyncio.gather(*(self._on_node(group, request.per_node, act) for group in by_node.values()))
        outcomes = [t.outcome for t in targets if t.outcome is not None]
        done_as = "paused" if action == "pause" else "resumed"
        paused = [o for o in outcomes if o.outcome == "paused"]
        result = SandboxGroupResult(
            action=action, sandboxes=outcomes,
            done=sum(o.outcome == done_as for o in outcomes),
            already=sum(o.outcome in ("already_paused", "already_running") for o in outcomes),
            failed=sum(o.outcome == "error" for o in outcomes),
            memory_before_bytes=sum(o.memory_before_bytes or 0 for o in paused),
            memory_after_bytes=sum(o.memory_after_bytes or 0 for o in paused),
            seconds=time.perf_counter() - start)
        await self._record(action, request, caller, result)
        return result

    async def _record(self, action: Action, request: SandboxGroupRequest, caller: Caller,
                      result: SandboxGroupResult) -> None:
        """Write the call, with each sandbox's outcome, to the caller's job log (its ``x-dsec-job``)
        and to the log of the job it selected (``job=``), as ``pause_sandboxes`` or
        ``resume_sandboxes``: ``dsec job show`` lists it, ``dsec job replay`` makes it again."""
        logs = dict.fromkeys(j for j in (caller.job, request.job) if j is not None)
        asked = request.model_dump(mode="json", exclude_none=True)
        if caller.job is not None:
            await self.jobs.check(caller)  # (its own job is made on first use; a selected one was seen)
        for job in logs:  # (in a job's log that is not the caller's, with the caller's: another's call)
            await self.jobs.record(replace(caller, job=job, key=None), f"{action}_sandboxes", None,
                                   asked if job == caller.job else {**asked, "asked_by_job": caller.job},
                                   result.model_dump(mode="json"))

    # -- which sandboxes ---------------------------------------------------------------------

    async def _select(self, request: SandboxGroupRequest, caller: Caller) -> list[_Target]:
        if request.project is not None:
            caller.check_sees(self.cluster.projects, request.project)
            below = self.cluster.projects.tree().subtree(request.project)
            found = []
            for info in await self.cluster.list_sandboxes():
                if info.project in below and info.status in (SandboxStatus.running, SandboxStatus.paused):
                    target = _Target(info.id)
                    target.edge, target.info = self.cluster.edges.get(info.node), info
                    if target.edge is None:  # (lost since it listed)
                        continue
                    found.append(target)
            return found
        given = request.ids is not None
        ids = list(dict.fromkeys(request.ids)) if given else await self.jobs.sandboxes_made(caller, request.job)
        targets = [_Target(sid) for sid in ids]
        by_node: dict[str, list[_Target]] = {}
        for target in targets:
            try:
                target.edge = self.cluster.edge_for(target.id)  # (a malformed id, a node not here or lost)
            except DSecError as exc:
                target.fail(exc)
                continue
            by_node.setdefault(target.edge.node, []).append(target)
        await asyncio.gather(*(self._listed(node, group, caller) for node, group in by_node.items()))
        if given:
            return targets
        # A job's sandboxes that ended, or whose node is no longer in the cluster, are not its now.
        return [t for t in targets if t.info is not None or (t.outcome is not None and t.outcome.error is not None
                                                              and t.outcome.error["code"] == SandboxLost.code)]

    async def _listed(self, node: str, group: list[_Target], caller: Caller) -> None:
        """Each target's info as its node lists it now; one it does not list (ended), or the
        caller may not see, is an error outcome."""
        edge = group[0].edge
        assert edge is not None
        try:
            live = {info.id: info for info in await edge.list()}
        except DSecError as exc:
            for target in group:
                target.fail(exc)
            return
        for target in group:
            info = live.get(target.id)
            if info is None or not caller.sees(self.cluster.projects, info.project):
                target.fail(SandboxNotFound(f"no live sandbox {target.id} on node {node}"))
            else:
                target.info = info

    # -- pausing, resuming -------------------------------------------------------------------

    async def _on_node(self, group: list[_Target], per_node: int,
                       act: Callable[[_Target], Awaitable[SandboxOutcome]]) -> None:
        gate = asyncio.Semaphore(per_node)

        async def one(target: _Target) -> None:
            async with gate:
                try:
                    target.outcome = await act(target)
                except Exception as exc:  # noqa: BLE001 - its own outcome; the others go on
                    if not isinstance(exc, DSecError):
                        log.warning("%s of %s failed: %r", "pause/resume", target.id, exc)
                    target.fail(exc)

        await asyncio.gather(*(one(t) for t in group))

    async def _pause(self, target: _Target) -> SandboxOutcome:
        edge, info = target.edge, target.info
        assert edge is not None and info is not None
        if info.status is SandboxStatus.paused:
            return SandboxOutcome(id=target.id, outcome="already_paused", node=edge.node, status=info.status)
        start = time.perf_counter()
        try:
            result: PauseResult = await edge.pause(target.id)
        except SandboxStateError:
            now = await edge.get(target.id)
            if now.status is SandboxStatus.paused:  # paused meanwhile (its TTL, another call)
                return SandboxOutcome(id=target.id, outcome="already_paused", node=edge.node, status=now.status)
            target.info = now
            raise
        return SandboxOutcome(id=target.id, outcome="paused", node=edge.node, status=result.sandbox.status,
                              memory_before_bytes=result.memory_before_bytes,
                              memory_after_bytes=result.memory_after_bytes, seconds=time.perf_counter() - start)

    async def _resume(self, target: _Target) -> SandboxOutcome:
        edge, info = target.edge, target.info
        assert edge is not None and info is not None
        if info.status is SandboxStatus.running:
            return SandboxOutcome(id=target.id, outcome="already_running", node=edge.node, status=info.status)
        start = time.perf_counter()
        try:
            now = await edge.resume(target.id)
        except SandboxStateError:
            now = await edge.get(target.id)
            if now.status is SandboxStatus.running:  # resumed meanwhile (a call to it)
                return SandboxOutcome(id=target.id, outcome="already_running", node=edge.node, status=now.status)
            target.info = now
            raise
        return SandboxOutcome(id=target.id, outcome="resumed", node=edge.node, status=now.status,
                              seconds=time.perf_counter() - start)

