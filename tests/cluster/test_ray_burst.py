"""Cloud bursting on a real autoscaling Ray cluster of this machine: Ray's fake multi-node provider
(``ray.cluster_utils.AutoscalingCluster``: its autoscaler launches real raylets here) with a base
node type (one node, ``a1``) and a burst node type (none to one, ``b1``, offering ``dsec_burst``),
real crun containers, one ``dsec serve --ray --burst-max 1``. The base node filled past 80% of its
10 sandboxes → the apiserver asks for a burst node → the autoscaler launches it and it joins →
the creates the base node has no room for land there → everything stopped → after the quiet
spell the burst node is drained and let go → the autoscaler removes it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dsec.local import LocalServer, free_port
from libdsec import DSecClient, DSecContainerRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.cluster]

ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32, cpu_cores_limit=0.1)
OBJECT_STORE = 80 << 20
NODE_TYPES = {
    "base": {"resources": {"CPU": 1, "dsec_edge": 1, "object_store_memory": OBJECT_STORE},
             "labels": {"dsec-node": "a1"}, "node_config": {}, "min_workers": 1, "max_workers": 1},
    "burst": {"resources": {"CPU": 1, "dsec_edge": 1, "dsec_burst": 1, "object_store_memory": OBJECT_STORE},
              "labels": {"dsec-node": "b1"}, "node_config": {}, "min_workers": 0, "max_workers": 1},
}
# The fake provider's own example config (fake_multi_node/example.yaml in Ray's repository, not
# shipped in the wheel), the node types aside.
BASE_CONFIG = {
    "cluster_name": "fake_multinode", "max_workers": 2,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                 "disable_launch_config_check": True},
    "auth": {}, "docker": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": 0.1,
    "initialization_commands": [], "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
    "head_start_ray_commands": [], "worker_start_ray_commands": [], "file_mounts": {}, "cluster_synced_files": [],
    "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
}


def _autoscaling_cluster_class():
    from ray.cluster_utils import AutoscalingCluster

    class LoopbackAutoscalingCluster(AutoscalingCluster):
        """``AutoscalingCluster`` kept to this test's own processes and to loopback. Its own
        ``start`` and ``shutdown`` run ``ray stop --force``, which ends every Ray process on the
        machine (other users' clusters too), and its head listens on the machine's address at
        port 6379: here the head listens on 127.0.0.1 at a free port (the fake provider's nodes
        join it there and bind loopback too), and ``shutdown`` ends this cluster's own processes
        (``pids``), by pid."""

        def __init__(self, head_resources: dict, worker_node_types: dict, **config_kwargs) -> None:
            self.port = free_port()
            self.address = f"127.0.0.1:{self.port}"
            super().__init__(head_resources, worker_node_types, **config_kwargs)

        def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
            config = json.loads(json.dumps(BASE_CONFIG))
            config["provider"]["gcs_address"] = self.address
            config["available_node_types"] = {
                **worker_node_types,
                "ray.head.default": {"resources": head_resources, "node_config": {}, "max_workers": 0},
            }
            config["head_node_type"] = "ray.head.default"
            config.update(config_kwargs)
            return config

        def start(self, _system_config=None, override_env=None) -> None:
            fd, config_path = tempfile.mkstemp(suffix=".json", dir=os.environ["RAY_TMPDIR"])
            with os.fdopen(fd, "w") as f:
                json.dump(self._config, f)
            cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", f"--autoscaling-config={config_path}",
                   "--node-ip-address=127.0.0.1", f"--port={self.port}", "--include-dashboard=false",
                   "--dashboard-agent-listen-port=0",
                   f"--num-cpus={self._head_resources.get('CPU', 0)}", f"--object-store-memory={OBJECT_STORE}"]
            if _system_config is not None:
                cmd.append(f"--system-config={json.dumps(_system_config, separators=(',', ':'))}")
            env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1",
                   # The fake provider's nodes take Ray's idea of this machine's address: loopback.
                   "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                   **(override_env or {})}
            log = Path(os.environ["RAY_TMPDIR"]) / "ray-start.log"
            with open(log, "ab") as out:  # a file: the daemons it starts keep it open
                done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                raise RuntimeError(f"ray start failed ({done.returncode}): {log.read_text()[-3000:]}")

        def pids(self) -> list[int]:
            """This cluster's processes: those with its temporary dir on their command line or a
            file open in it (every Ray process logs there; a worker's title hides its command line
            and environment, not its open files)."""
            where = os.environ["RAY_TMPDIR"].rstrip("/") + "/"
            found = []
            for pid in os.listdir("/proc"):
                if not pid.isdigit() or int(pid) == os.getpid():
                    continue
                try:
                    if where.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "):
                        found.append(int(pid))
                        continue
                    for fd in os.listdir(f"/proc/{pid}/fd"):
                        if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(where):
                            found.append(int(pid))
                            break
                except OSError:
                    continue
            return found

        def shutdown(self) -> None:
            for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                for pid in self.pids():
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                deadline = time.monotonic() + wait_s
                while self.pids() and time.monotonic() < deadline:
                    time.sleep(0.2)
                if not self.pids():
                    return
            raise AssertionError(f"Ray processes left: {self.pids()}")

    return LoopbackAutoscalingCluster


class BurstWorld:
    def __init__(self, base: Path, store: Path) -> None:
        self.base, self.store = base, store
        self.cluster = _autoscaling_cluster_class()(head_resources={"CPU": 0}, worker_node_types=NODE_TYPES)
        self.server: LocalServer | None = None

    def serve(self) -> LocalServer:
        self.server = LocalServer(self.base / "api", extra_args=(
            "--ray", self.cluster.address, "--node-state-dir", str(self.base / "nodes"),
            "--store-dir", str(self.store), "--fncall-max", "0", "--pool-max", "0", "--max-sandboxes", "10",
            "--burst-max", "1", "--burst-quiet-s", "5"),
            start_timeout_s=120).start()
        return self.server

    def client(self) -> DSecClient:
        return DSecClient(self.server.endpoint, token=self.server.token)

    def ray_nodes(self) -> dict[str, bool]:
        """Ray's own view: DSec name -> alive, for the nodes offering dsec_edge (latest record)."""
        import ray

        nodes = {}
        for n in sorted(ray.nodes(), key=lambda n: n.get("Alive", False)):  # an alive record wins
            if "dsec_edge" in (n.get("Resources") or {}) or (n.get("Labels") or {}).get("dsec-node"):
                nodes[(n.get("Labels") or {}).get("dsec-node", n["NodeID"][:8])] = n.get("Alive", False)
        return nodes



@pytest.fixture
def world(ray_base, test_store):
    world = BurstWorld(ray_base, test_store)
    import ray
    from ray._private import ray_constants

    enable_ray_cluster = ray_constants.ENABLE_RAY_CLUSTER
    try:
        world.cluster.start()
        ray_constants.ENABLE_RAY_CLUSTER = False  # this process's driver stays on loopback too
        ray.init(address=world.cluster.address, namespace="dsec-test", log_to_driver=False,
                 logging_level="warning")
        world.serve()
        yield world
    finally:
        if world.server is not None:
            world.server.stop()
        if ray.is_initialized():
            ray.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = enable_ray_cluster
        world.cluster.shutdown()  # then ray_base resets the nodes and checks nothing is left


async def until(world: BurstWorld, what: str, check, within_s: float):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.25)
    raise AssertionError(f"{what}: not within {within_s:g} s; Ray's nodes: {world.ray_nodes()}; "
                         f"the apiserver's log: {world.server.log_tail()}; "
                         f"the autoscaler's log: {autoscaler_log()}")


