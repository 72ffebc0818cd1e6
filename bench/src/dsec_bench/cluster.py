"""``dsec bench cluster``: the control plane at the report's scale, on this one machine, over
the **fake backend** (no container is made on either arm: every figure is the control plane's).

Two arms, the same phases, one run:

- **remote**: ``nodes`` (160) simulated nodes — edges over the in-memory fake backend, each
  behind its own node endpoint (``dsec.edge.simnodes``), spread over ``processes`` (4)
  processes — and one apiserver process, ``dsec serve --nodes-file``, reaching them through
  the real remote seam (``RemoteEdge``).
- **embedded** (the peer): one process serving the same apiserver app over as many in-process
  edges on the fake backend (``Cluster([Edge(FakeBackend) × nodes])``): the same placement,
  quotas and routes without the node seam's hops.

Then, with real containers (``crun``, ``--crun-count`` > 0): **crun-remote**, ``crun_nodes`` (4)
real nodes on this machine (``python -m dsec.nodes.edged``: an edge over crun each, one shared
layer store) behind one apiserver (``dsec serve --nodes-file``), against **crun-embedded**, one
``dsec serve`` whose one in-process edge makes the same containers: the node seam's cost when each
sandbox is a container, not a record. Both without a warm pool (each create makes its container),
on ``busybox``, 32 MB each; the batch and the single creates (``crun_count`` each,
``crun_in_flight`` at once) and their stops, no paced phase; no goal is judged on them (the
report's goals are the control plane's), their ratio is printed.

The load generator is this process, through the SDK (``libdsec.DSecClient``). Phases, on image
``tiny`` (sandboxes of 64 MB, so that 230 fit a simulated node's memory at the default
overcommit; nodes admit ``max_sandboxes`` (1000) each):

1. one batch, ``run_containers(args, count=batch)`` (32,000): sandboxes/s from the request to
   the last one received, and the spread (max/mean sandboxes per node, over every node);
2. every sandbox stopped, ``in_flight`` (256) stops at a time, in a random order (episodes
   end in any order; a batch's sandboxes come back grouped by node): stops/s;
3. ``singles`` (32,000) single creates, ``in_flight`` at a time (a closed loop): creates/s,
   p50/p99 latency, spread; then stopped as in 2;
4. single creates offered at a fixed rate (``paced_rate``, 2,000/s, for ``paced_s`` seconds;
   an open loop, at most ``in_flight`` outstanding): p50/p99 latency at that rate, each counted
   from when the create was due; then again at half the rate phase 3 reached (the latency of
   the path itself, below saturation). With 256 in flight in a closed loop the latency is
   queueing: by Little's law the mean is 256 ÷ rate, so p99 ≤ 50 ms there needs more than
   5,120 creates/s; the paced phase gives the latency a create sees when the cluster is asked
   for the goal's rate.

Each phase reports the CPU seconds of each process (apiserver, simulated nodes, load
generator), so the cost per sandbox shows where it goes. Everything lives in a temporary
directory; every process is stopped and the directory removed at the end, on failure and on
Ctrl-C or SIGTERM too (the children also get SIGTERM if this process dies: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs, Sandbox

from dsec.local import free_port
from . import hoststats as host

GOAL_BATCH_PER_S = 5000.0
GOAL_SINGLES_PER_S = 2000.0
GOAL_P99_MS = 50.0
GOAL_SPREAD = 1.15
NODE_TOKEN = "bench-cluster-node-token"
# Both arms run their edges over this backend; every printed figure and goal names it.
BACKEND = "fake backend"


@dataclass
class Options:
    nodes: int = 160
    processes: int = 4            # simulated-node processes (nodes are dealt out among them)
    batch: int = 32_000           # sandboxes in the one batch
    singles: int = 32_000         # single creates (closed loop)
    in_flight: int = 256          # single creates (and stops) outstanding at once
    paced_rate: float = 2000.0    # single creates offered per second in the paced phase (0: none)
    paced_s: float = 5.0
    max_sandboxes: int = 1000     # a simulated node's admission limit
    memory_mb: int = 64           # each sandbox's memory limit
    embedded: bool = True         # run the embedded peer too
    embedded_scale: float = 1.0   # the embedded arm's counts, as a fraction of the remote arm's
    crun_nodes: int = 4           # real nodes (crun) of the crun arms
    crun_count: int = 256         # their batch, and their single creates (0: no crun arms)
    crun_in_flight: int = 32
    strict: bool = False


class BenchError(RuntimeError):
    pass


# -- processes ------------------------------------------------------------------------------

# Run a module as ``python -m`` would, after asking the kernel for SIGTERM once this process
# (its parent) dies: a benchmark killed outright leaves no server behind.
# With DSEC_BENCH_PROFILE=DIR each child runs under cProfile (timed by its CPU time, not the
# wall clock, which charges a call for the time the process waited to run) and writes
# DIR/<module>-<pid>.prof.
_LAUNCH = ("import ctypes, os, runpy, sys; ctypes.CDLL(None).prctl(1, 15)\n"
           "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
           "sys.argv = sys.argv[2:]; out = os.environ.get('DSEC_BENCH_PROFILE')\n"
           "run = lambda: runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
           "if not out: run()\n"
           "else:\n"
           "    import cProfile, signal, time; p = cProfile.Profile(time.process_time); name = f'{out}/{sys.argv[0]}-{os.getpid()}.prof'\n"
           "    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # uvicorn raises it again at its end\n"
           "    try: p.runcall(run)\n"
           "    finally: p.dump_stats(name)")


async def _spawn(module: str, *args: str, log: Path, stdin=subprocess.DEVNULL,
                 stdout=None) -> asyncio.subprocess.Process:
    with open(log, "ab") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-c", _LAUNCH, str(os.getpid()), module, *args, stdin=stdin,
            stdout=stdout if stdout is not None else out, stderr=out,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def _end(proc: asyncio.subprocess.Process, timeout_s: float = 20.0) -> None:
    if proc.returncode is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


async def _wait_healthy(endpoint: str, proc: asyncio.subprocess.Process, log: Path, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=1.0) as http:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise BenchError(f"the server exited with {proc.returncode}: {_tail(log)}")
            try:
                if (await http.get(f"{endpoint}/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise BenchError(f"the server did not answer in {timeout_s:g} s: {_tail(log)}")


class Arm:
    """The processes of one arm; ``async with`` starts them and stops them all."""

    def __init__(self, name: str, work: Path, opts: Options, nodes: int) -> None:
        self.name, self.work, self.opts, self.nodes = name, work, opts, nodes
        self.procs: dict[str, asyncio.subprocess.Process] = {}  # role -> process
        self.endpoint = ""
        self.token = ""
        self.crun = name.startswith("crun-")
        self.image = "busybox" if self.crun else "tiny"
        self.state_dirs: list[Path] = []  # the real nodes' (crun arms), checked and reset at the end

    def pids(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for role, proc in self.procs.items():
            out.setdefault(role.split(":")[0], []).append(proc.pid)
        return out

    async def __aenter__(self) -> Arm:
        self.work.mkdir(parents=True)
        try:
            await self._start()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(_end(p) for p in self.procs.values()), return_exceptions=True)
        if self.state_dirs:
            await asyncio.to_thread(self._reset_nodes)

    def _reset_nodes(self) -> None:
        """A real node left nothing (its edge, stopped, leaves running sandboxes to the next one:
        a phase cut short leaves some), or ``dsec reset`` removes it before the work dir goes."""
        from dsec.local import leftovers

        for state in self.state_dirs:
            if leftovers(state, settle_s=1.0):
                subprocess.run([sys.executable, "-m", "dsec", "reset", "--state-dir", str(state), "--yes"],
                               capture_output=True, timeout=300)
            if left := leftovers(state):
                raise BenchError(f"{self.name}: node {state.name} left {left[:5]}")

    async def _start(self) -> None:
        if self.crun:
            return await self._start_crun()
        from dsec.edge.simnodes import tiny_image
        from dsec.images.store import LayerStore

        tiny_image(LayerStore(self.work / "store"), self.work)
        edge_config = json.dumps({"max_sandboxes": self.opts.max_sandboxes})
        names = [f"n{i}" for i in range(self.nodes)]
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        api_dir = self.work / "api"
        if self.name == "embedded":
            log = self.work / "embedded.log"
            proc = self.procs["apiserver"] = await _spawn(
                "dsec_bench.cluster", "embedded", "--state", str(api_dir), "--port", str(port),
                "--edge-config", edge_config, *names, log=log)
            await _wait_healthy(self.endpoint, proc, log)
        else:
            (self.work / "node-token").write_text(NODE_TOKEN)
            urls: dict[str, str] = {}
            k = max(1, min(self.opts.processes, self.nodes))
            starting = []
            for i in range(k):
                log = self.work / f"simnodes-{i}.log"
                proc = self.procs[f"simnodes:{i}"] = await _spawn(
                    "dsec.edge.simnodes", "--store", str(self.work / "store"), "--state", str(self.work / f"nodes{i}"),
                    "--token-file", str(self.work / "node-token"), "--edge-config", edge_config, *names[i::k],
                    log=log, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                starting.append(self._ready(proc, log, urls))
            await asyncio.gather(*starting)
            await self._serve_nodes({n: urls[n] for n in names}, api_dir, port)
        self.token = (api_dir / "token").read_text().strip()

    async def _serve_nodes(self, urls: dict[str, str], api_dir: Path, port: int) -> None:
        """The apiserver over the nodes at ``urls`` (``dsec serve --nodes-file``), once it answers."""
        nodes_file = self.work / "nodes.json"
        nodes_file.write_text(json.dumps({"token": NODE_TOKEN, "nodes": urls}))
        log = self.work / "apiserver.log"
        proc = self.procs["apiserver"] = await _spawn(
            "dsec", "serve", "--state-dir", str(api_dir), "--nodes-file", str(nodes_file), "--port", str(port),
            log=log)
        await _wait_healthy(self.endpoint, proc, log)

    async def _start_crun(self) -> None:
        from dsec.images.builders import build_busybox
        from dsec.images.store import LayerStore

        store = self.work / "store"
        build_busybox(LayerStore(store))
        edge = {"pool_min": 0, "pool_max": 0}
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        api_dir = self.work / "api"
        if self.name == "crun-embedded":
            api_dir.mkdir()
            (api_dir / "store").symlink_to(store)
            self.state_dirs.append(api_dir)
            log = self.work / "serve.log"
            proc = self.procs["apiserver"] = await _spawn(
                "dsec", "serve", "--state-dir", str(api_dir), "--port", str(port), "--pool-max", "0", log=log)
            await _wait_healthy(self.endpoint, proc, log)
        else:
            urls = {}
            for i in range(self.nodes):
                name, state = f"n{i}", self.work / f"node-n{i}"
                self.state_dirs.append(state)
                log = self.work / f"edged-{name}.log"
                proc = self.procs[f"node:{i}"] = await _spawn(
                    "dsec.nodes.edged", "--state-dir", str(state), "--node", name, "--store", str(store),
                    "--config", json.dumps({"edge": edge, "fncall": None}), log=log,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(NODE_TOKEN.encode() + b"\n")
                await proc.stdin.drain()
                async with asyncio.timeout(120):
                    line = await proc.stdout.readline()
                if not line:
                    raise BenchError(f"node {name} exited at start: {_tail(log)}")
                urls[name] = json.loads(line)["url"]
            await self._serve_nodes(urls, api_dir, port)
        self.token = (api_dir / "token").read_text().strip()

    @staticmethod
    async def _ready(proc: asyncio.subprocess.Process, log: Path, urls: dict[str, str]) -> None:
        assert proc.stdout is not None
        async with asyncio.timeout(120):
            while (line := (await proc.stdout.readline()).decode().strip()) != "ready":
                if not line:
                    raise BenchError(f"simulated nodes exited at start: {_tail(log)}")
                entry = json.loads(line)
                urls[entry["node"]] = entry["url"]


# -- measuring ------------------------------------------------------------------------------


class CpuMeter:
    """CPU seconds of each role's processes (and of this one, the load generator) over a phase."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids
        self.host = host.CpuSample.now()
        self.start = self._now()

    def _now(self) -> dict[str, float]:
        out = {role: sum(host.process_cpu(p)[0] for p in pids) for role, pids in self.pids.items()}
        out["client"] = host.self_cpu()
        return out

    def stop(self, count: int) -> dict[str, Any]:
        now, machine = self._now(), host.CpuSample.now().since(self.host)
        cpu_s = {role: now[role] - self.start[role] for role in now}
        ours = sum(cpu_s.values())
        cores = os.cpu_count() or 1
        return {
            "cpu_s": {k: round(v, 3) for k, v in cpu_s.items()},
            "cpu_us_per_sandbox": {k: round(v / max(count, 1) * 1e6, 1) for k, v in cpu_s.items()},
            # Every process of the arm and the load generator: what the machine's cores could
            # do at this CPU cost with no other work on them (a bound: it assumes they overlap).
            "cpu_us_all": ours / max(count, 1) * 1e6,
            "cpu_bound_per_s": count * cores / ours if ours > 0 else float("nan"),
            "others_share": max(0.0, machine["busy_cpu_s"] - ours) / (machine["wall_s"] * cores),
        }


