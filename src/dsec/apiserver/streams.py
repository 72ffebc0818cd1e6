"""A desktop's live view in the browser: ``sandbox.desktop.stream_url()``.

The node starts x11vnc and noVNC in the sandbox (``Desktops.desktop_stream``, on E2B Desktop's
ports); this module serves noVNC's page, its files and its VNC WebSocket to a browser under
``/v1/sandboxes/{id}/desktop/stream/{key}/…``, through the same proxy as the sandbox's other
ports (``PortProxy.serve`` for HTTP, ``websocket.relay`` for the WebSocket): one copy of the
proxying for E2B Desktop's stream (a host name) and DSec's.

A browser sends no ``Authorization`` header on a page or a WebSocket, so the page's path carries
a key instead (every file noVNC loads is relative to the page, so each carries it too): made
for the sandbox and the project of the caller that asked for it, with its expiry, signed with a
key drawn from the apiserver's root token (any apiserver of the cluster checks it without a
lookup). Each request is checked: a missing, altered or expired key is ``Unauthenticated`` (401);
a key is refused once its sandbox is no longer its project's. A caller of another project cannot
get a key for the sandbox (``stream_url`` answers ``SandboxNotFound``, as for any of its calls).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
from urllib.parse import quote

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from libdsec import DSecError, Unauthenticated
from libdsec.protocol import DesktopStream

from ..edge.desktop import STREAM_PORT
from .auth import Caller
from .lean import error_headers
from .ports import PortProxy
from .websocket import relay as websocket_relay

_PATH = re.compile(rb"/v1/sandboxes/([a-z0-9-]{1,80})/desktop/stream/([^/]*)(/.*)?\Z")
PAGE = "vnc.html"


class StreamKeys:
    """The keys of live views: ``EXPIRES.PROJECT.MAC`` (the project in URL-safe base64)."""

    def __init__(self, root_token: str | bytes) -> None:
        token = root_token.encode() if isinstance(root_token, str) else root_token
        self._key = hashlib.sha256(b"dsec-desktop-stream\0" + token).digest()

    def _mac(self, sandbox_id: str, project: str, expires: int) -> str:
        payload = f"{sandbox_id}\0{project}\0{expires}".encode()
        return hmac.new(self._key, payload, hashlib.sha256).hexdigest()[:40]

    def stream(self, sandbox_id: str, project: str, ttl_s: float) -> DesktopStream:
        expires = int(time.time() + ttl_s)
        name = base64.urlsafe_b64encode(project.encode()).decode().rstrip("=")
        key = f"{expires}.{name}.{self._mac(sandbox_id, project, expires)}"
        base = f"v1/sandboxes/{sandbox_id}/desktop/stream/{key}"
        query = f"autoconnect=1&reconnect=1&resize=scale&path={quote(base + '/websockify', safe='')}"
        return DesktopStream(path=f"/{base}/{PAGE}?{query}", expires_at=float(expires))

    def check(self, sandbox_id: str, key: str) -> str:
        """The project of a key made for ``sandbox_id``; else ``Unauthenticated``."""
        parts = key.split(".")
        try:
            expires, name, mac = int(parts[0]), parts[1], parts[2]
            project = base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode()
        except (IndexError, ValueError, binascii.Error, UnicodeDecodeError):
            raise Unauthenticated(f"the live view of sandbox {sandbox_id} needs the key in the URL that "
                                  f"sandbox.desktop.stream_url() gives: this path has none") from None
        if len(parts) != 3 or not hmac.compare_digest(self._mac(sandbox_id, project, expires), mac):
            raise Unauthenticated(f"the live view of sandbox {sandbox_id} needs the key in the URL that "
                                  f"sandbox.desktop.stream_url() gives: this one is not it")
        if expires < time.time():
            raise Unauthenticated(f"the key of this live view of sandbox {sandbox_id} expired; ask "
                                  f"sandbox.desktop.stream_url() for a new one")
        return project


class StreamRoutes:
    """ASGI middleware: ``/v1/sandboxes/{id}/desktop/stream/{key}/…`` (HTTP and WebSocket) to
    the sandbox's noVNC, once its key is checked; everything else goes on to ``app``."""

    def __init__(self, app, keys: StreamKeys, proxy: PortProxy) -> None:
        self.app, self.keys, self.proxy = app, keys, proxy

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind in ("http", "websocket") and scope["path"].startswith("/v1/sandboxes/") \
                and "/desktop/stream/" in scope["path"]:
            m = _PATH.match(scope.get("raw_path") or scope["path"].encode())
            if m is not None:
                await self._serve(scope, receive, send, m)
                return
        await self.app(scope, receive, send)

    async def _serve(self, scope, receive, send, m: re.Match) -> None:
        sandbox_id, key = m.group(1).decode(), m.group(2).decode("latin-1")
        rest = m.group(3) or b"/"
        target = rest + (b"?" + scope["query_string"] if scope.get("query_string") else b"")
        try:
            project = self.keys.check(sandbox_id, key)
            cluster = self.proxy.cluster
            edge = await cluster.edge_for_caller(sandbox_id, Caller(project=project))
        except DSecError as exc:
            answer = JSONResponse(exc.to_wire(), status_code=exc.status, headers=error_headers(exc))
            if scope["type"] == "websocket":
                await WebSocket(scope, receive, send).send_denial_response(answer)
            else:
                await answer(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await websocket_relay(WebSocket(scope, receive, send), edge, sandbox_id, STREAM_PORT,
                                  target.decode("latin-1"))
            return
        try:
            await self.proxy.serve(scope, receive, send, sandbox_id, STREAM_PORT, target,
                                   b"127.0.0.1:%d" % STREAM_PORT)
        except DSecError as exc:
            await JSONResponse(exc.to_wire(), status_code=exc.status, headers=error_headers(exc))(scope, receive, send)