def autoscaler_log(chars: int = 3000) -> str:
    """The end of what Ray's autoscaler (its monitor process, which runs the fake provider's
    launches) wrote: why a node it should have started is not there."""
    logs = Path(os.environ["RAY_TMPDIR"]) / "session_latest" / "logs"
    text = ""
    for name in ("monitor.log", "monitor.err", "monitor.out"):
        try:
            text += f"[{name}] " + (logs / name).read_text(errors="replace")[-chars:]
        except OSError:
            continue
    return text[-2 * chars:] or f"(none under {logs})"


async def test_a_busy_cluster_bursts_onto_a_new_node_and_lets_it_go_when_quiet(world):
    async with world.client() as client:
        def nodes_are(names: set[str]):
            async def check() -> bool:
                return {n.node for n in await client.node_info()} == names
            return check

        async def b1_removed() -> bool:
            return not world.ray_nodes().get("b1", False)

        # The autoscaler launches the base node (min_workers 1); the apiserver gives it an edge.
        await until(world, "the base node joins", nodes_are({"a1"}), 120)
        first = await client.run_containers(ARGS, count=9)
        assert {s.info.node for s in first} == {"a1"}
        # 9 of 10: above 80%, a burst node is asked for, launched, and joins.
        began = time.monotonic()
        await until(world, "the burst node joins", nodes_are({"a1", "b1"}), 90)
        joined_after = time.monotonic() - began
        more = [await client.run_container(ARGS) for _ in range(3)]
        nodes = [s.info.node for s in first + more]
        assert nodes.count("a1") == 10 and [s.info.node for s in more[1:]] == ["b1", "b1"], nodes
        result = await more[-1].run_shell("echo on $(hostname)")
        assert result.exit_code == 0 and result.stdout.startswith("on ")
        for s in first + more:
            await s.stop()
        # Quiet: after 5 s below half, b1 is drained, let go once empty, and the autoscaler (idle
        # for 6 s) removes it; a1 stays.
        quiet = time.monotonic()
        await until(world, "the burst node is let go", nodes_are({"a1"}), 60)
        let_go_after = time.monotonic() - quiet
        await until(world, "the autoscaler removes the burst node", b1_removed, 90)
        assert world.ray_nodes().get("a1") is True
        removed_after = time.monotonic() - quiet
        assert await client.list_sandboxes() == []
        print(f"\nburst node joined {joined_after:.1f} s after the request; let go {let_go_after:.1f} s and "
              f"removed {removed_after:.1f} s after the cluster went quiet")
