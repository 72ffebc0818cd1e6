"""Who is calling: a bearer token names a project. The token in the state dir's ``token`` file
is the root project's; every other token is looked up (by digest) in the project store."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from libdsec import InvalidRequest, ProjectNotFound, Unauthenticated
from libdsec._projects import ROOT_PROJECT
from libdsec.protocol import check_job_name, check_key

from .projects import ProjectStore


@dataclass(frozen=True)
class Caller:
    project: str
    # From the request's headers: the job it is recorded in, a create's idempotency key.
    job: str | None = None
    key: str | None = None

    @property
    def is_root(self) -> bool:
        return self.project == ROOT_PROJECT

    def sees(self, projects: ProjectStore, project: str) -> bool:
        """True when ``project`` is the caller's own or below it."""
        if self.is_root:
            return True
        tree = projects.tree()
        return project in tree and self.project in tree.ancestors(project)

    def check_sees(self, projects: ProjectStore, project: str) -> None:
        """Raise ``ProjectNotFound`` for a project the caller may not see (or that does not
        exist: the two look the same from outside)."""
        # (``sees`` lets the root token see any name; here the project must also exist)
        if not self.sees(projects, project) or (self.is_root and project not in projects.tree()):
            raise ProjectNotFound(f"no project {project!r}")


class Authenticator:
    def __init__(self, root_token: str, projects: ProjectStore) -> None:
        self.root_token = root_token.encode()
        self.projects = projects

    def project_of(self, token: str) -> str | None:
        """The project whose token ``token`` is (the root project's for the root token), None
        for a token no one has (or has no longer)."""
        if secrets.compare_digest(token.encode(), self.root_token):
            return ROOT_PROJECT
        return self.projects.project_of_token(token)

    def caller(self, authorization: str, job: str | None = None, key: str | None = None) -> Caller:
        scheme, _, given = authorization.partition(" ")
        given = given.strip()
        if scheme.lower() == "bearer" and given and (project := self.project_of(given)) is not None:
            return _with(project, job, key)
        raise Unauthenticated("missing or invalid API token (Authorization: Bearer <token>)")


def _with(project: str, job: str | None, key: str | None) -> Caller:
    try:
        return Caller(project, None if job is None else check_job_name(job), None if key is None else check_key(key))
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
