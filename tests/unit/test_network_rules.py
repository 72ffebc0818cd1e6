"""Network allowlists without the kernel: rules against a node's configuration, the resolver's
DNS codec, the seccomp profile's ioctl matches, and security-event bookkeeping."""

from __future__ import annotations

import socket
import struct

import pytest

from libdsec import InvalidRequest
from dsec.isolation import profile
from dsec.isolation.events import SecurityEvents
from dsec.isolation.network import NetworkConfig, Service, resolve_rules
from dsec.isolation.resolver import answer, parse_query
from dsec.isolation.userns import IdRanges

CONFIG = NetworkConfig(
    services={"pypi": Service(("pypi.mirror.internal",), (8080,)), "npm": Service(("10.9.9.9",), (80, 443))},
    hosts={"pypi.mirror.internal": ["10.1.0.2", "10.1.0.3"], "example.internal": ["10.2.0.2"]},
    domain_ports=(443,),
)


def test_services_and_domains_become_names_and_flows():
    allowed = resolve_rules(CONFIG, {"pypi": True, "npm": False, "domains": ["Example.Internal."]})
    assert allowed.names == {"pypi.mirror.internal", "example.internal"}
    assert allowed.flows == {("10.1.0.2", "tcp", 8080), ("10.1.0.3", "tcp", 8080), ("10.2.0.2", "tcp", 443)}
    assert resolve_rules(CONFIG, {"npm": True}).flows == {("10.9.9.9", "tcp", 80), ("10.9.9.9", "tcp", 443)}
    assert resolve_rules(CONFIG, {}).empty and resolve_rules(CONFIG, {"pypi": False}).empty


def test_denying_a_service_the_node_does_not_know_denies_nothing():
    """The report's Listing 1 passes {"npm": False, …}: on a node that has no npm, that is no error."""
    assert resolve_rules(CONFIG, {"crates": False}).empty
    assert resolve_rules(CONFIG, {"crates": False, "pypi": True}).names == {"pypi.mirror.internal"}


@pytest.mark.parametrize("rules, match", [
    ({"crates": True}, "unknown service 'crates' .*network configuration"),
    ({"crates": "no"}, "true or false"),
    ({"pypi": ["x"]}, "true or false"),
    ({"domains": "example.internal"}, "list of domain names"),
    ({"domains": [""]}, "list of domain names"),
])
def test_bad_rules_are_refused(rules, match):
    with pytest.raises(InvalidRequest, match=match):
        resolve_rules(CONFIG, rules)


def _query(name: str, qtype: int = 1) -> bytes:
    q = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + q + struct.pack(">HH", qtype, 1)


def test_resolver_answers_and_refuses():
    qid, _flags, name, qtype, _end = parse_query(_query("Pypi.Mirror.Internal"))
    assert (qid, name, qtype) == (0x1234, "pypi.mirror.internal", 1)
    reply = answer(_query("pypi.mirror.internal"), ["10.1.0.2", "10.1.0.3"])
    _id, flags, _qd, ancount = struct.unpack(">HHHH", reply[:8])
    assert flags & 0xF == 0 and ancount == 2 and socket.inet_aton("10.1.0.3") in reply
    assert struct.unpack(">H", answer(_query("x.internal"), None)[2:4])[0] & 0xF == 3  # NXDOMAIN
    assert struct.unpack(">H", answer(_query("pypi.mirror.internal", 28), ["10.1.0.2"])[6:8])[0] == 0  # no AAAA
    for junk in (b"", b"\x00" * 5, _query("a")[:-3], b"\x12\x34\x81\x00" + b"\0" * 8):
        with pytest.raises(ValueError):
            parse_query(junk)
        answer(junk, None)  # never raises


