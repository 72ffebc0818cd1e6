"""DSec on a real Ray cluster of this machine (``ray.cluster_utils.Cluster``: a head and three
``dsec_edge`` nodes, real raylets) with real crun containers on every node, through one
``dsec serve --ray`` apiserver: spread, calls on every node, a node killed (its sandboxes answer
``SandboxLost`` within seconds, creates go on elsewhere), a node that comes back re-adopting its
sandboxes, a node removed in the middle of a batch (what was stopped while it was away is
stopped when it is back), and a node added."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from dsec.local import LocalServer
from libdsec import DSecClient, DSecContainerRunArgs, DSecError, DSecFnCallArgs, QuotaExceeded, SandboxLost
from libdsec import SandboxStatus, Unauthenticated

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.cluster]

ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32, cpu_cores_limit=0.1)
NODE_ARGS = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}


class RayWorld:
    def __init__(self, base: Path, store: Path) -> None:
        from ray.cluster_utils import Cluster

        self.base, self.store = base, store
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False,
            "object_store_memory": 80 << 20,
            # A node killed hard is declared dead in about 1.5 s instead of 13 s.
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
        })
        self.nodes = {}
        self.servers: list[LocalServer] = []

    def add(self, name: str):
        self.nodes[name] = self.cluster.add_node(resources={"dsec_edge": 1}, labels={"dsec-node": name}, **NODE_ARGS)
        return self.nodes[name]

    def kill(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def serve(self, name: str = "api", db: str | None = None) -> LocalServer:
        server = LocalServer(self.base / name, extra_args=(
            "--ray", self.cluster.address, "--node-state-dir", str(self.base / "nodes"),
            "--store-dir", str(self.store), "--fncall-max", "2", "--fncall-workers", "1", "--pool-max", "4",
            *(("--db", db) if db else ())), start_timeout_s=120).start()
        self.servers.append(server)
        return server

    @property
    def server(self) -> LocalServer:
        return self.servers[0]



@pytest.fixture(scope="module")
def world(ray_base, test_store, python_image, postgres):
    world = RayWorld(ray_base, test_store)
    try:
        for name in ("a1", "a2", "a3"):
            world.add(name)
        world.db = postgres.new_database()
        world.serve(db=world.db)
        yield world
    finally:
        if world.servers:
            world.server.stop_sandboxes()
        for server in world.servers:
            server.stop()
        world.cluster.shutdown()  # then ray_base resets the nodes and checks nothing is left


async def wait_for_nodes(client: DSecClient, names: set[str], within_s: float = 60, exact: bool = False) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        found = {n.node for n in await client.node_info()}
        if found == names or (not exact and names <= found):
            return
        await asyncio.sleep(0.25)
    raise AssertionError(f"nodes {sorted(n.node for n in await client.node_info())}, expected {sorted(names)}")


def client_of(world: RayWorld) -> DSecClient:
    return DSecClient(world.server.endpoint, token=world.server.token)


async def test_sandboxes_spread_over_the_nodes_and_answer_on_each(world):
    async with client_of(world) as client:
        await wait_for_nodes(client, {"a1", "a2", "a3"})
        sandboxes = await client.run_containers(ARGS, count=9)
        by_node = {}
        for s in sandboxes:
            by_node.setdefault(s.info.node, []).append(s)
        assert set(by_node) == {"a1", "a2", "a3"}, {n: len(v) for n, v in by_node.items()}
        for node, group in by_node.items():
            s = group[0]
            await s.write_file("/tmp/where", node)
            result = await s.run_shell("cat /tmp/where; echo; hostname")
            assert result.exit_code == 0 and result.stdout.split()[0] == node
        listed = {i.id for i in await client.list_sandboxes()}
        assert {s.id for s in sandboxes} <= listed
        for s in sandboxes:
            await s.stop()
        assert not {s.id for s in sandboxes} & {i.id for i in await client.list_sandboxes()}


async def test_a_killed_node_is_lost_then_comes_back_with_its_sandboxes(world):
    async with client_of(world) as client:
        await wait_for_nodes(client, {"a1", "a2", "a3"})
        made = await client.run_containers(ARGS, count=6)
        on_a2 = [s for s in made if s.info.node == "a2"]
        others = [s for s in made if s.info.node != "a2"]
        assert on_a2 and others
        await on_a2[0].write_file("/tmp/kept", "still here")
        killed_at = time.monotonic()
        world.kill("a2")
        # Calls to its sandboxes fail with SandboxLost within seconds, never a hang.
        with pytest.raises(SandboxLost):
            async with asyncio.timeout(30):
                while True:
                    await on_a2[0].run_shell("true", timeout=5)
                    await asyncio.sleep(0.1)
        lost_after = time.monotonic() - killed_at
        assert lost_after < 30
        # New creates go to the surviving nodes; the others still answer.
        fresh = [await client.run_container(ARGS) for _ in range(4)]
        assert {s.info.node for s in fresh} <= {"a1", "a3"}
        assert (await others[0].run_shell("echo ok")).stdout == "ok\n"
        await wait_for_nodes(client, {"a1", "a3"}, exact=True)
        # The node comes back under its name: its edge re-adopts what still runs there.
        world.add("a2")
        await wait_for_nodes(client, {"a1", "a2", "a3"})
        result = await on_a2[0].run_shell("cat /tmp/kept")
        assert (result.exit_code, result.stdout) == (0, "still here")
        for s in made + fresh:
            await s.stop()


async def test_a_node_removed_mid_batch_leaves_all_or_none(world):
    async with client_of(world) as client:
        await wait_for_nodes(client, {"a1", "a2", "a3"})
        batch = asyncio.create_task(client.run_containers(ARGS, count=24))
        await asyncio.sleep(0.3)
        world.kill("a3")
        try:
            made = await batch
        except DSecError as exc:
            made = None
            assert "a3" in str(exc) or isinstance(exc, SandboxLost), exc
        lost = []
        if made is not None:  # it completed before a3 went: what is on a3 is lost with it
            assert len(made) == 24
            for s in made:
                try:
                    await s.stop()
                except SandboxLost:  # kept: made when a3 is back (it may have been made already)
                    lost.append(s)
        # Nothing of a failed batch is left on the surviving nodes.
        await asyncio.sleep(0.5)
        assert [i.id for i in await client.list_sandboxes()] == []
        # A node added (a new one, and a3 back): both take new work.
        world.add("a4")
        world.add("a3")
        await wait_for_nodes(client, {"a1", "a2", "a3", "a4"})
        # What a3 is owed is stopped now that it is back: the sandboxes of the complete batch
        # stopped while it was away, or what the failed batch made there before it died.
        deadline = time.monotonic() + 20
        while (left := await client.list_sandboxes()) and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
        assert left == []
        # Placement goes by load, and a node that has just joined is still filling its warm
        # pool: it takes work within a few batches, not always in the first.
        nodes: set[str] = set()
        for _ in range(3):
            spread = await client.run_containers(ARGS, count=12)
            nodes |= {s.info.node for s in spread}
            for s in spread:
                await s.stop()
            if {"a3", "a4"} <= nodes:
                break
        assert {"a3", "a4"} <= nodes
        assert await client.list_sandboxes() == []


async def test_every_feature_works_across_nodes(world):
    """An image packed on one node starts on every node (one shared store); pause, network
    rules, security events, quotas and FnCall through the apiserver, whichever node serves."""
    async with client_of(world) as client:
        await wait_for_nodes(client, {"a1", "a2", "a3"})
        first = await client.run_container(ARGS)
        await first.write_file("/root/made-on", first.info.node)
        snap = await first.pack_diff()
        branches = await client.run_containers(DSecContainerRunArgs(container_image=snap.image, memory_limit_mb=32,
                                                                    cpu_cores_limit=0.1), count=6)
        assert len({b.info.node for b in branches}) >= 2
        for b in branches:
            assert (await b.read_file("/root/made-on")).decode() == first.info.node
        paused = await branches[0].pause()
        assert paused.sandbox.status is SandboxStatus.paused
        assert (await branches[0].run_shell("echo awake")).stdout == "awake\n"  # a call resumes it
        await branches[1].set_network_rules({})
        assert await branches[1].security_events() == []
        result = await client.fncall(DSecFnCallArgs(code="print(6 * 7)"))
        assert (result.exit_code, result.stdout) == (0, "42\n")
        # Quotas count what every node holds.
        await client.create_project("team", sandboxes=2)
        token = await client.create_project_token("team")
        async with DSecClient(world.server.endpoint, token=token) as team:
            held = [await team.run_container(ARGS), await team.run_container(ARGS)]
            with pytest.raises(QuotaExceeded):
                await team.run_container(ARGS)
            for s in held:
                await s.stop()
        await client.remove_project("team")
        for s in [first, *branches]:
            await s.stop()
        await client.remove_image(snap.image)


async def test_two_apiservers_serve_one_cluster(world):
    """A second apiserver over the same Ray cluster and PostgreSQL: the same nodes (the edges are
    detached actors it finds by name), the same sandboxes, the same projects and tokens."""
    second = world.serve("api2", db=world.db)
    async with client_of(world) as one, DSecClient(second.endpoint, token=second.token) as root2:
        await wait_for_nodes(one, {"a1", "a2", "a3"})
        await one.create_project("pair")
        token = await one.create_project_token("pair")
        async with DSecClient(second.endpoint, token=token) as two:
            await wait_for_nodes(root2, {"a1", "a2", "a3"})
            # The second learns of the token from PostgreSQL's NOTIFY (or its periodic look at
            # the version): at once on a quiet machine, a moment later on a busy one.
            deadline = time.monotonic() + 15
            while True:
                try:
                    await two.list_sandboxes()
                    break
                except Unauthenticated:
                    assert time.monotonic() < deadline, "the second apiserver never learnt the token"
                    await asyncio.sleep(0.1)
            made = await two.run_containers(ARGS, count=3)
            seen = await (await one.get_sandbox(made[0].id)).refresh()
            assert seen.project == "pair"
            for s in made:
                await s.stop()
        await one.remove_project("pair")
    second.stop()
    world.servers.remove(second)


async def test_vms_on_a_node_that_serves_them(world):
    """A node whose edge has the VM backends (this one) takes the microVMs and full VMs; the
    others, containers only, are never asked for one."""
    from libdsec import DSecFullVMRunArgs, DSecMicroVMRunArgs

    os.environ["DSEC_VMS"] = "1"
    try:
        world.add("v1")  # its raylet, and so its edge, sees DSEC_VMS=1
    finally:
        os.environ["DSEC_VMS"] = "0"
    async with client_of(world) as client:
        await wait_for_nodes(client, {"v1"}, within_s=120)
        vm = await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=192),
                                      timeout=180)
        async with vm:
            assert (vm.info.node, vm.info.kind.value) == ("v1", "microvm")
            assert (await vm.run_shell("echo in a vm")).stdout == "in a vm\n"
        full = await client.run_vm(DSecFullVMRunArgs(container_image="busybox"), timeout=240)
        async with full:
            assert (full.info.node, full.info.kind.value) == ("v1", "fullvm")
            assert (await full.run_shell("echo x")).stdout == "x\n"
