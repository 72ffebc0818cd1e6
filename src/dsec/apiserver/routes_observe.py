"""What operators see: ``GET /metrics`` (Prometheus' text format), ``GET /v1/stats`` (the same
figures as one ``ClusterStats``, for ``dsec top`` and scripts: the public table's ``stats``,
``calls.ApiCalls``) and the live dashboard at
``/dashboard``: a static page and a small script of ours (``dashboard/``, served from here, no
build step, nothing from another host) that polls ``/dashboard/stats`` and draws its charts.

All of it takes the root token: the figures span every project. ``/metrics`` and ``/v1/stats``
take it as ``Authorization: Bearer``; a browser opens ``/dashboard?token=TOKEN`` once, which
sets it as a cookie scoped to ``/dashboard`` (HttpOnly, SameSite=Strict) and sends the browser
on to ``/dashboard``: the token leaves the address bar, and no other route takes the cookie.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response

from libdsec import Unauthenticated
from libdsec.protocol import ClusterStats

from .auth import Authenticator, Caller
from .cluster import Cluster
from .metrics import CONTENT_TYPE, Exposition

COOKIE = "dsec_dashboard"
ROOT_ONLY = "the metrics, stats and dashboard take the root token (they span every project)"
_ASSETS = {"": ("index.html", "text/html; charset=utf-8"), "/app.js": ("app.js", "text/javascript; charset=utf-8")}


def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath("dashboard", name).read_bytes()


def add_observe_routes(app: FastAPI, cluster: Cluster, authenticator: Authenticator, errors: dict) -> None:
    exposition = Exposition()
    assets = {path: (_asset(name), media) for path, (name, media) in _ASSETS.items()}

    def root(authorization: str) -> Caller:
        caller = authenticator.caller(authorization)
        if not caller.is_root:
            raise Unauthenticated(ROOT_ONLY)
        return caller

    def dashboard_caller(request: Request) -> Caller:
        authorization = request.headers.get("authorization", "")
        if not authorization and (token := request.cookies.get(COOKIE)):
            authorization = f"Bearer {token}"
        return root(authorization)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        root(request.headers.get("authorization", ""))
        return Response(exposition.render(await cluster.stats()), media_type=CONTENT_TYPE)

    @app.get("/dashboard/stats", include_in_schema=False)
    async def dashboard_stats(request: Request) -> ClusterStats:
        dashboard_caller(request)
        return await cluster.stats()

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request, token: str | None = None) -> Response:
        if token is not None:
            root(f"Bearer {token}")
            response = RedirectResponse("/dashboard", status_code=303)
            response.set_cookie(COOKIE, token, path="/dashboard", httponly=True, samesite="strict")
            return response
        dashboard_caller(request)
        body, media = assets[""]
        return Response(body, media_type=media, headers={"cache-control": "no-store"})

    @app.get("/dashboard/app.js", include_in_schema=False)
    async def dashboard_script(request: Request) -> Response:
        dashboard_caller(request)
        body, media = assets["/app.js"]
        return Response(body, media_type=media, headers={"cache-control": "no-store"})
