"""Per-sandbox network allowlists, enforced in the kernel of the host.

Default: no network. A sandbox starts in an empty network namespace (only ``lo``). When its
``network_rules`` allow anything, the edge gives it a routed veth link to the host (a /30 of
the node's subnet: gateway ``.1`` on the host side, ``.2`` as the sandbox's ``eth0``), points
its ``/etc/resolv.conf`` at the gateway, where the edge's resolver answers only allowed names,
and installs an nftables chain for it on the host::

    table inet dsec_<node hash>
      map sandboxes  { ifname : verdict }          host-side veth → the sandbox's chain
      chain forward  (hook forward)  established → accept; iifname vmap @sandboxes;
                                     anything new towards a sandbox → drop
      chain input    (hook input)    iifname vmap @sandboxes   (the host itself, the edge, …)
      chain sb<i>    saddr is not the sandbox's → drop; DNS to its gateway → accept;
                     daddr . proto . dport in @allow<i> → accept;
                     else remember the destination in @blocked<i> and drop

``@allow<i>`` holds the addresses and ports the rules name (from the node's configuration:
services map to hosts and ports, domains to the host table and ``domain_ports``); changing the
rules of a running sandbox swaps the set's contents in one nft transaction. The sandbox has no
CAP_NET_ADMIN, and the chain is in the host's namespace anyway, out of its reach. Nothing
from a sandbox reaches the host, the apiserver (127.0.0.1 of the host is not even routable from
another namespace), the edge or another sandbox: only what is in its set, and its resolver.

Configuration: ``network.json`` in the state dir (or ``DSEC_NETWORK_CONFIG``)::

    {"services": {"pypi": {"hosts": ["pypi.mirror.internal"], "ports": [8080]}},
     "hosts": {"pypi.mirror.internal": ["10.214.1.2"]},
     "domain_ports": [80, 443], "subnet": "10.213.0.0/16"}

Each sandbox's link is a routing interface of its own (forwarding on for it alone, whatever
the host's ``ip_forward``); the interface toward the mirrors needs IPv4 forwarding on too, as
for any router: that one is the operator's.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from libdsec import BackendError, InvalidRequest

from .. import settings
from .resolver import SandboxResolver

log = logging.getLogger("dsec.network")

DOMAINS_KEY = "domains"


@dataclass(frozen=True)
class Service:
    hosts: tuple[str, ...]
    ports: tuple[int, ...]
    protocols: tuple[str, ...] = ("tcp",)


@dataclass
class NetworkConfig:
    services: dict[str, Service] = field(default_factory=dict)
    hosts: dict[str, list[str]] = field(default_factory=dict)
    domain_ports: tuple[int, ...] = (80, 443)
    subnet: str | None = None

    @classmethod
    def load(cls, path: Path) -> NetworkConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            return cls()
        services = {
            name: Service(tuple(s.get("hosts", ())), tuple(int(p) for p in s.get("ports", ())),
                          tuple(s.get("protocols", ("tcp",))))
            for name, s in raw.get("services", {}).items()
        }
        hosts = {k.lower().rstrip("."): [str(ipaddress.IPv4Address(a)) for a in v] for k, v in raw.get("hosts", {}).items()}
        return cls(services, hosts, tuple(raw.get("domain_ports", (80, 443))), raw.get("subnet"))


@dataclass(frozen=True)
class Allowed:
    """What a set of rules lets through: names the resolver answers, and (addr, proto, port)."""

    names: frozenset[str]
    flows: frozenset[tuple[str, str, int]]

    @property
    def empty(self) -> bool:
        return not self.names and not self.flows


NOTHING = Allowed(frozenset(), frozenset())  # what no rules (the default) let through


def _addresses(config: NetworkConfig, host: str) -> list[str]:
    try:
        return [str(ipaddress.IPv4Address(host))]
    except ValueError:
        return config.hosts.get(host.lower().rstrip("."), [])


def resolve_rules(config: NetworkConfig, rules: dict) -> Allowed:
    """Check ``network_rules`` against the node's configuration; InvalidRequest if they name
    a service this node does not know or have the wrong shape."""
    if not rules:
        return NOTHING
    names: set[str] = set()
    flows: set[tuple[str, str, int]] = set()
    for key, value in rules.items():
        if key == DOMAINS_KEY:
            if not isinstance(value, list) or not all(isinstance(d, str) and d for d in value):
                raise InvalidRequest("network_rules.domains must be a list of domain names")
            for domain in value:
                domain = domain.lower().rstrip(".")
                names.add(domain)
                for addr in _addresses(config, domain):
                    flows |= {(addr, "tcp", p) for p in config.domain_ports}
            continue
        if not isinstance(value, bool):
            raise InvalidRequest(f"network_rules.{key} must be true or false")
        service = config.services.get(key)
        if service is None:
            if not value:  # denying what the node does not offer denies nothing that was allowed
                continue
            known = ", ".join(sorted(config.services)) or "none"
            raise InvalidRequest(
                f"network_rules: unknown service {key!r} (this node knows: {known}). Services are named in the "
                f"node's network configuration (docs/SECURITY.md, Network); or allow hosts by name with 'domains'")
        if not value:
            continue
        for host in service.hosts:
            names.add(host.lower().rstrip("."))
            for addr in _addresses(config, host):
                flows |= {(addr, proto, p) for proto in service.protocols for p in service.ports}
    return Allowed(frozenset(names), frozenset(flows))


def _run(argv: list[str], stdin: str | None = None) -> None:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BackendError(f"{' '.join(argv[:3])} failed: {proc.stderr.strip()[:500]}")


@dataclass
class _Link:
    index: int
    sandbox_id: str
    allowed: Allowed
    resolver: SandboxResolver | None = None
    blocked_seen: set[str] = field(default_factory=set)


class SandboxNetworks:
    """The networked sandboxes of one edge. ``attach`` / ``update`` / ``detach`` per sandbox;
    ``close`` removes the node's table when no sandbox has a link any more."""

    def __init__(self, node_dir: Path, config: NetworkConfig | None = None,
                 record: Callable[[str, str, str], None] | None = None) -> None:
        digest = hashlib.sha1(str(Path(node_dir).resolve()).encode()).hexdigest()
        self.tag = digest[:4]
        self.table = f"dsec_{digest[:8]}"
        path = settings.current().network_config or Path(node_dir).parent / "network.json"
        self.config = config or NetworkConfig.load(Path(path))
        subnet = self.config.subnet or f"10.{128 + int(digest[8:12], 16) % 64}.0.0/16"
        self.subnet = ipaddress.IPv4Network(subnet)
        self.record = record or (lambda *_: None)
        self._links: dict[str, _Link] = {}
        self._table_made = False

    # -- names -------------------------------------------------------------------------------

    def _host_if(self, index: int) -> str:
        return f"dsv{self.tag}{index}"

    def _addrs(self, index: int) -> tuple[str, str]:
        base = int(self.subnet.network_address) + 4 * index
        return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))

    def check(self, rules: dict) -> Allowed:
        return resolve_rules(self.config, rules)

    def links(self) -> list[str]:
        return list(self._links)

    # -- nftables ----------------------------------------------------------------------------

    def reset(self) -> None:
        """Remove what an edge that crashed left of this node's networking (its table and the
        host ends of its links); the edge gives re-adopted sandboxes their links anew."""
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)
        out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
            if name.startswith(f"dsv{self.tag}"):
                subprocess.run(["ip", "link", "del", name], capture_output=True)
        self._table_made = False

    def _ensure_table(self) -> None:
        if self._table_made:
            return
        t = self.table
        subprocess.run(["nft", "delete", "table", "inet", t], capture_output=True)
        _run(["nft", "-f", "-"], f"""
add table inet {t}
add map inet {t} sandboxes {{ type ifname : verdict; }}
add chain inet {t} forward {{ type filter hook forward priority -10; policy accept; }}
add chain inet {t} input {{ type filter hook input priority -10; policy accept; }}
flush chain inet {t} forward
flush chain inet {t} input
add rule inet {t} forward ct state established,related accept
add rule inet {t} forward iifname vmap @sandboxes
add rule inet {t} forward oifname "dsv{self.tag}*" drop
add rule inet {t} input iifname vmap @sandboxes
""")
        self._table_made = True

    def _elements(self, allowed: Allowed) -> str:
        return ", ".join(f"{a} . {proto} . {port}" for a, proto, port in sorted(allowed.flows))

    # -- lifecycle ---------------------------------------------------------------------------

    async def attach(self, sandbox_id: str, init_pid: int, allowed: Allowed,
                     write_resolv_conf: Callable[[bytes], object]) -> None:
        """Give a running sandbox (its init is ``init_pid``) a link, its chain and its resolver."""
        if sandbox_id in self._links:
            await self.update(sandbox_id, allowed)
            return
        used = {link.index for link in self._links.values()}
        index = next(i for i in range(1, self.subnet.num_addresses // 4) if i not in used)
        link = _Link(index, sandbox_id, allowed)
        self._links[sandbox_id] = link
        host_if, peer = self._host_if(index), f"dsp{self.tag}{index}"
        gw, addr = self._addrs(index)
        try:
            self._ensure_table()
            t, i = self.table, index
            _run(["ip", "-batch", "-"], f"""link add {host_if} type veth peer name {peer}
link set {peer} netns {init_pid}
addr add {gw}/30 dev {host_if}
link set {host_if} up
""")
            # What the sandbox sends is routed on from its link: forwarding on that interface
            # alone (the host's ip_forward may be off; nothing else starts to be routed).
            with open(f"/proc/sys/net/ipv4/conf/{host_if}/forwarding", "w") as f:
                f.write("1")
            # An eth0 left from before an edge restart goes first.
            subprocess.run(["nsenter", f"--net=/proc/{init_pid}/ns/net", "ip", "link", "del", "eth0"], capture_output=True)
            _run(["nsenter", f"--net=/proc/{init_pid}/ns/net", "ip", "-batch", "-"], f"""link set {peer} name eth0
addr add {addr}/30 dev eth0
link set eth0 up
link set lo up
route add default via {gw}
""")
            elements = self._elements(allowed)
            _run(["nft", "-f", "-"], f"""
add set inet {t} allow{i} {{ type ipv4_addr . inet_proto . inet_service; }}
add set inet {t} blocked{i} {{ type ipv4_addr . inet_proto . inet_service; flags dynamic; size 1024; }}
add chain inet {t} sb{i}
add rule inet {t} sb{i} ip saddr != {addr} counter drop
add rule inet {t} sb{i} ip daddr {gw} udp dport 53 accept
add rule inet {t} sb{i} ip daddr . meta l4proto . th dport @allow{i} accept
add rule inet {t} sb{i} meta l4proto {{ tcp, udp }} add @blocked{i} {{ ip daddr . meta l4proto . th dport }} counter drop
add rule inet {t} sb{i} counter drop
{f"add element inet {t} allow{i} {{ {elements} }}" if elements else ""}
add element inet {t} sandboxes {{ "{host_if}" : jump sb{i} }}
""")
            link.resolver = SandboxResolver(gw, lambda name, link=link: self._lookup(link, name),
                                            lambda name, sid=sandbox_id: self.record(sid, "dns.refused", f"name {name!r} is not allowed"))
            await link.resolver.start()
            await write_resolv_conf(f"nameserver {gw}\noptions timeout:1 attempts:1\n".encode())
        except BaseException:
            self.detach(sandbox_id)
            raise

    def _lookup(self, link: _Link, name: str) -> list[str] | None:
        name = name.lower().rstrip(".")
        if not any(name == n or name.endswith("." + n) for n in link.allowed.names):
            return None
        return _addresses(self.config, name) or None

    async def update(self, sandbox_id: str, allowed: Allowed) -> None:
        """Swap a networked sandbox's allowlist at once (one nft transaction)."""
        link = self._links[sandbox_id]
        elements = self._elements(allowed)
        t, i = self.table, link.index
        _run(["nft", "-f", "-"], f"flush set inet {t} allow{i}\n"
             + (f"add element inet {t} allow{i} {{ {elements} }}\n" if elements else ""))
        link.allowed = allowed

    def detach(self, sandbox_id: str) -> None:
        """Remove a sandbox's link, chain, sets and resolver (idempotent). Its end of the veth
        goes with its network namespace; the host end is deleted here in case it is alive."""
        link = self._links.pop(sandbox_id, None)
        if link is None:
            return
        if link.resolver is not None:
            link.resolver.close()
        t, i, host_if = self.table, link.index, self._host_if(link.index)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        if self._table_made:
            subprocess.run(["nft", "-f", "-"], capture_output=True, text=True, input=f"""
delete element inet {t} sandboxes {{ "{host_if}" }}
""")
            subprocess.run(["nft", "-f", "-"], capture_output=True, text=True, input=f"""
flush chain inet {t} sb{i}
delete chain inet {t} sb{i}
delete set inet {t} allow{i}
delete set inet {t} blocked{i}
""")

    def collect(self, sandbox_id: str) -> None:
        """Record destinations the sandbox's chain dropped since last time."""
        link = self._links.get(sandbox_id)
        if link is None or not self._table_made:
            return
        proc = subprocess.run(["nft", "-j", "list", "set", "inet", self.table, f"blocked{link.index}"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return
        try:
            items = json.loads(proc.stdout)["nftables"]
            elems = next(x["set"].get("elem", []) for x in items if "set" in x)
        except (ValueError, KeyError, StopIteration):
            return
        for elem in elems:
            value = elem.get("elem", {}).get("val", elem) if isinstance(elem, dict) else elem
            parts = value.get("concat", []) if isinstance(value, dict) else []
            if len(parts) != 3:
                continue
            addr, proto, port = parts
            key = f"{proto} {addr}:{port}"
            if key not in link.blocked_seen:
                link.blocked_seen.add(key)
                self.record(sandbox_id, "network.blocked", f"connection to {key} is not allowed")

    def close(self) -> None:
        """Drop every link and the node's table (edge shutdown with no networked sandbox left)."""
        for sandbox_id in list(self._links):
            self.detach(sandbox_id)
        if self._table_made:
            subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)
            self._table_made = False
