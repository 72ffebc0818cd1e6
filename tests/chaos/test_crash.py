"""Chaos: ``kill -9`` of ``dsec serve`` in the middle of 200 concurrent commands, of a pack_diff
and of a pause; the sandbox's own processes killed under it; a SIGTERM. After a restart every
sandbox is running and adopted (it answers commands) or gone, never both or neither; what the node
says it commits adds up to the sandboxes it lists; and once they are stopped the host has no
mount, cgroup, veth, nftables chain, process or record of the state dir left."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dsec.local import LocalServer, leftovers, persisted_record
from libdsec import (
    DSecClient, DSecContainerRunArgs, DSecError, SandboxNotFound, SandboxStateError, SandboxStatus,
)

pytestmark = [pytest.mark.slow, pytest.mark.root]

MEMORY_MB = 32
ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=MEMORY_MB)
# A service at an address nothing here contacts: it gives a sandbox a veth link and a chain.
NETWORK = {"services": {"mirror": {"hosts": ["mirror.internal"], "ports": [8080]}},
           "hosts": {"mirror.internal": ["10.254.7.2"]}}
NETWORKED = ARGS.model_copy(update={"network_rules": {"mirror": True}})


def host_network(state: Path) -> list[str]:
    """This state dir's node's veth links and nftables table (names from ``SandboxNetworks``)."""
    digest = hashlib.sha1(str((state / "node").resolve()).encode()).hexdigest()
    tag, table = digest[:4], f"dsec_{digest[:8]}"
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    found = [f"veth {name}" for line in links.splitlines()
             if (name := line.split(":")[1].strip().split("@")[0]).startswith((f"dsv{tag}", f"dsp{tag}"))]
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    if table in tables:
        chains = subprocess.run(["nft", "list", "table", "inet", table], capture_output=True, text=True).stdout
        found += [f"nft chain {line.split()[1]}" for line in chains.splitlines()
                  if line.strip().startswith("chain sb")]
    return found


def serve(state: Path, port: int = 0) -> LocalServer:
    return LocalServer(state, port=port, extra_args=("--pool-max", "4"), env={"DSEC_VMS": "0"}).start()


@pytest.fixture
def state(new_state_dir):
    state = new_state_dir("dsec-chaos")
    (state / "network.json").write_text(json.dumps(NETWORK))
    yield state
    if leftovers(state, settle_s=0):  # a failed test's sandboxes: a last server stops them
        srv = serve(state)
        srv.stop_sandboxes()
        srv.stop()
    assert not leftovers(state), leftovers(state)
    assert not host_network(state), host_network(state)


async def check_after_restart(srv: LocalServer, ids: list[str]) -> list[str]:
    """Each of ``ids`` is running and answers, or is gone; the node's commitments add up.
    Returns the running ones."""
    async with DSecClient(srv.endpoint, token=srv.token) as client:
        listed = {i.id: i for i in await client.list_sandboxes()}
        running = []
        for sid in ids:
            try:
                sandbox = await client.get_sandbox(sid)
            except SandboxNotFound:
                assert sid not in listed
                continue
            if sandbox.status in (SandboxStatus.running, SandboxStatus.paused):  # a call resumes a paused one
                assert sid in listed
                result = await sandbox.run_shell("echo alive", timeout=20)
                assert result.stdout == "alive\n", result
                running.append(sid)
            else:  # failed at the restart: not listed as holding anything, and refuses calls
                assert sandbox.status in (SandboxStatus.failed, SandboxStatus.stopped), sandbox.info
                with pytest.raises(SandboxStateError):
                    await sandbox.run_shell("true")
        holding = [i for i in listed.values() if i.status in (SandboxStatus.running, SandboxStatus.paused)]
        (node,) = await client.node_info()
        assert node.sandboxes == len(holding)
        assert node.committed_memory_mb == MEMORY_MB * len(holding), (node, holding)
        return running


async def stop_all(srv: LocalServer) -> None:
    async with DSecClient(srv.endpoint, token=srv.token) as client:
        for info in await client.list_sandboxes():
            await (await client.get_sandbox(info.id)).stop()


async def finish(srv: LocalServer) -> None:
    """Whatever a failed test left running on a live server is stopped; the server too."""
    if srv.proc is not None and srv.proc.poll() is None:
        try:
            await stop_all(srv)
        except DSecError:
            pass
    srv.stop()


async def test_kill9_in_the_middle_of_200_concurrent_commands(state):
    srv = serve(state)
    try:
        async with DSecClient(srv.endpoint, token=srv.token, retries=0) as client:
            sandboxes = [await client.run_container(NETWORKED if i == 0 else ARGS) for i in range(8)]
            assert host_network(state), "the networked sandbox has its link and chain"
            ids = [s.id for s in sandboxes]
            commands = [asyncio.create_task(sandboxes[i % 8].run_shell(f"sleep 0.$((RANDOM % 9)); echo {i}"))
                        for i in range(200)]
            await asyncio.sleep(0.4)
            srv.kill()
            outcomes = await asyncio.wait_for(asyncio.gather(*commands, return_exceptions=True), 60)
        # Each command either answered or failed with an error of the tree: none hung.
        assert all(isinstance(o, DSecError) or o.exit_code == 0 for o in outcomes), outcomes[:3]
        assert any(isinstance(o, DSecError) for o in outcomes), "the kill came in the middle"
        srv = serve(state, srv.port)
        running = await check_after_restart(srv, ids)
        assert running == ids, "a server crash kills no sandbox"
        await stop_all(srv)
        srv.stop()
        assert not leftovers(state, settle_s=0) and not host_network(state)
    finally:
        await finish(srv)


async def test_kill9_during_a_pack_diff_and_a_pause(state):
    srv = serve(state)
    try:
        async with DSecClient(srv.endpoint, token=srv.token, retries=0) as client:
            images_before = {i.name for i in (await client.list_images()).images}
            packed, paused, other = [await client.run_container(ARGS) for _ in range(3)]
            for sandbox in (packed, paused):
                filled = await sandbox.run_shell("dd if=/dev/urandom of=/root/blob bs=1M count=6 2>/dev/null; "
                                                 "i=0; while [ $i -lt 300 ]; do echo $i > /root/f$i; i=$((i+1)); done")
                assert filled.exit_code == 0 and not filled.stderr, filled
            # The third fills its own disk: after the restart its commands still run (to clean up).
            full = await other.run_shell("dd if=/dev/zero of=/root/fill bs=1M 2>&1; df -k / | tail -1")
            assert "No space left" in full.stdout, full
            calls = [asyncio.create_task(packed.pack_diff()), asyncio.create_task(paused.pause())]
            await asyncio.sleep(0.05)
            srv.kill()
            pack_outcome, _ = await asyncio.gather(*calls, return_exceptions=True)
        srv = serve(state, srv.port)
        running = await check_after_restart(srv, [packed.id, paused.id, other.id])
        assert other.id in running, "the other sandbox is not affected"
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            back = await client.get_sandbox(other.id)
            assert (await back.run_shell("rm /root/fill && echo room")).stdout == "room\n"
            for sid in set(running) - {other.id}:  # thawed, and its files as it left them
                back = await client.get_sandbox(sid)
                assert (await back.run_shell("cat /root/f299")).stdout == "299\n"
            # Cut short (or, on a quiet machine, done just before the kill): no image, or a whole
            # one (the store is shared with other runs: new images there may be theirs).
            for name in {i.name for i in (await client.list_images()).images} - images_before:
                assert (await client.inspect_image(name)).layers
            if not isinstance(pack_outcome, BaseException):
                await client.remove_image(pack_outcome.image)
        await stop_all(srv)
    finally:
        await finish(srv)


async def test_a_killed_sandbox_init_fails_that_sandbox_only_and_sigterm_waits_for_the_pool(state):
    """Then a SIGTERM: after a burst the warm pool holds sandboxes, and the server exits only once
    their processes, mounts and cgroups are gone (nothing is left the moment it exits)."""
    srv = serve(state)
    try:
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            victim, other = await client.run_container(NETWORKED), await client.run_container(ARGS)
            os.kill(persisted_record(state, victim.id)["handle"]["pid"], signal.SIGKILL)
            with pytest.raises(SandboxStateError, match="died|not running|gone|exited"):
                await victim.run_shell("echo hi", timeout=10)
            deadline = time.monotonic() + 10
            while (await victim.refresh()).status is SandboxStatus.running and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert victim.status is SandboxStatus.failed, victim.info
            assert (await other.run_shell("echo fine")).stdout == "fine\n"
            await other.stop()
            await victim.stop()
            made = await asyncio.gather(*(client.run_container(ARGS) for _ in range(8)))
            await asyncio.gather(*(s.stop() for s in made))
        await asyncio.sleep(1.5)  # the pool refills
        assert leftovers(state, settle_s=0), "the pool holds sandboxes"
        srv.stop()
        assert leftovers(state, settle_s=0) == [] and not host_network(state)
    finally:
        srv.stop()
