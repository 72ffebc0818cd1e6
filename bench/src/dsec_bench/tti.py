"""``dsec bench tti``: time to interactive, in ComputeSDK's method, for DSec and a peer in one run.

Time to interactive (TTI) is the wall-clock time from the create call to the first command's
answer (``echo benchmark``) in the new sandbox; the sandbox is then killed, untimed, as
ComputeSDK's public benchmark does (its leaderboard is how users compare hosted platforms).
Three modes, ``iterations`` (100) sandboxes each:

- **sequential**: one at a time, each created, answered and killed before the next;
- **staggered**: launched ``stagger_ms`` apart (200 ms, as ComputeSDK's published method), so
  that the load ramps up;
- **burst**: all launched at once.

For each: min, median, p95, p99, success, and ComputeSDK's composite score (each figure scored
``100 × (1 − ms / 10,000)``, weighted median 60%, p95 25%, p99 15%, times the success rate).
Systems, on one ``dsec serve`` of the benchmark's own, the ``python`` image, 512 MB sandboxes:
DSec's SDK; the official ``e2b`` SDK against DSec's E2B API (``Sandbox.create`` →
``commands.run`` → ``kill``); and podman (``podman run -d`` of the same image imported into
podman, then ``podman exec``; ``podman rm -f`` untimed). Everything runs on this machine: the
hosted platforms' figures beside them in docs/BENCHMARKS.md are theirs, over the internet, and
not of this run.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs

from dsec.local import serving
from .harness import _import_into_podman, python_store
from .lifecycle_peers import PODMAN, PODMAN_FLAGS
from .results import run_noting, save_results, source_commit

MODES = ("sequential", "staggered", "burst")
COMMAND = "echo benchmark"
CEILING_MS = 10_000.0


def score(median_ms: float, p95_ms: float, p99_ms: float, success: float) -> float:
    """ComputeSDK's composite score."""
    def one(ms: float) -> float:
        return max(0.0, 100 * (1 - ms / CEILING_MS))
    return (0.6 * one(median_ms) + 0.25 * one(p95_ms) + 0.15 * one(p99_ms)) * success


def summary(times: list[float], failures: list[str], n: int) -> dict:
    xs = sorted(1000 * t for t in times)
    if not xs:
        return {"n": n, "ok": 0, "success": 0.0, "failures": failures[:5]}

    def pct(q: float) -> float:
        return xs[min(len(xs) - 1, max(0, round(q * len(xs)) - 1))]

    out = {"n": n, "ok": len(xs), "success": len(xs) / n, "min_ms": xs[0], "median_ms": statistics.median(xs),
           "p95_ms": pct(0.95), "p99_ms": pct(0.99), "max_ms": xs[-1], "mean_ms": statistics.fmean(xs),
           "failures": failures[:5]}
    out["score"] = score(out["median_ms"], out["p95_ms"], out["p99_ms"], out["success"])
    return out


async def run_mode(mode: str, n: int, stagger_s: float, once: Callable[[], Awaitable[tuple[float, Callable]]]) -> dict:
    """``n`` TTIs in ``mode``; ``once()`` returns (TTI seconds, a coroutine function that kills it)."""
    times: list[float] = []
    failures: list[str] = []
    kills: list[Callable] = []

    async def one() -> None:
        try:
            tti, kill = await once()
        except Exception as exc:  # noqa: BLE001 - a failure counts against success, named
            failures.append(f"{type(exc).__name__}: {exc}"[:300])
            return
        times.append(tti)
        kills.append(kill)

    if mode == "sequential":
        for _ in range(n):
            await one()
            while kills:
                await kills.pop()()
    else:
        tasks = []
        for _ in range(n):
            tasks.append(asyncio.create_task(one()))
            if mode == "staggered":
                await asyncio.sleep(stagger_s)
        await asyncio.gather(*tasks)
        await asyncio.gather(*(kill() for kill in kills), return_exceptions=True)
    return summary(times, failures, n)


async def _interactive(create, run, kill) -> tuple[float, Callable]:
    """One TTI: ``create()`` a sandbox, ``run(sandbox)`` the command (its output); returns the
    seconds to the answer and the kill (not timed). A wrong answer is a failure."""
    start = time.perf_counter()
    sandbox = await create()
    try:
        out = await run(sandbox)
    except BaseException:
        await kill(sandbox)
        raise
    tti = time.perf_counter() - start
    if out != "benchmark\n":
        await kill(sandbox)
        raise RuntimeError(f"{COMMAND!r} answered {out!r}")
    return tti, lambda: kill(sandbox)


def _dsec_once(client: DSecClient, args: DSecContainerRunArgs):
    async def run(sandbox):
        return (await sandbox.run_shell(COMMAND)).stdout

    return lambda: _interactive(lambda: client.run_container(args), run, lambda sandbox: sandbox.stop())


def _e2b_once(e2b: dict[str, str]):
    from e2b import AsyncSandbox

    async def run(sandbox):
        return (await sandbox.commands.run(COMMAND)).stdout

    return lambda: _interactive(lambda: AsyncSandbox.create(template="python", timeout=600, **e2b), run,
                                lambda sandbox: sandbox.kill())


