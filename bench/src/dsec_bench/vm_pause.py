"""``dsec bench vm-pause``: host memory held by N paused idle microVMs.

N microVMs boot, each writes some agent-like text state into its own filesystem (the tmpfs
upper, so guest memory) and leaves a process running, then idles. Host memory is read three
times on the same VMs:

1. running, idle;
2. the peer: paused as QEMU alone pauses a VM (QMP ``stop``), which keeps every page in RAM;
3. paused by DSec (``backend.pause``: ``stop``, then the VM's memory cgroup pushed out to swap,
   zram here, which keeps it compressed in RAM).

"Host memory" per state is the QEMU processes' resident set plus, for what went to zram, the
RAM zram uses for it (the growth of zram's ``mem_used_total`` over the run's start: zram is
node-wide, so other swapping on the host shows up in that figure). The host-wide used memory
(MemTotal - MemAvailable) is given as well. Then every VM is resumed and checked (its file's
digest, its process), and the first command's latency after resume is set beside a command on
a running VM. Drives the backend directly (no HTTP).
"""

from __future__ import annotations

import asyncio
import os
import resource
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from libdsec.protocol import ExecRequest

from dsec.backends.base import ExecContext
from dsec.backends.vm import machine
from dsec.backends.vm.microvm import MicroVMBackend
from dsec.resources import reclaim
from .hoststats import settled_memory
from .microvm import vm_spec
from .results import save_results

ROOT = ExecContext(uid=0, gid=0, workdir="/", env={"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"})
MiB = 1 << 20


def _state_command(state_mb: int) -> str:
    # Text, not zeros (zram keeps a page of one repeated byte as nothing).
    return (f"seq 1 99999999 | head -c {state_mb * MiB} > /root/state && md5sum /root/state | cut -c1-32;"
            " sleep 86400 >/dev/null 2>&1 &")


def _held(backend: MicroVMBackend, handles, zram_start: int) -> dict:
    rss = sum(machine.rss_bytes(h.pid) or 0 for h in handles)
    swapped = sum(reclaim.swapped_bytes(backend.cgroup_parent, h.cid) or 0 for h in handles)
    zram = max(0, reclaim.zram_stats()["mem_used_total"] - zram_start)
    each = sorted((machine.rss_bytes(h.pid) or 0) >> 20 for h in handles)
    return {"rss": rss, "swapped": swapped, "zram": zram, "held": rss + zram, "rss_each_mib": each}


