"""WebSocket to a port inside a sandbox (``sandbox.port_url(PORT)`` with ``ws://``).

The apiserver takes the client's WebSocket and speaks WebSocket itself to the server inside,
message for message, over a byte tunnel to that port: a PTY of the node's (``dsec.edge.pty``)
whose command is ``stty raw -echo`` (the terminal passes every byte as it is, both ways) then a
relay to 127.0.0.1:PORT (the image's ``nc``; else the VM guest's busybox ``nc``, or a
container's ``dsec-init --connect``), read as base64 so nothing is decoded on the way. So,
as for plain HTTP to a port, the connection is made in the sandbox's own network namespace (or
the VM's), the same for every kind and through the same node seam, and nothing is opened on the
node. The handshake's path, query and subprotocols go on to the server inside; the caller's
token does not.

Nothing listening on the port, or what answers is not a WebSocket server: the client's
handshake is denied with 502 (``PortUnreachable`` naming the port). Either side closing closes
the other (with its code), and the tunnel is closed with it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.http11 import Response as HandshakeResponse
from websockets.uri import parse_uri

from libdsec import DSecError, PortUnreachable, SandboxStateError
from libdsec.protocol import OpenPtyRequest

from ..edge.api import EdgeAPI

log = logging.getLogger("dsec.apiserver.websocket")

READY = b"\x01"  # the tunnel's command says it is in raw mode (bytes before that would be cooked)
MAX_MESSAGE = 16 << 20
HANDSHAKE_TIMEOUT_S = 30.0


# The relay: the image's nc, or the VM guest's busybox, or a container's dsec-init (--connect).
_TUNNEL = """stty raw -echo || exit 97
if command -v nc >/dev/null 2>&1; then set -- nc 127.0.0.1 {port}
elif [ -x /dev/.dsec/busybox ]; then set -- /dev/.dsec/busybox nc 127.0.0.1 {port}
elif [ -x /dev/.dsec-init ]; then set -- /dev/.dsec-init --connect {port}
else exit 98; fi
printf '\\001'
exec "$@"
"""


def tunnel_command(port: int) -> str:
    return _TUNNEL.format(port=int(port))


async def _deny(websocket: WebSocket, exc: DSecError) -> None:
    await websocket.send_denial_response(JSONResponse(exc.to_wire(), status_code=exc.status))


async def relay(websocket: WebSocket, edge: EdgeAPI, sandbox_id: str, port: int, path: str) -> None:
    """Serve the client's WebSocket ``websocket`` (not accepted yet) from ``port`` inside."""
    target = "/" + path + (f"?{websocket.url.query}" if websocket.url.query else "")
    asked = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    inner = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}{target}"), subprotocols=asked or None,
                           max_size=MAX_MESSAGE)
    try:
        pty = await edge.open_pty(sandbox_id, OpenPtyRequest(command=tunnel_command(port), idle_timeout=3600))
    except DSecError as exc:
        await _deny(websocket, exc)
        return
    output = edge.pty_stream(sandbox_id, pty.id, "base64")
    pending = bytearray()

    async def read() -> bytes:
        """The next bytes from the port (b"" once the tunnel ended)."""
        while True:
            try:
                event = await anext(output)
            except StopAsyncIteration:
                return b""
            if event.event == "stdout":
                return base64.b64decode(event.data)
            if event.event in ("exit", "error"):
                return b""

    async def send_inner() -> None:
        if data := b"".join(inner.data_to_send()):
            await edge.pty_input(sandbox_id, pty.id, data)

    try:
        await anext(output)  # started
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            while READY not in pending:
                chunk = await read()
                if not chunk:
                    raise PortUnreachable(f"cannot reach port {port} in the sandbox (no nc or stty there)")
                pending += chunk
            rest = bytes(pending[pending.index(READY) + 1:])
            inner.send_request(inner.connect())
            try:
                await send_inner()
            except SandboxStateError:  # the relay ended already: it could not connect
                raise PortUnreachable(f"nothing answered a WebSocket on port {port} in the sandbox "
                                      "(connection refused)") from None
            response = None
            while response is None:
                if rest:
                    inner.receive_data(rest)
                for event in inner.events_received():
                    if isinstance(event, HandshakeResponse):
                        response = event
                if response is None:
                    rest = await read()
                    if not rest:
                        raise PortUnreachable(f"nothing answered a WebSocket on port {port} in the sandbox "
                                              "(connection refused or closed without an answer)")
        if inner.handshake_exc is not None or response.status_code != 101:
            raise PortUnreachable(f"port {port} in the sandbox did not take the WebSocket: HTTP "
                                  f"{response.status_code} {response.reason_phrase}")
    except (DSecError, TimeoutError) as exc:
        await edge.close_pty(sandbox_id, pty.id)
        await output.aclose()
        if isinstance(exc, TimeoutError):
            exc = PortUnreachable(f"port {port} in the sandbox did not answer the WebSocket handshake within "
                                  f"{HANDSHAKE_TIMEOUT_S:g}s")
        await _deny(websocket, exc)
        return

    await websocket.accept(subprotocol=inner.subprotocol)
    fragments: list[bytes] = []

    async def inner_to_client() -> None:
        while True:
            for frame in inner.events_received():
                if frame.opcode is Opcode.CLOSE:
                    return
                if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
                    fragments[:] = [frame.data]
                    kind = frame.opcode
                elif frame.opcode is Opcode.CONT:
                    fragments.append(frame.data)
                else:
                    continue  # ping/pong: the protocol answers pings itself
                if frame.fin:
                    message = b"".join(fragments)
                    if kind is Opcode.TEXT:
                        await websocket.send_text(message.decode())
                    else:
                        await websocket.send_bytes(message)
            await send_inner()  # (pongs)
            data = await read()
            if not data:
                inner.receive_eof()
                return
            inner.receive_data(data)

    async def client_to_inner() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                inner.send_close(message.get("code", 1000))
                await send_inner()
                return
            if message.get("text") is not None:
                inner.send_text(message["text"].encode())
            elif message.get("bytes") is not None:
                inner.send_binary(message["bytes"])
            await send_inner()

    tasks = [asyncio.create_task(inner_to_client()), asyncio.create_task(client_to_inner())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task.exception() is not None and not isinstance(task.exception(), (WebSocketDisconnect, DSecError)):
                log.warning("a WebSocket to port %d of %s failed: %r", port, sandbox_id, task.exception())
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await websocket.close(code=inner.close_code or 1000, reason=inner.close_reason or "")
        with contextlib.suppress(Exception):
            await output.aclose()
        with contextlib.suppress(Exception):
            await edge.close_pty(sandbox_id, pty.id)