def _podman_once(image: str):
    async def podman(*args: str) -> bytes:
        proc = await asyncio.create_subprocess_exec(PODMAN, *args, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
        out, err = await asyncio.wait_for(proc.communicate(), 300)
        if proc.returncode != 0:
            raise RuntimeError(f"podman {args[0]}: {err.decode(errors='replace')[-300:]}")
        return out

    async def create() -> str:
        name = f"dsec-bench-tti-{secrets.token_hex(4)}"
        try:
            await podman("run", "-d", "--rm", *PODMAN_FLAGS, "-m", "512m", "--name", name, image, "sleep", "infinity")
        except BaseException:
            await kill(name)
            raise
        return name

    async def run(name: str) -> str:
        return (await podman("exec", name, "sh", "-c", COMMAND)).decode()

    async def kill(name: str) -> None:
        proc = await asyncio.create_subprocess_exec(PODMAN, "rm", "-f", "-t", "0", name,
                                                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        await proc.wait()

    return lambda: _interactive(create, run, kill)


def main(state_dir: Path, console: Console, iterations: int = 100, stagger_ms: float = 200.0,
         systems: tuple[str, ...] = ("dsec", "e2b", "podman"), store_dir: Path | None = None) -> int:
    """Run it, print the tables, write ``<state_dir>.json``; 0 when every system ran (a system
    missing on this machine is skipped and named)."""
    state_dir = Path(state_dir).resolve()
    started = datetime.now(timezone.utc)
    store = python_store(state_dir, store_dir, console)
    r: dict = {"commit": source_commit(), "started": started.isoformat(timespec="seconds"), "iterations": iterations,
               "stagger_ms": stagger_ms, "load_start": os.getloadavg()[0], "skipped": {}}
    console.print(f"[bold]dsec bench tti[/bold]: {iterations} sandboxes a mode, commit {r['commit']}, "
                  f"load {r['load_start']:.1f}")
    errors: list[str] = []
    args = DSecContainerRunArgs(container_image="python", memory_limit_mb=512)

    async def run() -> None:
        # A warm pool as large as a burst, as a trainer's server would have for its batch size.
        with serving(state_dir, "--pool-max", str(min(iterations, 64)), "--fncall-max", "0") as server:
            async with DSecClient(server.endpoint, token=server.token) as client:
                await (await client.run_container(args)).stop()  # (the pool learns the image)
                if "dsec" in systems:
                    r["dsec"] = {m: await run_mode(m, iterations, stagger_ms / 1000, _dsec_once(client, args))
                                 for m in MODES}
                if "e2b" in systems:
                    try:
                        import e2b  # noqa: F401
                    except ImportError:
                        r["skipped"]["e2b"] = "the e2b package is not installed: pip install 'dsec[e2b]'"
                    else:
                        key = await client.create_project_token("root", e2b=True)
                        e2b_args = {"api_key": key, "api_url": f"{server.endpoint}/e2b",
                                    "sandbox_url": f"{server.endpoint}/e2b/envd"}
                        r["e2b"] = {m: await run_mode(m, iterations, stagger_ms / 1000, _e2b_once(e2b_args))
                                    for m in MODES}
        if "podman" in systems:
            if not os.path.exists(PODMAN):
                r["skipped"]["podman"] = f"podman not found at {PODMAN}: apt-get install podman"
                return
            work = Path(tempfile.mkdtemp(prefix="dsec-bench-tti-"))
            image = f"localhost/dsec-bench-tti-python-{secrets.token_hex(3)}"
            try:
                await asyncio.to_thread(_import_into_podman, store, "python", image, work)
                r["podman"] = {m: await run_mode(m, iterations, stagger_ms / 1000, _podman_once(image))
                               for m in MODES}
            finally:
                proc = await asyncio.create_subprocess_exec(PODMAN, "rmi", "-f", image, stdout=asyncio.subprocess.DEVNULL,
                                                            stderr=asyncio.subprocess.DEVNULL)
                await proc.wait()
                shutil.rmtree(work, ignore_errors=True)

    run_noting(run(), r, errors)
    for system in ("dsec", "e2b", "podman"):
        for mode, s in r.get(system, {}).items():
            if s["success"] < 1.0:
                errors.append(f"{system} {mode}: {s['n'] - s['ok']} of {s['n']} failed: {s['failures'][:2]}")
    r["errors"] = errors
    _report(console, r)
    save_results(console, state_dir, r, errors)
    return 0 if not errors else 1


def _report(console: Console, r: dict) -> None:
    names = {"dsec": "DSec SDK", "e2b": "e2b SDK on DSec", "podman": "podman run + exec"}
    for mode in MODES:
        table = Table(title=f"time to interactive, {mode} ({r['iterations']} sandboxes; commit {r['commit']})")
        for col in ("system", "min", "median", "p95", "p99", "success", "score"):
            table.add_column(col)
        for system, name in names.items():
            s = r.get(system, {}).get(mode)
            if not s:
                continue
            if not s["ok"]:
                table.add_row(name, "-", "-", "-", "-", "0%", "0")
                continue
            table.add_row(name, *(f"{s[k]:.0f} ms" for k in ("min_ms", "median_ms", "p95_ms", "p99_ms")),
                          f"{100 * s['success']:.0f}%", f"{s['score']:.1f}")
        console.print(table)
    for system, why in r["skipped"].items():
        console.print(f"{names[system]} skipped: {why}")
