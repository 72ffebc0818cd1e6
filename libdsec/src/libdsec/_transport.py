"""How the SDK's requests reach one endpoint: one small interface, two implementations.

``Transport`` (as httpx's ``BaseTransport``) has three calls: ``request`` sends one request and
reads its answer whole, ``stream`` reads an answer as it arrives (the NDJSON of a batch create,
an exec stream, a tree download), ``aclose`` ends it (a second ``aclose`` does nothing). The
client above it (``DSecClient._request`` and ``_stream``) has the one retry and fail-over
policy; it sees only ``Answer``/``StreamAnswer`` and the failures of ``_wire``:

    WireError               the exchange failed: a timeout, an answer that is no HTTP
    ├── CannotConnect       no connection could be made: the request never left
    └── ConnectionBroken    the connection broke: the request may have reached the server

Each implementation maps its own failures onto these, so a caller never sees an httpx exception.

- ``WireClient`` (``_wire.py``), ``transport="wire"``: the lean HTTP/1.1 client, plain
  ``http://`` only, a ``Transport`` as it stands (no wrapper: not one more call a request).
  The default for ``http://`` endpoints: httpx costs the client several times the CPU a
  request costs the server (``_wire.py`` says why; figures in docs/BENCHMARKS.md, "Lifecycle").
- ``HttpxTransport``, ``transport="httpx"`` or an httpx transport object (``httpx.MockTransport``,
  ``httpx.ASGITransport``, …): httpx, for ``https://`` (the default there: the lean client
  speaks no TLS) and for tests that serve an app in-process.

``DSecClient(transport="wire")`` with an ``https://`` endpoint is refused (``InvalidRequest``).
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

from ._errors import InvalidRequest
from ._wire import Answer, CannotConnect, ConnectionBroken, WireClient, WireError

if TYPE_CHECKING:
    import httpx

__all__ = ["Answer", "HttpxTransport", "StreamAnswer", "Transport", "WireClient", "check_choice", "make_transport"]

# httpx's connection pools a client takes turns over (see HttpxTransport).
_POOL_SHARDS = 8


class StreamAnswer(Protocol):
    """An answer read as it arrives: its status, then its body in pieces, or whole."""

    status_code: int

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...


class Transport(Protocol):
    """Requests to one endpoint. ``path`` is absolute (``/v1/sandboxes``); ``headers`` are this
    request's own, beside the ones the transport was made with (the token, the job); ``timeout``
    bounds the whole exchange (for ``stream``: the head, then each piece). Failures are
    ``WireError``s (the tree in the module docstring); an error *answer* (4xx, 5xx) is an answer."""

    async def request(self, method: str, path: str, *, params: dict[str, str] | None, body: bytes | None,
                      content_type: str | None, timeout: float, headers: dict[str, str] | None) -> Answer: ...

    def stream(self, method: str, path: str, *, body: bytes | None, content_type: str | None, timeout: float,
               headers: dict[str, str] | None) -> Any:
        """An async context manager giving a ``StreamAnswer``; leaving it early closes the connection."""

    async def aclose(self) -> None: ...


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default TLS context, made once a process: each client making its own loads the
    CA bundle again, a cost per client opened larger than its first requests'."""
    import httpx

    return httpx.create_ssl_context()


def _failure(exc: Exception) -> WireError:
    """An httpx failure as one of the tree's (see the module docstring)."""
    import httpx

    if isinstance(exc, httpx.ConnectError):
        return CannotConnect(f"cannot connect: {exc!r}")
    if isinstance(exc, (httpx.NetworkError, httpx.RemoteProtocolError)):
        return ConnectionBroken(f"the server broke off the exchange: {exc!r}")
    return WireError(repr(exc))


class _HttpxStream:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status_code = response.status_code

    async def chunks(self) -> AsyncIterator[bytes]:
        import httpx

        try:
            async for chunk in self._response.aiter_bytes():
                yield chunk
        except httpx.TransportError as exc:
            raise _failure(exc) from exc

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])