async def run(state_dir: Path, store_dir: Path, console: Console, image: str, count: int, memory_mb: int,
              state_mb: int, concurrency: int) -> dict:
    store, image, spec = vm_spec(store_dir, image, memory_mb, console)
    assets = Path(os.environ.get("DSEC_VM_ASSETS") or state_dir / "vm")
    backend = MicroVMBackend(state_dir / "node", store, assets, boot_timeout_s=180)
    r: dict = {"accel": await backend.accel(), "qemu": machine.qemu_version(), "image": image,
               "swap_total": reclaim.swap_total_bytes(), "load_start": os.getloadavg()[0]}
    console.print(f"[bold]dsec bench vm-pause[/bold]: {count} microVMs of {image}, {memory_mb} MB each, "
                  f"{state_mb} MiB of state each, accel {r['accel'].upper()}, load {r['load_start']:.1f}")
    handles: list = []
    try:
        base_mem = await settled_memory(settle_s=1)
        zram_start = reclaim.zram_stats()["mem_used_total"]
        sem = asyncio.Semaphore(concurrency)

        async def boot(i: int):
            async with sem:
                h = await backend.create(f"cpause{i:011x}", spec)
                handles.append(h)
                out = await backend.exec(h, ExecRequest(command=_state_command(state_mb), timeout=300), ROOT)
                return h, out.stdout.strip()

        booted = await asyncio.gather(*(boot(i) for i in range(count)))
        digests = {h.cid: d for h, d in booted}
        run_latency = []
        for h in handles:
            t = time.perf_counter()
            await backend.exec(h, ExecRequest(command="echo ok"), ROOT)
            run_latency.append(time.perf_counter() - t)

        r["running"] = _held(backend, handles, zram_start)
        r["running_used"] = (await settled_memory())["used"] - base_mem["used"]

        # The peer: QEMU's own pause.
        for h in handles:
            await backend._live[h.cid].qmp.execute("stop")
        r["stopped"] = _held(backend, handles, zram_start)
        r["stopped_used"] = (await settled_memory())["used"] - base_mem["used"]
        for h in handles:
            await backend._live[h.cid].qmp.execute("cont")

        # DSec's pause.
        cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for h in handles:
            await backend.pause(h)
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        r["pause_wall_s"] = (time.perf_counter() - t0) / count
        r["pause_cpu_s"] = (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / count
        r["paused"] = _held(backend, handles, zram_start)
        r["paused_used"] = (await settled_memory())["used"] - base_mem["used"]

        # Resume: the first command faults the guest's pages back in.
        resume_latency, intact = [], 0
        for h in handles:
            t = time.perf_counter()
            await backend.resume(h)
            await backend.exec(h, ExecRequest(command="echo ok"), ROOT)
            resume_latency.append(time.perf_counter() - t)
        for h in handles:
            check = await backend.exec(h, ExecRequest(command="md5sum /root/state | cut -c1-32; pidof sleep >/dev/null && echo alive",
                                                      timeout=300), ROOT)
            intact += check.stdout.split() == [digests[h.cid], "alive"]
        r["resumed"] = _held(backend, handles, zram_start)
        r["run_latency_ms"] = statistics.median(run_latency) * 1e3
        r["resume_latency_ms"] = statistics.median(resume_latency) * 1e3
        r["intact"] = intact
    finally:
        await asyncio.gather(*(backend.destroy(h) for h in handles), return_exceptions=True)
        await backend.recover([])
        await backend.close()
    return r


def report(r: dict, console: Console, count: int) -> list[str]:
    def mib(x: float) -> str:
        return f"{x / MiB:.0f} MiB"

    run_, stop, paused = r["running"], r["stopped"], r["paused"]
    saving = 1 - paused["held"] / stop["held"]
    table = Table("measure", "DSec pause (stop + push-out)", "peer: QMP stop", "ratio", "running, idle")
    table.add_row(f"host memory held, {count} paused microVMs (RSS + zram)", mib(paused["held"]), mib(stop["held"]),
                  f"{saving * 100:.1f}% less", mib(run_["held"]))
    table.add_row("  of which QEMU resident", mib(paused["rss"]), mib(stop["rss"]), "", mib(run_["rss"]))
    table.add_row("  of which zram (for what went to swap)", f"{mib(paused['zram'])} for {mib(paused['swapped'])}",
                  mib(stop["zram"]), "", "")
    table.add_row("host used memory, over the start (MemTotal-MemAvailable)", mib(r["paused_used"]),
                  mib(r["stopped_used"]), "", mib(r["running_used"]))
    table.add_row("first command after resume (median)", f"{r['resume_latency_ms']:.0f} ms",
                  f"on a running VM {r['run_latency_ms']:.0f} ms", "", "")
    console.print(table)
    console.print(f"QEMU resident per VM (MiB): running {run_['rss_each_mib']}, paused {paused['rss_each_mib']}")
    console.print(f"pause: {r['pause_wall_s'] * 1e3:.0f} ms wall, {r['pause_cpu_s'] * 1e3:.0f} ms CPU per VM; "
                  f"{r['intact']} of {count} resumed with their file and process intact; swap {mib(r['swap_total'])}; "
                  f"accel {r['accel'].upper()}, QEMU {r['qemu']}, load at start {r['load_start']:.1f}")
    missed = []
    if r["intact"] < count:
        missed.append("VMs intact after resume")
    if r["swap_total"] and saving < 0.5:
        missed.append("paused memory ≥ 50% less than QMP stop")
    return missed


def main(state_dir: Path, store_dir: Path, console: Console, image: str = "busybox", count: int = 8, memory_mb: int = 256,
         state_mb: int = 32, concurrency: int = 2, strict: bool = False) -> int:
    state_dir.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(run(state_dir, store_dir, console, image, count, memory_mb, state_mb, concurrency))
    missed = report(results, console, count)
    if missed:
        console.print(f"[yellow]goals missed: {', '.join(missed)}[/yellow]")
    save_results(console, state_dir, {**results, "count": count, "missed": missed}, [])
    return 2 if (missed and strict) else 0
