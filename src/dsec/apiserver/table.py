"""The public table's routes (``libdsec.api_ops.PUBLIC_OPS``), served by one generic handler.

``TableRoutes`` is ASGI middleware in front of FastAPI: a request whose method and path are an
operation of the table is served here, whole — the caller checked (the app's ``check``), the
path parameters, query and body parsed by their types and the operation's model, the job log's
rule applied (the entry's ``journal``), then one call: the ``EdgeAPI`` method of the
operation's name, on the sandbox's node (``Cluster.edge_for``; any node for an image call), the
``Cluster`` method of that name for the few the cluster wraps (``CLUSTER_CALLS``), or, for an
operation the apiserver serves itself (``served="apiserver"``), the ``calls.ApiCalls`` method of
that name, given the caller first. The answer is written by the operation's shape: one JSON
body (a model, a list of models, or a small object), raw bytes, NDJSON lines or byte chunks (for
a stream, what fails before its first piece is a plain error answer). Whatever is not in the
table goes on to FastAPI unchanged.

Errors are FastAPI's, as its routes for these operations gave them: a ``DSecError`` as its wire
body and status; input that does not parse as 422 ``invalid_request``, "malformed request: "
and each problem with where it is (``path.pid``, a query parameter's name, a body field), the
caller checked first; anything else as 500 ``internal``.

The OpenAPI document still describes every operation: ``add_schema_routes`` registers, from
the table, FastAPI routes that are there for the document (and a wrong method's 405) only.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import parse_qsl

from fastapi import FastAPI, Path, Query
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from libdsec import InvalidRequest
from libdsec.api_ops import PREFIX, PUBLIC_OPS
from libdsec.ops import Operation as Op, path_format, path_regex

from ..edge.api import EdgeAPI, node_of
from ..edge.files import file_mode
from .calls import ApiCalls
from .cluster import Cluster
from .jobs import Jobs, file_request
from .lean import send_answer

# The operations the cluster wraps (metrics, a stop kept for a node that is away, a copy or a
# fork counted against its project's quota, a desktop's live view and its key, FnCall's choice
# of a node that serves it); the others are the edge's method of the same name.
CLUSTER_CALLS = frozenset({"exec", "stop", "clean_copy", "fork", "desktop_stream", "fncall", "fncall_many"})
# A chunked answer's media type, when not raw bytes.
MEDIA = {"download_tree_tar": "application/x-tar"}
_OCTETS = "application/octet-stream"
_OK = b'{"ok":true}'

# The path parameters whose values are checked once the caller is (a segment of any other value
# still matches the route, so a bad one is a 422 naming it, as FastAPI's routes answered).
_PATH_CHECKS: dict[str, tuple[type, dict[str, Any]]] = {
    "int": (int, {"ge": 1, "le": 999_999_999}),
    "job": (str, {"min_length": 1, "max_length": 128, "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]*$"}),
    "snapshot": (str, {"min_length": 1, "max_length": 64, "pattern": r"^[a-z0-9][a-z0-9._-]*$"}),
}
_CHECKED = {kind: TypeAdapter(Annotated[t, Field(**c)]) for kind, (t, c) in _PATH_CHECKS.items()}
_LOOSE = re.compile(r":(?:" + "|".join(_PATH_CHECKS) + r")\}")
_QUERY = TypeAdapter(Annotated[str, Field(min_length=1)])
# Query parameters that may be left out: their checked value, and the one a call gets without.
_QUERY_DEFAULTS: dict[str, tuple[TypeAdapter, Any]] = {
    "count": (TypeAdapter(Annotated[int, Field(ge=0)]), 0),
    "flag": (TypeAdapter(bool), False),
}
Check = Callable[[dict, dict, str], Awaitable[Any]]


def _problems(exc: ValidationError, where: str = "") -> list[str]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in (where, *err.get("loc", ())) if x != "")
        out.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return out


def _arguments(op: Op) -> tuple[str, ...]:
    target = ApiCalls if op.served == "apiserver" else Cluster if op.name in CLUSTER_CALLS else EdgeAPI
    return tuple(p for p in inspect.signature(getattr(target, op.name)).parameters if p not in ("self", "caller"))


@dataclass(frozen=True, slots=True)
class _Route:
    op: Op
    checked: tuple[tuple[str, TypeAdapter], ...]  # the path parameters checked (an id: 1 … 999999999)
    queries: tuple[tuple[str, str], ...]
    fields: tuple[str, ...]  # a spread request's fields that are the method's arguments
    order: tuple[str, ...]  # the method's arguments given, in its order (passed by position)
    on_cluster: bool
    by_sandbox: bool
    body: str | None  # the operation's body shape (Op.body_shape, read once)
    own: bool  # served by the apiserver itself (ApiCalls), given the caller


def _route(op: Op) -> _Route:
    names = _arguments(op)
    fields = tuple(f for f in op.request.model_fields if f in names) if op.spread and op.request else ()
    given = {n for n, _ in op.params} | {n for n, _ in op.query_params} | set(fields)
    if (op.request is not None and not op.spread) or op.body_shape in ("bytes", "stream"):
        given.add(op.request_arg)
    order = names[:len(given)]
    if set(order) != given:
        raise ValueError(f"{op.name}: the table gives {sorted(given)}, the method takes {names}")
    return _Route(op, tuple((n, _CHECKED[kind]) for n, kind in op.params if kind in _CHECKED), op.query_params,
                  fields, order, op.name in CLUSTER_CALLS, "sandbox_id" in dict(op.params), op.body_shape,
                  op.served == "apiserver")


# Matched by method, in the table's order (the hottest first); a parameter is any one segment
# (its type is checked after the caller, as FastAPI did, so "0" is a 422 naming it, not a 404).
_BY_METHOD: dict[str, list[tuple[Any, _Route]]] = {}
for _op in PUBLIC_OPS:
    _loose = _LOOSE.sub("}", _op.path)
    _BY_METHOD.setdefault(_op.method, []).append((path_regex(_loose, PREFIX), _route(_op)))
del _op, _loose


def _match_in_order(method: str, path: str) -> tuple[_Route, dict[str, str]] | None:
    for regex, route in _BY_METHOD.get(method, ()):
        if (m := regex.match(path)) is not None:
            return route, m.groupdict()
    return None


# The operations without path parameters (the creates, FnCall, the lists) by their path, one
# look-up (those that an operation before them in the order would take stay in the order).
_PLAIN: dict[tuple[str, str], tuple[_Route, dict[str, str]]] = {}
for _op in PUBLIC_OPS:
    if not _op.params and (_found := _match_in_order(_op.method, PREFIX + _op.path)) is not None \
            and _found[0].op is _op:
        _PLAIN[(_op.method, PREFIX + _op.path)] = _found
del _op


def match(method: str, path: str) -> tuple[_Route, dict[str, str]] | None:
    return _PLAIN.get((method, path)) or _match_in_order(method, path)


async def _body(receive) -> bytes | None:
    """The request's whole body, or None if the client went away."""
    data = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        data += message.get("body", b"")
        if not message.get("more_body", False):
            return data


