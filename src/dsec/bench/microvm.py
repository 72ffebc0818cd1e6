"""``dsec bench microvm``: memory snapshots, shared layers and density of microVMs.

All in one run on this machine, each figure beside its peer:

1. restore from a memory snapshot vs a cold boot, each to a usable shell (an ``echo`` answered);
2. host memory of N identical idle microVMs with layers on pmem/DAX + KSM vs the same N with
   private copies of their layers (virtio-blk read with O_DIRECT, KSM merging off), as the sum of
   the QEMU processes' proportional set sizes (shared pages split between their users);
3. M idle microVMs at once (clones of one snapshot), each answering.

Drives the backend directly (no HTTP): the figures are the VMs', not the apiserver's.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..backends.base import ExecContext, SandboxSpec
from ..backends.vm import machine
from ..backends.vm.microvm import MicroVMBackend
from ..images.builders import build_busybox
from ..images.store import LayerStore
from libdsec._models import ExecRequest

KSM = Path("/sys/kernel/mm/ksm")
ROOT = ExecContext(uid=0, gid=0, workdir="/", env={"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"})
# What each VM does before it idles: read part of its image, as an agent's first steps would.
WARM_COMMANDS = {
    "python": "python3 -c 'import json, email.parser, http.client, sqlite3, asyncio' && ls -R /usr/lib/python3* >/dev/null",
    "busybox": "ls -R / >/dev/null 2>&1; busybox --help >/dev/null",
}


def _ksm_read() -> dict[str, str]:
    return {k: (KSM / k).read_text().strip() for k in ("run", "pages_to_scan", "sleep_millisecs")}


def _ksm_write(values: dict[str, str]) -> None:
    for k in ("pages_to_scan", "sleep_millisecs", "run"):
        (KSM / k).write_text(values[k])


async def _ksm_settle(passes: int = 2, timeout: float = 240.0) -> int:
    """Let KSM make ``passes`` full scans; returns pages shared."""
    start = int((KSM / "full_scans").read_text())
    deadline = time.monotonic() + timeout
    while int((KSM / "full_scans").read_text()) < start + passes and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    return int((KSM / "pages_sharing").read_text())


def _pss_total(handles) -> int:
    return sum(machine.pss_bytes(h.pid) or 0 for h in handles)


async def _make(backend: MicroVMBackend, spec: SandboxSpec, count: int, concurrency: int, prefix: str, warm: str):
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int):
        async with sem:
            h = await backend.create(f"c{prefix}{i:015x}"[:17], spec)
            await backend.exec(h, ExecRequest(command=warm, timeout=120), ROOT)
            return h

    return await asyncio.gather(*(one(i) for i in range(count)))


async def _destroy(backend: MicroVMBackend, handles) -> None:
    await asyncio.gather(*(backend.destroy(h) for h in handles), return_exceptions=True)


async def run(state_dir: Path, store_dir: Path, console: Console, image: str, boots: int, restores: int,
              idle: int, many: int, memory_mb: int, concurrency: int) -> dict:
    store = LayerStore(store_dir)
    if not store.has_image(image):
        if image != "busybox":
            console.print(f"image {image!r} not in {store_dir}: using busybox")
            image = "busybox"
        if not store.has_image("busybox"):
            build_busybox(store)
    img = store.get_image(image)
    from ..resources.cgroups import Limits

    spec = SandboxSpec(image=image, layers=img.layers, env=dict(img.env),
                       limits=Limits(memory_mb=memory_mb, cpu_cores=1.0, pids=1024))
    node = state_dir / "node"
    assets = Path(os.environ.get("DSEC_VM_ASSETS") or state_dir / "vm")
    shared = MicroVMBackend(node, store, assets, boot_timeout_s=180)
    private = MicroVMBackend(state_dir / "node-private", store, assets, layer_mode="private", boot_timeout_s=180)
    accel = await shared.accel()
    results: dict = {"accel": accel, "image": image, "qemu": machine.qemu_version()}
    console.print(f"[bold]dsec bench microvm[/bold]: image {image}, {memory_mb} MB guests, accel {accel.upper()}, "
                  f"QEMU {results['qemu']}")
    warm = WARM_COMMANDS.get(image, WARM_COMMANDS["busybox"])
    ksm_before = _ksm_read()
    live: list = []
    try:
        # 1. cold boot vs restore, each to an answered echo.
        await _destroy(shared, [await shared.create("cwarmup0000000000", spec)])  # caches (DAX layer)
        boot_s = []
        for i in range(boots):
            t = time.perf_counter()
            h = await shared.create(f"cboot{i:012x}", spec)
            await shared.exec(h, ExecRequest(command="echo ok"), ROOT)
            boot_s.append(time.perf_counter() - t)
            if i < boots - 1:
                await shared.destroy(h)
        base = h
        live.append(base)
        await shared.exec(base, ExecRequest(command=warm, timeout=120), ROOT)
        meta = await shared.snapshot(base)
        restore_s = []
        for i in range(restores):
            t = time.perf_counter()
            c = await shared.create(f"crest{i:012x}", replace(spec, snapshot=meta["id"]))
            await shared.exec(c, ExecRequest(command="echo ok"), ROOT)
            restore_s.append(time.perf_counter() - t)
            await shared.destroy(c)
        results.update(boot_s=statistics.median(boot_s), restore_s=statistics.median(restore_s),
                       snapshot_mb=meta["size_bytes"] / 2**20, snapshot_save_s=meta["save_s"])
        results["restore_speedup"] = results["boot_s"] / results["restore_s"]
        await _destroy(shared, live)
        live.clear()

        # 2. N idle VMs: pmem/DAX + KSM vs private copies.
        _ksm_write({"run": "1", "pages_to_scan": "20000", "sleep_millisecs": "20"})
        vms = await _make(shared, spec, idle, concurrency, "a", warm)
        live += vms
        shared_pages = await _ksm_settle()
        results["shared_mb"] = _pss_total(vms) / 2**20
        results["ksm_pages_sharing"] = shared_pages
        await _destroy(shared, vms)
        live.clear()
        _ksm_write({"run": "2", "pages_to_scan": ksm_before["pages_to_scan"], "sleep_millisecs": ksm_before["sleep_millisecs"]})
        vms = await _make(private, spec, idle, concurrency, "b", warm)
        live += vms
        await asyncio.sleep(5)
        results["private_mb"] = _pss_total(vms) / 2**20
        await _destroy(private, vms)
        live.clear()
        results["memory_saving"] = 1 - results["shared_mb"] / results["private_mb"]

        # 3. many idle VMs at once, clones of one snapshot.
        base = await shared.create("cmanybase00000000", spec)
        live.append(base)
        meta = await shared.snapshot(base)
        t = time.perf_counter()
        sem = asyncio.Semaphore(concurrency)

        async def clone(i: int):
            async with sem:
                return await shared.create(f"cmany{i:012x}", replace(spec, snapshot=meta["id"]))

        clones = await asyncio.gather(*(clone(i) for i in range(many)), return_exceptions=True)
        made = [c for c in clones if not isinstance(c, BaseException)]
        live += made
        answers = await asyncio.gather(*(shared.exec(c, ExecRequest(command="echo ok"), ROOT) for c in made),
                                       return_exceptions=True)
        results["many_made"] = len(made)
        results["many_answering"] = sum(1 for a in answers if not isinstance(a, BaseException) and a.stdout == "ok\n")
        results["many_s"] = time.perf_counter() - t
        results["many_mb"] = _pss_total(made) / 2**20
    finally:
        await _destroy(shared, live)
        _ksm_write(ksm_before)
        for b in (shared, private):
            await b.recover([])
            await b.close()
    return results


def report(r: dict, console: Console, idle: int, many: int) -> list[str]:
    table = Table("measure", "DSec", "peer", "ratio", "goal")
    table.add_row("to a usable shell (median)", f"restore {r['restore_s'] * 1000:.0f} ms",
                  f"cold boot {r['boot_s'] * 1000:.0f} ms", f"{r['restore_speedup']:.1f}× faster", "≥ 10×")
    table.add_row(f"host memory, {idle} idle microVMs", f"pmem/DAX + KSM {r['shared_mb']:.0f} MiB",
                  f"private copies {r['private_mb']:.0f} MiB", f"{r['memory_saving'] * 100:.0f}% less", "≥ 40% less")
    table.add_row("idle microVMs at once", f"{r['many_answering']} of {many} answering", "", f"{r['many_mb']:.0f} MiB in all", "≥ 50")
    console.print(table)
    console.print(f"accel {r['accel'].upper()}; snapshot {r['snapshot_mb']:.0f} MiB saved in {r['snapshot_save_s']:.2f} s; "
                  f"KSM pages sharing {r['ksm_pages_sharing']}; {many} clones up in {r['many_s']:.1f} s")
    missed = []
    if r["restore_speedup"] < 10:
        missed.append("restore speed-up")
    if r["memory_saving"] < 0.40:
        missed.append("memory saving")
    if r["many_answering"] < 50:
        missed.append("50 idle microVMs")
    return missed


def main(state_dir: Path, store_dir: Path, console: Console, image: str = "python", boots: int = 3, restores: int = 5,
         idle: int = 20, many: int = 50, memory_mb: int = 256, concurrency: int = 2, strict: bool = False) -> int:
    state_dir.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(run(state_dir, store_dir, console, image, boots, restores, idle, many, memory_mb, concurrency))
    missed = report(results, console, idle, many)
    if missed:
        console.print(f"[yellow]goals missed: {', '.join(missed)}[/yellow]")
    return 2 if (missed and strict) else 0
