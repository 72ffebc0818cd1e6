"""``dsec bench cluster-ray``: real crun containers on a Ray cluster of this machine, against the
embedded ``dsec serve`` in the same run; then a node killed under load.

- Lifecycle throughput (create → ``echo`` → stop, ``concurrency`` in flight) through
  ``dsec serve --ray`` over three ``dsec_edge`` Ray nodes (``ray.cluster_utils.Cluster``, real
  raylets, all on loopback) and through the embedded server, in alternating rounds. The nodes
  share this machine's cores with the embedded server's one node, so the ratio measures what the
  cluster's path costs (apiserver → node endpoint → edge), not added capacity. Each side's
  figure is the median of its rounds (not the best: a best round flatters the side whose rate
  wanders most); every round is printed. After each round the side just measured is left to
  go quiet (its warm pools refilled) before the other's round starts, so that neither is
  charged the other's refill. Goal: within 15%.
- Node loss: creates keep running (``concurrency`` in flight) while a sandbox on one node is
  probed every 50 ms; that node is killed hard. Measured: kill → the probe's first
  ``SandboxLost`` (goal ≤ 5 s), and the longest stretch in which creates failed (goal ≤ 5 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs, DSecError, SandboxLost

from dsec.local import LocalServer, leftovers

from . import hoststats as host
from .results import median_of_rounds

ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32, cpu_cores_limit=0.1)
NODES = ("b1", "b2", "b3")


class _Ray:
    def __init__(self, base: Path) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False,
            "object_store_memory": 80 << 20,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}})
        self.nodes: dict[str, Any] = {}

    def add(self, name: str) -> None:
        self.nodes[name] = self.cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=80 << 20,
                                                 resources={"dsec_edge": 1}, labels={"dsec-node": name})

    def kill(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)


class _Answerer:
    """A Ray actor answering what a node answers a ``get``: a sandbox's report."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    async def get(self, sandbox_id: str) -> bytes:
        return self.payload