async def _body_chunks(receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InvalidRequest("the request's body broke off: the client went away")
        if chunk := message.get("body", b""):
            yield chunk
        if not message.get("more_body", False):
            return


def _json_body(model: type[BaseModel], body: bytes, content_type: bytes, problems: list[str],
               optional: bool = False) -> BaseModel | None:
    """``body`` as ``model``, as FastAPI read it: JSON when the content type says so (or says
    nothing), else the bytes, which no model takes. An ``optional`` body may be ``null`` or left
    out: the method gets None (a spread request: its fields' defaults, as its own)."""
    if not body:
        problems.append("body: Field required")
        return None
    if content_type and not (content_type.startswith(b"application/json") or b"+json" in content_type):
        problems.append("body: Input should be a valid dictionary or object to extract fields from")
        return None
    try:
        if optional and body.strip() == b"null":
            return None
        return model.model_validate_json(body)
    except ValidationError as exc:
        problems.extend(_problems(exc))
        return None


async def first_piece(events: AsyncIterator) -> Any:
    """The first piece of a stream (None for none); errors before it are a plain answer."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None
    except BaseException:
        await events.aclose()
        raise


async def ndjson(first: BaseModel | None, events: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """One line an event, each sent once the last left; a client that goes away cancels this,
    which closes ``events`` (a command streamed dies with it)."""
    async with aclosing(events):
        if first is not None:
            yield first.model_dump_json() + "\n"
        async for event in events:
            yield event.model_dump_json() + "\n"


async def _chunks(first: bytes | None, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    async with aclosing(chunks):
        if first:
            yield first
        async for chunk in chunks:
            yield chunk


class TableRoutes:
    """ASGI middleware: ``app.add_middleware(TableRoutes, cluster=…, check=…, jobs=…)``.
    ``check(headers, path_params, operation)`` (the raw headers, bytes to bytes) returns the
    caller (or raises)."""

    def __init__(self, app, cluster: Cluster, check: Check, jobs: Jobs) -> None:
        self.app, self.cluster, self.check, self.jobs = app, cluster, check, jobs
        self.calls = ApiCalls(cluster, jobs)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or (found := match(scope["method"], scope["path"])) is None:
            return await self.app(scope, receive, send)
        route, params = found
        await send_answer(lambda: self._serve(route, params, scope, receive), scope, receive, send)

    async def _serve(self, route: _Route, params: dict, scope, receive):
        op = route.op
        headers = dict(scope["headers"])
        body = b""
        if route.body in ("json", "optional", "bytes") and (body := await _body(receive)) is None:
            return None
        caller = await self.check(headers, params, op.name)
        sandbox_id = params.get("sandbox_id")
        if route.by_sandbox:
            node_of(sandbox_id)  # a malformed id is named before any other problem of the request
        if op.journal == "made" and caller.job is not None:
            await self.jobs.mark(caller, sandbox_id, f"{op.method} {scope['path']}")
        kw, request = self._parse(route, params, scope, headers, body, receive)
        args = [kw[name] for name in route.order]
        if route.own:
            target: Any = self.calls
            args.insert(0, caller)
        else:
            target = self.cluster if route.on_cluster else (
                self.cluster.edge_for(sandbox_id) if route.by_sandbox else self.cluster.any_edge())
        bound = getattr(target, op.name)  # (called by position: the edge's own names are its affair)
        if op.answers == "lines":
            events = bound(*args)
            return StreamingResponse(ndjson(await first_piece(events), events), media_type="application/x-ndjson")
        if op.answers == "chunks":
            chunks = bound(*args)
            return StreamingResponse(_chunks(await first_piece(chunks), chunks), media_type=MEDIA.get(op.name, _OCTETS))
        if op.answers == "bytes":
            if op.journal == "read":
                data = await self.jobs.recorded_read(caller, sandbox_id, kw["path"], lambda: bound(*args))
            else:
                data = await bound(*args)
            return Response(data, media_type=_OCTETS)
        if op.journal != "recorded":  # (the common way: no closure, no coroutine of its own)
            return 200, _encoded(_shaped(route, await bound(*args))), []

        async def call() -> Any:
            return _shaped(route, await bound(*args))

        if caller.job is None:
            entry = {}
        elif request is not None:
            entry = request.model_dump(mode="json")
        elif route.body == "bytes":
            entry = file_request(kw["path"], kw["mode"], kw[op.request_arg])
        else:
            entry = {}
        return 200, _encoded(await self.jobs.recorded(caller, op.name, sandbox_id, entry, call)), []

    @staticmethod
    def _parse(route: _Route, params: dict, scope, headers: dict, body: bytes,
               receive) -> tuple[dict, BaseModel | None]:
        """The method's arguments (and the request's model, if it has one), or
        ``InvalidRequest`` naming every problem, as FastAPI listed them (up to five)."""
        op, problems = route.op, []
        kw: dict[str, Any] = dict(params)
        for name, checked in route.checked:
            try:
                kw[name] = checked.validate_python(params[name])
            except ValidationError as exc:
                problems.extend(_problems(exc, f"path.{name}"))
        if route.queries:
            query = dict(parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True))
            for name, kind in route.queries:
                if kind == "mode":
                    kw[name] = query.get(name, "0o644")
                    continue
                if kind == "opt":
                    kw[name] = query.get(name) or None
                    continue
                if kind in _QUERY_DEFAULTS:
                    adapter, kw[name] = _QUERY_DEFAULTS[kind]
                    try:
                        if name in query:
                            kw[name] = adapter.validate_python(query[name])
                    except ValidationError as exc:
                        problems.extend(_problems(exc, name))
                    continue
                try:
                    kw[name] = _QUERY.validate_python(query[name]) if name in query else None
                    if kw[name] is None:
                        problems.append(f"{name}: Field required")
                except ValidationError as exc:
                    problems.extend(_problems(exc, name))
        request = None
        if op.request is not None and (body or route.body != "optional"):
            request = _json_body(op.request, body, headers.get(b"content-type", b""), problems,
                                 route.body == "optional")
        if request is None and op.spread and route.body == "optional" and not problems:
            request = op.request()  # its fields' defaults
        if problems:
            raise InvalidRequest("malformed request: " + "; ".join(problems[:5]))
        for name, kind in route.queries:
            if kind == "mode":
                kw[name] = file_mode(kw[name])
        if request is not None:
            if route.fields:
                for f in route.fields:
                    kw[f] = getattr(request, f)
            elif not op.spread:
                kw[op.request_arg] = request
        elif route.body == "bytes":
            kw[op.request_arg] = body
        elif route.body == "optional" and not op.spread:
            kw[op.request_arg] = None
        elif route.body == "stream":
            kw[op.request_arg] = _body_chunks(receive)
        return kw, request


def add_schema_routes(app: FastAPI, responses: dict) -> None:
    """The table's operations in the app's routes, though ``TableRoutes`` serves them: a plain
    route an operation now, so that a request of another method on its path is a 405 (one of
    the operation's own never gets here), and a FastAPI route an operation, with its path
    parameters, query, body model and answer model, for the OpenAPI document, made the first
    time the document is asked for. (Made at start, those cost every server half a second of
    FastAPI building field validators that no request would use.)"""
    for op in PUBLIC_OPS:
        app.router.routes.append(Route(PREFIX + path_format(op.path), _not_served, methods=[op.method], name=op.name,
                                       include_in_schema=False))
    document = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            for op in PUBLIC_OPS:
                app.add_api_route(PREFIX + path_format(op.path), _schema_endpoint(op), methods=[op.method],
                                  name=op.name, responses=responses, response_model=_answer_model(op))
        return document()

    app.openapi = openapi  # type: ignore[method-assign]


async def _not_served(request) -> None:
    """A table route's request that ``TableRoutes`` left: of another method (a GET route
    answers HEAD here too)."""
    raise HTTPException(405)


def _shaped(route: _Route, result: Any) -> Any:
    """A JSON answer's value from the method's result: the answer model around an unwrapped
    list, ``{"ok": true}`` for an edge's call that answers nothing, else the result itself."""
    op = route.op
    if op.unwrap is not None:
        return op.answer(**{op.unwrap: result})
    return {"ok": True} if op.answer is None and not route.own else result


