"""WebSocket to a port inside a sandbox (``sandbox.port_url(PORT)`` with ``ws://``, or the
host name ``PORT-SANDBOXID.DOMAIN``: ``dsec.apiserver.ports``).

The apiserver takes the client's WebSocket and speaks WebSocket itself to the server inside,
message for message, over a TCP connection the sandbox's node makes to that port inside the
sandbox (``EdgeAPI.connect_port``: nothing of the image is needed). The client's connection is
the ASGI server's, which speaks the protocol on it, so the relay is by message, not by byte.
The handshake's path, query and subprotocols go on to the server inside; the caller's token
does not.

Nothing listening on the port, or what answers is not a WebSocket server: the client's
handshake is denied with 502 (``PortUnreachable`` naming the port). Either side closing closes
the other (with its code), and the connection with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from starlette.responses import JSONResponse, Response
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.http11 import Response as HandshakeResponse
from websockets.uri import parse_uri

from libdsec import DSecError, PortUnreachable

from ..edge.api import EdgeAPI

log = logging.getLogger("dsec.apiserver.websocket")

MAX_MESSAGE = 16 << 20
HANDSHAKE_TIMEOUT_S = 30.0
_CHUNK = 256 << 10


def _dsec_denial(exc: DSecError) -> Response:
    return JSONResponse(exc.to_wire(), status_code=exc.status)


async def relay(websocket: WebSocket, edge: EdgeAPI, sandbox_id: str, port: int, target: str,
                host: str | None = None, deny: Callable[[DSecError], Response] = _dsec_denial) -> None:
    """Serve the client's WebSocket ``websocket`` (not accepted yet) from ``port`` inside, at
    ``target`` (path and query), with ``host`` as the Host the server sees (127.0.0.1:PORT by
    default); a refusal's body is ``deny``'s."""
    asked = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    inner = ClientProtocol(parse_uri(f"ws://{host or f'127.0.0.1:{port}'}{target}"), subprotocols=asked or None,
                           max_size=MAX_MESSAGE)
    try:
        reader, writer = await edge.connect_port(sandbox_id, port)
    except DSecError as exc:
        await websocket.send_denial_response(deny(exc))
        return

    async def read() -> bytes:
        """The next bytes from the port (b"" once the connection ended)."""
        try:
            return await reader.read(_CHUNK)
        except OSError:
            return b""

    async def send_inner() -> None:
        if data := b"".join(inner.data_to_send()):
            writer.write(data)
            await writer.drain()

    try:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            inner.send_request(inner.connect())
            try:
                await send_inner()
            except OSError:
                raise PortUnreachable(f"port {port} in the sandbox closed the connection") from None
            response = None
            while response is None:
                for event in inner.events_received():
                    if isinstance(event, HandshakeResponse):
                        response = event
                if response is None:
                    data = await read()
                    if not data:
                        raise PortUnreachable(f"nothing answered a WebSocket on port {port} in the sandbox "
                                              "(closed without an answer)")
                    inner.receive_data(data)
        if inner.handshake_exc is not None or response.status_code != 101:
            raise PortUnreachable(f"port {port} in the sandbox did not take the WebSocket: HTTP "
                                  f"{response.status_code} {response.reason_phrase}")
    except (DSecError, TimeoutError) as exc:
        writer.close()
        if isinstance(exc, TimeoutError):
            exc = PortUnreachable(f"port {port} in the sandbox did not answer the WebSocket handshake within "
                                  f"{HANDSHAKE_TIMEOUT_S:g}s")
        await websocket.send_denial_response(deny(exc))
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
            if task.exception() is not None and not isinstance(task.exception(),
                                                               (WebSocketDisconnect, DSecError, OSError)):
                log.warning("a WebSocket to port %d of %s failed: %r", port, sandbox_id, task.exception())
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await websocket.close(code=inner.close_code or 1000, reason=inner.close_reason or "")
        writer.close()
