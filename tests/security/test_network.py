"""Red team, network: what an agent tries to reach from inside a sandbox. Each test asserts the
attempt fails, and that the platform recorded it where it can see it."""

from __future__ import annotations

import pytest

from libdsec import DSecContainerRunArgs, InvalidRequest

from redteam import CONNECT, FETCH, MIRROR_PORT, OTHER_PORT, event_kinds

pytestmark = [pytest.mark.slow, pytest.mark.root]


def _args(python_image: str, **kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image=python_image, memory_limit_mb=256, **kw)


async def _prepare(sandbox) -> None:
    await sandbox.write_file("/tmp/fetch.py", FETCH)
    await sandbox.write_file("/tmp/connect.py", CONNECT)


async def test_default_is_no_network(sclient, python_image, mirrors):
    async with await sclient.run_container(_args(python_image)) as sb:
        await _prepare(sb)
        r = await sb.run_shell(f"ip -br addr 2>/dev/null; cat /proc/net/dev | tail -n +3 | cut -d: -f1; "
                               f"python3 /tmp/connect.py {mirrors['pypi'].ip} {MIRROR_PORT}")
        assert r.exit_code == 3 and "Network is unreachable" in r.stdout, r
        assert "eth0" not in r.stdout


async def test_allowed_service_by_name(sclient, python_image, mirrors):
    async with await sclient.run_container(_args(python_image, network_rules={"pypi": True, "npm": False})) as sb:
        await _prepare(sb)
        r = await sb.run_shell(f"python3 /tmp/fetch.py http://pypi.mirror.internal:{MIRROR_PORT}/simple/")
        assert r.exit_code == 0 and "mirror pypi" in r.stdout, r


async def test_port_scan_for_mirrors(sclient, python_image, mirrors):
    """The report's agents scanned for reachable mirrors: every address/port not allowed is dropped."""
    async with await sclient.run_container(_args(python_image, network_rules={"pypi": True})) as sb:
        await _prepare(sb)
        targets = [(mirrors["example"].ip, MIRROR_PORT), (mirrors["pypi"].ip, OTHER_PORT),
                   (mirrors["pypi"].ip, 22), (mirrors["example"].ip, OTHER_PORT)]
        for host, port in targets:
            r = await sb.run_shell(f"python3 /tmp/connect.py {host} {port} 1")
            assert r.exit_code == 3 and "CONNECTED" not in r.stdout, (host, port, r)
        blocked = (await event_kinds(sb)).get("network.blocked", [])
        for host, port in targets:
            assert any(f"{host}:{port}" in d for d in blocked), (host, port, blocked)


async def test_dns_for_a_name_not_allowed(sclient, python_image, mirrors):
    async with await sclient.run_container(_args(python_image, network_rules={"pypi": True})) as sb:
        await _prepare(sb)
        r = await sb.run_shell("python3 -c \"import socket; print(socket.gethostbyname('example.internal'))\"")
        assert r.exit_code != 0 and "Name or service not known" in r.stderr + r.stdout, r
        r = await sb.run_shell("python3 -c \"import socket; print(socket.gethostbyname('npm.mirror.internal'))\"")
        assert r.exit_code != 0
        refused = (await event_kinds(sb)).get("dns.refused", [])
        assert any("example.internal" in d for d in refused) and any("npm.mirror.internal" in d for d in refused)


async def test_allowed_name_on_a_port_not_allowed(sclient, python_image, mirrors):
    async with await sclient.run_container(_args(python_image, network_rules={"pypi": True})) as sb:
        await _prepare(sb)
        r = await sb.run_shell(f"python3 /tmp/fetch.py http://pypi.mirror.internal:{OTHER_PORT}/")
        assert r.exit_code == 3, r
        blocked = (await event_kinds(sb)).get("network.blocked", [])
        assert any(f"{mirrors['pypi'].ip}:{OTHER_PORT}" in d for d in blocked), blocked


async def test_domains_and_rules_changed_between_stages(sclient, python_image, mirrors):
    async with await sclient.run_container(_args(python_image, network_rules={"domains": ["example.internal"]})) as sb:
        await _prepare(sb)
        url_example = f"http://example.internal:{MIRROR_PORT}/"
        url_pypi = f"http://pypi.mirror.internal:{MIRROR_PORT}/"
        assert "mirror example" in (await sb.run_shell(f"python3 /tmp/fetch.py {url_example}")).stdout
        assert (await sb.run_shell(f"python3 /tmp/fetch.py {url_pypi}")).exit_code == 3
        # Next stage: pypi only.
        await sb.set_network_rules({"pypi": True})
        assert "mirror pypi" in (await sb.run_shell(f"python3 /tmp/fetch.py {url_pypi}")).stdout
        r = await sb.run_shell(f"python3 /tmp/connect.py {mirrors['example'].ip} {MIRROR_PORT} 1")
        assert r.exit_code == 3
        # Last stage: no network at all.
        await sb.set_network_rules({})
        r = await sb.run_shell(f"python3 /tmp/connect.py {mirrors['pypi'].ip} {MIRROR_PORT} 1")
        assert r.exit_code == 3


async def test_unknown_service_is_refused(sclient, python_image):
    with pytest.raises(InvalidRequest, match="unknown service"):
        await sclient.run_container(_args(python_image, network_rules={"crates": True}))


async def test_rules_survive_an_edge_crash(tmp_path_factory, test_store, python_image, mirrors, monkeypatch):
    """SIGKILL the server: on restart the re-adopted sandbox gets its link, chain and resolver
    back from its persisted rules (still only what they allow), and nothing stale is left."""
    import json

    from dsec.local import LocalServer, leftovers
    from libdsec import DSecClient

    state = tmp_path_factory.mktemp("dsec-crash")
    (state / "store").symlink_to(test_store)
    (state / "network.json").write_text(json.dumps({
        "services": {"pypi": {"hosts": ["pypi.mirror.internal"], "ports": [MIRROR_PORT]}},
        "hosts": {"pypi.mirror.internal": [mirrors["pypi"].ip], "example.internal": [mirrors["example"].ip]},
        "domain_ports": [MIRROR_PORT]}))
    monkeypatch.setenv("DSEC_VM_ASSETS", str(test_store.parent / "vm"))
    srv = LocalServer(state, extra_args=("--pool-max", "0")).start()
    try:
        async with DSecClient(srv.endpoint, token=srv.token) as c:
            sb = await c.run_container(_args(python_image, network_rules={"pypi": True}))
            await _prepare(sb)
        srv.kill()
        srv = LocalServer(state, port=srv.port, extra_args=("--pool-max", "0")).start()
        async with DSecClient(srv.endpoint, token=srv.token) as c:
            sb = await c.get_sandbox(sb.id)
            r = await sb.run_shell(f"python3 /tmp/fetch.py http://pypi.mirror.internal:{MIRROR_PORT}/")
            assert "mirror pypi" in r.stdout, r
            r = await sb.run_shell(f"python3 /tmp/connect.py {mirrors['example'].ip} {MIRROR_PORT} 1")
            assert r.exit_code == 3, r
            await sb.stop()
    finally:
        srv.stop()
    assert not leftovers(state)
