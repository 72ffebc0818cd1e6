"""The apiserver as ``dsec serve`` serves it: DSec's own API (``dsec.apiserver``) and the
compatibility layers over it (``dsec.compat``: SWE-ReX's runtime, SandboxFusion's ``run_code``,
E2B's control plane and envd), in that order."""

from __future__ import annotations

from fastapi import FastAPI

from .apiserver.app import Cluster
from .apiserver.app import create_app as create_api
from .apiserver.ports import DEFAULT_DOMAIN
from .compat.e2b import add_e2b_routes
from .compat.sandboxfusion import add_sandboxfusion_routes
from .compat.swerex import add_swerex_routes

COMPAT = (add_swerex_routes, add_sandboxfusion_routes, add_e2b_routes)


def create_app(cluster: Cluster, token: str, lifespan=None, domain: str = DEFAULT_DOMAIN) -> FastAPI:
    return create_api(cluster, token, lifespan=lifespan, extensions=COMPAT, domain=domain)
