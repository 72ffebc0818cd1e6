"""``dsec bench ports``: HTTP and WebSocket to a port inside a sandbox, through ``port_url`` and
through the host name ``PORT-SANDBOXID.localhost``, against the same server reached directly from
inside the sandbox's network namespace (``nsenter --net``) in the same run (docs/BENCHMARKS.md,
"Ports").

- requests/s: the same load loop (``LOAD``: keep-alive connections, one request in flight on
  each) against the apiserver and, in the sandbox's namespace, against the port itself; the
  three loads taken in turn, ``rounds`` times (so a machine's load moves all three alike), the
  median of each reported;
- first byte: the server inside stamps the first chunk of a streamed answer with the time it
  writes it; the client notes when it arrives (one clock: the machine's);
- WebSocket: an echo's round trip (the ``websockets`` client; the peer the same client in the
  sandbox's namespace), p50.

The server inside is ``APP_SERVER`` (the standard library only: the python image has no more),
also used by ``tests/integration/test_ports.py``. Its own server runs containers only, on
127.0.0.1, with its state under ``--state-dir``; everything it makes is removed at the end
(and checked).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs

from dsec.images.builders import build_python
from dsec.images.store import LayerStore
from dsec.local import LocalServer

from .results import finish_on_server

RESULTS_FILE = "bench-ports.json"

# HTTP/1.1 with keep-alive, threads; and a WebSocket echo (text: "echo:TEXT", binary reversed).
#   GET /            a small page           GET /conn     the client's port (one per connection)
#   GET /headers     the request's headers as the server got them
#   POST /sum        sha256 and length of the body (Content-Length or chunked)
#   GET /stream      "first" written and flushed, then "last" once /tmp/go exists (chunked)
#   GET /ts          a chunk stamped with the time it is written, then the end 20 ms later
#   GET /ws          a WebSocket echo
APP_SERVER = r'''
import base64, hashlib, os, struct, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PAGE = b"<html><head><title>sandbox page</title></head><body><h1 id=t>hello from the sandbox</h1></body></html>"

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # (as servers made for keep-alive do: the head and the body are two writes, and with Nagle
    # the second waits for the first's delayed ACK, 40 ms, on any kept connection)
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def answer(self, body, kind="text/plain"):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Seen-Host", self.headers.get("Host", ""))
        self.send_header("X-Seen-Auth", "yes" if self.headers.get("Authorization") else "no")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_HEAD(self):
        self.answer(PAGE, "text/html")

    def do_GET(self):
        if self.path == "/ws":
            return self.websocket()
        if self.path == "/conn":
            return self.answer(str(self.client_address[1]).encode())
        if self.path == "/headers":
            return self.answer(str(self.headers).encode())
        if self.path in ("/stream", "/ts"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if self.path == "/ts":
                self.chunk(b"%.6f" % time.time())
                time.sleep(0.02)
            else:
                self.chunk(b"first\n")
                deadline = time.time() + 60
                while not os.path.exists("/tmp/go") and time.time() < deadline:
                    time.sleep(0.01)
                self.chunk(b"last\n")
            self.wfile.write(b"0\r\n\r\n")
            return
        self.answer(PAGE, "text/html")

    def do_POST(self):
        digest, size = hashlib.sha256(), 0
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            while (n := int(self.rfile.readline().split(b";")[0], 16)):
                data = self.rfile.read(n)
                self.rfile.readline()
                digest.update(data)
                size += len(data)
            while self.rfile.readline().strip():
                pass
        else:
            left = int(self.headers.get("Content-Length", "0"))
            while left:
                data = self.rfile.read(min(left, 1 << 20))
                digest.update(data)
                size, left = size + len(data), left - len(data)
        self.answer(f"{digest.hexdigest()} {size}".encode())

    def websocket(self):
        key = self.headers["Sec-WebSocket-Key"]
        accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
        self.wfile.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        self.wfile.flush()
        f = self.rfile

        def send(opcode, data):
            n = len(data)
            head = bytes([0x80 | opcode]) + (bytes([n]) if n < 126 else bytes([126]) + struct.pack(">H", n)
                                             if n < 65536 else bytes([127]) + struct.pack(">Q", n))
            self.wfile.write(head + data)
            self.wfile.flush()

        while True:
            head = f.read(2)
            if len(head) < 2:
                return
            n = head[1] & 0x7F
            n = struct.unpack(">H", f.read(2))[0] if n == 126 else struct.unpack(">Q", f.read(8))[0] if n == 127 else n
            mask = f.read(4)
            data = bytes(c ^ mask[i % 4] for i, c in enumerate(f.read(n)))
            opcode = head[0] & 0x0F
            if opcode == 1:
                send(1, b"echo:" + data)
            elif opcode == 2:
                send(2, data[::-1])
            elif opcode == 9:
                send(10, data)
            elif opcode == 8:
                send(8, data[:2])
                self.close_connection = True
                return

ThreadingHTTPServer.daemon_threads = True
server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
print("ready", flush=True)
server.serve_forever()
'''

# The load loop: CONCURRENCY keep-alive connections for SECONDS, GET PATH on each, one request in
# flight; prints the requests completed a second and its own CPU seconds (any answer but a 200 ends it
# with an error: errors are not the server's answers). Argv: host port host-header authorization
# concurrency seconds path.
LOAD = r'''
import asyncio, sys, time

async def main(host, port, name, auth, concurrency, seconds, path):
    head = f"GET {path} HTTP/1.1\r\nHost: {name}\r\n" + (f"Authorization: {auth}\r\n" if auth else "") + "\r\n"
    head = head.encode()
    done = 0
    end = time.monotonic() + seconds

    async def one():
        nonlocal done
        reader, writer = await asyncio.open_connection(host, port)
        while time.monotonic() < end:
            writer.write(head)
            answer = await reader.readuntil(b"\r\n\r\n")
            if not answer.startswith(b"HTTP/1.1 200 "):
                sys.exit(f"not a 200: {answer[:300]!r}")
            length = next(int(l.split(b":")[1]) for l in answer.split(b"\r\n") if l.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            done += 1
        writer.close()

    await asyncio.gather(*(one() for _ in range(concurrency)))
    print(done / seconds, time.process_time())

asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6]),
                 sys.argv[7]))
'''


# The first byte of /ts, straight from the port (run in the sandbox's network namespace).
FIRST_BYTE_DIRECT = r'''
import socket, sys, time
out = []
for _ in range(int(sys.argv[2])):
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    s.sendall(b"GET /ts HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    buf = b""
    while b"\r\n\r\n" not in buf or buf.split(b"\r\n\r\n", 1)[1].count(b"\r\n") < 2:
        buf += s.recv(65536)
    now = time.time()
    out.append((now - float(buf.split(b"\r\n\r\n", 1)[1].split(b"\r\n")[1])) * 1000)
    while s.recv(65536):
        pass
    s.close()
print(" ".join(map(str, out)))
'''


def _cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid``, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _host_pid(marker: str) -> int:
    """The pid, on the host, of the python process in the sandbox whose command line has
    ``marker`` (not the shell that started it)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if b"python" in argv[0] and any(marker.encode() in arg for arg in argv[1:]):
                    return int(entry)
            except OSError:
                continue
    raise RuntimeError(f"no process with {marker!r} on the host")


