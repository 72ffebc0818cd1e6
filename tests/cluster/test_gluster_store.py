"""DSec's layer store on a real distributed filesystem: a GlusterFS volume of the test's own
(``gluster_volume``: glusterd and its brick in a network namespace of their own, reached over a
veth pair of this machine only), mounted through its FUSE client, holds the store of a Ray
cluster of three DSec nodes (``ray.cluster_utils.Cluster``, real crun containers) behind one
``dsec serve --ray``. An image imported or built on one node starts on the others; a
``pack_diff`` made on one node starts on the others; GC, through the apiserver or on a second
client of the volume that knows no node, never removes a layer a node's sandbox holds; the
store's lock and its manifests hold across two clients; the volume stopped or its brick frozen
in the middle of a run gives calls and creates ``StoreUnavailable`` naming the store (within
``STORE_AWAY_BOUND_S``, never a hang), and everything works again once it is back; the FUSE
client killed and mounted again: new sandboxes work on every node, those started before say
they cannot read their layers; the volume slow (every read delayed 200 ms) or full: creates and
commands work (a full store refuses what writes to it, naming the lack of room). Each node reads its layers through its layer cache
(``DSEC_LAYER_CACHE_MB``): a second create of an image on a node reads nothing from the volume."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
from pathlib import Path

import pytest

import gluster_volume
from dsec.local import LocalServer
from libdsec import BackendError, DSecClient, DSecContainerRunArgs, DSecError, StoreUnavailable

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.cluster]

NODES = ("g1", "g2", "g3")
NODE_ARGS = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}
# A call or create while the store is away is refused within the edge's store_check_s (10 s);
# the volume's ping timeout (5 s) bounds a stat that waits on a server gone silent.
STORE_AWAY_BOUND_S = 15
# A node takes the store's answer as good for a second (StoreHealth.fresh_s).
STORE_FRESH_S = 1.2
# Each node's layer cache (dsec.images.layercache), in MiB.
CACHE_MB = 64


def args(image: str) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image=image, memory_limit_mb=32, cpu_cores_limit=0.1)


@pytest.fixture(scope="module")
def gluster(tmp_path_factory):
    why = gluster_volume.missing()
    if why:
        pytest.skip(why)
    volume = gluster_volume.GlusterVolume(tmp_path_factory.mktemp("gluster")).start()
    try:
        yield volume
    finally:
        volume.close()
        assert not volume.leftovers(), volume.leftovers()


@pytest.fixture(scope="module")
def world(gluster, ray_base):
    """Three DSec nodes and one apiserver on the store in the GlusterFS volume. (``gluster`` is
    set up first, so it is taken down last: after ``ray_base`` has reset the nodes.)"""
    from ray.cluster_utils import Cluster

    from dsec.images.builders import build_busybox
    from dsec.images.store import LayerStore

    store = gluster.mountpoint / "store"
    build_busybox(LayerStore(store))  # imported from outside, as an operator does on the store's mount
    # The nodes' edges (Ray's workers) take it from here; ray_base puts the environment back.
    os.environ["DSEC_LAYER_CACHE_MB"] = str(CACHE_MB)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False,
        "object_store_memory": 80 << 20})
    server = None
    try:
        for name in NODES:
            cluster.add_node(resources={"dsec_edge": 1}, labels={"dsec-node": name}, **NODE_ARGS)
        server = LocalServer(ray_base / "api", extra_args=(
            "--ray", cluster.address, "--node-state-dir", str(ray_base / "nodes"), "--store-dir", str(store),
            "--fncall-max", "0", "--pool-max", "0"), start_timeout_s=120).start()
        yield server, store
    finally:
        if server is not None:
            server.stop_sandboxes()
            server.stop()
        cluster.shutdown()


def client_of(world) -> DSecClient:
    server, _ = world
    return DSecClient(server.endpoint, token=server.token)


async def wait_for_nodes(client: DSecClient, within_s: float = 90) -> None:
    deadline = time.monotonic() + within_s
    while {n.node for n in await client.node_info()} != set(NODES):
        assert time.monotonic() < deadline, f"nodes {[n.node for n in await client.node_info()]}"
        await asyncio.sleep(0.25)


async def on_every_node(client: DSecClient, image: str) -> dict:
    """Sandboxes of ``image`` until every node has one: {node: sandbox}; the rest stopped.
    (Placement spreads a batch, but a node that joined a moment ago may not be in its view yet.)"""
    by_node: dict = {}
    deadline = time.monotonic() + 60
    while set(by_node) != set(NODES):
        assert time.monotonic() < deadline, f"sandboxes only on {sorted(by_node)}"
        for s in await client.run_containers(args(image), count=6):
            if s.info.node in by_node:
                await s.stop()
            else:
                by_node[s.info.node] = s
    return by_node


async def test_images_imported_built_and_packed_on_one_node_start_on_the_others(world):
    async with client_of(world) as client:
        await wait_for_nodes(client)
        # Imported from outside (the fixture's busybox): every node starts it.
        for s in (await on_every_node(client, "busybox")).values():
            assert (await s.run_shell("head -1 /etc/passwd")).stdout.startswith("root:")
            await s.stop()
        # Built on one node (a Dockerfile build: its layers written to the store there).
        built = await client.build_image("gl-built", dockerfile_text="FROM busybox\nRUN echo made-here > /made\n")
        assert built.image == "gl-built"
        for s in (await on_every_node(client, "gl-built")).values():
            assert (await s.read_file("/made")) == b"made-here\n"
            await s.stop()
        # Packed on one node, started on each of the others.
        first = await client.run_container(args("busybox"))
        await first.write_file("/root/made-on", first.info.node)
        snap = await first.pack_diff()
        await first.stop()
        for node, s in (await on_every_node(client, snap.image)).items():
            assert (await s.read_file("/root/made-on")).decode() == first.info.node
            await s.stop()
        await client.remove_image("gl-built")
        await client.remove_image(snap.image)


async def test_gc_keeps_the_layers_another_nodes_sandbox_holds(world, gluster):
    from dsec.images.store import LayerStore

    _, store_dir = world
    async with client_of(world) as client:
        await wait_for_nodes(client)
        first = await client.run_container(args("busybox"))
        await first.write_file("/root/kept", "layer of a snapshot")
        snap = await first.pack_diff()
        await first.stop()
        user = await client.run_container(args(snap.image))
        (layer,) = [d for d in (await client.inspect_image(snap.image)).layers
                    if d not in (await client.inspect_image("busybox")).layers]
        # Its manifest removed from the store by another machine's `dsec image rm` (which sees
        # none of these nodes' sandboxes): only the node's sandbox holds the layer now.
        LayerStore(store_dir).remove_image(snap.image)
        # GC through the apiserver, on whichever node it lands (random: asked six times).
        for _ in range(6):
            assert layer not in await client.gc_images()
        # GC on another machine's mount of the volume, which knows no node at all (`dsec image
        # gc` there): the node's lock on the layer file keeps it.
        assert layer not in LayerStore(gluster.mount_another() / store_dir.name).gc()
        assert LayerStore(store_dir).has_layer(layer)
        assert (await user.read_file("/root/kept")) == b"layer of a snapshot"
        await user.stop()
        # Once no sandbox holds it, GC removes it (the nodes keep no warm pool here).
        deadline = time.monotonic() + 30
        store = LayerStore(store_dir)
        while store.has_layer(layer):
            assert time.monotonic() < deadline, f"layer {layer} was not collected once its sandbox stopped"
            await client.gc_images()
            await asyncio.sleep(0.5)


def cache_stats(ray_base) -> dict[str, dict]:
    """Each node's layer cache's counters, by node (from its own mount of the cache)."""
    return {p.parents[3].name: json.loads(p.read_text())
            for p in (ray_base / "nodes").glob("*/node/layer-cache/mnt/.stats")}


async def test_a_second_create_of_an_image_on_a_node_reads_nothing_from_the_volume(world, gluster, ray_base):
    async with client_of(world) as client:
        await wait_for_nodes(client)
        for s in (await on_every_node(client, "busybox")).values():
            assert (await s.run_shell("md5sum /bin/busybox")).exit_code == 0
            await s.stop()
        first = cache_stats(ray_base)
        assert set(first) == set(NODES) and all(c["fetched_bytes"] > 0 for c in first.values()), first
        Path("/proc/sys/vm/drop_caches").write_text("3\n")  # from the nodes' disks, not their memory
        gluster.start_profile()
        read_before = gluster.data_read()
        for s in (await on_every_node(client, "busybox")).values():
            assert (await s.run_shell("md5sum /bin/busybox")).exit_code == 0
            await s.stop()
        assert gluster.data_read() == read_before
        again = cache_stats(ray_base)
        for node in NODES:
            assert again[node]["fetched_bytes"] == first[node]["fetched_bytes"], (node, first[node], again[node])
            assert again[node]["cached_bytes_served"] > first[node]["cached_bytes_served"]
            assert again[node]["used_bytes"] <= CACHE_MB << 20


def test_a_manifest_put_on_one_client_is_read_at_once_on_another(world, gluster):
    """An image made, and made again under its name (a rebuild), on one machine is what every
    other machine reads the moment after: no client answers from a stale cache."""
    from dsec.images.store import Image, LayerStore

    _, store_dir = world
    here = LayerStore(store_dir)
    there = LayerStore(gluster.mount_another() / store_dir.name)
    layers = here.get_image("busybox").layers
    stale = []
    try:
        for i in range(50):
            here.put_image(Image(name="gl-again", layers=layers, env={"ROUND": f"{i:03}"}))
            if not there.has_image("gl-again") or there.get_image("gl-again").env["ROUND"] != f"{i:03}":
                stale.append(i)
    finally:
        here.remove_image("gl-again")
    assert not stale, f"read as it was before in rounds {stale}"
    assert not there.has_image("gl-again")


def test_the_store_lock_holds_across_two_clients_of_the_volume(world, gluster):
    """The store's lock (LayerStore.locked: builds of one image, from any node) is one lock for
    two machines' mounts of the volume: the second client waits until the first lets go."""
    import threading

    from dsec.images.store import LayerStore

    _, store_dir = world
    other = LayerStore(gluster.mount_another() / store_dir.name)
    mine = LayerStore(store_dir)
    got = threading.Event()

    def take_it() -> None:
        with other.locked("gl-build"):
            got.set()

    with mine.locked("gl-build"):
        taker = threading.Thread(target=take_it)
        taker.start()
        assert not got.wait(1.5), "the second client took the lock while the first held it"
    assert got.wait(10), "the second client did not get the lock once it was let go"
    taker.join(10)


