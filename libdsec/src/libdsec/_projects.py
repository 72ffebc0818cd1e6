"""Projects and quotas: the wire models, and the client methods that manage them.

Projects nest; each token belongs to one. A token sees and manages its own project and the
projects below it, and the sandboxes of those. A quota caps sandboxes, CPU cores (weights:
what ``cpu_cores_limit`` asks for) and memory (``memory_limit_mb``); ``None`` is no cap of the
project's own (it shares its parent's). Quota a parent hands to its children is reserved for
them: the children's quotas together stay within the parent's, and the parent's own sandboxes
use what is left.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from .protocol import ProjectUsage, _Model

if TYPE_CHECKING:
    from ._client import DSecClient

PROJECT_NAME_PATTERN = r"^[a-z][a-z0-9-]{0,62}$"  # (Rust regex: $ is the very end)
ROOT_PROJECT = "root"


class ProjectQuota(_Model):
    sandboxes: int | None = None
    cpu_cores: float | None = None
    memory_mb: int | None = None

    @field_validator("cpu_cores")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class ProjectInfo(_Model):
    name: str
    parent: str | None
    # root/…/name
    path: str
    quota: ProjectQuota
    # Quota handed to child projects (the sum of their caps, per resource).
    handed_out: ProjectUsage
    # What the project's own sandboxes hold, and with its descendants'.
    usage: ProjectUsage
    subtree_usage: ProjectUsage
    children: list[str] = Field(default_factory=list)


class ProjectList(_Model):
    projects: list[ProjectInfo]


class ProjectCreateRequest(_Model):
    name: str = Field(pattern=PROJECT_NAME_PATTERN)
    # Default: the caller's own project.
    parent: str | None = None
    quota: ProjectQuota = Field(default_factory=ProjectQuota)


class TokenRequest(_Model):
    # "e2b": E2B's API key form, ``e2b_`` + 40 hex digits (e2b SDKs refuse any other key).
    form: Literal["dsec", "e2b"] = "dsec"


class ProjectToken(_Model):
    project: str
    token: str


def _route(name: str, /, **arguments: object) -> tuple[str, str]:
    from .api_ops import api_route  # (not above: the table imports this module's models)

    return api_route(name, **arguments)


class _ProjectMethods:
    """Mixed into :class:`libdsec.DSecClient`."""

    async def list_projects(self: DSecClient) -> list[ProjectInfo]:
        """The caller's project and every project below it."""
        return ProjectList.model_validate(await self._request(*_route("list_projects"))).projects

    async def get_project(self: DSecClient, name: str) -> ProjectInfo:
        return ProjectInfo.model_validate(await self._request(*_route("get_project", name=name)))

    async def create_project(
        self: DSecClient,
        name: str,
        *,
        parent: str | None = None,
        sandboxes: int | None = None,
        cpu_cores: float | None = None,
        memory_mb: int | None = None,
    ) -> ProjectInfo:
        """A new project under ``parent`` (default: the caller's), with an optional quota."""
        request = ProjectCreateRequest(
            name=name, parent=parent,
            quota=ProjectQuota(sandboxes=sandboxes, cpu_cores=cpu_cores, memory_mb=memory_mb),
        )
        return ProjectInfo.model_validate(await self._request(*_route("create_project"), model=request))

    async def set_project_quota(
        self: DSecClient,
        name: str,
        *,
        sandboxes: int | None = None,
        cpu_cores: float | None = None,
        memory_mb: int | None = None,
    ) -> ProjectInfo:
        """Replace a project's quota (``None``: no cap of its own). Only an ancestor may."""
        quota = ProjectQuota(sandboxes=sandboxes, cpu_cores=cpu_cores, memory_mb=memory_mb)
        return ProjectInfo.model_validate(await self._request(*_route("set_quota", name=name), model=quota))

    async def remove_project(self: DSecClient, name: str) -> None:
        """Remove a project that has no children and no sandboxes (its tokens go with it)."""
        await self._request(*_route("remove_project", name=name))

    async def create_project_token(self: DSecClient, name: str, *, e2b: bool = False) -> str:
        """A new API token for ``name``; shown once (the server keeps only its hash). ``e2b``:
        in E2B's API key form (``e2b_`` + 40 hex digits), for e2b SDKs (docs/COMPAT.md)."""
        body = await self._request(*_route("new_token", name=name), model=TokenRequest(form="e2b" if e2b else "dsec"))
        return ProjectToken.model_validate(body).token

