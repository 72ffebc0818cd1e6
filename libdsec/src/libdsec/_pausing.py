"""Pausing many sandboxes in one call: the wire models, and the client methods that send them.

A preempted training job gives its CPU back by pausing every sandbox it holds at once
(``pause_sandboxes(job=...)``): containers are frozen and their memory pushed out to swap, VMs
paused as their backend pauses them. The server finds the sandboxes (a job's from its log, a
project's and those of the projects below it from the nodes, or the ``ids`` given), asks each
node holding some of them to pause them (a bounded number at a time per node), and answers one
``SandboxOutcome`` per sandbox: one failure does not stop the others. Each sandbox then resumes
on its next call (unless made with ``auto_resume=False``), or all at once with
``resume_sandboxes`` and the same selector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, ValidationError, model_validator

from ._errors import InvalidRequest
from .protocol import MAX_SANDBOX_BATCH, SandboxStatus, _Model, check_job_name

if TYPE_CHECKING:
    from ._client import DSecClient

# Sandboxes a node pauses (or resumes) at a time for one call, unless the call asks otherwise.
DEFAULT_PER_NODE = 16
MAX_PER_NODE = 256

Outcome = Literal["paused", "already_paused", "resumed", "already_running", "error"]


class SandboxGroupRequest(_Model):
    """Which sandboxes: exactly one of a job (those its log made: creates, batches, clean
    copies, forks), a project (its own and those of the projects below it) or a list of ids."""

    job: str | None = None
    project: str | None = None
    ids: list[str] | None = Field(default=None, min_length=1, max_length=MAX_SANDBOX_BATCH)
    # Sandboxes each node pauses or resumes at a time.
    per_node: int = Field(DEFAULT_PER_NODE, ge=1, le=MAX_PER_NODE)

    @model_validator(mode="after")
    def _one_selector(self) -> SandboxGroupRequest:
        given = [name for name in ("job", "project", "ids") if getattr(self, name) is not None]
        if len(given) != 1:
            said = "none" if not given else " and ".join(given)
            raise ValueError(f"give exactly one of job, project or ids to select the sandboxes (got {said})")
        if self.job is not None:
            check_job_name(self.job)
        return self


class SandboxOutcome(_Model):
    """What the call did to one sandbox; ``error`` (``{"code", "message"}`` as on the wire)
    when it could not."""

    id: str
    outcome: Outcome
    node: str | None = None
    status: SandboxStatus | None = None
    memory_before_bytes: int | None = None
    memory_after_bytes: int | None = None
    seconds: float | None = None
    error: dict | None = None


class SandboxGroupResult(_Model):
    """One outcome per selected sandbox, and the totals: how many the call changed
    (``done``), found so already (``already``) or could not change (``failed``), and the memory
    the paused ones held before and after their memory was pushed out (summed over the
    sandboxes whose backend can tell)."""

    action: Literal["pause", "resume"]
    sandboxes: list[SandboxOutcome]
    done: int
    already: int
    failed: int
    memory_before_bytes: int
    memory_after_bytes: int
    seconds: float


def group_request(job: str | None, project: str | None, ids: list[str] | None,
                  per_node: int = DEFAULT_PER_NODE) -> SandboxGroupRequest:
    """The request, or ``InvalidRequest`` naming what is wrong with the selector."""
    try:
        return SandboxGroupRequest(job=job, project=project, ids=None if ids is None else list(ids), per_node=per_node)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise InvalidRequest(f"{where + ': ' if where else ''}{err.get('msg', 'invalid')}".replace("Value error, ", "")) from None


class _GroupMethods:
    """Mixed into :class:`libdsec.DSecClient`."""

    async def pause_sandboxes(self: DSecClient, *, job: str | None = None, project: str | None = None,
                              ids: list[str] | None = None, per_node: int = DEFAULT_PER_NODE) -> SandboxGroupResult:
        """Pause every running sandbox of a ``job``, a ``project`` (and the projects below it)
        or the given ``ids``, in one call: exactly one of the three. Each sandbox's outcome is in
        the answer (paused, already paused, or the error that kept it running)."""
        from .api_ops import api_route  # (not above: the table imports this module's models)

        return await self._group("pause_sandboxes", api_route("pause_sandboxes"),
                                 group_request(job, project, ids, per_node))

    async def resume_sandboxes(self: DSecClient, *, job: str | None = None, project: str | None = None,
                               ids: list[str] | None = None, per_node: int = DEFAULT_PER_NODE) -> SandboxGroupResult:
        """Resume every paused sandbox of a ``job``, a ``project`` or the given ``ids`` (exactly
        one); each one's outcome is in the answer."""
        from .api_ops import api_route

        return await self._group("resume_sandboxes", api_route("resume_sandboxes"),
                                 group_request(job, project, ids, per_node))

    async def _group(self: DSecClient, op: str, route: tuple[str, str],
                     request: SandboxGroupRequest) -> SandboxGroupResult:
        """The call ``op`` at ``route``, or on a resumed job (``resume=True``) its logged answer
        while the log has one."""
        if self._replay is not None:
            answered, result = self._replay.group(op, request.model_dump(mode="json", exclude_none=True))
            if answered:
                return SandboxGroupResult.model_validate(result)
        return SandboxGroupResult.model_validate(
            await self._request(*route, model=request, timeout=max(self._timeout, 600)))
