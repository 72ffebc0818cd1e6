"""The red-team suite's fixtures: a ``dsec serve`` with a network configuration, and local
"mirror" servers, each in a network namespace of its own that the fixture makes and removes.

Every address used here lives inside those namespaces or on the host ends of their veths: no
packet leaves this machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


from redteam import MIRROR_PORT, OTHER_PORT

_SERVE = (
    "import http.server, socketserver, sys, threading\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = ('mirror %s port %d' % (sys.argv[1], self.server.server_address[1])).encode()\n"
    "        self.send_response(200); self.send_header('content-length', str(len(body))); self.end_headers()\n"
    "        self.wfile.write(body)\n"
    "    def log_message(self, *a): pass\n"
    "servers = [socketserver.ThreadingTCPServer(('0.0.0.0', p), H) for p in (PORTS)]\n"
    "for s in servers[1:]: threading.Thread(target=s.serve_forever, daemon=True).start()\n"
    "servers[0].serve_forever()\n"
).replace("PORTS", f"{MIRROR_PORT}, {OTHER_PORT}")


@dataclass
class Mirror:
    name: str
    netns: str
    host_if: str
    host_ip: str
    ip: str
    proc: subprocess.Popen


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def start_mirror(name: str, subnet_index: int) -> Mirror:
    tag = secrets.token_hex(3)
    netns, host_if = f"dsecmir{tag}", f"dmh{tag}"
    host_ip, ip = f"10.214.{subnet_index}.1", f"10.214.{subnet_index}.2"
    _sh("ip", "netns", "add", netns)
    try:
        _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _sh("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        _sh("ip", "link", "set", host_if, "up")
        # The host routes the mirror's answers back to the sandboxes: forwarding on for the
        # interface toward it, as network.json's operator would set it (ip_forward may be off).
        Path(f"/proc/sys/net/ipv4/conf/{host_if}/forwarding").write_text("1")
        for cmd in (["ip", "addr", "add", f"{ip}/30", "dev", "eth0"], ["ip", "link", "set", "eth0", "up"],
                    ["ip", "link", "set", "lo", "up"], ["ip", "route", "add", "default", "via", host_ip]):
            _sh("ip", "netns", "exec", netns, *cmd)
        proc = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", _SERVE, name],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except BaseException:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        raise
    mirror = Mirror(name, netns, host_if, host_ip, ip, proc)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        probe = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c",
                                f"import socket; socket.create_connection(('127.0.0.1', {MIRROR_PORT}), 1)"],
                               capture_output=True)
        if probe.returncode == 0:
            return mirror
        time.sleep(0.1)
    stop_mirror(mirror)
    raise RuntimeError(f"mirror {name} did not come up")


def stop_mirror(mirror: Mirror) -> None:
    mirror.proc.kill()
    mirror.proc.wait()
    subprocess.run(["ip", "link", "del", mirror.host_if], capture_output=True)
    subprocess.run(["ip", "netns", "del", mirror.netns], capture_output=True)


@pytest.fixture(scope="session")
def mirrors():
    """Two mirrors: ``pypi`` (a named service) and ``example`` (reached by domain)."""
    made = []
    try:
        made.append(start_mirror("pypi", 201))
        made.append(start_mirror("example", 202))
        yield {m.name: m for m in made}
    finally:
        for m in made:
            stop_mirror(m)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(m.netns in left for m in made)


@pytest.fixture(scope="session")
def sec_server(tmp_path_factory, test_store, mirrors):
    """A ``dsec serve`` whose network configuration knows the two mirrors."""
    from dsec.local import LocalServer, leftovers

    state = tmp_path_factory.mktemp("dsec-sec")
    (state / "store").symlink_to(test_store)
    (state / "network.json").write_text(json.dumps({
        "services": {"pypi": {"hosts": ["pypi.mirror.internal"], "ports": [MIRROR_PORT]},
                     "npm": {"hosts": ["npm.mirror.internal"], "ports": [MIRROR_PORT]}},
        "hosts": {"pypi.mirror.internal": [mirrors["pypi"].ip], "example.internal": [mirrors["example"].ip],
                  "npm.mirror.internal": []},
        "domain_ports": [MIRROR_PORT],
    }))
    srv = LocalServer(state, extra_args=("--pool-max", "2"))
    # The VM backends' kernel cache, shared with the VM tests (so no extraction runs here).
    previous = os.environ.get("DSEC_VM_ASSETS")
    os.environ["DSEC_VM_ASSETS"] = str(Path(test_store).parent / "vm")
    try:
        srv.start()
    finally:
        if previous is None:
            os.environ.pop("DSEC_VM_ASSETS", None)
        else:
            os.environ["DSEC_VM_ASSETS"] = previous
    try:
        yield srv
    finally:
        srv.stop()
        left = leftovers(state)
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
        shutil.rmtree(state, ignore_errors=True)
    assert not left, f"left behind: {left}"
    from dsec.isolation.network import SandboxNetworks

    net = SandboxNetworks(Path(state) / "node")
    assert net.table not in tables, "the node's nftables table outlived the server"
    assert f"dsv{net.tag}" not in links, "a sandbox's veth outlived the server"


@pytest.fixture
async def sclient(sec_server):
    from libdsec import DSecClient

    async with DSecClient(sec_server.endpoint, token=sec_server.token) as c:
        yield c