async def test_the_volume_stopped_gives_store_unavailable_then_everything_recovers(world, gluster):
    _, store_dir = world
    async with client_of(world) as client:
        await wait_for_nodes(client)
        running = await on_every_node(client, "busybox")
        gluster.stop_volume()
        await asyncio.sleep(STORE_FRESH_S)  # a call that needs nothing of the store may work until then
        try:
            for node, s in running.items():
                started = time.monotonic()
                with pytest.raises(StoreUnavailable) as refused:
                    await s.run_shell("cat /etc/passwd", timeout=30)
                assert time.monotonic() - started < STORE_AWAY_BOUND_S
                assert str(store_dir) in str(refused.value) and node in str(refused.value), refused.value
            started = time.monotonic()
            with pytest.raises(StoreUnavailable) as refused:
                await client.run_container(args("busybox"))
            assert time.monotonic() - started < STORE_AWAY_BOUND_S
            assert str(store_dir) in str(refused.value)
            # The store's own calls, and a pack_diff (which writes a layer to it), say the same.
            for call in (client.list_images(), client.inspect_image("busybox"), client.gc_images(),
                         next(iter(running.values())).pack_diff()):
                with pytest.raises(StoreUnavailable, match=str(store_dir)):
                    await call
        finally:
            gluster.start_volume()
        # Back: the running sandboxes answer (their layers read through the same mounts), and
        # new creates work, on every node.
        deadline = time.monotonic() + 30
        for node, s in running.items():
            while True:
                try:
                    result = await s.run_shell("head -1 /etc/passwd")
                    break
                except StoreUnavailable:
                    assert time.monotonic() < deadline, "the store did not come back"
                    await asyncio.sleep(0.5)
            assert result.exit_code == 0 and result.stdout.startswith("root:"), (node, result)
        for s in (await on_every_node(client, "busybox")).values():
            assert (await s.run_shell("echo back")).stdout == "back\n"
            await s.stop()
        for s in running.values():
            await s.stop()
        assert await client.list_sandboxes() == []


