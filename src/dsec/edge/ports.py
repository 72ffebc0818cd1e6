"""HTTP to a port inside a sandbox, the same for every kind: one command in the sandbox per
request, ``base64 -d | nc 127.0.0.1 PORT | base64`` (busybox has both), so the request reaches
the port in the sandbox's own network namespace (or the VM's) and nothing is opened on the node.

The request is sent with ``Connection: close`` and read to its end; the answer comes back whole
(a chunked body is de-chunked). Nothing listening is ``PortUnreachable`` (502), naming the port.
One request at a time, HTTP/1.x only: no WebSocket (an upgrade is refused).
"""

from __future__ import annotations

import base64

from libdsec import InvalidRequest, PortUnreachable
from libdsec.protocol import ExecResult, PortRequest, PortResponse

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
               "host", "content-length", "authorization"}
_NO_CONNECT = 97


def script(port: int) -> str:
    return f"base64 -d | nc -w 10 127.0.0.1 {port} 2>/dev/null | base64 || exit {_NO_CONNECT}\n"


def raw_request(request: PortRequest) -> bytes:
    if any(k.lower() == "upgrade" for k, _ in request.headers):
        raise InvalidRequest("a WebSocket (or other upgrade) cannot go to a sandbox's port: HTTP requests only")
    body = base64.b64decode(request.body_b64)
    head = [f"{request.method} {request.path} HTTP/1.1", f"Host: 127.0.0.1:{request.port}", "Connection: close",
            f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in request.headers if k.lower() not in _HOP_BY_HOP]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def parse(result: ExecResult, port: int) -> PortResponse:
    raw = base64.b64decode("".join(result.stdout.split()))
    if not raw:
        raise PortUnreachable(f"nothing answered on port {port} in the sandbox (connection refused or closed "
                              "without an answer)")
    head, sep, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        raise PortUnreachable(f"port {port} in the sandbox answered what is not HTTP: {raw[:80]!r}") from None
    headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:] if ":" in line)]
    if any(k.lower() == "transfer-encoding" and "chunked" in v.lower() for k, v in headers):
        body = _dechunk(body)
    headers = [(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP]
    return PortResponse(status=status, headers=headers, body_b64=base64.b64encode(body).decode())


def _dechunk(data: bytes) -> bytes:
    out, at = bytearray(), 0
    while True:
        end = data.find(b"\r\n", at)
        if end < 0:
            return bytes(out)
        size = int(data[at:end].split(b";")[0] or b"0", 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2:end + 2 + size]
        at = end + 2 + size + 2
