"""``dsec bench soak``: many sandbox lifecycles in a row on one ``dsec serve``, and whether what the
server and the host hold stays flat from the first thousand to the last.

Each lifecycle: create a busybox sandbox, write a file into it, run a command that reads it,
stop it; every ``pause_every``-th is also paused and resumed (its next command checks the file),
every ``pack_every``-th is packed (``pack_diff``; the image is removed after), every
``fncall_every``-th lifecycle also runs a FnCall. ``concurrency`` lifecycles are in flight.
After every ``sample_every`` lifecycles (and once the warm pool has settled, 1 s) it reads: the
server's resident memory and open fds, the host's used memory (MemTotal − MemAvailable),
``Slab`` and ``PageTables``, and the state dir's mounts (a started overlay awaiting detach not
counted) and sandbox cgroups.

``tracemalloc=True`` runs the server with ``DSEC_TRACEMALLOC=1`` (see ``dsec.memtrace``) and asks
it for a report at each sample: the first is the baseline, the last says by line and by stack what
the later lifecycles added (printed, and kept in the results). Tracing slows the server: its
figures are for finding a leak, not for the table.

The peer is the run's own start: each figure at the end is set beside its value after the first
``sample_every`` lifecycles (``growth``). A leak shows as a curve that climbs with the count;
noise from other work on the host moves the host figures either way.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs, DSecError, DSecFnCallArgs

from dsec.local import LocalServer
from dsec.memtrace import REPORT
from dsec.resources import cgroups
from .hoststats import meminfo

MiB = 1 << 20


def _server_figures(pid: int) -> tuple[int, int]:
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def _state_figures(state_dir: Path) -> tuple[int, int]:
    """The state dir's mounts and sandbox cgroups. A started container's overlay stays mounted on
    the host until the next create detaches it (``RootFilesystems.detach_started``), so how many
    there are depends on which creates came last, not on how many ran: one whose sandbox's own
    bundle mount is still there is not counted (a leaked one would have lost its bundle too)."""
    inside = str(state_dir.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f if line.split()[4].startswith(inside)]
    bundles = set(points)
    mounts = sum(1 for p in points if not (p.endswith("/rootfs") and p.removesuffix("/rootfs") in bundles))
    groups = len(cgroups.sandbox_cgroup_dirs(cgroups.parent_for(state_dir)))
    return mounts, groups


def sample(server: LocalServer, state_dir: Path, done: int, started: float) -> dict:
    assert server.proc is not None
    rss, fds = _server_figures(server.proc.pid)
    mounts, groups = _state_figures(state_dir)
    info = meminfo()
    return {"lifecycles": done, "elapsed_s": round(time.monotonic() - started, 1), "server_rss_mib": rss / MiB,
            "server_fds": fds, "host_used_mib": (info["MemTotal"] - info["MemAvailable"]) / MiB,
            "slab_mib": info["Slab"] / MiB, "page_tables_mib": info["PageTables"] / MiB, "mounts": mounts,
            "sandbox_cgroups": groups}


async def traced_report(server: LocalServer, state_dir: Path, number: int, timeout_s: float = 120.0) -> str:
    """Ask a server run with ``DSEC_TRACEMALLOC`` for its ``number``-th report and wait for it."""
    assert server.proc is not None
    path = state_dir / REPORT
    os.kill(server.proc.pid, signal.SIGUSR2)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = ""
        if text.startswith(f"report {number} "):
            return text
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the server wrote no tracemalloc report {number} in {timeout_s:g} s ({path})")


async def _lifecycle(client: DSecClient, i: int, pause_every: int, pack_every: int, fncall_every: int,
                     errors: list[str]) -> None:
    try:
        async with await client.run_container(DSecContainerRunArgs(container_image="busybox",
                                                                   memory_limit_mb=32)) as sandbox:
            await sandbox.write_file("/root/note", f"lifecycle {i}\n")
            result = await sandbox.run_shell("cat /root/note")
            assert result.stdout == f"lifecycle {i}\n", result
            if pause_every and i % pause_every == 0:
                await sandbox.pause()
                assert (await sandbox.run_shell("cat /root/note")).stdout == f"lifecycle {i}\n"
            if pack_every and i % pack_every == 0:
                packed = await sandbox.pack_diff(f"soak-{os.getpid()}-{i}")
                await client.remove_image(packed.image)
        if fncall_every and i % fncall_every == 0:
            answer = await client.fncall(DSecFnCallArgs(code=f"print({i} * 2)"))
            assert answer.stdout == f"{i * 2}\n", answer
    except (DSecError, AssertionError) as exc:
        errors.append(f"lifecycle {i}: {type(exc).__name__}: {exc}"[:300])


async def soak(server: LocalServer, state_dir: Path, console: Console, lifecycles: int, concurrency: int,
               sample_every: int, pause_every: int, pack_every: int, fncall_every: int,
               tracemalloc: bool = False) -> dict:
    samples: list[dict] = []
    errors: list[str] = []
    report = ""
    started = time.monotonic()
    async with DSecClient(server.endpoint, token=server.token) as client:
        next_i = 0
        while next_i < lifecycles:
            upto = min(lifecycles, next_i + sample_every)
            gate = asyncio.Semaphore(concurrency)

            async def one(i: int) -> None:
                async with gate:
                    await _lifecycle(client, i, pause_every, pack_every, fncall_every, errors)

            await asyncio.gather(*(one(i) for i in range(next_i, upto)))
            next_i = upto
            await asyncio.sleep(1.0)  # the warm pool refills, stopped sandboxes finish going
            samples.append(sample(server, state_dir, next_i, started))
            s = samples[-1]
            if tracemalloc:
                report = await traced_report(server, state_dir, len(samples))
                s["traced_mib"] = int(report.split()[3]) / MiB
            console.print(f"  {next_i:>6} lifecycles  {s['elapsed_s']:>7.1f} s  server {s['server_rss_mib']:.0f} MiB "
                          f"{s['server_fds']} fds  slab {s['slab_mib']:.0f} MiB  mounts {s['mounts']}  "
                          f"cgroups {s['sandbox_cgroups']}  errors {len(errors)}")
    return {"samples": samples, "errors": errors, "tracemalloc": report}


def growth(samples: list[dict]) -> dict[str, float]:
    """Each figure at the last sample less at the first."""
    first, last = samples[0], samples[-1]
    return {k: round(last[k] - first[k], 2) for k in first if k not in ("lifecycles", "elapsed_s")}


def main(state_dir: Path, console: Console, lifecycles: int = 10_000, concurrency: int = 16,
         sample_every: int = 1000, pause_every: int = 10, pack_every: int = 50, fncall_every: int = 5,
         store: Path | None = None, tracemalloc: bool = False) -> int:
    if sample_every < 1 or lifecycles < sample_every:
        console.print("[red]--lifecycles must be at least --sample-every (and that at least 1)[/red]")
        return 2
    state_dir.mkdir(parents=True, exist_ok=True)
    if store is not None and not (state_dir / "store").exists():
        (state_dir / "store").symlink_to(store)
    env = {"DSEC_VMS": "0"} | ({"DSEC_TRACEMALLOC": "1"} if tracemalloc else {})
    server = LocalServer(state_dir, extra_args=("--pool-max", str(max(4, concurrency))), env=env)
    if tracemalloc:  # a traced start is slower
        server.start_timeout_s = max(server.start_timeout_s, 300)
    server.start()
    try:
        result = asyncio.run(soak(server, state_dir, console, lifecycles, concurrency, sample_every,
                                  pause_every, pack_every, fncall_every, tracemalloc))
    finally:
        server.stop()
    samples, errors = result["samples"], result["errors"]
    table = Table(title=f"dsec bench soak: {lifecycles} lifecycles, {concurrency} in flight")
    for column in ("lifecycles", "s", "server RSS MiB", "server fds", "host used MiB", "Slab MiB", "PageTables MiB",
                   "mounts", "cgroups") + (("traced MiB",) if tracemalloc else ()):
        table.add_column(column, justify="right")
    for s in samples:
        table.add_row(str(s["lifecycles"]), f"{s['elapsed_s']:.0f}", f"{s['server_rss_mib']:.1f}", str(s["server_fds"]),
                      f"{s['host_used_mib']:.0f}", f"{s['slab_mib']:.1f}", f"{s['page_tables_mib']:.1f}",
                      str(s["mounts"]), str(s["sandbox_cgroups"]),
                      *((f"{s['traced_mib']:.1f}",) if tracemalloc else ()))
    console.print(table)
    if result["tracemalloc"]:
        console.print(f"tracemalloc, the last report (its baseline: after the first {sample_every}):")
        console.print(result["tracemalloc"], markup=False, highlight=False, soft_wrap=True)
    grew = growth(samples)
    console.print(f"growth, last sample less the first (after {sample_every}): {grew}")
    console.print(f"lifecycles/s: {lifecycles / samples[-1]['elapsed_s']:.1f}; errors: {len(errors)}")
    for line in errors[:10]:
        console.print(f"  [red]{line}[/red]")
    out = state_dir.with_suffix(".json")
    out.write_text(json.dumps({"samples": samples, "growth": grew, "errors": errors,
                               "tracemalloc": result["tracemalloc"]}, indent=1))
    console.print(f"results in {out}")
    shutil.rmtree(state_dir, ignore_errors=True)
    return 1 if errors else 0
