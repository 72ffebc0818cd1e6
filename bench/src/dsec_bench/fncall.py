"""``dsec bench fncall``: stateless calls through the warm pool, against the same snippet run per
call with ``bwrap … python3 -c`` and with plain ``python3 -c``, all in one run.

The snippet is ``print(sum(range(1000)))``; every answer is checked (``499500``).

1. Peers: ``python3 -c`` and ``bwrap --unshare-all … python3 -c`` (the host's python3, the same
   Debian 3.11 as the image's), one process per call, ``in_flight`` (32) at a time, spawned
   from this process with asyncio; then 1 at a time. Latency is spawn to exit.
2. DSec throughput: ``fncall_many`` against a ``dsec serve`` this benchmark starts itself, 500
   calls to an HTTP request and 2 requests in flight: an HTTP request costs more CPU than a
   trivial call, so the throughput figure carries many calls a request.
   Then the same with a call of ``pass``: the pool's floor, what a call costs with no work of its
   own (the HTTP share, the worker's fork, the child's set-up and exit). Its ratio to the peers
   bounds what any call through a fork-per-call pool can reach on the host.
3. DSec latency, measured at the client, end to end (the SDK's call to its answer: HTTP, the
   server's queue, the worker's fork, run and exit), in two forms: batched (``fncall_many``, 8
   calls a request; a call's latency is its request's round trip, since all 8 are answered
   together) and one call a request (``fncall``). Each at ``in_flight`` (32) calls in flight (4
   requests of 8, or 32 requests) and at one request in flight. The goal (p50 ≤ 2 ms, p99 ≤ 20
   ms) is judged on the client's figure with one request in flight, both forms: with 32 calls
   in flight on 2 cores a call's round trip is at least 32 / throughput (Little's law), so that
   figure is the queue the load keeps and is reported beside it, not judged. The server's own
   figures for each call, ``worker_s`` (its turn in a worker) and ``queued_s`` (its wait for a
   free worker), are printed as the breakdown. One request a call is bound by the HTTP exchange:
   a request costs the client and the server more CPU than a trivial call.

CPU: host CPU per call in each phase, the benchmark's own (its cgroup: this process, the peers
and the server; and the workers' cgroups), DSec's split into client (this process), server and
workers (zygotes and their calls), and the share of the machine other work (not this benchmark,
its server, its workers or its peers) took meanwhile, since this host is shared. CPU per call is
the steadier figure when others load the machine: the ratio by it is printed too.
Beside each throughput, the same divided by (1 − that share): what the run would have done with
the machine to itself, all of it being CPU-bound work. Goals are judged on the raw figures.
5. The SandboxFusion arm (``dsec_bench.fncall_fusion``; ``--no-fusion`` skips it): python and
   C++ calls through ``run_code`` with SandboxFusion's own client, against per-call ``bwrap`` of
   the same program.

Results go to ``<state_dir>/bench-fncall.json``; the server is stopped and what it left behind
(``dsec.local.leftovers``) is printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from libdsec import DSecClient, DSecFnCallArgs

from dsec.images.builders import build_python
from dsec.images.store import LayerStore
from dsec.local import LocalServer, leftovers
from dsec.resources import cgroups
from . import fncall_fusion
from . import hoststats as host

CODE = "print(sum(range(1000)))"
EXPECTED = "499500\n"
# The least a call can be: the pool's fixed cost (the HTTP share, the worker's fork, the child's
# set-up and exit) with no work of its own, measured the same way as the snippet. It bounds the
# ratio to the peers that any call through a fork-per-call pool can reach on this host.
FLOOR_CODE = "pass"
RESULTS_FILE = "bench-fncall.json"
PYTHON3 = "/usr/bin/python3"
BWRAP = [
    "bwrap", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
    "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
    "--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", "/usr/bin",
]

GOAL_CALLS_PER_S = 1000.0
GOAL_VS_BWRAP = 20.0
GOAL_FLOOR_SHARE = 0.95  # the snippet's calls/s over the floor's (a call of ``pass``), same run
GOAL_P50_MS = 2.0
GOAL_P99_MS = 20.0


class BenchError(RuntimeError):
    pass


class CpuGroup:
    """A CPU-accounting cgroup holding this process for the run, and so everything it starts:
    the peers (bwrap does not wait for all it starts, so rusage would miss their CPU) and the
    server. ``close()`` moves this process back and removes the cgroup."""

    def __init__(self, name: str) -> None:
        self.name = name
        root = cgroups.CGROUP_ROOT if cgroups.is_v2() else next(
            (cgroups.CGROUP_ROOT / c for c in ("cpuacct", "cpu,cpuacct") if (cgroups.CGROUP_ROOT / c).is_dir()), None)
        if root is None:
            raise BenchError("no cpuacct cgroup hierarchy")
        self.root = root
        self.home = self._current()
        (root / name).mkdir(exist_ok=True)
        (root / name / "cgroup.procs").write_text(str(os.getpid()))

    def _current(self) -> str:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if (cgroups.is_v2() and controllers == "") or "cpuacct" in controllers.split(","):
                return path
        return "/"

    def usage_s(self) -> float:
        return _cgroup_cpu_s(self.name)

    def close(self) -> None:
        (self.root / self.home.lstrip("/") / "cgroup.procs").write_text(str(os.getpid()))
        deadline = time.monotonic() + 10
        while True:
            try:
                (self.root / self.name).rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


@dataclass
class Meter:
    """CPU used during a phase: by the host, and by the benchmark (its cgroup: this process, the
    peers, the server; and the fncall workers' cgroups); the rest is others'."""

    group: CpuGroup
    parent: str | None = None
    server_pid: int | None = None

    def __post_init__(self) -> None:
        self._host = host.CpuSample.now()
        self._ours = self._ours_now()
        self._parts = self._parts_now()

    def _parts_now(self) -> dict[str, float]:
        """DSec's CPU by part: this process (the SDK client), the server, the workers."""
        if self.server_pid is None or self.parent is None:
            return {}
        return {"client": host.self_cpu(), "server": host.process_cpu(self.server_pid)[0],
                "workers": _cgroup_cpu_s(self.parent)}

    def _ours_now(self) -> float:
        return self.group.usage_s() + (_cgroup_cpu_s(self.parent) if self.parent is not None else 0.0)

    def stop(self, count: int) -> dict:
        spent = host.CpuSample.now().since(self._host)
        ours = self._ours_now() - self._ours
        cores = os.cpu_count() or 1
        others = max(0.0, spent["busy_cpu_s"] - ours)
        share = others / (spent["wall_s"] * cores) if spent["wall_s"] > 0 else float("nan")
        parts = {f"{k}_cpu_ms_per_call": (v - self._parts[k]) / max(count, 1) * 1e3
                 for k, v in self._parts_now().items()}
        return {**parts, "wall_s": spent["wall_s"], "host_cpu_ms_per_call": spent["busy_cpu_s"] / max(count, 1) * 1e3,
                "own_cpu_ms_per_call": ours / max(count, 1) * 1e3, "others_share": share,
                "calls_per_s": count / spent["wall_s"],
                "calls_per_s_alone": count / spent["wall_s"] / max(0.05, 1 - share)}


def _cgroup_cpu_s(parent: str) -> float:
    """CPU time of every process under a cgroup parent (the fncall workers), in seconds."""
    try:
        if cgroups.is_v2():
            for line in (cgroups.CGROUP_ROOT / parent / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
            return 0.0
        return int((cgroups.CGROUP_ROOT / "cpuacct" / parent / "cpuacct.usage").read_text()) / 1e9
    except (OSError, ValueError):
        return 0.0


async def _peer(group: CpuGroup, argv: list[str], count: int, in_flight: int) -> dict:
    """``count`` processes, ``in_flight`` at a time; each must print the expected answer."""
    latencies: list[float] = []
    gate = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with gate:
            start = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await proc.communicate()
            latencies.append(time.perf_counter() - start)
            if out.decode() != EXPECTED:
                raise BenchError(f"{argv[0]} answered {out!r} {err[-300:]!r}")

    meter = Meter(group)
    await asyncio.gather(*(one() for _ in range(count)))
    cpu = meter.stop(count)
    return {"calls": count, "in_flight": in_flight, "latency": host.latency_summary(latencies), **cpu}


async def _throughput(client: DSecClient, count: int, meter: Meter, code: str = CODE,
                      expected: str = EXPECTED) -> dict:
    calls = [DSecFnCallArgs(code=code) for _ in range(count)]
    results = await client.fncall_many(calls, per_request=500, requests_in_flight=2)
    cpu = meter.stop(count)
    _check(results, expected)
    return {"code": code, "calls": count, "per_request": 500, "requests_in_flight": 2,
            "worker": host.latency_summary([r.worker_s for r in results]),
            "duration": host.latency_summary([r.duration_s for r in results]), **cpu}


async def _latency(client: DSecClient, count: int, in_flight: int, meter: Meter) -> dict:
    args = DSecFnCallArgs(code=CODE)
    round_trips: list[float] = []
    results = []
    left = count

    async def loop() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            start = time.perf_counter()
            result = await client.fncall(args)
            round_trips.append(time.perf_counter() - start)
            results.append(result)

    await asyncio.gather(*(loop() for _ in range(in_flight)))
    cpu = meter.stop(count)
    _check(results)
    return {"calls": count, "in_flight": in_flight,
            "round_trip": host.latency_summary(round_trips),
            "worker": host.latency_summary([r.worker_s for r in results]),
            "queued": host.latency_summary([r.queued_s for r in results]),
            "duration": host.latency_summary([r.duration_s for r in results]), **cpu}


async def _latency_batched(client: DSecClient, count: int, in_flight: int, per_request: int, meter: Meter) -> dict:
    """``in_flight`` calls kept in flight as requests of ``per_request``; each call's latency at
    the client is its request's round trip (the SDK's call to the answer, all of it)."""
    args = DSecFnCallArgs(code=CODE)
    results = []
    round_trips: list[float] = []
    left = count

    async def loop() -> None:
        nonlocal left
        while left > 0:
            n = min(per_request, left)
            left -= n
            start = time.perf_counter()
            answered = await client.fncall_many([args] * n, per_request=n)
            round_trips.extend([time.perf_counter() - start] * len(answered))
            results.extend(answered)

    await asyncio.gather(*(loop() for _ in range(max(1, in_flight // per_request))))
    cpu = meter.stop(count)
    _check(results)
    return {"calls": count, "in_flight": in_flight, "per_request": per_request,
            "round_trip": host.latency_summary(round_trips),
            "worker": host.latency_summary([r.worker_s for r in results]),
            "queued": host.latency_summary([r.queued_s for r in results]),
            "in_server": host.latency_summary([r.queued_s + r.worker_s for r in results]),
            "duration": host.latency_summary([r.duration_s for r in results]), **cpu}


def _median_round(rounds: list[dict]) -> dict:
    """The round of the median throughput (the lower middle one of an even count)."""
    return dict(sorted(rounds, key=lambda r: r["calls_per_s"])[(len(rounds) - 1) // 2])


def _check(results: list, expected: str = EXPECTED) -> None:
    bad = [r for r in results if r.error is not None or r.stdout != expected or r.exit_code != 0]
    if bad:
        raise BenchError(f"{len(bad)} of {len(results)} calls went wrong; the first: {bad[0]!r}"[:800])


async def _wait_quiet(pid: int, parent: str, timeout_s: float = 180.0) -> None:
    """Wait until the server and its workers are idle: start-up work (worker starts, the VM
    backends' preparation) must not land in a measurement."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = sum(host.process_cpu(pid)) + _cgroup_cpu_s(parent)
        await asyncio.sleep(1.0)
        if sum(host.process_cpu(pid)) + _cgroup_cpu_s(parent) - before < 0.05:
            return


async def _dsec(group: CpuGroup, server: LocalServer, opts: dict, console: Console) -> dict:
    parent = cgroups.parent_for(server.state_dir)
    pid = server.proc.pid

    def meter() -> Meter:
        return Meter(group, parent, pid)

    async with DSecClient(server.endpoint, token=server.token, timeout=600) as client:
        console.log("warming up (the pool starts its workers)")
        _check(await client.fncall_many([DSecFnCallArgs(code=CODE) for _ in range(500)]))
        _check([await client.fncall(DSecFnCallArgs(code=CODE)) for _ in range(100)])
        await _wait_quiet(pid, parent)
        out: dict[str, Any] = {}
        rounds = max(1, opts.get("rounds", 3))
        console.log(f"throughput: {rounds} rounds of {opts['calls']} calls with fncall_many, each beside "
                    f"{opts['calls']} calls of {FLOOR_CODE!r} (the pool's floor), in turn")
        real_rounds, floor_rounds = [], []
        for i in range(rounds):
            # Each round's two phases back to back, their order alternating, so that a drift
            # of the machine's speed falls on both alike.
            for which in (("real", "floor") if i % 2 == 0 else ("floor", "real")):
                if which == "real":
                    real_rounds.append(await _throughput(client, opts["calls"], meter()))
                else:
                    floor_rounds.append(await _throughput(client, opts["calls"], meter(), FLOOR_CODE, ""))
                await _wait_quiet(pid, parent)
        out["throughput"], out["floor"] = _median_round(real_rounds), _median_round(floor_rounds)
        out["throughput"]["rounds_calls_per_s"] = [r["calls_per_s"] for r in real_rounds]
        out["floor"]["rounds_calls_per_s"] = [r["calls_per_s"] for r in floor_rounds]
        out["floor_share_rounds"] = [r["calls_per_s"] / f["calls_per_s"] for r, f in zip(real_rounds, floor_rounds)]
        console.log(f"latency: {opts['latency_calls']} calls, {opts['in_flight']} in flight, 8 a request")
        out["latency_batched"] = await _latency_batched(client, opts["latency_calls"], opts["in_flight"], 8, meter())
        await _wait_quiet(pid, parent)
        console.log(f"latency: {opts['latency_calls']} calls, {opts['in_flight']} in flight, one request each")
        out["latency"] = await _latency(client, opts["latency_calls"], opts["in_flight"], meter())
        await _wait_quiet(pid, parent)
        sequential = max(opts.get("sequential_min", 100), opts["latency_calls"] // 10)
        console.log(f"latency: {sequential} calls one at a time")
        out["sequential"] = await _latency(client, sequential, 1, meter())
        await _wait_quiet(pid, parent)
        console.log(f"latency: {sequential} calls, 8 a request, one request at a time")
        out["sequential_batched"] = await _latency_batched(client, sequential, 8, 8, meter())
        if opts.get("fusion"):
            await _wait_quiet(pid, parent)
            out["fusion"] = await fncall_fusion.measure(f"{server.endpoint}/sandboxfusion/{server.token}", BWRAP,
                                                        PYTHON3, meter, lambda: _wait_quiet(pid, parent), opts, console)
    return out


def _ensure_store(state_dir: Path, store_dir: Path | None, console: Console, fusion: bool = False) -> None:
    store_path = state_dir / "store"
    if store_dir is not None and not store_path.exists():
        store_path.symlink_to(Path(store_dir).resolve())
    store = LayerStore(store_path)
    if not store.has_image("python"):
        with console.status("building the python image (debootstrap, about a minute) …"):
            build_python(store)
    if fusion:
        fncall_fusion.ensure_image(store, console)


def _summary(res: dict) -> dict:
    tp = res["dsec"]["throughput"]["calls_per_s"]
    bwrap = res["peers"]["bwrap"]["calls_per_s"]
    single = res["dsec"]["sequential"]["round_trip"]
    batched = res["dsec"]["sequential_batched"]["round_trip"]
    alone = res["dsec"]["throughput"]["calls_per_s_alone"]
    floor = res["dsec"]["floor"]
    floor_share = statistics.median(res["dsec"]["floor_share_rounds"])
    return {
        "calls_per_s": tp,
        "vs_bwrap": tp / bwrap,
        "vs_python3_c": tp / res["peers"]["python3"]["calls_per_s"],
        "calls_per_s_alone": alone,
        "vs_bwrap_alone": alone / res["peers"]["bwrap"]["calls_per_s_alone"],
        "vs_python3_c_alone": alone / res["peers"]["python3"]["calls_per_s_alone"],
        "vs_bwrap_by_cpu": res["peers"]["bwrap"]["own_cpu_ms_per_call"] / res["dsec"]["throughput"]["own_cpu_ms_per_call"],
        "floor_calls_per_s": floor["calls_per_s"],
        "floor_vs_bwrap": floor["calls_per_s"] / bwrap,
        "floor_vs_bwrap_by_cpu": res["peers"]["bwrap"]["own_cpu_ms_per_call"] / floor["own_cpu_ms_per_call"],
        "floor_share": floor_share,
        "goals": {
            f"≥ {GOAL_CALLS_PER_S:g} calls/s": tp >= GOAL_CALLS_PER_S,
            f"≥ {GOAL_VS_BWRAP:g}× bwrap": tp / bwrap >= GOAL_VS_BWRAP,
            f"≥ {GOAL_FLOOR_SHARE:.0%} of the fork-per-call floor (calls/s, median of rounds)":
                floor_share >= GOAL_FLOOR_SHARE,
            f"p50 ≤ {GOAL_P50_MS:g} ms at the client, a call a request, 1 in flight": single["p50_ms"] <= GOAL_P50_MS,
            f"p99 ≤ {GOAL_P99_MS:g} ms at the client, a call a request, 1 in flight": single["p99_ms"] <= GOAL_P99_MS,
            f"p50 ≤ {GOAL_P50_MS:g} ms at the client, 8 calls a request, 1 in flight": batched["p50_ms"] <= GOAL_P50_MS,
            f"p99 ≤ {GOAL_P99_MS:g} ms at the client, 8 calls a request, 1 in flight": batched["p99_ms"] <= GOAL_P99_MS,
        },
    }


def _table(res: dict) -> Table:
    table = Table(title=f"fncall: {CODE!r} — {res['machine']['cores']} cores", show_header=True)
    for col in ("system", "calls/s", "alone", "p50 ms", "p99 ms", "own CPU ms/call", "others' share"):
        table.add_column(col, justify="right" if col != "system" else "left")

    def row(name: str, r: dict, lat: dict) -> None:
        table.add_row(name, f"{r['calls_per_s']:.0f}", f"{r['calls_per_s_alone']:.0f}", f"{lat['p50_ms']:.2f}",
                      f"{lat['p99_ms']:.2f}", f"{r['own_cpu_ms_per_call']:.2f}", f"{r['others_share']:.0%}")

    n = res["options"]["in_flight"]
    peers, dsec = res["peers"], res["dsec"]
    row(f"python3 -c, {n} in flight", peers["python3"], peers["python3"]["latency"])
    row(f"bwrap … python3 -c, {n} in flight", peers["bwrap"], peers["bwrap"]["latency"])
    row("python3 -c, 1 in flight", peers["python3_sequential"], peers["python3_sequential"]["latency"])
    row("bwrap … python3 -c, 1 in flight", peers["bwrap_sequential"], peers["bwrap_sequential"]["latency"])
    row("DSec fncall_many (500/request): worker_s", dsec["throughput"], dsec["throughput"]["worker"])
    row(f"DSec fncall_many, {FLOOR_CODE!r} (the floor): worker_s", dsec["floor"], dsec["floor"]["worker"])
    lb = dsec["latency_batched"]
    row(f"DSec {n} in flight (8/request): at the client", lb, lb["round_trip"])
    row(f"DSec {n} in flight (8/request): worker_s", lb, lb["worker"])
    row(f"DSec {n} in flight (8/request): queued_s", lb, lb["queued"])
    row(f"DSec {n} in flight (8/request): in server", lb, lb["in_server"])
    row(f"DSec fncall, {n} in flight: at the client", dsec["latency"], dsec["latency"]["round_trip"])
    row(f"DSec fncall, {n} in flight: worker_s", dsec["latency"], dsec["latency"]["worker"])
    row(f"DSec fncall, {n} in flight: queued_s", dsec["latency"], dsec["latency"]["queued"])
    row("DSec fncall, 1 in flight: at the client (judged)", dsec["sequential"], dsec["sequential"]["round_trip"])
    row("DSec fncall, 1 in flight: worker_s", dsec["sequential"], dsec["sequential"]["worker"])
    sb = dsec["sequential_batched"]
    row("DSec fncall_many, 8/request, 1 in flight: at the client (judged)", sb, sb["round_trip"])
    row("DSec fncall_many, 8/request, 1 in flight: worker_s", sb, sb["worker"])
    if "fusion" in dsec:
        for name, figures, latency in fncall_fusion.rows(dsec["fusion"]):
            row(name, figures, latency)
    return table


async def _run(state_dir: Path, opts: dict, console: Console) -> dict:
    if not shutil.which("bwrap"):
        raise BenchError("bwrap not found: apt-get install bubblewrap (scripts/setup-host.sh does)")
    group = CpuGroup(f"{cgroups.parent_for(state_dir)}-bench")
    try:
        return await _measure(group, state_dir, opts, console)
    finally:
        group.close()


async def _measure(group: CpuGroup, state_dir: Path, opts: dict, console: Console) -> dict:
    n, count = opts["in_flight"], opts["peer_calls"]
    res: dict[str, Any] = {"options": opts, "machine": host.machine(), "code": CODE, "peers": {}}
    console.log(f"peers: python3 -c and bwrap … python3 -c, {count} calls each, {n} in flight")
    res["peers"]["python3"] = await _peer(group, [PYTHON3, "-c", CODE], count, n)
    res["peers"]["bwrap"] = await _peer(group, [*BWRAP, PYTHON3, "-c", CODE], count, n)
    res["peers"]["python3_sequential"] = await _peer(group, [PYTHON3, "-c", CODE], max(20, count // 10), 1)
    res["peers"]["bwrap_sequential"] = await _peer(group, [*BWRAP, PYTHON3, "-c", CODE], max(20, count // 10), 1)
    workers = ("--fncall-workers", str(opts["workers"])) if opts["workers"] else ()
    server = LocalServer(state_dir, extra_args=("--pool-max", "0", *workers), start_timeout_s=120)
    with server:
        try:
            res["dsec"] = await _dsec(group, server, opts, console)
        except BaseException:
            console.print(server.log_tail(2000))
            raise
    res["left_behind"] = leftovers(state_dir)
    res["summary"] = _summary(res)
    return res


def main(state_dir: Path, store_dir: Path | None, console: Console, *, calls: int, latency_calls: int,
         peer_calls: int, in_flight: int, workers: int, strict: bool, fusion: bool = True,
         fusion_calls: int = 300, fusion_cpp_calls: int = 30, fusion_cpp_in_flight: int = 2,
         sequential_min: int = 100, rounds: int = 3) -> int:
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    _ensure_store(state_dir, store_dir, console, fusion)
    # A server prepares its VM backends at start (fetching a guest kernel with apt, booting a
    # probe VM). fncall uses no VM: its servers run containers only (DSEC_VMS=0) unless told
    # otherwise, and even then name a kernel package that does not exist, so that step fails at
    # once, no traffic leaves the machine and no probe loads the CPU while this measures.
    os.environ.setdefault("DSEC_VMS", "0")
    os.environ.setdefault("DSEC_GUEST_KERNEL_PACKAGE", "dsec-bench-fncall-no-guest-kernel")
    os.environ.setdefault("DSEC_VM_ACCEL", "tcg")
    opts = {"calls": calls, "latency_calls": latency_calls, "peer_calls": peer_calls, "in_flight": in_flight,
            "workers": workers, "fusion": fusion, "fusion_calls": fusion_calls, "fusion_cpp_calls": fusion_cpp_calls,
            "fusion_cpp_in_flight": fusion_cpp_in_flight, "sequential_min": sequential_min,
            "rounds": rounds}
    try:
        res = asyncio.run(_run(state_dir, opts, console))
    except (BenchError, fncall_fusion.FusionBenchError) as exc:
        console.print(f"[red]benchmark failed:[/red] {exc}")
        return 1
    res["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    (state_dir / RESULTS_FILE).write_text(json.dumps(res, indent=1, default=str))
    console.print(_table(res))
    summary = res["summary"]
    console.print(f"DSec fncall_many: {summary['calls_per_s']:.0f} calls/s = {summary['vs_bwrap']:.1f}× bwrap, "
                  f"{summary['vs_python3_c']:.1f}× python3 -c; with the machine to itself "
                  f"{summary['calls_per_s_alone']:.0f} calls/s = {summary['vs_bwrap_alone']:.1f}× bwrap, "
                  f"{summary['vs_python3_c_alone']:.1f}× python3 -c")
    tp = res["dsec"]["throughput"]
    console.print(f"CPU per call: DSec fncall_many {tp['own_cpu_ms_per_call']:.2f} ms (client "
                  f"{tp['client_cpu_ms_per_call']:.2f} + server {tp['server_cpu_ms_per_call']:.2f} + workers "
                  f"{tp['workers_cpu_ms_per_call']:.2f}), bwrap {res['peers']['bwrap']['own_cpu_ms_per_call']:.2f} ms "
                  f"({summary['vs_bwrap_by_cpu']:.1f}×), python3 -c {res['peers']['python3']['own_cpu_ms_per_call']:.2f} ms")
    floor = res["dsec"]["floor"]
    console.print(f"the pool's floor, a call of {FLOOR_CODE!r} (no work: the HTTP share, fork, set-up, exit): "
                  f"{summary['floor_calls_per_s']:.0f} calls/s = {summary['floor_vs_bwrap']:.1f}× bwrap, "
                  f"{floor['own_cpu_ms_per_call']:.2f} ms of CPU a call ({summary['floor_vs_bwrap_by_cpu']:.1f}× by CPU): "
                  "no call through this pool can beat that ratio on this host")
    shares = ", ".join(f"{x:.1%}" for x in res["dsec"]["floor_share_rounds"])
    console.print(f"the snippet's calls/s over the floor's: {summary['floor_share']:.1%} (median of the rounds: "
                  f"{shares}); CPU a call {tp['own_cpu_ms_per_call']:.2f} ms against the floor's "
                  f"{floor['own_cpu_ms_per_call']:.2f} ms (workers {tp['workers_cpu_ms_per_call']:.2f} against "
                  f"{floor['workers_cpu_ms_per_call']:.2f})")
    if "fusion" in res["dsec"]:
        fncall_fusion.report(res["dsec"]["fusion"], console)
    for goal, met in summary["goals"].items():
        console.print(f"  {'[green]met[/green]' if met else '[red]missed[/red]'}  {goal}")
    phases = [*res["peers"].values(), *res["dsec"].values()]
    if "fusion" in res["dsec"]:
        phases += [r for r in res["dsec"]["fusion"].values() if "others_share" in r]
    others = statistics.fmean(r["others_share"] for r in phases if "others_share" in r)
    if others > 0.1:
        console.print(f"[yellow]note:[/yellow] other work took {others:.0%} of the machine during the run")
    for item in res["left_behind"]:
        console.print(f"[red]left behind:[/red] {item}")
    console.print(f"results: {state_dir / RESULTS_FILE}")
    if res["left_behind"]:
        return 1
    return 2 if strict and not all(summary["goals"].values()) else 0
