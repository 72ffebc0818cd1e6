"""``dsec bench joblog``: what recording a job costs a sandbox's lifecycle.

One ``dsec serve`` of the benchmark's own (busybox, ``--pool-max`` 64, containers only), and two
arms on it, in alternating rounds so that both see the same stretches of the host's speed
(it swings by tens of percent within minutes here):

- **unrecorded**: full lifecycles — ``run_container`` → ``run_shell("echo hi")`` → ``stop`` —
  ``concurrency`` (32) at a time, by a plain ``DSecClient``;
- **recorded**: the same lifecycles by ``DSecClient(job=…)``, each create with its own
  idempotency ``key``: every create, command and stop is written to the job's log (in the
  server's SQLite project store) before it is answered, and every create claims and settles
  its key.

Printed: lifecycles/s of each arm, the median of its rounds, the ratio (goal: recorded ≥ 0.90× the
unrecorded, i.e. recording adds ≤ 10 %), p50/p99 lifecycle time, the server's CPU a lifecycle
(its process, all threads, over the arm's rounds: what predicts the ratio on a quiet machine,
where the host's CPU is what bounds the rate), and the entries the log holds
at the end (checked: 3 per recorded lifecycle). Then a resume of the job through the log is
timed (answered from the log, nothing runs). Results go to ``<state_dir>.json``.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs

from dsec.local import serving
from . import hoststats as host
from .results import median_of_rounds, save_results, source_commit

ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=64)
JOB = "bench-joblog"


async def _lifecycle(client: DSecClient, key: str | None) -> float:
    t0 = time.perf_counter()
    sandbox = await client.run_container(ARGS, key=key)
    result = await sandbox.run_shell("echo hi")
    await sandbox.stop()
    if result.stdout != "hi\n":
        raise RuntimeError(f"echo hi answered {result.stdout!r}")
    return time.perf_counter() - t0


async def _round(client: DSecClient, count: int, concurrency: int, keys: list[str] | None,
                 progress: Progress, task) -> tuple[float, list[float]]:
    todo = iter(range(count))
    times: list[float] = []

    async def worker() -> None:
        for i in todo:
            times.append(await _lifecycle(client, keys[i] if keys else None))
            progress.advance(task)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, times


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def _run(server, lifecycles: int, rounds: int, concurrency: int, console: Console) -> dict:
    per_round = max(1, lifecycles // rounds)
    arms = {name: {"seconds": 0.0, "times": [], "round_rates": [], "server_cpu_s": 0.0}
            for name in ("unrecorded", "recorded")}
    pid = server.proc.pid
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        async with DSecClient(server.endpoint, token=server.token) as plain, \
                DSecClient(server.endpoint, token=server.token, job=JOB) as recorded:
            warm = progress.add_task("warm-up", total=2 * concurrency * 2)
            for client, keys in ((plain, None), (recorded, [f"warm-{i}" for i in range(2 * concurrency)])):
                await _round(client, 2 * concurrency, concurrency, keys, progress, warm)
            n = 0
            for r in range(rounds):
                order = (("unrecorded", plain), ("recorded", recorded))
                for name, client in order if r % 2 == 0 else order[::-1]:
                    task = progress.add_task(f"round {r + 1}/{rounds}: {name}", total=per_round)
                    keys = [f"episode-{n + i}" for i in range(per_round)] if name == "recorded" else None
                    cpu0 = host.process_cpu(pid)[0]
                    seconds, times = await _round(client, per_round, concurrency, keys, progress, task)
                    arms[name]["server_cpu_s"] += host.process_cpu(pid)[0] - cpu0
                    if name == "recorded":
                        n += per_round
                    arms[name]["seconds"] += seconds
                    arms[name]["times"] += times
                    arms[name]["round_rates"].append(len(times) / seconds)
                    progress.remove_task(task)
            log = await recorded.job_log(JOB)
        t0 = time.perf_counter()
        async with DSecClient(server.endpoint, token=server.token, job=JOB, resume=True) as resumed:
            opened_s = time.perf_counter() - t0
            for i in range(2 * concurrency):
                await _lifecycle(resumed, f"warm-{i}")
            for i in range(n):
                await _lifecycle(resumed, f"episode-{i}")
            resume_s = time.perf_counter() - t0
            answered = resumed.replayed
    out: dict = {}
    for name, arm in arms.items():
        times = arm["times"]
        out[name] = {"lifecycles": len(times), "seconds": arm["seconds"],
                     "lifecycles_per_s": median_of_rounds(arm["round_rates"]), "rounds": arm["round_rates"],
                     "lifecycles_per_s_pooled": len(times) / arm["seconds"],
                     "p50_ms": statistics.median(times) * 1000, "p99_ms": _pct(times, 0.99),
                     "server_cpu_ms_per_lifecycle": arm["server_cpu_s"] / len(times) * 1000}
    expected = 3 * (n + 2 * concurrency)
    out["log_entries"] = len(log.entries)
    out["log_entries_expected"] = expected
    out["resume"] = {"entries": len(log.entries), "answered": answered, "open_s": opened_s, "total_s": resume_s}
    out["ratio_recorded_over_unrecorded"] = out["recorded"]["lifecycles_per_s"] / out["unrecorded"]["lifecycles_per_s"]
    return out


def main(state_dir: Path, console: Console, lifecycles: int = 1200, rounds: int = 4, concurrency: int = 32) -> int:
    state_dir = Path(state_dir).resolve()
    os.environ.setdefault("DSEC_VMS", "0")
    os.environ.setdefault("DSEC_GUEST_KERNEL_PACKAGE", "dsec-bench-joblog-no-guest-kernel")
    r: dict = {"commit": source_commit(), "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "lifecycles": lifecycles, "rounds": rounds, "concurrency": concurrency,
               "load_start": os.getloadavg()[0]}
    console.print(f"[bold]dsec bench joblog[/bold]: {lifecycles} lifecycles per arm in {rounds} rounds, "
                  f"{concurrency} in flight, commit {r['commit']}, load {r['load_start']:.1f}")
    errors: list[str] = []
    try:
        with serving(state_dir, "--pool-max", "64") as server:
            try:
                r.update(asyncio.run(_run(server, lifecycles, rounds, concurrency, console)))
            finally:  # (interrupted mid-round, sandboxes run: the server keeps them over its stop)
                server.stop_sandboxes()
    except KeyboardInterrupt:
        errors.append("interrupted")
    except Exception as exc:  # noqa: BLE001 - reported
        errors.append(f"{type(exc).__name__}: {exc}")
    r["load_end"] = os.getloadavg()[0]
    r["errors"] = errors
    if "recorded" in r:
        table = Table(title=f"lifecycle throughput with and without a job log, commit {r['commit']}")
        for col in ("arm", "lifecycles", "lifecycles/s", "rounds", "p50 ms", "p99 ms", "server CPU a lifecycle"):
            table.add_column(col)
        for name in ("unrecorded", "recorded"):
            a = r[name]
            table.add_row(name, str(a["lifecycles"]), f"{a['lifecycles_per_s']:.1f}",
                          " ".join(f"{x:.0f}" for x in a["rounds"]), f"{a['p50_ms']:.1f}", f"{a['p99_ms']:.1f}",
                          f"{a['server_cpu_ms_per_lifecycle']:.2f} ms")
        console.print(table)
        ratio = r["ratio_recorded_over_unrecorded"]
        console.print(f"recorded / unrecorded throughput: {ratio:.3f}× (goal ≥ 0.90×: "
                      f"{'met' if ratio >= 0.90 else 'MISSED'}); the log holds {r['log_entries']} entries "
                      f"({r['log_entries_expected']} expected)")
        res = r["resume"]
        console.print(f"resume: {res['answered']} calls answered from the log in {res['total_s']:.2f}s "
                      f"(log read in {res['open_s'] * 1000:.0f} ms)")
        if r["log_entries"] != r["log_entries_expected"] or res["answered"] != r["log_entries_expected"]:
            errors.append("the log does not hold (or answer) every recorded call")
    save_results(console, state_dir, r, errors)
    return 0 if not errors else 1
