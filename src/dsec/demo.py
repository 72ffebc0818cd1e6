"""The main job (``make demo``): start the embedded server, bring up COUNT sandboxes from one
image in one batch, run a multi-step task in each, report, stop everything, and check that
nothing is left behind."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs, Sandbox

from .images.builders import ensure_default_images
from .images.store import LayerStore
from .local import LocalServer, leftovers

TASK = """\
import json, pathlib, statistics
numbers = [int(x) for x in pathlib.Path("input.txt").read_text().split()]
result = {"n": len(numbers), "sum": sum(numbers), "mean": statistics.mean(numbers)}
pathlib.Path("result.json").write_text(json.dumps(result))
print("ok")
"""


def memory_used_bytes() -> int:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console)


async def _task(sandbox: Sandbox, index: int) -> tuple[bool, list[float]]:
    """Write input, run python on it, read the result back: three calls, checked."""
    numbers = list(range(index, index + 100))
    latencies = []
    t = time.perf_counter()
    await sandbox.write_file("/root/task/input.txt", " ".join(map(str, numbers)))
    await sandbox.write_file("/root/task/main.py", TASK)
    latencies.append(time.perf_counter() - t)
    t = time.perf_counter()
    run = await sandbox.run_shell("cd /root/task && python3 main.py && ls -l result.json >/dev/null", timeout=60)
    latencies.append(time.perf_counter() - t)
    t = time.perf_counter()
    raw = await sandbox.read_file("/root/task/result.json")
    latencies.append(time.perf_counter() - t)
    result = json.loads(raw)
    ok = run.exit_code == 0 and run.stdout.strip() == "ok" and result["sum"] == sum(numbers)
    return ok, latencies


async def _job(server: LocalServer, count: int, image: str, console: Console) -> dict:
    args = DSecContainerRunArgs(container_image=image, memory_limit_mb=256, cpu_cores_limit=1.0,
                                ttl_running_stop=600)
    async with DSecClient(server.endpoint, token=server.token) as client:
        mem_before = memory_used_bytes()
        with _progress(console) as progress:
            bar = progress.add_task(f"creating {count} sandboxes from {image!r}", total=count)
            t0 = time.perf_counter()
            sandboxes = await client.run_containers(
                args, count=count, timeout=600, progress=lambda done, total: progress.update(bar, completed=done)
            )
            create_s = time.perf_counter() - t0
        await asyncio.sleep(1.0)
        mem_idle = memory_used_bytes()
        create_latencies = [s.info.create_s for s in sandboxes if s.info.create_s is not None]

        exec_latencies: list[float] = []
        failures = 0
        sem = asyncio.Semaphore(16)
        with _progress(console) as progress:
            bar = progress.add_task("running the task in each", total=count)

            async def one(i: int, sandbox: Sandbox) -> None:
                nonlocal failures
                async with sem:
                    ok, lat = await _task(sandbox, i)
                exec_latencies.extend(lat)
                failures += not ok
                progress.advance(bar)

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i, s) for i, s in enumerate(sandboxes)))
            task_s = time.perf_counter() - t0

        with _progress(console) as progress:
            bar = progress.add_task("stopping", total=count)

            async def stop(sandbox: Sandbox) -> None:
                async with sem:
                    await sandbox.stop()
                progress.advance(bar)

            t0 = time.perf_counter()
            await asyncio.gather(*(stop(s) for s in sandboxes))
            stop_s = time.perf_counter() - t0
    return {
        "count": count, "create_s": create_s, "task_s": task_s, "stop_s": stop_s, "failures": failures,
        "create_latencies": create_latencies, "exec_latencies": exec_latencies,
        "mem_per_sandbox": (mem_idle - mem_before) / count,
    }


def run_demo(count: int, image: str, state_dir: Path, port: int, console: Console) -> int:
    store = LayerStore(state_dir / "store")
    with console.status("preparing images (the python image takes about a minute the first time) …"):
        ensure_default_images(store, log=lambda msg: console.log(msg))
    console.print(f"[bold]DSec demo[/bold]: {count} sandboxes from {image!r}, state in {state_dir}")
    with LocalServer(state_dir, port=port) as server:
        result = asyncio.run(_job(server, count, image, console))
    left = leftovers(state_dir)

    table = Table(title=f"{count} sandboxes from {image!r}", show_header=True)
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("created / s (one batch)", f"{count / result['create_s']:.1f}")
    table.add_row("create latency p50 / p99", f"{percentile(result['create_latencies'], 50) * 1e3:.1f} / "
                  f"{percentile(result['create_latencies'], 99) * 1e3:.1f} ms")
    table.add_row("call latency p50 / p99 (write, exec python, read)",
                  f"{percentile(result['exec_latencies'], 50) * 1e3:.1f} / "
                  f"{percentile(result['exec_latencies'], 99) * 1e3:.1f} ms")
    table.add_row("tasks done / s", f"{count / result['task_s']:.1f}")
    table.add_row("tasks failed", str(result["failures"]))
    table.add_row("host memory per idle sandbox", f"{result['mem_per_sandbox'] / 2**20:.2f} MiB")
    table.add_row("stopped / s", f"{count / result['stop_s']:.1f}")
    table.add_row("left behind", "nothing" if not left else f"{len(left)} items")
    console.print(table)
    for item in left:
        console.print(f"[red]left behind:[/red] {item}")
    return 1 if result["failures"] or left else 0
