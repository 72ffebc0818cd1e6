"""Routes served without FastAPI's per-request machinery (the "plain lane"), and the error
answers every lane shares.

A call through FastAPI costs the server's event loop several times what the call itself costs
the apiserver, more than half of it the framework's own layers (exception and exit-stack
middleware, routing, dependency solving, validation and serialisation wrappers). DSec's own
operations skip it by the public table's handler (``table.TableRoutes``); the compat layers' by
this ASGI middleware.

Plain routes (``plain_routes``: the E2B API's) are those that do all their own work: an
endpoint taking the request and its string path parameters and answering a ``Response`` of its
own (its errors included), and ASGI apps mounted at a path. FastAPI adds nothing to them but
its layers, so they are called here as its router would call them, query strings and all, in
the order given up to the first one that is not plain (a catch-all, say): from it on, FastAPI
routes them, as its order says it must. Whoever gives them owns their paths (no route of the
app before them may match them).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import re
import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from fastapi.routing import APIRoute
from starlette.convertors import PathConvertor
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount

from libdsec import DSecError, Overloaded

log = logging.getLogger("dsec.apiserver")

_JSON = [(b"content-type", b"application/json")]


@dataclass(frozen=True)
class _Plain:
    regex: re.Pattern
    endpoint: Callable[..., Awaitable]  # endpoint(request, **path_params) -> Response; or the app mounted
    mount: str | None = None  # the path the app is mounted at


def _plain(route) -> _Plain | None:
    """How to serve ``route`` as a plain route (module docstring), or None when it is not one."""
    if isinstance(route, Mount):
        return _Plain(route.path_regex, route.app, route.path)
    if (not isinstance(route, APIRoute) or route.dependencies
            or any(isinstance(c, PathConvertor) for c in route.param_convertors.values())):
        return None
    hints = typing.get_type_hints(route.endpoint)
    params = list(inspect.signature(route.endpoint).parameters)
    if not params or hints.get(params[0]) is not Request or hints.get("return") not in (Response, JSONResponse):
        return None
    if any(name not in route.param_convertors or hints.get(name) is not str for name in params[1:]):
        return None
    return _Plain(route.path_regex, route.endpoint)


def error_headers(exc: DSecError) -> dict[str, str]:
    """An error answer's headers: ``Retry-After`` (whole seconds, at least 1, as HTTP has it;
    the body's ``retry_after`` is the finer figure) on an ``Overloaded``."""
    if isinstance(exc, Overloaded):
        return {"retry-after": str(max(1, math.ceil(exc.retry_after)))}
    return {}


def _error(exc: DSecError) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    headers = [(k.encode(), v.encode()) for k, v in error_headers(exc).items()]
    return exc.status, json.dumps(exc.to_wire(), separators=(",", ":")).encode(), headers


def internal_error(exc: Exception, scope) -> bytes:
    """The 500 ``internal`` body for an error nothing expected (logged with its traceback)."""
    log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
    body = {"error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}}
    return json.dumps(body, separators=(",", ":")).encode()


Answer = tuple[int, bytes, list[tuple[bytes, bytes]]]


async def send_answer(serve: Callable[[], Awaitable[Answer | Response | None]], scope, receive, send) -> None:
    """Send what ``serve()`` answers: (status, JSON body, extra headers), a ``Response``, or
    nothing (the client went away); a ``DSecError`` as its wire body and status, anything else
    a 500 ``internal``, as FastAPI's app would answer them (``CatchUnexpected``). For the ASGI
    middleware that serve their routes ahead of FastAPI (``table.TableRoutes``)."""
    try:
        answer = await serve()
    except DSecError as exc:
        answer = _error(exc)
    except Exception as exc:  # noqa: BLE001 - see above
        answer = 500, internal_error(exc, scope), []
    if answer is None:
        return
    if isinstance(answer, Response):
        return await answer(scope, receive, send)
    status, body, headers = answer
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class CatchUnexpected:
    """ASGI middleware: an unexpected error becomes a 500 ``internal`` error body, if the
    answer has not started (else it is raised on: the connection is then closed)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def send_tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            if scope["type"] != "http" or started:
                raise
            await Response(internal_error(exc, scope), 500, media_type="application/json")(scope, receive, send)


class LeanRoutes:
    """ASGI middleware: ``app.add_middleware(LeanRoutes, plain_routes=…)``; the list is read at
    the first request (the app adds them after this), and again when it has grown (a layer
    that adds its routes at its own first request: ``dsec.compat.e2b``)."""

    def __init__(self, app, plain_routes: Sequence[BaseRoute] = ()) -> None:
        self.app = app
        self._plain_routes = plain_routes
        self._read = -1  # how many of plain_routes were read
        self._plain: dict[str, list[_Plain]] = {}  # by method; "*": the mounts
        self._plain_prefixes: tuple[str, ...] = ()  # what every plain route's path starts with

    def _by_method(self) -> None:
        self._read = len(self._plain_routes)
        self._plain = {}
        for route in self._plain_routes:
            plain = _plain(route)
            if plain is None:
                break  # from here on, FastAPI's order decides
            for method in getattr(route, "methods", None) or ("*",):
                self._plain.setdefault(method, []).append(plain)
        if self._plain:  # one prefix a first path segment ("/e2b/…", "/files")
            groups: dict[str, list[str]] = {}
            for route in self._plain_routes:
                groups.setdefault(route.path.split("/")[1], []).append(route.path)
            self._plain_prefixes = tuple(os.path.commonprefix(paths) for paths in groups.values())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._read != len(self._plain_routes):
            self._by_method()
        if self._plain and scope["path"].startswith(self._plain_prefixes):
            return await self._serve_plain(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _serve_plain(self, scope, receive, send) -> None:
        path = scope["path"]
        for plain in (*self._plain.get(scope["method"], ()), *self._plain.get("*", ())):
            if (match := plain.regex.match(path)) is not None:
                break
        else:
            return await self.app(scope, receive, send)
        params = match.groupdict()

        async def call(scope, receive, send) -> None:
            if plain.mount is not None:  # as Starlette's Mount calls it
                root = scope.get("root_path", "")
                await plain.endpoint({**scope, "app_root_path": scope.get("app_root_path", root),
                                      "root_path": root + plain.mount}, receive, send)
                return
            scope = {**scope, "path_params": params}
            response = await plain.endpoint(Request(scope, receive, send), **params)
            await response(scope, receive, send)

        await CatchUnexpected(call)(scope, receive, send)