async def test_a_server_gone_silent_is_refused_within_the_bound_then_recovers(world, gluster):
    """The brick frozen (its connection up, no answer): calls and creates wait at most the
    bound, then get StoreUnavailable; thawed, everything works again."""
    async with client_of(world) as client:
        await wait_for_nodes(client)
        running = await on_every_node(client, "busybox")
        gluster.freeze_brick()
        try:
            await asyncio.sleep(STORE_FRESH_S)
            started = time.monotonic()
            refusals = await asyncio.gather(*(s.run_shell("true", timeout=60) for s in running.values()),
                                            client.run_container(args("busybox")), return_exceptions=True)
            took = time.monotonic() - started
            assert all(isinstance(r, StoreUnavailable) for r in refusals), refusals
            assert took < STORE_AWAY_BOUND_S, took
        finally:
            gluster.thaw_brick()
        deadline = time.monotonic() + 30
        for s in running.values():
            while True:
                try:
                    assert (await s.run_shell("head -1 /etc/passwd")).stdout.startswith("root:")
                    break
                except StoreUnavailable:
                    assert time.monotonic() < deadline, "the store did not come back"
                    await asyncio.sleep(0.5)
        for s in (await on_every_node(client, "busybox")).values():
            await s.stop()
        for s in running.values():
            await s.stop()
        assert await client.list_sandboxes() == []


