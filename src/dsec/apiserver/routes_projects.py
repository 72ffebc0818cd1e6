"""HTTP routes for projects, quotas and tokens. Like every route, they only parse: the project
store keeps the records and checks the quota tree; the rule here is who may touch what.

A token may read its own project and those below it, create projects below its own, mint
tokens for any of those, and set quotas or remove projects strictly below its own (a project
cannot raise its own quota). The root token may do all of it, its own quota included.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI

from libdsec import InvalidRequest
from libdsec.protocol import ProjectUsage
from libdsec._projects import ProjectCreateRequest, ProjectInfo, ProjectList, ProjectQuota, ProjectToken, TokenRequest

from .auth import Caller
from .cluster import Cluster
from .projects import quota_of
from .quota import RESOURCES, Amount


def _usage(amount: Amount) -> ProjectUsage:
    return ProjectUsage(sandboxes=int(amount.sandboxes), cpu_cores=round(amount.cpu_cores, 6),
                        memory_mb=int(amount.memory_mb))


async def describe(cluster: Cluster, names: list[str]) -> list[ProjectInfo]:
    tree = cluster.projects.tree()
    usage = await cluster.usage()
    out = []
    for name in names:
        project = tree.projects[name]
        below = tree.subtree(name)
        subtree = Amount()
        for p in below:
            subtree = subtree + usage.get(p, Amount())
        handed = tree.handed_out(name)
        out.append(ProjectInfo(
            name=name, parent=project.parent, path=tree.path(name), quota=quota_of(project),
            handed_out=_usage(handed), usage=_usage(usage.get(name, Amount())), subtree_usage=_usage(subtree),
            children=list(tree.children.get(name, ())),
        ))
    return out


def _strictly_below(cluster: Cluster, caller: Caller, name: str, action: str) -> None:
    caller.check_sees(cluster.projects, name)
    if name == caller.project and not caller.is_root:
        raise InvalidRequest(f"cannot {action} project {name!r} with its own token: ask a token of its parent")


def add_project_routes(app: FastAPI, cluster: Cluster, authenticated, errors: dict) -> None:
    projects = cluster.projects

    @app.get("/v1/projects", responses=errors)
    async def list_projects(caller: Caller = Depends(authenticated)) -> ProjectList:
        tree = projects.tree()
        names = sorted(tree.subtree(caller.project), key=tree.path)
        return ProjectList(projects=await describe(cluster, names))

    @app.get("/v1/projects/{name}", responses=errors)
    async def get_project(name: str, caller: Caller = Depends(authenticated)) -> ProjectInfo:
        caller.check_sees(projects, name)
        return (await describe(cluster, [name]))[0]

    @app.post("/v1/projects", responses=errors)
    async def create_project(request: ProjectCreateRequest, caller: Caller = Depends(authenticated)) -> ProjectInfo:
        parent = request.parent or caller.project
        caller.check_sees(projects, parent)
        await projects.create(request.name, parent, request.quota)
        return (await describe(cluster, [request.name]))[0]

    @app.put("/v1/projects/{name}/quota", responses=errors)
    async def set_quota(name: str, quota: ProjectQuota, caller: Caller = Depends(authenticated)) -> ProjectInfo:
        _strictly_below(cluster, caller, name, "set the quota of")
        await projects.set_quota(name, quota)
        return (await describe(cluster, [name]))[0]

    @app.delete("/v1/projects/{name}", responses=errors)
    async def remove_project(name: str, caller: Caller = Depends(authenticated)) -> dict:
        _strictly_below(cluster, caller, name, "remove")
        held = (await cluster.usage()).get(name, Amount())
        if any(held.get(r) for r in RESOURCES):
            raise InvalidRequest(f"project {name!r} still has {int(held.sandboxes)} sandboxes: stop them first")
        await projects.remove(name)
        return {"removed": name}

    @app.post("/v1/projects/{name}/tokens", responses=errors)
    async def new_token(name: str, request: TokenRequest | None = None,
                        caller: Caller = Depends(authenticated)) -> ProjectToken:
        caller.check_sees(projects, name)
        e2b = request is not None and request.form == "e2b"
        return ProjectToken(project=name, token=await projects.new_token(name, e2b=e2b))