class HttpxTransport:
    """httpx as a ``Transport``. ``transport``: an httpx transport object to send through
    (one pool); without one, requests take turns over a few connection pools: httpcore's pool
    looks at every connection (a poll(2) for each idle one) and every queued request each time
    one is sent or done, so its cost per request grows with the connections in flight."""

    def __init__(self, endpoint: str, headers: dict[str, str], max_connections: int, *, timeout: float,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        import httpx

        shards = 1 if transport is not None else min(_POOL_SHARDS, max_connections)
        per_shard = -(-max_connections // shards)
        self._pools = [
            httpx.AsyncClient(base_url=endpoint, headers=headers, timeout=timeout, transport=transport,
                              verify=_tls_context(),
                              limits=httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard))
            for _ in range(shards)
        ]
        self._turn = 0

    def _pool(self) -> httpx.AsyncClient:
        self._turn = (self._turn + 1) % len(self._pools)
        return self._pools[self._turn]

    @staticmethod
    def _headers(headers: dict[str, str] | None, body: bytes | None, content_type: str | None) -> dict[str, str]:
        own = dict(headers or {})
        if body is not None:
            own["content-type"] = content_type or "application/octet-stream"
        return own

    async def request(self, method: str, path: str, *, params: dict[str, str] | None, body: bytes | None,
                      content_type: str | None, timeout: float, headers: dict[str, str] | None) -> Answer:
        import httpx

        try:
            response = await self._pool().request(method, path, params=params, content=body, timeout=timeout,
                                                  headers=self._headers(headers, body, content_type))
        except httpx.TransportError as exc:
            raise _failure(exc) from exc
        return Answer(response.status_code, response.content)

    @asynccontextmanager
    async def stream(self, method: str, path: str, *, body: bytes | None, content_type: str | None, timeout: float,
                     headers: dict[str, str] | None) -> AsyncIterator[_HttpxStream]:
        import httpx

        request = self._pool().stream(method, path, content=body, timeout=timeout,
                                      headers=self._headers(headers, body, content_type))
        try:
            response = await request.__aenter__()
        except httpx.TransportError as exc:
            raise _failure(exc) from exc
        try:
            yield _HttpxStream(response)
        finally:
            try:
                await request.__aexit__(None, None, None)
            except httpx.TransportError:
                pass  # the answer was read, or is given up: nothing more to say of its connection

    async def aclose(self) -> None:
        pools, self._pools = self._pools, []
        for pool in pools:
            await pool.aclose()


def make_transport(choice: Any, endpoint: str, headers: dict[str, str], max_connections: int, *,
                   timeout: float, several: bool) -> WireClient | HttpxTransport:
    """The transport ``choice`` names for ``endpoint`` (``DSecClient(transport=...)``): ``None``
    (the lean client for ``http://``, httpx for ``https://``), ``"wire"``, ``"httpx"``, or an
    httpx transport object. ``several``: the client has other endpoints to move on to."""
    check_choice(choice, (endpoint,))
    if choice is None:
        choice = "wire" if endpoint.startswith("http://") else "httpx"
    if choice == "wire":
        return WireClient(endpoint, headers, max_connections, check_idle=several)
    if choice == "httpx":
        return HttpxTransport(endpoint, headers, max_connections, timeout=timeout)
    return HttpxTransport(endpoint, headers, max_connections, timeout=timeout, transport=choice)


def check_choice(choice: Any, endpoints: tuple[str, ...]) -> Any:
    """``choice`` (``DSecClient(transport=...)``) if it can serve every endpoint, else
    ``InvalidRequest`` naming the problem: when the client is made, not at its first call."""
    if isinstance(choice, str) and choice not in ("wire", "httpx"):
        raise InvalidRequest(f"transport={choice!r}: not 'wire', 'httpx' or an httpx async transport")
    if choice is not None and not isinstance(choice, str) and not callable(getattr(choice, "handle_async_request", None)):
        raise InvalidRequest(f"transport={choice!r}: not 'wire', 'httpx' or an httpx async transport")
    if choice == "wire":
        for endpoint in endpoints:
            if not endpoint.startswith("http://"):
                raise InvalidRequest(f"transport='wire' speaks plain http:// only, not {endpoint!r}: "
                                     "pass transport='httpx' (the default for https://)")
    return choice
