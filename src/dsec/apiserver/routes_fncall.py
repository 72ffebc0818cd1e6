"""FnCall routes: ``POST /v1/fncall`` (one call) and ``POST /v1/fncall:batch`` (many calls in
one request, answers in order). Handlers only parse and hand the call to an edge.

Both are served by ``FnCallRoutes``, ASGI middleware in front of FastAPI (as the public
table's operations are, ``table.TableRoutes``): a call is a millisecond, and FastAPI's layers
(its middleware, routing over every route, dependency solving) cost the server's event loop
a good share of that on every request. The FastAPI routes stay for the OpenAPI document (and a
wrong method's 405); their bodies' schemas are written inline, since the bodies are parsed
here from the raw JSON (``lean.parse_body``): file contents travel as base64, which pydantic
decodes only when it reads JSON itself. The answers are FastAPI's as they were: the caller
checked first, a malformed body a 422 ``invalid_request`` naming each problem, a
``DSecError`` its wire body and status, anything else a 500 ``internal``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from pydantic import BaseModel

from libdsec.protocol import MAX_BATCH_COUNT, DSecFnCallArgs, FnCallBatchRequest, FnCallBatchResult, FnCallResult

from .cluster import Cluster
from .lean import parse_body, send_answer
from .table import _body

Check = Callable[[dict, dict, str], Awaitable[Any]]
CALL_PATH, BATCH_PATH = "/v1/fncall", "/v1/fncall:batch"


def _body_schema(schema: dict) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


class FnCallRoutes:
    """ASGI middleware: ``app.add_middleware(FnCallRoutes, cluster=…, check=…)`` serves the two
    FnCall routes (module docstring); everything else goes on to ``app``. ``check(headers,
    path_params, route)`` returns the caller or raises, as for the table's operations."""

    def __init__(self, app, cluster: Cluster, check: Check) -> None:
        self.app, self.cluster, self.check = app, cluster, check

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in (CALL_PATH, BATCH_PATH):
            return await self.app(scope, receive, send)
        await send_answer(lambda: self._serve(scope, receive), scope, receive, send)

    async def _serve(self, scope, receive) -> tuple[int, bytes, list] | None:
        body = await _body(receive)
        if body is None:
            return None
        batch = scope["path"] == BATCH_PATH
        await self.check(dict(scope["headers"]), {}, "fncall_batch" if batch else "fncall")
        if batch:
            request = parse_body(FnCallBatchRequest, body)
            answer: BaseModel = FnCallBatchResult(results=await self.cluster.fncall_many(request.calls))
        else:
            answer = await self.cluster.fncall(parse_body(DSecFnCallArgs, body))
        return 200, answer.model_dump_json().encode(), []


def add_fncall_routes(app: FastAPI, cluster: Cluster, authenticated, errors: dict) -> None:
    """The routes for the OpenAPI document; ``FnCallRoutes`` serves their requests first (the
    endpoints still serve them where it is not in front, and do the same)."""
    auth = [Depends(authenticated)]
    call_schema = DSecFnCallArgs.model_json_schema()
    batch_schema = {"title": "FnCallBatchRequest", "type": "object", "required": ["calls"],
                    "additionalProperties": False,
                    "properties": {"calls": {"type": "array", "items": call_schema, "minItems": 1,
                                             "maxItems": MAX_BATCH_COUNT}}}

    @app.post(CALL_PATH, dependencies=auth, responses=errors, response_model=FnCallResult,
              openapi_extra=_body_schema(call_schema))
    async def fncall(request: Request) -> Response:
        args = parse_body(DSecFnCallArgs, await request.body())
        return _json(await cluster.fncall(args))

    @app.post(BATCH_PATH, dependencies=auth, responses=errors, response_model=FnCallBatchResult,
              openapi_extra=_body_schema(batch_schema))
    async def fncall_batch(request: Request) -> Response:
        batch = parse_body(FnCallBatchRequest, await request.body())
        return _json(FnCallBatchResult(results=await cluster.fncall_many(batch.calls)))