def _encoded(result: Any) -> bytes:
    """A JSON answer's body: a model, a list of models, or a small object (as Starlette wrote it)."""
    if isinstance(result, BaseModel):
        return result.model_dump_json().encode()
    if isinstance(result, list):
        return b"[" + b",".join(item.model_dump_json().encode() for item in result) + b"]"
    if result == {"ok": True}:
        return _OK
    return json.dumps(result, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _answer_model(op: Op) -> Any:
    if op.answers in ("bytes", "chunks"):
        return None
    if op.answers == "list":
        return list[op.answer]  # type: ignore[name-defined]
    return dict if op.answer is None else op.answer


def _schema_endpoint(op: Op) -> Callable:
    parameters = []
    for name, kind in op.params:
        annotation, checks = _PATH_CHECKS.get(kind, (str, {}))
        parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=Path(**checks),
                                            annotation=annotation))
    for name, kind in op.query_params:
        default, annotation = {"mode": (Query("0o644"), str), "opt": (Query(None), str | None),
                               "count": (Query(0, ge=0), int), "flag": (Query(False), bool)}.get(
                                   kind, (Query(min_length=1), str))
        parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=annotation))
    if op.body_shape == "optional":
        parameters.append(inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY, default=None,
                                            annotation=op.request | None))
    elif op.request is not None:
        parameters.append(inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY, annotation=op.request))

    async def endpoint(**_: Any) -> None:
        raise RuntimeError(f"{op.name} is served by TableRoutes, in front of this route")

    endpoint.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    endpoint.__name__ = op.name
    if op.served == "apiserver":  # (the document's description, as the route's docstring gave it)
        endpoint.__doc__ = getattr(ApiCalls, op.name).__doc__
    return endpoint