async def _data_path(server: LocalServer, calls: int, in_flight: int) -> dict:
    """The same call (a sandbox's report) to a node by a Ray actor call and by the node's own
    endpoint (``RemoteEdge.get``), ``in_flight`` at a time: calls/s and the caller's CPU a call."""
    import resource

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from libdsec.protocol import SandboxInfo

    from dsec.edge.remote import RemoteEdge
    from dsec.nodes.ray import NAMESPACE

    async with DSecClient(server.endpoint, token=server.token) as client:
        sandbox = await client.run_container(ARGS)
        info = await sandbox.refresh()
        host = ray.get_actor(f"dsec-edge-{info.node}", namespace=NAMESPACE)
        url, token = await host.start.remote()
        node_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and (n.get("Labels") or {}).get("dsec-node") == info.node)
        answerer = ray.remote(_Answerer).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_id, soft=False)).remote(info.model_dump_json().encode())
        edge = RemoteEdge(info.node, url, token)

        async def by_actor() -> None:
            SandboxInfo.model_validate_json(await answerer.get.remote(info.id))

        async def by_endpoint() -> None:
            await edge.get(info.id)

        passes: dict[str, list[tuple[float, float]]] = {"actor": [], "endpoint": []}
        for name, call in (("actor", by_actor), ("endpoint", by_endpoint)) * 3:
            for _ in range(50):
                await call()
            left = calls
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()

            async def worker() -> None:
                nonlocal left
                while left > 0:
                    left -= 1
                    await call()

            await asyncio.gather(*(worker() for _ in range(in_flight)))
            wall = time.perf_counter() - start
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
            passes[name].append((calls / wall, cpu / calls * 1000))
        await edge.close()
        ray.kill(answerer)
        await sandbox.stop()
        # The median pass of each way (three, interleaved), by rate.
        return {name: sorted(runs)[len(runs) // 2] for name, runs in passes.items()}


async def _lifecycles(server: LocalServer, count: int, concurrency: int) -> float:
    async with DSecClient(server.endpoint, token=server.token) as client:
        left = count

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                sandbox = await client.run_container(ARGS)
                await sandbox.run_shell("echo hi")
                await sandbox.stop()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return count / (time.perf_counter() - start)


def _edge_daemons(nodes_dir: Path) -> list[int]:
    """The pids of the edge daemons (``dsec.nodes.edged``) whose state dirs are under ``nodes_dir``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"dsec.nodes.edged" in cmd and any(part.startswith(str(nodes_dir).encode()) for part in cmd):
            found.append(int(entry.name))
    return found


def _settle(pids: list[int], quiet: float = 0.05, window_s: float = 0.25, most_s: float = 15.0) -> float:
    """Wait until the side just measured is quiet (its processes and their children below
    ``quiet`` of a core over ``window_s``; at most ``most_s``); the seconds waited. A round ends
    with its warm pools short of the creates it took, and their refill (crun, a few ms of CPU a
    sandbox) would otherwise run in the other side's next round, charged to it."""
    def cpu() -> float:
        total = 0.0
        for pid in pids:
            try:
                total += sum(host.process_cpu(pid))
            except OSError:  # (gone: nothing more to wait for)
                pass
        return total

    start = time.monotonic()
    last = cpu()
    while time.monotonic() - start < most_s:
        time.sleep(window_s)
        now = cpu()
        if now - last < quiet * window_s:
            break
        last = now
    return time.monotonic() - start


async def _node_loss(server: LocalServer, ray: _Ray, victim: str, concurrency: int) -> dict:
    async with DSecClient(server.endpoint, token=server.token) as client:
        probe = None
        for _ in range(50):
            s = await client.run_container(ARGS)
            if s.info.node == victim:
                probe = s
                break
            await s.stop()
        if probe is None:
            raise RuntimeError(f"no sandbox landed on {victim}")
        failures: list[float] = []
        successes: list[float] = []
        stop = asyncio.Event()

        async def creator() -> None:
            while not stop.is_set():
                try:
                    s = await client.run_container(ARGS)
                    successes.append(time.monotonic())
                    await s.stop()
                except DSecError:
                    failures.append(time.monotonic())
                    await asyncio.sleep(0.02)

        workers = [asyncio.create_task(creator()) for _ in range(concurrency)]
        await asyncio.sleep(1.0)
        killed = time.monotonic()
        await asyncio.to_thread(ray.kill, victim)
        lost_s = None
        while time.monotonic() - killed < 30:
            try:
                await probe.run_shell("true", timeout=5)
            except SandboxLost:
                lost_s = time.monotonic() - killed
                break
            except DSecError:
                pass
            await asyncio.sleep(0.05)
        await asyncio.sleep(3.0)
        stop.set()
        await asyncio.gather(*workers, return_exceptions=True)
        # The longest stretch after the kill in which creates failed and none succeeded.
        worst, start = 0.0, None
        events = sorted([(t, False) for t in failures] + [(t, True) for t in successes])
        for t, ok in events:
            if t < killed:
                continue
            if not ok and start is None:
                start = t
            elif ok and start is not None:
                worst, start = max(worst, t - start), None
        if start is not None:
            worst = max(worst, events[-1][0] - start)
        return {"lost_s": lost_s, "create_outage_s": worst, "failed_creates": sum(t >= killed for t in failures),
                "creates_after_kill": sum(t >= killed for t in successes)}


def main(state_dir: Path, console: Console, lifecycles: int = 300, rounds: int = 2, concurrency: int = 16) -> int:
    os.environ.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "DSEC_VMS": "0"})
    base = Path(state_dir)
    shutil.rmtree(base, ignore_errors=True)
    (base / "ray").mkdir(parents=True)
    os.environ["RAY_TMPDIR"] = str(base / "ray")
    embedded = LocalServer(base / "embedded", extra_args=("--fncall-max", "0")).start()
    servers, ray = [embedded], None
    result: dict[str, Any] = {}
    try:
        console.print("[bold]starting a Ray cluster of 3 dsec_edge nodes on loopback[/]")
        ray = _Ray(base)
        for name in NODES:
            ray.add(name)
        clustered = LocalServer(base / "api", extra_args=(
            "--ray", ray.cluster.address, "--node-state-dir", str(base / "nodes"),
            "--store-dir", str(base / "embedded" / "store"), "--fncall-max", "0"), start_timeout_s=180).start()
        servers.append(clustered)
        rates: dict[str, list[float]] = {"embedded": [], "ray": []}
        asyncio.run(_lifecycles(embedded, concurrency * 2, concurrency))  # warm both pools
        asyncio.run(_lifecycles(clustered, concurrency * 2, concurrency))
        sides = {"embedded": [embedded.proc.pid], "ray": [clustered.proc.pid, *_edge_daemons(base / "nodes")]}
        settled: dict[str, list[float]] = {"embedded": [], "ray": []}
        for r in range(rounds):
            for name, server in (("embedded", embedded), ("ray", clustered)):
                rate = asyncio.run(_lifecycles(server, lifecycles // rounds, concurrency))
                rates[name].append(rate)
                settled[name].append(_settle(sides[name]))
                console.print(f"round {r + 1}: {name} {rate:.1f} lifecycles/s (then quiet after {settled[name][-1]:.1f} s)")
        result["rounds"] = rates
        result["settle_s"] = settled
        result["embedded"] = median_of_rounds(rates["embedded"])
        result["ray"] = median_of_rounds(rates["ray"])
        import ray as ray_module

        from dsec.nodes.ray import join

        join(ray.cluster.address)
        result["data_path"] = asyncio.run(_data_path(clustered, 2000, 64))
        ray_module.shutdown()
        console.print("[bold]killing node b3 under load[/]")
        result.update(asyncio.run(_node_loss(clustered, ray, "b3", concurrency)))
    finally:
        for server in reversed(servers):
            server.stop_sandboxes()
            server.stop()
        if ray is not None:
            ray.cluster.shutdown()
        from dsec.node import reset_node

        for node_dir in sorted((base / "nodes").glob("*")) if (base / "nodes").is_dir() else []:
            asyncio.run(reset_node(node_dir))
    left = [x for d in [base / "embedded", *sorted((base / "nodes").glob("*"))] for x in leftovers(d)]
    table = Table(title="DSec on 3 Ray nodes vs embedded, same run")
    for col in ("figure", "DSec on Ray", "embedded", "ratio", "goal", "met"):
        table.add_column(col)
    ratio = result["ray"] / result["embedded"]
    table.add_row("lifecycles/s (create, echo, stop), median round", f"{result['ray']:.1f}", f"{result['embedded']:.1f}",
                  f"{ratio:.2f}", "≥ 0.85", _met(ratio >= 0.85))
    table.add_row("  every round", ", ".join(f"{x:.1f}" for x in result["rounds"]["ray"]),
                  ", ".join(f"{x:.1f}" for x in result["rounds"]["embedded"]), "", "", "")
    lost = result.get("lost_s")
    table.add_row("kill → first SandboxLost", "—" if lost is None else f"{lost:.2f} s", "", "", "≤ 5 s",
                  _met(lost is not None and lost <= 5))
    table.add_row("longest stretch of failing creates", f"{result['create_outage_s']:.2f} s", "", "", "≤ 5 s",
                  _met(result["create_outage_s"] <= 5))
    for name, (rate, cpu_ms) in result.get("data_path", {}).items():
        table.add_row(f"data path: a node call by {'a Ray actor call' if name == 'actor' else 'its HTTP endpoint'}",
                      f"{rate:,.0f} calls/s, caller CPU {cpu_ms:.2f} ms", "", "", "64 in flight", "")
    table.add_row("creates after the kill (failed)", f"{result['creates_after_kill']} ({result['failed_creates']})",
                  "", "", "", "")
    console.print(table)
    result["ratio"] = ratio
    (base.parent / f"{base.name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    if left:
        console.print(f"[red]left behind: {left}[/]")
        return 1
    shutil.rmtree(base, ignore_errors=True)
    return 0


def _met(ok: bool) -> str:
    return "yes" if ok else "NO"
