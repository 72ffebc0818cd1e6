"""A TCP connection from the node to a port inside a sandbox (``Capability.PORTS``), needing
nothing of the sandbox's image.

- A container: the socket is made in the sandbox's network namespace (a short-lived thread
  ``setns``'s into ``/proc/<init>/ns/net``, makes the socket and goes back: a socket keeps the
  namespace it was made in), then connected to 127.0.0.1:PORT from the node's event loop and
  handed over as asyncio streams. No process in the sandbox, no helper binary.
- A VM: its guest's own loopback is out of the node's reach, so a terminal of the guest agent's
  (``open_pty``) runs the guest's busybox ``nc`` in raw mode (``stty raw -echo``: every byte
  passes as it is); ``pty_tunnel`` relays it onto one end of a socketpair and hands the other
  end over as the same asyncio streams. nc connects first and then runs the relay (``-e``: two
  ``cat``s between the connection and the terminal), which says it is ready: so nothing
  listening there is ``PortUnreachable`` with nc's own words, as a container's refusal is,
  never a stream that ends at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import threading

from libdsec import PortUnreachable, SandboxStateError

from .. import _sys
from .base import PtyProcess

READ_CHUNK = 256 << 10


def _refused(port: int, why: str = "connection refused") -> PortUnreachable:
    return PortUnreachable(f"nothing listens on port {port} in the sandbox ({why})")


def _socket_in(pid: int) -> socket.socket:
    """A TCP socket of the network namespace of process ``pid``, made in a thread of its own
    (``setns`` moves the calling thread alone) that goes back to the node's namespace after."""
    made: list[socket.socket | BaseException] = []

    def run() -> None:
        try:
            home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                os.close(home)
                raise SandboxStateError("the sandbox's processes are gone") from None
            try:
                _sys.setns(target, _sys.CLONE_NEWNET)
                try:
                    made.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC))
                finally:
                    # Back home (the thread ends right after; this keeps it honest if it did not).
                    _sys.setns(home, _sys.CLONE_NEWNET)
            finally:
                os.close(target)
                os.close(home)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            made.append(exc)

    thread = threading.Thread(target=run, name="dsec-netns-socket", daemon=True)
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


async def connect_in_netns(pid: int, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to 127.0.0.1:``port`` in the network namespace of ``pid``."""
    loop = asyncio.get_running_loop()
    sock = await loop.run_in_executor(None, _socket_in, pid)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        return await asyncio.open_connection(sock=sock, limit=READ_CHUNK)
    except ConnectionRefusedError:
        sock.close()
        raise _refused(port) from None
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.ENETUNREACH, errno.EADDRNOTAVAIL):  # no loopback up in there
            raise _refused(port, os.strerror(exc.errno)) from None
        raise
    except BaseException:
        sock.close()
        raise


READY = b"\x01"  # the tunnel's command says it is connected, in raw mode (bytes before would be cooked)

# nc connects, then becomes the relay with the connection on its stdin and stdout and the
# terminal on stderr (busybox nc's -e leaves stderr alone): one cat from the terminal to the
# connection, one back. A refusal is nc's message on the terminal, and the end of it.
_TUNNEL = """stty raw -echo || exit 97
exec {busybox} nc 127.0.0.1 {port} -e {busybox} sh -c '{busybox} printf "\\001" >&2; {busybox} cat <&2 & exec {busybox} cat >&2'
"""


def tunnel_command(busybox: str, port: int) -> str:
    return _TUNNEL.format(busybox=busybox, port=int(port))


async def pty_tunnel(pty: PtyProcess, port: int,
                     timeout: float = 30.0) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The byte stream of a terminal running ``tunnel_command``, as asyncio streams. The
    terminal is closed with the streams (or when the other side of it ends)."""
    pending = bytearray()
    try:
        async with asyncio.timeout(timeout):
            while READY not in pending:
                chunk = await pty.read()
                if not chunk:
                    said = pending.decode(errors="replace").strip().removeprefix("nc: ")
                    raise _refused(port, said[-200:] or "the guest's tunnel ended")
                pending += chunk
    except BaseException:
        await pty.close()
        raise
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=theirs, limit=READ_CHUNK)
    loop = asyncio.get_running_loop()
    first = bytes(pending[pending.index(READY) + 1:])

    async def out() -> None:  # guest → node
        data = first
        while True:
            if data:
                await loop.sock_sendall(ours, data)
            data = await pty.read()
            if not data:
                ours.shutdown(socket.SHUT_WR)
                return

    async def into() -> None:  # node → guest
        while data := await loop.sock_recv(ours, READ_CHUNK):
            await pty.write(data)

    async def run() -> None:
        tasks = [asyncio.ensure_future(out()), asyncio.ensure_future(into())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await pty.close()
            ours.close()

    writer._dsec_tunnel = asyncio.ensure_future(run())  # held: the relay lives as long as the streams
    return reader, writer