async def test_the_fuse_client_killed_strands_its_sandboxes_and_creates_work_once_mounted_again(world, gluster):
    """A killed FUSE client leaves a dead mount: calls and creates get StoreUnavailable. Once
    the operator mounts the volume again, new sandboxes read their layers through the new mount
    on every node; those started before read through the gone one, and say so (stop them)."""
    from dsec.images.store import Image, LayerStore

    _, store_dir = world
    # An image with a file no sandbox reads before the client dies: none of it is in a cache.
    store = LayerStore(store_dir)
    data = gluster.base / "unread"
    (data / "data").mkdir(parents=True)
    (data / "data" / "unread").write_bytes(os.urandom(4 << 20))
    layer = store.add_dir(data)
    store.put_image(Image(name="gl-unread", layers=(*store.get_image("busybox").layers, layer),
                          env=store.get_image("busybox").env))
    async with client_of(world) as client:
        await wait_for_nodes(client)
        before = await on_every_node(client, "gl-unread")
        gluster.kill_mount()
        await asyncio.sleep(STORE_FRESH_S)  # a call that needs nothing of the store may work until then
        try:
            for node, s in before.items():
                with pytest.raises(StoreUnavailable, match="cannot be read") as refused:
                    await s.run_shell("true", timeout=30)
                assert node in str(refused.value)
            with pytest.raises(StoreUnavailable, match=str(store_dir)):
                await client.run_container(args("busybox"))
        finally:
            gluster.remount()
        after = await on_every_node(client, "gl-unread")
        for s in after.values():
            result = await s.run_shell("md5sum /data/unread")
            assert result.exit_code == 0 and result.stdout.split()[0] == hashlib.md5(
                (data / "data" / "unread").read_bytes()).hexdigest(), result
        for s in before.values():
            with pytest.raises(StoreUnavailable, match="mounted again"):
                await s.run_shell("true")
        for s in [*before.values(), *after.values()]:
            await s.stop()
        assert await client.list_sandboxes() == []
        await client.remove_image("gl-unread")


