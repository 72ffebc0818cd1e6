"""FnCall routes: ``POST /v1/fncall`` (one call) and ``POST /v1/fncall:batch`` (many calls in
one request, answers in order). Handlers only parse and hand the call to an edge.

Bodies are parsed here from the raw JSON (``lean.parse_body``): file contents travel as
base64, which pydantic decodes only when it reads JSON itself.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request, Response
from pydantic import BaseModel

from libdsec.protocol import MAX_BATCH_COUNT, DSecFnCallArgs, FnCallBatchRequest, FnCallBatchResult, FnCallResult

from .cluster import Cluster
from .lean import parse_body


def _body_schema(schema: dict) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def add_fncall_routes(app: FastAPI, cluster: Cluster, authenticated, errors: dict) -> None:
    auth = [Depends(authenticated)]
    call_schema = DSecFnCallArgs.model_json_schema()
    batch_schema = {"title": "FnCallBatchRequest", "type": "object", "required": ["calls"],
                    "additionalProperties": False,
                    "properties": {"calls": {"type": "array", "items": call_schema, "minItems": 1,
                                             "maxItems": MAX_BATCH_COUNT}}}

    @app.post("/v1/fncall", dependencies=auth, responses=errors, response_model=FnCallResult,
              openapi_extra=_body_schema(call_schema))
    async def fncall(request: Request) -> Response:
        args = parse_body(DSecFnCallArgs, await request.body())
        return _json(await cluster.fncall(args))

    @app.post("/v1/fncall:batch", dependencies=auth, responses=errors, response_model=FnCallBatchResult,
              openapi_extra=_body_schema(batch_schema))
    async def fncall_batch(request: Request) -> Response:
        batch = parse_body(FnCallBatchRequest, await request.body())
        return _json(FnCallBatchResult(results=await cluster.fncall_many(batch.calls)))