def _spread(infos: list, nodes: int) -> dict[str, Any]:
    per_node = Counter(i.node for i in infos)
    mean = len(infos) / nodes
    most = max(per_node.values(), default=0)
    return {"max_per_node": most, "min_per_node": min((per_node.get(f"n{i}", 0) for i in range(nodes)), default=0),
            "mean_per_node": mean, "spread": most / mean if mean else float("nan")}


class Phases:
    def __init__(self, arm: Arm, client: DSecClient, progress: Progress, opts: Options, scale: float) -> None:
        self.arm, self.client, self.progress, self.opts = arm, client, progress, opts
        self.args = DSecContainerRunArgs(container_image=arm.image, memory_limit_mb=opts.memory_mb)
        self.batch = max(1, round(opts.batch * scale))
        self.singles = max(1, round(opts.singles * scale))
        self.paced_s = opts.paced_s * scale

    def _task(self, what: str, total: int):
        return self.progress.add_task(f"{self.arm.name}: {what}", total=total)

    async def run(self) -> dict[str, Any]:
        r: dict[str, Any] = {"nodes": self.arm.nodes, "batch_count": self.batch, "singles_count": self.singles}
        with _collector_held():
            made, r["batch"] = await self.run_batch()
        with _collector_held():
            r["batch_stop"] = await self.stop_all(made, "stop the batch")
        with _collector_held():
            made, r["singles"] = await self.run_singles()
        with _collector_held():
            r["singles_stop"] = await self.stop_all(made, "stop the single creates")
        if self.opts.paced_rate > 0 and self.paced_s > 0:
            with _collector_held():
                made, r["paced"] = await self.run_paced(self.opts.paced_rate)
            with _collector_held():
                r["paced_stop"] = await self.stop_all(made, "stop the paced creates")
            with _collector_held():
                made, r["paced_half"] = await self.run_paced(r["singles"]["per_s"] / 2)
            with _collector_held():
                r["paced_half_stop"] = await self.stop_all(made, "stop the paced creates")
        r["left_running"] = len(await self.client.list_sandboxes())
        return r

    async def run_batch(self) -> tuple[list[Sandbox], dict]:
        task = self._task(f"one batch of {self.batch:,}", self.batch)
        last = [0.0]

        def progress(done: int, count: int) -> None:
            last[0] = time.perf_counter()
            if done % 256 == 0 or done == count:
                self.progress.update(task, completed=done)

        meter = CpuMeter(self.arm.pids())
        t0 = time.perf_counter()
        made = await self.client.run_containers(self.args, count=self.batch, timeout=600, progress=progress)
        seconds = last[0] - t0
        figures = {"seconds": seconds, "per_s": self.batch / seconds, **_spread([s.info for s in made], self.arm.nodes),
                   **meter.stop(self.batch), "loadavg": _loadavg()}
        return made, figures

    async def _closed_loop(self, total: int, what: str, fn: Callable[[int], Awaitable[Any]]) -> tuple[float, list, list[float]]:
        task = self._task(what, total)
        it = iter(range(total))
        results: list = []
        latencies: list[float] = []
        errors: list[str] = []

        async def worker() -> None:
            for i in it:
                t = time.perf_counter()
                try:
                    results.append(await fn(i))
                except Exception as exc:  # noqa: BLE001 - counted; too many end the phase
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    if len(errors) > 10:
                        raise BenchError(f"{what}: {len(errors)} errors, the first: {errors[0]}") from None
                    continue
                latencies.append(time.perf_counter() - t)
                if len(latencies) % 256 == 0:
                    self.progress.update(task, completed=len(latencies))
            self.progress.update(task, completed=len(latencies))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(self.opts.in_flight, total))))
        return time.perf_counter() - t0, results, latencies

    async def stop_all(self, made: list[Sandbox], what: str) -> dict:
        made = list(made)
        random.Random(len(made)).shuffle(made)
        meter = CpuMeter(self.arm.pids())
        seconds, _, latencies = await self._closed_loop(len(made), f"{what} ({self.opts.in_flight} in flight)",
                                                        lambda i: made[i].stop())
        return {"count": len(made), "seconds": seconds, "per_s": len(made) / seconds,
                **_ms(latencies), **meter.stop(len(made))}

    async def run_singles(self) -> tuple[list[Sandbox], dict]:
        meter = CpuMeter(self.arm.pids())
        seconds, made, latencies = await self._closed_loop(
            self.singles, f"{self.singles:,} single creates, {self.opts.in_flight} in flight",
            lambda i: self.client.run_container(self.args))
        return made, {"seconds": seconds, "per_s": len(made) / seconds, **_ms(latencies),
                      **_spread([s.info for s in made], self.arm.nodes), **meter.stop(len(made)), "loadavg": _loadavg()}

    async def run_paced(self, rate: float) -> tuple[list[Sandbox], dict]:
        """Creates offered at ``rate`` a second; each one's latency counts from when it was
        due, so falling behind the rate shows as latency, not as a slower offer."""
        total = max(1, round(rate * self.paced_s))
        task = self._task(f"single creates offered at {rate:,.0f}/s", total)
        gate = asyncio.Semaphore(self.opts.in_flight)
        made: list[Sandbox] = []
        latencies: list[float] = []
        errors: list[str] = []
        meter = CpuMeter(self.arm.pids())
        t0 = time.perf_counter()

        async def one(due: float) -> None:
            try:
                made.append(await self.client.run_container(self.args))
                latencies.append(time.perf_counter() - due)
            except Exception as exc:  # noqa: BLE001 - counted
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
            finally:
                gate.release()
                if len(latencies) % 256 == 0:
                    self.progress.update(task, completed=len(latencies))

        tasks = []
        for i in range(total):
            due = t0 + i / rate
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            await gate.acquire()
            tasks.append(asyncio.create_task(one(due)))
        await asyncio.gather(*tasks)
        seconds = time.perf_counter() - t0
        self.progress.update(task, completed=len(latencies))
        if errors:
            raise BenchError(f"paced creates: {len(errors)} errors, the first: {errors[0]}")
        return made, {"rate": rate, "count": total, "seconds": seconds, "achieved_per_s": total / seconds,
                      **_ms(latencies), **meter.stop(total)}