async def back(client: DSecClient, within_s: float = 60) -> None:
    """Until a create works again on every node (the volume restarted: each node finds its
    store back by itself)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            for s in (await on_every_node(client, "busybox")).values():
                await s.stop()
            return
        except StoreUnavailable:
            for info in await client.list_sandboxes():  # what was made before a node refused
                with contextlib.suppress(DSecError):
                    await (await client.get_sandbox(info.id)).stop()
            assert time.monotonic() < deadline, "the store did not come back"
            await asyncio.sleep(0.5)


async def test_a_slow_volume_makes_first_reads_slower_and_nothing_fails(world, gluster):
    """Every read of the volume delayed by 200 ms (gluster's delay-gen on the brick): creates
    and commands on every node work and read the right bytes, only slower where they read the
    volume (a first read on a node); a slow store is no reason to refuse (docs/CLUSTER.md)."""
    from dsec.images.store import Image, LayerStore

    _, store_dir = world
    store = LayerStore(store_dir)
    data = gluster.base / "slow"
    (data / "data").mkdir(parents=True)
    blob = os.urandom(512 << 10)
    (data / "data" / "blob").write_bytes(blob)
    layer = store.add_dir(data)
    base = store.get_image("busybox")
    store.put_image(Image(name="gl-slow", layers=(*base.layers, layer), env=base.env))
    async with client_of(world) as client:
        await wait_for_nodes(client)
        gluster.slow_reads(200)
        try:
            await back(client)
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            started = time.monotonic()
            with open(store.layer_path(layer), "rb") as f:
                f.read(4096)
            assert time.monotonic() - started >= 0.2, "the volume's reads are not delayed"
            made = await on_every_node(client, "gl-slow")
            for node, s in made.items():
                result = await s.run_shell("md5sum /data/blob", timeout=60)
                assert result.exit_code == 0 and result.stdout.split()[0] == hashlib.md5(blob).hexdigest(), (node, result)
            for s in made.values():
                await s.stop()
        finally:
            gluster.slow_reads(0)
        await back(client)
        assert await client.list_sandboxes() == []
        await client.remove_image("gl-slow")


async def test_a_full_volume_refuses_writes_by_name_and_serves_the_rest(world, gluster):
    """The volume full: a pack_diff (a layer written to the store) is refused naming the lack of
    space, nothing half-written is left in the store and no image is added; running sandboxes,
    and creates of images already there, work on every node. With room again it packs."""
    from dsec.images.store import LayerStore

    _, store_dir = world
    async with client_of(world) as client:
        await wait_for_nodes(client)
        running = await on_every_node(client, "busybox")
        source = next(iter(running.values()))
        await source.run_shell("dd if=/dev/urandom of=/root/blob bs=1M count=2 2>/dev/null")
        images = {i.name for i in (await client.list_images()).images}
        gluster.fill()
        try:
            with pytest.raises(DSecError, match="(?i)no space left|ENOSPC") as refused:
                await source.pack_diff("gl-when-full")
            assert isinstance(refused.value, BackendError), refused.value
            assert {i.name for i in (await client.list_images()).images} == images
            tmp = LayerStore(store_dir).tmp_dir
            assert not tmp.exists() or list(tmp.iterdir()) == [], list(tmp.iterdir())
            for node, s in running.items():
                assert (await s.run_shell("echo still")).stdout == "still\n", node
            for s in (await on_every_node(client, "busybox")).values():
                assert (await s.run_shell("head -1 /etc/passwd")).stdout.startswith("root:")
                await s.stop()
        finally:
            gluster.unfill()
        packed = await source.pack_diff("gl-with-room")
        async with await client.run_container(args(packed.image)) as child:
            assert (await child.run_shell("md5sum /root/blob")).stdout.split()[0] == (
                await source.run_shell("md5sum /root/blob")).stdout.split()[0]
        for s in running.values():
            await s.stop()
        await client.remove_image(packed.image)
        assert await client.list_sandboxes() == []


async def test_builds_of_one_image_on_several_nodes_at_once_run_once(world):
    """Six builds of one Dockerfile at once, each sent to whichever node the apiserver picks
    (with three nodes, all six on one is a chance in 243): the store's lock, which holds across
    the nodes' mounts of the volume, lets one run its steps; the others wait and take its image."""
    text = f"FROM busybox\nRUN echo {os.urandom(8).hex()} > /nonce && sleep 1\n"
    logs: list[list[str]] = [[] for _ in range(6)]
    async with client_of(world) as client:
        await wait_for_nodes(client)
        results = await asyncio.gather(*(client.build_image(f"gl-same-{n}", dockerfile_text=text, on_log=logs[n].append)
                                         for n in range(6)))
        try:
            assert len({r.key for r in results}) == 1
            ran = [n for n, log in enumerate(logs) if any(line.startswith("step 1/") for line in log)]
            assert len(ran) == 1, logs
            for s in (await on_every_node(client, "gl-same-0")).values():
                assert (await s.read_file("/nonce")).decode().strip() == text.split()[4]
                await s.stop()
        finally:
            for n in range(6):
                await client.remove_image(f"gl-same-{n}")
            await client.remove_image(f"dockerfile-{results[0].key[:32]}")
        assert await client.list_sandboxes() == []
