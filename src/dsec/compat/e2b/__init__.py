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

import asyncio
import importlib

from fastapi import FastAPI
from starlette.routing import BaseRoute

from ...apiserver.auth import Authenticator
from ...apiserver.cluster import Cluster

__all__ = ["add_e2b_routes"]


def add_e2b_routes(app: FastAPI, cluster: Cluster, authenticator: Authenticator) -> list[BaseRoute]:
    """The E2B API, made at its first request (to ``/e2b…`` or ``/files``): importing the e2b
    package and making its routes costs a server about a second of CPU, which a server whose
    callers never use E2B's API need not pay at every start. Until then nothing of it is in the
    app; its first caller waits for it (the import in a thread: the server serves the others
    meanwhile). Returns no route: they are added to ``app.state.plain_routes`` when made."""
    app.add_middleware(_AtFirstRequest, make=lambda: _add_routes(app, cluster, authenticator))
    return []


class _AtFirstRequest:
    """ASGI middleware: the E2B API made (``make``) before the first request for it goes on."""

    def __init__(self, app, make) -> None:
        self.app, self._make = app, make
        self._made = False
        self._making: asyncio.Lock | None = None

    async def __call__(self, scope, receive, send) -> None:
        if not self._made and scope["type"] == "http" and scope["path"].startswith(("/e2b", "/files")):
            self._making = self._making or asyncio.Lock()
            async with self._making:
                if not self._made:
                    await asyncio.to_thread(_import_e2b)
                    self._make()
                    self._made = True
        await self.app(scope, receive, send)


def _import_e2b() -> None:
    for module in ("e2b.envd.filesystem.filesystem_connect", "e2b.envd.process.process_connect",
                   "dsec.compat.e2b.control"):
        try:
            importlib.import_module(module)
        except ImportError:
            return  # (said by _add_routes)


def _add_routes(app: FastAPI, cluster: Cluster, authenticator: Authenticator) -> None:
    """Mount the control plane at ``/e2b`` and envd at ``/e2b/envd``; without the e2b extra,
    ``/e2b`` answers 501 saying what to install. Their routes go on the app's list in FastAPI's
    order, and those the apiserver calls without FastAPI's layers on ``app.state.plain_routes``
    (``apiserver.lean``: they do all their own work)."""
    try:
        from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
        from e2b.envd.process.process_connect import ProcessASGIApplication
    except ImportError as exc:
        _add_missing(app, str(exc))
        return
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
    plain = getattr(app.state, "plain_routes", None)
    if plain is not None:
        plain.extend([envd_mount, signed_files, *router.routes])


def _add_missing(app: FastAPI, why: str) -> None:
    from fastapi.responses import JSONResponse

    @app.api_route("/e2b/{path:path}", methods=["GET", "POST", "PUT", "DELETE"], include_in_schema=False)
    async def e2b_missing(path: str) -> JSONResponse:
        return JSONResponse({"code": 501, "message": f"the E2B API needs the e2b extra (pip install 'dsec[e2b]'): {why}"},
                            status_code=501)