@contextlib.contextmanager
def _collector_held() -> Iterator[None]:
    """No cyclic garbage collection in this (the client's) process during a phase: the phase's
    own results (tens of thousands of sandbox handles) grow the heap, and each of the
    collector's full passes over it stalled every request in flight for up to a few hundred ms,
    which the latencies then counted against the platform. The SDK leaves no cycles a request
    (a test checks), so nothing piles up meanwhile; what the phase left is collected after it."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def _mounts_under(path: Path) -> list[str]:
    inside = str(path.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        return [t for line in f if (t := line.split()[4]).startswith(inside)]


def _ms(latencies: list[float]) -> dict[str, float]:
    s = host.latency_summary(latencies)
    return {"p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"], "max_ms": s["max_ms"]}


def _loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


async def _measure_arm(name: str, work: Path, opts: Options, progress: Progress, scale: float) -> dict[str, Any]:
    nodes = 1 if name == "crun-embedded" else opts.nodes
    async with Arm(name, work / name, opts, nodes) as arm:
        client = DSecClient(arm.endpoint, token=arm.token, timeout=600, max_connections=opts.in_flight)
        async with client:
            res = await Phases(arm, client, progress, opts, scale).run()
        res["processes"] = {role: len(pids) for role, pids in arm.pids().items()}
    return res


# -- report ---------------------------------------------------------------------------------


def _goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    remote = res["arms"].get("remote", {})

    def goal(what: str, value: float | None, target: float, higher: bool) -> dict[str, Any]:
        met = None if value is None else (value >= target if higher else value <= target)
        return {"goal": what, "value": value, "target": target, "met": met}

    paced = remote.get("paced", {})
    return [
        goal(f"batch ≥ {GOAL_BATCH_PER_S:,.0f} sandboxes/s", remote.get("batch", {}).get("per_s"), GOAL_BATCH_PER_S, True),
        goal(f"batch spread ≤ {GOAL_SPREAD}", remote.get("batch", {}).get("spread"), GOAL_SPREAD, False),
        goal(f"single creates ≥ {GOAL_SINGLES_PER_S:,.0f}/s ({res['options']['in_flight']} in flight)",
             remote.get("singles", {}).get("per_s"), GOAL_SINGLES_PER_S, True),
        goal(f"single create p99 ≤ {GOAL_P99_MS:g} ms ({res['options']['in_flight']} in flight)",
             remote.get("singles", {}).get("p99_ms"), GOAL_P99_MS, False),
        goal(f"single create p99 ≤ {GOAL_P99_MS:g} ms (offered at {res['options']['paced_rate']:,.0f}/s)",
             paced.get("p99_ms"), GOAL_P99_MS, False),
    ]


def _fmt(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _table(res: dict[str, Any]) -> Table:
    remote, embedded = res["arms"].get("remote", {}), res["arms"].get("embedded", {})
    scale = res["options"]["embedded_scale"]
    title = f"dsec bench cluster — {res['options']['nodes']} simulated nodes, fake backend on both arms"
    t = Table(title=title + (f"; embedded peer at {scale:g}× the counts" if scale != 1 else ""))
    for col in ("measure", "remote seam (fake backend)", "embedded (fake backend, same run)", "remote ÷ embedded", "goal"):
        t.add_column(col)
    goals = {g["goal"]: g for g in res["summary"]["goals"]}

    def verdict(name: str | None) -> str:
        if name is None:
            return ""
        g = next((g for k, g in goals.items() if k.startswith(name)), None)
        if g is None or g["met"] is None:
            return ""
        return f"{g['goal']}: " + ("[green]met[/green]" if g["met"] else "[red]missed[/red]")

    rows = [
        ("batch sandboxes/s", ("batch", "per_s"), ",.0f", "batch ≥"),
        ("batch spread (max/mean per node)", ("batch", "spread"), ".3f", "batch spread"),
        ("batch: stops/s", ("batch_stop", "per_s"), ",.0f", None),
        ("single creates/s", ("singles", "per_s"), ",.0f", "single creates ≥"),
        ("single create p50 ms", ("singles", "p50_ms"), ".1f", None),
        ("single create p99 ms", ("singles", "p99_ms"), ".1f", "single create p99 ≤ 50 ms (2"),
        ("single creates spread", ("singles", "spread"), ".3f", None),
        (f"create p50 ms offered at {res['options']['paced_rate']:,.0f}/s", ("paced", "p50_ms"), ".1f", None),
        (f"create p99 ms offered at {res['options']['paced_rate']:,.0f}/s", ("paced", "p99_ms"), ".1f",
         "single create p99 ≤ 50 ms (o"),
        ("create p50 ms offered at ½ the closed-loop rate", ("paced_half", "p50_ms"), ".1f", None),
        ("create p99 ms offered at ½ the closed-loop rate", ("paced_half", "p99_ms"), ".1f", None),
        ("  (that rate, creates/s)", ("paced_half", "rate"), ",.0f", None),
        ("batch: CPU µs a sandbox, all processes", ("batch", "cpu_us_all"), ",.0f", None),
        ("batch: sandboxes/s that CPU allows on 2 free cores", ("batch", "cpu_bound_per_s"), ",.0f", None),
        ("single create: CPU µs, all processes", ("singles", "cpu_us_all"), ",.0f", None),
        ("single creates/s that CPU allows on 2 free cores", ("singles", "cpu_bound_per_s"), ",.0f", None),
        ("others' share of the machine (single creates)", ("singles", "others_share"), ".0%", None),
    ]
    for label, (phase, key), spec, goal_name in rows:
        a, b = remote.get(phase, {}).get(key), embedded.get(phase, {}).get(key)
        ratio = f"{a / b:.2f}" if a is not None and b else "—"
        t.add_row(label, _fmt(a, spec), _fmt(b, spec), ratio, verdict(goal_name))
    return t


def _crun_table(res: dict[str, Any]) -> Table:
    remote, embedded = res["arms"].get("crun-remote", {}), res["arms"].get("crun-embedded", {})
    o = res["options"]
    t = Table(title=f"dsec bench cluster — real containers (crun): {o['crun_nodes']} nodes on this machine behind "
                    f"one apiserver, against one embedded node; {o['crun_count']} sandboxes a phase, "
                    f"{o['crun_in_flight']} in flight, no warm pool")
    for col in ("measure", "remote seam (crun)", "embedded (crun, same run)", "remote ÷ embedded"):
        t.add_column(col)
    rows = [
        ("batch sandboxes/s", ("batch", "per_s"), ",.1f"),
        ("batch spread (max/mean per node)", ("batch", "spread"), ".3f"),
        ("batch: stops/s", ("batch_stop", "per_s"), ",.1f"),
        ("single creates/s", ("singles", "per_s"), ",.1f"),
        ("single create p50 ms", ("singles", "p50_ms"), ".1f"),
        ("single create p99 ms", ("singles", "p99_ms"), ".1f"),
        ("single creates: stops/s", ("singles_stop", "per_s"), ",.1f"),
        ("single create: CPU µs, all processes", ("singles", "cpu_us_all"), ",.0f"),
        ("others' share of the machine (single creates)", ("singles", "others_share"), ".0%"),
    ]
    for label, (phase, key), spec in rows:
        a, b = remote.get(phase, {}).get(key), embedded.get(phase, {}).get(key)
        t.add_row(label, _fmt(a, spec), _fmt(b, spec), f"{a / b:.2f}" if a is not None and b else "—")
    return t


def _cpu_lines(res: dict[str, Any]) -> list[str]:
    lines = []
    for name, arm in res["arms"].items():
        for phase in ("batch", "batch_stop", "singles", "singles_stop", "paced", "paced_half"):
            if phase in arm:
                per = arm[phase]["cpu_us_per_sandbox"]
                parts = ", ".join(f"{role} {us:,.0f}" for role, us in per.items())
                lines.append(f"{name} {phase}: CPU µs per sandbox: {parts}; others "
                             f"{arm[phase]['others_share']:.0%} of the machine")
    return lines


def main(console: Console, **options: Any) -> int:
    """Run both arms, print the table, write the results (``--results``) if asked. Returns 0
    when it ran cleanly, 1 on an error, 2 (``strict``) when a goal is missed, 130 interrupted."""
    results_path = options.pop("results", None)
    opts = Options(**options)
    res: dict[str, Any] = {"benchmark": "dsec bench cluster", "backend": BACKEND, "options": asdict(opts),
                           "machine": host.machine(),
                           "arms": {}, "errors": []}
    res["machine"].pop("crun", None), res["machine"].pop("podman", None)
    console.print(f"[bold]dsec bench cluster[/bold]: {opts.nodes} simulated nodes in {opts.processes} processes, "
                  f"one apiserver; {BACKEND} on both arms (no containers: the control plane's figures)"
                  + (f"; then {opts.crun_nodes} real crun nodes against one embedded, {opts.crun_count} sandboxes a "
                     "phase" if opts.crun_count > 0 else "") + "; "
                  f"{res['machine']['cores']} cores, load average {' '.join(_loadavg())}")
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-cluster-"))
    res["work_dir"] = str(work)
    code = 0

    async def run(progress: Progress) -> None:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        res["arms"]["remote"] = await _measure_arm("remote", work, opts, progress, 1.0)
        if opts.embedded:
            res["arms"]["embedded"] = await _measure_arm("embedded", work, opts, progress, opts.embedded_scale)
        if opts.crun_count > 0:
            # Containers only: no VM backend fetches a guest kernel or probes an accelerator.
            os.environ.setdefault("DSEC_VMS", "0")
            crun = replace(opts, nodes=opts.crun_nodes, batch=opts.crun_count, singles=opts.crun_count,
                           in_flight=opts.crun_in_flight, paced_rate=0.0, memory_mb=32)
            res["arms"]["crun-remote"] = await _measure_arm("crun-remote", work, crun, progress, 1.0)
            res["arms"]["crun-embedded"] = await _measure_arm("crun-embedded", work, crun, progress, 1.0)

    try:
        with Progress(TextColumn("{task.description:<58}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            asyncio.run(run(progress))
    except (KeyboardInterrupt, asyncio.CancelledError):
        res["errors"].append("interrupted")
        code = 130
    except Exception as exc:  # noqa: BLE001 - reported; everything is cleaned up below
        res["errors"].append(f"{type(exc).__name__}: {exc}"[:2000])
        code = 1
    finally:
        if mounted := _mounts_under(work):  # a real node not reset: never delete through its mounts
            res["errors"].append(f"left mounted under {work}: {mounted[:5]}")
            code = code or 1
        else:
            shutil.rmtree(work, ignore_errors=True)
    res["machine"]["loadavg_at_end"] = _loadavg()
    res["summary"] = {"goals": _goals(res) if "remote" in res["arms"] else []}
    if results_path is not None:
        Path(results_path).write_text(json.dumps(res, indent=1, default=str) + "\n")
    if "remote" in res["arms"]:
        console.print(_table(res))
    if "crun-remote" in res["arms"]:
        console.print(_crun_table(res))
    if res["arms"]:
        for line in _cpu_lines(res):
            console.print(line)
    for g in res["summary"]["goals"]:
        shown = _fmt(g["value"], ",.3g")
        verdict = {True: "[green]met[/green]", False: "[red]missed[/red]", None: "[yellow]not measured[/yellow]"}[g["met"]]
        console.print(f"goal ({BACKEND}): {g['goal']}: {shown} {verdict}")
    for err in res["errors"]:
        console.print(f"[red]error:[/red] {err}")
    console.print(f"load average at the end {' '.join(res['machine']['loadavg_at_end'])}; temporary directory "
                  f"{work} {'removed' if not work.exists() else '[red]left behind[/red]'}")
    if code == 0 and opts.strict and any(g["met"] is False for g in res["summary"]["goals"]):
        code = 2
    return code


# -- the embedded peer's server (``python -m dsec_bench.cluster embedded …``) ---------------


async def _serve_embedded(names: list[str], state: Path, port: int, edge_config: dict) -> None:
    import uvicorn

    from dsec.app import create_app
    from dsec.apiserver.cluster import Cluster
    from dsec.apiserver.projects import open_project_store
    from dsec.backends.fake import FakeBackend
    from dsec.edge.edge import Edge, EdgeConfig
    from dsec.edge.simnodes import tiny_image
    from dsec.images.store import LayerStore
    from dsec.server import load_or_create_token

    state.mkdir(parents=True, exist_ok=True)
    store = LayerStore(state.parent / "store")
    tiny_image(store, state)
    edges = [Edge(EdgeConfig(node_dir=state / "nodes" / name, node=name, pool_min=0, pool_max=0, **edge_config),
                  FakeBackend(), store) for name in names]
    projects = open_project_store(state / "projects.db")
    try:
        for edge in edges:
            await edge.start()
        cluster = Cluster(edges, projects=projects, view_max_age_s=1.0)  # as `dsec serve --nodes-file`
        app = create_app(cluster, load_or_create_token(state))
        config = uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio", log_level="warning",
                                proxy_headers=False, timeout_keep_alive=75, timeout_graceful_shutdown=10)
        gc.freeze()
        await uvicorn.Server(config).serve()
    finally:
        await asyncio.gather(*(e.close() for e in edges), return_exceptions=True)
        projects.close()


def _embedded_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsec_bench.cluster embedded")
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--edge-config", default="{}")
    parser.add_argument("nodes", nargs="+")
    ns = parser.parse_args(argv)
    asyncio.run(_serve_embedded(ns.nodes, ns.state, ns.port, json.loads(ns.edge_config)))


if __name__ == "__main__":
    if sys.argv[1:2] != ["embedded"]:
        sys.exit("usage: python -m dsec_bench.cluster embedded --state DIR --port PORT NODE…  (see dsec bench cluster)")
    _embedded_main(sys.argv[2:])
