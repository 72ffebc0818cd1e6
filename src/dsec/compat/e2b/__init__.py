"""The E2B API on DSec: ``E2B_API_URL=<endpoint>/e2b``, ``E2B_SANDBOX_URL=<endpoint>/e2b/envd``,
``E2B_API_KEY=<a DSec token>`` and the official ``e2b`` SDK works unmodified (docs/COMPAT.md).

- ``control``: E2B's REST control plane (sandboxes, timeouts, pause/connect, metrics, templates);
- ``templates``: E2B's template builder (builds, upload links, build status) on DSec's image builds;
- ``envd``: the data plane's ASGI app (its HTTP file routes, the sandbox-id routing and tokens);
- ``process`` / ``filesystem``: envd's Connect RPC services, on DSec's processes and file calls.

Needs the ``e2b`` extra (``pip install dsec[e2b]``): the wire is ``connectrpc``'s, with the
message classes the e2b package publishes.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.routing import BaseRoute

from ...apiserver.auth import Authenticator
from ...apiserver.cluster import Cluster

__all__ = ["add_e2b_routes"]


def add_e2b_routes(app: FastAPI, cluster: Cluster, authenticator: Authenticator) -> list[BaseRoute]:
    """Mount the control plane at ``/e2b`` and envd at ``/e2b/envd``; without the e2b extra,
    ``/e2b`` answers 501 saying what to install. Returns them in FastAPI's order, for the
    apiserver to call without FastAPI's layers (``apiserver.lean``: they do all their own work)."""
    try:
        from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
        from e2b.envd.process.process_connect import ProcessASGIApplication
    except ImportError as exc:
        _add_missing(app, str(exc))
        return []
    from .control import e2b_router
    from .envd import EnvdApp, EnvdContext, EnvdTokens
    from .filesystem import FilesystemService
    from .process import ProcessService

    tokens = EnvdTokens(authenticator.root_token)
    envd = EnvdContext(cluster, tokens)
    process = ProcessASGIApplication(ProcessService(envd))
    files = FilesystemASGIApplication(FilesystemService(envd))
    envd_app = EnvdApp(envd, {process.path + "/": process, files.path + "/": files})
    app.mount("/e2b/envd", envd_app)
    envd_mount = app.routes[-1]
    # The SDK's signed file URLs: /files joined to E2B_SANDBOX_URL, its path dropped.
    app.add_api_route("/files", envd_app.signed_files, methods=["GET", "POST"], include_in_schema=False)
    signed_files = app.routes[-1]
    router = e2b_router(cluster, authenticator, tokens)
    app.include_router(router)
    return [envd_mount, signed_files, *router.routes]


def _add_missing(app: FastAPI, why: str) -> None:
    from fastapi.responses import JSONResponse

    @app.api_route("/e2b/{path:path}", methods=["GET", "POST", "PUT", "DELETE"], include_in_schema=False)
    async def e2b_missing(path: str) -> JSONResponse:
        return JSONResponse({"code": 501, "message": f"the E2B API needs the e2b extra (pip install 'dsec[e2b]'): {why}"},
                            status_code=501)