def test_ioctl_matches_compare_only_the_low_bits():
    rules = [r for r in profile.seccomp_profile()["syscalls"] if r["names"] == ["ioctl"]]
    matches = {(a["value"], a["valueTwo"]) for r in rules for a in r["args"]}
    assert all(a["op"] == "SCMP_CMP_MASKED_EQ" for r in rules for a in r["args"])
    assert (0xFFFF, 0x586D) in matches and (0xFFFF, 0x660F) in matches  # extent swaps, any size
    for cmd in (0xC0C0586D, 0x1C0C0586D, 0xC0C8586D, 0xC028660F, 0x5412):
        assert any(cmd & mask == value for mask, value in matches), hex(cmd)
    assert "SECCOMP_FILTER_FLAG_LOG" in profile.seccomp_profile()["flags"]


def test_id_ranges_are_one_per_sandbox_and_name_their_owner():
    ranges = IdRanges(base=1 << 30, count=65536, ranges=3)
    a, b = ranges.take("ca"), ranges.take("cb")
    assert a.base != b.base and ranges.take("ca") == a
    assert ranges.owner(b.host(1000)) == "cb" and ranges.owner(5) is None
    ranges.release("ca")
    assert ranges.take("cc").base == a.base
    ranges.take("cd")
    with pytest.raises(OSError):
        ranges.take("ce")
    with pytest.raises(ValueError):
        a.host(65536)


def test_counters_become_events_once():
    events = SecurityEvents()
    assert events.counter_delta("s", "oom_kill", 2) == 2
    assert events.counter_delta("s", "oom_kill", 2) == 0
    assert events.counter_delta("s", "oom_kill", 5) == 3
    events.record("s", "dns.refused", "name 'x' is not allowed")
    events.record("s", "syscall.denied", "mount denied to 'mount'")
    events.record("s", "syscall.denied", "mount denied to 'mount'")  # a repeat: counted, not listed again
    assert [(e.kind, e.count) for e in events.list("s")] == [("dns.refused", 1), ("syscall.denied", 2)]
    assert events.list("other") == []


def test_resolver_drops_a_flood():
    from dsec.isolation import resolver

    sent = []
    proto = resolver._Protocol(lambda name: ["10.1.0.2"], lambda name: None)
    proto.transport = type("T", (), {"sendto": lambda self, data, addr: sent.append(data)})()
    for _ in range(resolver.QUERY_BURST + 100):
        proto.datagram_received(_query("pypi.mirror.internal"), ("10.0.0.2", 5353))
    assert resolver.QUERY_BURST <= len(sent) < resolver.QUERY_BURST + 20 and proto.dropped >= 80


def test_an_ended_sandbox_leaves_only_its_packed_events_bounded():
    from dsec.isolation import events as events_module

    events = SecurityEvents(kept=3)
    for n in range(10):
        events.counter_delta(f"quiet{n}", "oom_kill", 0)  # a sandbox with counters and no event
        events.forget(f"quiet{n}")
    assert events.kept_logs() == (0, 0)  # nothing left of them
    events.record("loud", "limit.memory", "1 process(es) killed at the memory limit")
    events.record("loud", "limit.memory", "1 process(es) killed at the memory limit")
    events.forget("loud")
    assert [(e.kind, e.count) for e in events.list("loud")] == [("limit.memory", 2)]  # readable after its end
    events.record("loud", "network.blocked", "connection to 10.0.0.1:80 is not allowed")  # a late one joins it
    events.forget("loud")
    assert [e.kind for e in events.list("loud")] == ["limit.memory", "network.blocked"]
    for n in range(5):
        events.record(f"s{n}", "limit.timeout", "timed out")
        events.forget(f"s{n}")
    assert events.kept_logs() == (0, 3)  # at most `kept` ended logs, the oldest gone first
    assert events.list("loud") == [] and events.list("s4")[0].kind == "limit.timeout"
    old, events_module.ENDED_LOGS_BYTES = events_module.ENDED_LOGS_BYTES, 1
    try:
        events.record("big", "limit.timeout", "timed out")
        events.forget("big")
        assert events.kept_logs() == (0, 0)  # and at most ENDED_LOGS_BYTES in all
    finally:
        events_module.ENDED_LOGS_BYTES = old
