"""The edge's DNS resolver: one UDP socket per networked sandbox, on the sandbox's gateway
address, answering only the names the sandbox's rules allow.

Answers come from the node's host table (``NetworkConfig.hosts``); a name that is not allowed
gets NXDOMAIN and a ``dns.refused`` security event. The socket a query arrives on names the
sandbox, so a sandbox cannot ask in another's name (and its source address is checked by the
nftables chain anyway). Only A queries get addresses: sandboxes have no IPv6. Each socket answers
at most ``QUERIES_PER_S`` a second (bursts of ``QUERY_BURST``); a flood beyond is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import Callable

log = logging.getLogger("dsec.resolver")

_TYPE_A = 1
_CLASS_IN = 1
_NXDOMAIN = 3
_FORMERR = 1
_TTL_S = 30
QUERIES_PER_S = 200  # per sandbox, sustained
QUERY_BURST = 400


def parse_query(packet: bytes) -> tuple[int, int, str, int, int]:
    """(id, flags, name, qtype, end of question) of a DNS query; ValueError if malformed."""
    if len(packet) < 12:
        raise ValueError("short DNS header")
    qid, flags, qdcount = struct.unpack(">HHH", packet[:6])
    if qdcount != 1 or flags & 0x8000:
        raise ValueError("not a single-question query")
    labels, i = [], 12
    while True:
        if i >= len(packet):
            raise ValueError("truncated name")
        n = packet[i]
        i += 1
        if n == 0:
            break
        if n & 0xC0 or i + n > len(packet):
            raise ValueError("bad label")
        labels.append(packet[i:i + n].decode("ascii", errors="replace").lower())
        i += n
    if i + 4 > len(packet):
        raise ValueError("truncated question")
    qtype, _qclass = struct.unpack(">HH", packet[i:i + 4])
    return qid, flags, ".".join(labels), qtype, i + 4


def answer(packet: bytes, addresses: list[str] | None) -> bytes:
    """The reply to ``packet``: ``addresses`` as A records, or NXDOMAIN when None."""
    try:
        qid, flags, _name, qtype, end = parse_query(packet)
    except ValueError:
        return packet[:2] + struct.pack(">HHHHH", 0x8180 | _FORMERR, 0, 0, 0, 0) if len(packet) >= 2 else b""
    rd = flags & 0x0100
    question = packet[12:end]
    if addresses is None:
        return struct.pack(">HHHHHH", qid, 0x8080 | rd | _NXDOMAIN, 1, 0, 0, 0) + question
    records = [a for a in addresses if qtype == _TYPE_A]
    out = struct.pack(">HHHHHH", qid, 0x8480 | rd, 1, len(records), 0, 0) + question
    for addr in records:
        out += struct.pack(">HHHIH", 0xC00C, _TYPE_A, _CLASS_IN, _TTL_S, 4) + socket.inet_aton(addr)
    return out


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, lookup: Callable[[str], list[str] | None], refused: Callable[[str], None]) -> None:
        self.lookup = lookup
        self.refused = refused
        self.transport: asyncio.DatagramTransport | None = None
        self.tokens, self.last, self.dropped = float(QUERY_BURST), time.monotonic(), 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        # A flood of queries costs the edge CPU: past the budget, queries are dropped unanswered.
        now = time.monotonic()
        self.tokens = min(QUERY_BURST, self.tokens + (now - self.last) * QUERIES_PER_S)
        self.last = now
        if self.tokens < 1:
            self.dropped += 1
            return
        self.tokens -= 1
        try:
            name = parse_query(data)[2]
        except ValueError:
            name = None
        addresses = self.lookup(name) if name is not None else None
        if name is not None and addresses is None:
            self.refused(name)
        reply = answer(data, addresses)
        if reply and self.transport is not None:
            self.transport.sendto(reply, addr)


class SandboxResolver:
    """The resolver socket of one sandbox. ``lookup(name)`` returns the addresses of an allowed
    name or None; ``refused(name)`` is told of every name refused."""

    def __init__(self, address: str, lookup: Callable[[str], list[str] | None],
                 refused: Callable[[str], None], port: int = 53) -> None:
        self.address, self.port = address, port
        self._protocol = _Protocol(lookup, refused)
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_IP, 15, 1)  # IP_FREEBIND: the address may still be coming up
        sock.bind((self.address, self.port))
        self._transport, _ = await loop.create_datagram_endpoint(lambda: self._protocol, sock=sock)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