async def _load(argv_prefix: list[str], host: str, port: int, name: str, auth: str, concurrency: int,
                seconds: float, path: str = "/conn") -> tuple[float, float]:
    """(requests/s, the load loop's own CPU seconds)."""
    proc = await asyncio.create_subprocess_exec(*argv_prefix, sys.executable, "-c", LOAD, host, str(port), name, auth,
                                                str(concurrency), str(seconds), path, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the load loop failed: {err.decode()[-500:]}")
    rps, cpu = out.split()
    return float(rps), float(cpu)


async def _first_byte_ms(url: str, headers: dict, samples: int) -> list[float]:
    import httpx

    gaps = []
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(samples):
            async with http.stream("GET", url, headers=headers) as answer:
                chunks = answer.aiter_raw()
                first = await anext(chunks)
                gaps.append((time.time() - float(first)) * 1000)
                async for _ in chunks:
                    pass
    return gaps


async def _first_byte_direct_ms(pid: int, port: int, samples: int) -> list[float]:
    return await _in_netns(pid, FIRST_BYTE_DIRECT, str(port), str(samples))


# The WebSocket echo's round trips straight from the port (run in the sandbox's network namespace).
WS_DIRECT = r'''
import asyncio, sys, time
from websockets.asyncio.client import connect

async def main(port, samples):
    rtts = []
    async with connect(f"ws://127.0.0.1:{port}/ws") as ws:
        for i in range(samples + 10):
            start = time.perf_counter()
            await ws.send(f"m{i}")
            await ws.recv()
            if i >= 10:
                rtts.append((time.perf_counter() - start) * 1000)
    print(" ".join(map(str, rtts)))

asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
'''


async def _in_netns(pid: int, script: str, *args: str) -> list[float]:
    proc = await asyncio.create_subprocess_exec("nsenter", f"--net=/proc/{pid}/ns/net", sys.executable, "-c", script,
                                                *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the loop in the sandbox's namespace failed: {err.decode()[-500:]}")
    return [float(x) for x in out.split()]


async def _ws_rtt_ms(url: str, headers: dict, samples: int, port: int) -> list[float]:
    from websockets.asyncio.client import connect

    rtts = []
    async with connect(url, additional_headers=headers, host="127.0.0.1", port=port) as ws:
        for i in range(samples + 10):
            start = time.perf_counter()
            await ws.send(f"m{i}")
            await ws.recv()
            if i >= 10:  # (warm-up)
                rtts.append((time.perf_counter() - start) * 1000)
    return rtts


async def _run(server: LocalServer, image: str, opts: dict, console: Console) -> dict:
    r: dict = {}
    seconds, concurrency, samples, rounds = opts["seconds"], opts["concurrency"], opts["samples"], opts["rounds"]
    auth = f"Bearer {server.token}"
    headers = {"authorization": auth}
    async with DSecClient(server.endpoint, token=server.token) as client:
        async with await client.run_container(DSecContainerRunArgs(container_image=image, memory_limit_mb=512,
                                                                   cpu_cores_limit=2)) as sandbox:
            marker = f"app-{os.urandom(4).hex()}"
            await sandbox.write_file(f"/tmp/{marker}.py", APP_SERVER)
            proc = await sandbox.start_shell(f"exec python3 /tmp/{marker}.py 8000")
            async for event in proc.stream():
                if "ready" in (event.data or ""):
                    break
            pid = _host_pid(marker)
            name = f"8000-{sandbox.id}.localhost"
            api = ("127.0.0.1", server.port)
            path = f"/v1/sandboxes/{sandbox.id}/ports/8000"
            console.print("requests/s ...")
            loads = {"direct": (["nsenter", f"--net=/proc/{pid}/ns/net"], "127.0.0.1", 8000, "x", "", "/conn"),
                     "port_url": ([], *api, f"127.0.0.1:{server.port}", auth, f"{path}/conn"),
                     "host_name": ([], *api, f"{name}:{server.port}", auth, "/conn")}
            seen: dict[str, list[float]] = {way: [] for way in loads}
            # CPU µs a request (user + system) of the load loop, the apiserver and the server inside
            cpu: dict[str, list[dict]] = {way: [] for way in loads}
            for _ in range(rounds):
                for way, (prefix, host, port, name_, auth_, path_) in loads.items():
                    before = {"apiserver": sum(_cpu_s(server.proc.pid)), "server": sum(_cpu_s(pid))}
                    rps, load_cpu = await _load(prefix, host, port, name_, auth_, concurrency, seconds, path_)
                    served = rps * seconds
                    seen[way].append(rps)
                    cpu[way].append({"load": load_cpu / served * 1e6,
                                     "apiserver": (sum(_cpu_s(server.proc.pid)) - before["apiserver"]) / served * 1e6,
                                     "server": (sum(_cpu_s(pid)) - before["server"]) / served * 1e6})
            for way, figures in seen.items():
                r[f"rps_{way}"] = statistics.median(figures)
                r[f"rps_{way}_rounds"] = figures
                r[f"cpu_us_per_request_{way}"] = {part: statistics.median(c[part] for c in cpu[way])
                                                  for part in ("load", "apiserver", "server")}
            console.print("first byte ...")
            r["first_byte_direct_ms"] = statistics.median(await _first_byte_direct_ms(pid, 8000, samples))
            r["first_byte_port_url_ms"] = statistics.median(await _first_byte_ms(
                f"{server.endpoint}{path}/ts", headers, samples))
            # (*.localhost is not in every resolver: the host name goes in the Host header)
            r["first_byte_host_name_ms"] = statistics.median(await _first_byte_ms(
                f"{server.endpoint}/ts", {**headers, "host": f"{name}:{server.port}"}, samples))
            console.print("WebSocket ...")
            r["ws_rtt_direct_ms"] = statistics.median(await _in_netns(pid, WS_DIRECT, "8000", str(samples)))
            r["ws_rtt_port_url_ms"] = statistics.median(await _ws_rtt_ms(
                f"ws://127.0.0.1:{server.port}{path}/ws", headers, samples, server.port))
            r["ws_rtt_host_name_ms"] = statistics.median(await _ws_rtt_ms(
                f"ws://{name}:{server.port}/ws", headers, samples, server.port))
            await proc.kill()
    return r


def _table(r: dict) -> Table:
    t = Table(title="a port inside a python sandbox (ThreadingHTTPServer)")
    for column in ("", "direct (nsenter --net)", "port_url", "host name", "goal"):
        t.add_column(column)
    def ms(key: str, peer: str) -> str:
        return f"{r[key]:.2f} ({r[key] / r[peer]:.1f}x, +{r[key] - r[peer]:.2f})" if r.get(peer) else f"{r[key]:.2f}"

    t.add_row(f"requests/s (median of {len(r.get('rps_direct_rounds', [0]))})", f"{r['rps_direct']:.0f}",
              f"{r['rps_port_url']:.0f} ({r['rps_port_url'] / r['rps_direct']:.0%})",
              f"{r['rps_host_name']:.0f} ({r['rps_host_name'] / r['rps_direct']:.0%})", "≥ 50% of direct")
    t.add_row("first byte p50 (ms)", f"{r['first_byte_direct_ms']:.2f}",
              ms("first_byte_port_url_ms", "first_byte_direct_ms"), ms("first_byte_host_name_ms", "first_byte_direct_ms"),
              "≤ 5 ms")
    if "cpu_us_per_request_direct" in r:
        def cpu(way: str) -> str:
            c = r[f"cpu_us_per_request_{way}"]
            apiserver = f" + api {c['apiserver']:.0f}" if way != "direct" else ""
            return f"load {c['load']:.0f}{apiserver} + server {c['server']:.0f}"

        t.add_row("CPU a request (µs)", cpu("direct"), cpu("port_url"), cpu("host_name"), "")
    t.add_row("WebSocket echo RTT p50 (ms)", f"{r['ws_rtt_direct_ms']:.2f}" if "ws_rtt_direct_ms" in r else "",
              ms("ws_rtt_port_url_ms", "ws_rtt_direct_ms"), ms("ws_rtt_host_name_ms", "ws_rtt_direct_ms"), "≤ 2 ms")
    return t


def main(state_dir: Path, console: Console, **opts) -> int:
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    store = LayerStore(state_dir / "store")
    if not store.has_image("python"):
        build_python(store)
    os.environ.setdefault("DSEC_VMS", "0")
    errors: list[str] = []
    r: dict = {}
    server = LocalServer(state_dir, extra_args=("--pool-max", "0")).start()
    try:
        r = asyncio.run(_run(server, "python", opts, console))
    except Exception as exc:  # noqa: BLE001 - reported, then cleaned up and checked
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        server.stop()
    shutil.rmtree(state_dir / "work", ignore_errors=True)
    return finish_on_server(console, state_dir, RESULTS_FILE, r, errors, opts, _table, "ws_rtt_host_name_ms")
