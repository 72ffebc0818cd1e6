"""Red team, isolation: the control channel, the shared layers, neighbours and predecessors.

There is no executor inside a sandbox: commands arrive by ``crun exec`` from the host, files are
read and written from the host through the sandbox's root. These tests show there is nothing
inside to forge, read or reach, and that what one sandbox does stays in it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from libdsec import DSecContainerRunArgs
from redteam import CONNECT, event_kinds

pytestmark = [pytest.mark.slow, pytest.mark.root]


def _args(image: str, **kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image=image, memory_limit_mb=128, **kw)


async def test_no_executor_socket_to_forge(sclient):
    """The report's agents sent forged RPC to the in-sandbox executor's socket. Here the
    sandbox has no socket, no listener and no process but its init and the command; the init
    starts commands, but its channel is an unnamed socket made in the host's network namespace
    that only it holds, and it is not dumpable: its fds cannot be opened, it cannot be traced,
    and a signal from inside does not stop it."""
    async with await sclient.run_container(_args("busybox")) as sb:
        r = await sb.run_shell("tail -n +2 /proc/net/unix | wc -l; tail -n +2 /proc/net/tcp | wc -l; "
                               "tail -n +2 /proc/net/tcp6 | wc -l; tail -n +2 /proc/net/udp | wc -l; "
                               "find / -xdev -type s 2>/dev/null | wc -l; ls /proc | grep -c '^[0-9]'")
        unix, tcp, tcp6, udp, sockets, procs = (int(x) for x in r.stdout.split())
        assert (unix, tcp, tcp6, udp, sockets) == (0, 0, 0, 0, 0), r.stdout
        assert procs <= 6, r.stdout  # init, the command's keeper, sh, tail/find/ls, grep
        r = await sb.run_shell("cat /proc/1/cmdline | tr '\\0' ' '")
        assert r.stdout.startswith("/dev/.dsec-init"), r.stdout
        r = await sb.run_shell("ls -l /proc/1/fd/; cat /proc/1/fd/0 </dev/null; cat /proc/1/environ; "
                               "kill -9 1; kill -TERM 1; sleep 0.2; echo still here")
        assert r.stderr.count("Permission denied") >= 3, r
        assert "socket:" not in r.stdout and r.stdout.strip().endswith("still here"), r
        assert (await sb.run_shell("echo ok")).stdout == "ok\n"


async def test_reading_the_executors_logs(sclient, sec_server):
    """Nothing the platform logs (server log, crun logs, the API token) is inside the sandbox."""
    token = sec_server.token
    async with await sclient.run_container(_args("busybox")) as sb:
        r = await sb.run_shell(f"find / -xdev -type f -exec grep -l -s -F '{token}' {{}} + 2>/dev/null | head; "
                               "find / -xdev \\( -name 'serve.log' -o -name 'crun.log' -o -name token "
                               "-o -name 'config.json' \\) 2>/dev/null | head", timeout=60)
        assert r.stdout.strip() == "", r.stdout
        r = await sb.run_shell("ls /proc/1/root/ | head -50; readlink /proc/1/root")
        assert "node" not in r.stdout.split() and "store" not in r.stdout.split()


async def test_connecting_to_the_host_edge_and_apiserver(sclient, sec_server, python_image, mirrors):
    """From a networked sandbox: the apiserver's port on the sandbox's gateway (the host), on
    127.0.0.1 (the sandbox's own loopback), the host end of a mirror's link, the resolver's TCP
    port. All dropped or refused; the drops are recorded."""
    port = int(sec_server.endpoint.rsplit(":", 1)[1])
    async with await sclient.run_container(_args(python_image, network_rules={"pypi": True})) as sb:
        await sb.write_file("/tmp/connect.py", CONNECT)
        gw = (await sb.run_shell("ip route 2>/dev/null | awk '/default/ {print $3}' || "
                                 "awk '$2 == \"00000000\" {print $3}' /proc/net/route")).stdout.strip()
        if not gw:
            gw = (await sb.run_shell("sed -n 's/nameserver //p' /etc/resolv.conf")).stdout.strip()
        targets = [(gw, port), ("127.0.0.1", port), (gw, 22), (gw, 53), (mirrors["pypi"].host_ip, port)]
        for host, p in targets:
            r = await sb.run_shell(f"python3 /tmp/connect.py {host} {p} 1")
            assert r.exit_code == 3 and "CONNECTED" not in r.stdout, (host, p, r)
        blocked = (await event_kinds(sb)).get("network.blocked", [])
        for host, p in targets:
            if host != "127.0.0.1":
                assert any(f"{host}:{p}" in d for d in blocked), (host, p, blocked)


async def test_reaching_another_sandbox(sclient, python_image):
    args = _args(python_image, network_rules={"pypi": True})
    async with await sclient.run_container(args) as a, await sclient.run_container(args) as b:
        await a.write_file("/tmp/listen.py", "import socket, time\ns = socket.socket(); s.bind(('0.0.0.0', 7000)); "
                                             "s.listen(); time.sleep(30)\n")
        await a.run_shell("nohup python3 /tmp/listen.py >/dev/null 2>&1 &")
        addr_a = (await a.run_shell("python3 -c \"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                                    "s.connect(('10.0.0.1', 9)); print(s.getsockname()[0])\"")).stdout.strip()
        await b.write_file("/tmp/connect.py", CONNECT)
        r = await b.run_shell(f"python3 /tmp/connect.py {addr_a} 7000 1")
        assert r.exit_code == 3, r
        assert any(f"{addr_a}:7000" in d for d in (await event_kinds(b)).get("network.blocked", []))


async def test_overwriting_bin_sh(sclient, sec_server):
    """The report's agents overwrote /bin/bash. Here it is the sandbox's own copy (overlay copy-up):
    the shared layer and every other sandbox keep theirs."""
    store = Path(os.readlink(Path(sec_server.state_dir) / "store"))
    from dsec.images.store import LayerStore

    layers = LayerStore(store).get_image("busybox").layers
    digests_before = {d: hashlib.sha256(LayerStore(store).layer_path(d).read_bytes()).hexdigest() for d in layers}
    async with await sclient.run_container(_args("busybox")) as a, await sclient.run_container(_args("busybox")) as b:
        r = await a.run_shell("rm -f /bin/sh && printf '#!/bin/busybox ash\\necho PWNED\\n' > /bin/sh && "
                              "chmod +x /bin/sh && cat /bin/sh")
        assert "PWNED" in r.stdout
        assert (await a.run_shell("echo still")).stdout != "still\n"  # its own shell is now broken
        assert (await b.run_shell("echo fine")).stdout == "fine\n"
        async with await sclient.run_container(_args("busybox")) as c:
            assert (await c.run_shell("echo fine")).stdout == "fine\n"
    after = {d: hashlib.sha256(LayerStore(store).layer_path(d).read_bytes()).hexdigest() for d in layers}
    assert after == digests_before


async def test_reading_another_sandboxs_files(sclient):
    async with await sclient.run_container(_args("busybox")) as a, await sclient.run_container(_args("busybox")) as b:
        await a.write_file("/root/answer.txt", "42-secret-of-a")
        await a.run_shell("sleep 30 >/dev/null 2>&1 &")
        r = await b.run_shell("find / -xdev -type f -exec grep -l -s 42-secret-of-a {} + 2>/dev/null | head; "
                              "ls /proc/*/root/root/ 2>/dev/null | head; ps | wc -l", timeout=60)
        assert "answer" not in r.stdout and "42-secret" not in r.stdout, r
        r = await b.run_shell("ps -o pid,args | grep -c '[s]leep 30'")
        assert r.stdout.strip() == "0"  # a's processes are not visible from b


async def test_leftovers_of_an_earlier_sandbox(sclient):
    first = await sclient.run_container(_args("busybox"))
    await first.run_shell("echo leftover-answer > /root/answer.txt; echo x > /tmp/leftover; mkdir -p /var/cache/x")
    await first.stop()
    for _ in range(3):  # fresh and warm-pool sandboxes alike
        async with await sclient.run_container(_args("busybox")) as sb:
            r = await sb.run_shell("cat /root/answer.txt /tmp/leftover 2>&1; ls /var/cache/x 2>&1; "
                                   "find / -xdev -type f -exec grep -l -s leftover-answer {} + 2>/dev/null | head", timeout=60)
            assert "leftover-answer" not in r.stdout and "No such file" in r.stdout, r


async def test_root_inside_is_not_root_outside(sclient):
    async with await sclient.run_container(_args("busybox")) as sb:
        r = await sb.run_shell("id -u; cat /proc/self/uid_map; echo $$")
        uid, inside, outside, count = (int(x) for x in r.stdout.split()[:4])
        assert uid == 0 and inside == 0 and outside >= 1 << 30 and count == 65536
        info = await sb.refresh()
        assert info.status.value == "running"


async def test_another_projects_token_cannot_touch_the_sandbox(sclient, sec_server):
    """Every call is authenticated and scoped to a project: project b's token cannot run, read,
    write, re-network, stop or even see project a's sandbox (nor its security events)."""
    from libdsec import DSecClient, SandboxNotFound, Unauthenticated

    suffix = os.urandom(3).hex()
    await sclient.create_project(f"reda{suffix}")
    await sclient.create_project(f"redb{suffix}")
    token_a = await sclient.create_project_token(f"reda{suffix}")
    token_b = await sclient.create_project_token(f"redb{suffix}")
    try:
        async with DSecClient(sec_server.endpoint, token=token_a) as a_client, \
                DSecClient(sec_server.endpoint, token=token_b) as b_client, \
                DSecClient(sec_server.endpoint, token="forged-" + token_a[7:]) as forged:
            async with await a_client.run_container(_args("busybox")) as sb:
                await sb.write_file("/root/answer.txt", "a's secret")
                with pytest.raises(Unauthenticated):
                    await forged.list_sandboxes()
                assert sb.id not in [s.id for s in await b_client.list_sandboxes()]
                stolen = type(sb)(b_client, sb.info)
                for attempt in (stolen.run_shell("cat /root/answer.txt"), stolen.read_file("/root/answer.txt"),
                                stolen.write_file("/root/answer.txt", "b was here"), stolen.security_events(),
                                stolen.set_network_rules({"pypi": True}), stolen.refresh()):
                    with pytest.raises(SandboxNotFound):
                        await attempt
                with pytest.raises(SandboxNotFound):
                    await b_client.get_sandbox(sb.id)
                with pytest.raises(SandboxNotFound):
                    await stolen.stop()
                assert await sb.read_file("/root/answer.txt") == b"a's secret"
    finally:
        for name in (f"reda{suffix}", f"redb{suffix}"):
            try:
                await sclient.remove_project(name)
            except Exception:  # noqa: BLE001 - best effort
                pass
