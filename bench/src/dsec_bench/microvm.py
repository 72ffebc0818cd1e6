"""``dsec bench microvm``: memory snapshots, shared layers and density of microVMs.

All in one run on this machine, each figure beside its peer:

1. restore from a memory snapshot vs a cold boot, each to a usable shell (an ``echo`` answered);
   and a new microVM as a node makes one (from the boot template its first one kept) vs the cold boot;
2. host memory of N identical idle microVMs with layers on pmem/DAX + KSM (at the platform's KSM
   settings, ``dsec.resources.ksm``, once it has merged all it will) vs the same N with private
   copies of their layers (virtio-blk read with O_DIRECT, KSM merging off), as the sum of the QEMU
   processes' proportional set sizes (shared pages split between their users, the page cache of
   the layers and of a snapshot's RAM files included);
3. host memory of N clones of one snapshot (sharing its RAM copy-on-write) vs the N cold-booted
   VMs it was taken among, both with KSM stopped (the sharing of the snapshot alone), and the
   clones again with KSM;
4. M idle microVMs at once (clones of one snapshot), each answering;
5. under TCG, the CPU price of the translation cache's size (the platform's vs 64 MiB).

Drives the backend directly (no HTTP): the figures are the VMs', not the apiserver's.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dsec.backends.base import ExecContext, SandboxSpec
from dsec.backends.vm import machine
from dsec.backends.vm.microvm import MicroVMBackend
from dsec.images.builders import build_busybox
from dsec.images.store import LayerStore
from dsec.resources import ksm
from libdsec.protocol import ExecRequest

from .results import save_results

ROOT = ExecContext(uid=0, gid=0, workdir="/", env={"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"})
# What each VM does before it idles: read part of its image, as an agent's first steps would.
WARM_COMMANDS = {
    "python": "python3 -c 'import json, email.parser, http.client, sqlite3, asyncio' && ls -R /usr/lib/python3* >/dev/null",
    "busybox": "ls -R / >/dev/null 2>&1; busybox --help >/dev/null",
}


def _ksmd_cpu_s() -> float:
    """CPU seconds ksmd has used (the price of the merging)."""
    for pid in os.listdir("/proc"):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "ksmd":
                return machine.cpu_seconds(int(pid)) or 0.0
        except (OSError, ValueError):
            continue
    return 0.0


async def _ksm_settle(min_scans: int = 3, timeout: float = 600.0) -> dict:
    """Run KSM at the platform's settings until it has merged all it will: at least
    ``min_scans`` full scans (the first one counted may have started part-way through the
    VMs, and a page merges on the scan after the one that saw it unchanged), and the last scan
    merged under 1% more. What it shared, in how long, at what CPU."""
    ksm.enable()
    start, cpu, t = ksm.full_scans(), _ksmd_cpu_s(), time.monotonic()
    sharing, scans = -1, 0
    while time.monotonic() - t < timeout:
        await asyncio.sleep(0.5)
        done = ksm.full_scans() - start
        if done == scans:
            continue
        scans = done
        now = ksm.stats().get("pages_sharing", 0)
        if scans >= min_scans and now - sharing < 0.01 * max(now, 1):
            break
        sharing = now
    return {**ksm.stats(), "scans": scans, "settle_s": time.monotonic() - t, "ksmd_cpu_s": _ksmd_cpu_s() - cpu}


def _ksm_stop() -> None:
    """Stop KSM and unmerge everything: the next figure starts from private pages."""
    ksm.write({"run": "2"})


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


async def _clones(backend: MicroVMBackend, spec: SandboxSpec, snapshot: str, count: int, concurrency: int,
                  prefix: str, keep_going: bool = False):
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int):
        async with sem:
            return await backend.create(f"c{prefix}{i:015x}"[:17], replace(spec, snapshot=snapshot))

    made = await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)
    ok = [c for c in made if not isinstance(c, BaseException)]
    if not keep_going and len(ok) < count:
        await _destroy(backend, ok)
        raise next(c for c in made if isinstance(c, BaseException))
    return ok


async def _destroy(backend: MicroVMBackend, handles) -> None:
    await asyncio.gather(*(backend.destroy(h) for h in handles), return_exceptions=True)


def vm_spec(store_dir: Path, image: str, memory_mb: int, console: Console) -> tuple[LayerStore, str, SandboxSpec]:
    """The store, the image the benchmark boots (busybox, built if need be, when ``image`` is not
    there) and the spec of its VMs."""
    from dsec.resources.cgroups import Limits

    store = LayerStore(store_dir)
    if not store.has_image(image):
        if image != "busybox":
            console.print(f"image {image!r} not in {store_dir}: using busybox")
            image = "busybox"
        if not store.has_image("busybox"):
            build_busybox(store)
    img = store.get_image(image)
    return store, image, SandboxSpec(image=image, layers=img.layers, env=dict(img.env),
                                     limits=Limits(memory_mb=memory_mb, cpu_cores=1.0, pids=1024))


async def run(state_dir: Path, store_dir: Path, console: Console, image: str, boots: int, restores: int,
              idle: int, many: int, memory_mb: int, concurrency: int) -> dict:
    store, image, spec = vm_spec(store_dir, image, memory_mb, console)
    node = state_dir / "node"
    assets = Path(os.environ.get("DSEC_VM_ASSETS") or state_dir / "vm")
    shared = MicroVMBackend(node, store, assets, boot_timeout_s=180)
    private = MicroVMBackend(state_dir / "node-private", store, assets, layer_mode="private", boot_timeout_s=180)
    accel = await shared.accel()
    results: dict = {"accel": accel, "image": image, "qemu": machine.qemu_version()}
    console.print(f"[bold]dsec bench microvm[/bold]: image {image}, {memory_mb} MB guests, accel {accel.upper()}, "
                  f"QEMU {results['qemu']}")
    warm = WARM_COMMANDS.get(image, WARM_COMMANDS["busybox"])
    ksm_before = ksm.take()
    live: list = []
    try:
        # 1. cold boot vs restore, each to an answered echo.
        await _destroy(shared, [await shared.create("cwarmup0000000000", spec)])  # caches (DAX layer)
        boot_s, boot_cpu = [], []
        for i in range(boots):
            t = time.perf_counter()
            h = await shared.create(f"cboot{i:012x}", spec)
            await shared.exec(h, ExecRequest(command="echo ok"), ROOT)
            boot_s.append(time.perf_counter() - t)
            boot_cpu.append(machine.cpu_seconds(h.pid) or 0.0)
            if i < boots - 1:
                await shared.destroy(h)
        base = h
        live.append(base)
        await shared.exec(base, ExecRequest(command=warm, timeout=120), ROOT)
        meta = await shared.snapshot(base)
        # The restores run as the cold boots did, with no other VM beside them.
        await _destroy(shared, live)
        live.clear()
        restore_s, restore_cpu = [], []
        for i in range(restores):
            t = time.perf_counter()
            c = await shared.create(f"crest{i:012x}", replace(spec, snapshot=meta["id"]))
            await shared.exec(c, ExecRequest(command="echo ok"), ROOT)
            restore_s.append(time.perf_counter() - t)
            restore_cpu.append(machine.cpu_seconds(c.pid) or 0.0)
            await shared.destroy(c)
        shared.delete_snapshot(meta["id"])
        # QEMU's own CPU time to the answered echo: what the load of others does not inflate.
        results.update(boot_s=statistics.median(boot_s), restore_s=statistics.median(restore_s),
                       boot_qemu_cpu_s=statistics.median(boot_cpu), restore_qemu_cpu_s=statistics.median(restore_cpu),
                       snapshot_mb=meta["size_bytes"] / 2**20, snapshot_save_s=meta["save_s"])
        results["restore_speedup"] = results["boot_s"] / results["restore_s"]
        results.update(await _from_templates(state_dir, store, assets, spec, restores))
        results["template_speedup"] = results["boot_s"] / results["template_s"]

        # 2. N idle VMs: pmem/DAX + KSM vs private copies; 3. N clones vs those N cold boots.
        _ksm_stop()
        vms = await _make(shared, spec, idle, concurrency, "a", warm)
        live += vms
        results["boot_cpu_s"] = statistics.median(machine.cpu_seconds(h.pid) or 0 for h in vms)
        await asyncio.sleep(5)
        results["cold_mb"] = _pss_total(vms) / 2**20
        merged = await _ksm_settle()
        results["shared_mb"] = _pss_total(vms) / 2**20
        results["ksm"] = merged
        meta = await shared.snapshot(vms[0])
        await _destroy(shared, vms)
        live.clear()
        _ksm_stop()
        clones = await _clones(shared, spec, meta["id"], idle, concurrency, "d")
        live += clones
        await asyncio.sleep(5)
        results["clones_mb"] = _pss_total(clones) / 2**20
        results["clones_ksm"] = await _ksm_settle()
        results["clones_ksm_mb"] = _pss_total(clones) / 2**20
        results["clone_snapshot_mb"] = meta["size_bytes"] / 2**20
        await _destroy(shared, clones)
        live.clear()
        shared.delete_snapshot(meta["id"])
        _ksm_stop()
        vms = await _make(private, spec, idle, concurrency, "b", warm)
        live += vms
        await asyncio.sleep(5)
        results["private_mb"] = _pss_total(vms) / 2**20
        await _destroy(private, vms)
        live.clear()
        results["memory_saving"] = 1 - results["shared_mb"] / results["private_mb"]
        results["clone_saving"] = 1 - results["clones_mb"] / results["cold_mb"]
        ksm.enable()

        # 4. many idle VMs at once, clones of one snapshot.
        base = await shared.create("cmanybase00000000", spec)
        live.append(base)
        meta = await shared.snapshot(base)
        t = time.perf_counter()
        made = await _clones(shared, spec, meta["id"], many, concurrency, "m", keep_going=True)
        live += made
        answers = await asyncio.gather(*(shared.exec(c, ExecRequest(command="echo ok"), ROOT) for c in made),
                                       return_exceptions=True)
        results["many_made"] = len(made)
        results["many_answering"] = sum(1 for a in answers if not isinstance(a, BaseException) and a.stdout == "ok\n")
        results["many_s"] = time.perf_counter() - t
        results["many_mb"] = _pss_total(made) / 2**20
        await _destroy(shared, live)
        live.clear()
        shared.delete_snapshot(meta["id"])

        # 5. the price of the translation cache's size: QEMU's CPU time for a boot, the warm-up,
        # and the warm-up once more (the second run reuses translations the cache still holds).
        if accel == "tcg":
            results["tb_cpu"] = {}
            platform_tb = machine.TCG_TB_MB
            try:
                for tb in sorted({platform_tb, 64}):
                    machine.TCG_TB_MB = tb
                    h = await shared.create(f"ctb{tb:014d}", spec)
                    live.append(h)
                    marks = [machine.cpu_seconds(h.pid) or 0.0]
                    for _ in range(2):
                        await shared.exec(h, ExecRequest(command=warm, timeout=300), ROOT)
                        marks.append(machine.cpu_seconds(h.pid) or 0.0)
                    results["tb_cpu"][tb] = (marks[0], marks[1] - marks[0], marks[2] - marks[1], machine.rss_bytes(h.pid) / 2**20)
                    await _destroy(shared, [h])
                    live.remove(h)
            finally:
                machine.TCG_TB_MB = platform_tb
    finally:
        await _destroy(shared, live)
        ksm.give_back(ksm_before)
        for b in (shared, private):
            await b.recover([])
            await b.close()
            for snapshot in b.snapshots_dir.iterdir():  # the benchmark's own node: none are kept
                shutil.rmtree(snapshot, ignore_errors=True)
    return results


async def _from_templates(state_dir: Path, store, assets: Path, spec: SandboxSpec, count: int) -> dict:
    """1b. New microVMs as a node makes them (with boot templates): the first boots and keeps
    its memory, each next one restores it and is made someone new; each to an answered echo."""
    templated = MicroVMBackend(state_dir / "node-templates", store, assets, boot_timeout_s=180,
                               templates_dir=state_dir / "templates")
    made_s = []
    try:
        await _destroy(templated, [await templated.create("ctplfirst0000000", spec)])
        for i in range(count):
            t = time.perf_counter()
            h = await templated.create(f"ctpl{i:012x}", spec)
            await templated.exec(h, ExecRequest(command="echo ok"), ROOT)
            made_s.append(time.perf_counter() - t)
            await templated.destroy(h)
    finally:
        await templated.recover([])
        await templated.close()
        shutil.rmtree(state_dir / "templates", ignore_errors=True)
    return {"template_s": statistics.median(made_s)}


def report(r: dict, console: Console, idle: int, many: int) -> list[str]:
    table = Table("measure", "DSec", "peer (same run)", "ratio", "goal")
    table.add_row("to a usable shell (median)", f"restore {r['restore_s'] * 1000:.0f} ms",
                  f"cold boot {r['boot_s'] * 1000:.0f} ms", f"{r['restore_speedup']:.1f}× faster", "≥ 10×")
    if "template_s" in r:
        table.add_row("a new microVM to a usable shell (median)", f"from its boot template {r['template_s'] * 1000:.0f} ms",
                      f"cold boot {r['boot_s'] * 1000:.0f} ms", f"{r['template_speedup']:.1f}× faster", "")
    table.add_row("QEMU CPU to a usable shell (median)", f"restore {r['restore_qemu_cpu_s'] * 1000:.0f} ms",
                  f"cold boot {r['boot_qemu_cpu_s'] * 1000:.0f} ms",
                  f"{r['boot_qemu_cpu_s'] / max(r['restore_qemu_cpu_s'], 1e-3):.1f}× less", "")
    table.add_row(f"host memory, {idle} idle microVMs", f"pmem/DAX + KSM {r['shared_mb']:.0f} MiB",
                  f"private copies {r['private_mb']:.0f} MiB", f"{r['memory_saving'] * 100:.0f}% less", "≥ 40% less")
    table.add_row(f"host memory, {idle} clones of one snapshot (no KSM)", f"clones {r['clones_mb']:.0f} MiB",
                  f"cold boots {r['cold_mb']:.0f} MiB", f"{r['clone_saving'] * 100:.0f}% less "
                  f"({r['cold_mb'] / r['clones_mb']:.1f}×)", "shared copy-on-write")
    table.add_row("idle microVMs at once", f"{r['many_answering']} of {many} answering", "", f"{r['many_mb']:.0f} MiB in all", "≥ 50")
    console.print(table)
    k, kc = r["ksm"], r["clones_ksm"]
    console.print(
        f"accel {r['accel'].upper()}, TCG translation cache {machine.TCG_TB_MB} MiB per VM; a cold boot + warm-up "
        f"took {r['boot_cpu_s']:.1f} s of QEMU CPU (median)\n"
        f"KSM ({ksm.SETTINGS['pages_to_scan']} pages / {ksm.SETTINGS['sleep_millisecs']} ms): merged all it would "
        f"in {k['scans']} full scans, {k['settle_s']:.0f} s, ksmd {k['ksmd_cpu_s']:.1f} s CPU, "
        f"{k.get('pages_sharing', 0)} pages sharing + {k.get('ksm_zero_pages', 0)} zero pages; the clones with "
        f"KSM: {r['clones_ksm_mb']:.0f} MiB ({kc['scans']} scans, {kc['settle_s']:.0f} s)\n"
        f"snapshot {r['snapshot_mb']:.0f} MiB on disk (RAM files sparse), saved in {r['snapshot_save_s']:.2f} s; "
        f"{many} clones up in {r['many_s']:.1f} s; load average {os.getloadavg()[0]:.1f}")
    for tb, (boot, first, again, rss) in sorted(r.get("tb_cpu", {}).items()):
        console.print(f"translation cache {tb} MiB: QEMU CPU boot {boot:.1f} s, warm-up {first:.1f} s, warm-up again "
                      f"{again:.1f} s; RSS {rss:.0f} MiB")
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
    save_results(console, state_dir, {**results, "idle": idle, "many": many, "missed": missed}, [])
    return 2 if (missed and strict) else 0
