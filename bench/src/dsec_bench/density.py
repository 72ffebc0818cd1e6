"""``dsec bench density``: how many idle sandboxes one node holds, what pausing gives back, what
the cold-memory reclaimer saves, and how fast placement decides. One run, peers beside.

1. Placement: decisions per second of ``dsec.placement.place`` over a view of 1,000 nodes, one
   sandbox per call and in batches of 1,000 (a pure function: no I/O).
2. The floor: ``peer_count`` idle bare ``crun run -d`` containers of a sleeping busybox on the
   same EROFS layer (read-only root, crun's default namespaces): host memory per container.
3. Idle density, how many fit: a ``dsec serve`` (no warm pool, default overcommit) is filled
   with idle busybox sandboxes (16 MB limit, default CPU weight) in batches of ``batch`` until a
   limit is hit: the server refuses a create (its admission: committed memory at its
   overcommit, ``max_sandboxes``), the host's MemAvailable falls under a reserve (a tenth of
   RAM, so the host keeps answering), the time limit, or ``max_count`` (a safety cap for tests
   and quick runs; 0: none). After a refused batch it goes on one at a time, so the count is
   the limit's to one sandbox. What stopped it is reported. Every ``step`` sandboxes, ``probe``
   single creates are timed: the create latency table as the count grows. Host memory per
   sandbox = Δ(MemTotal − MemAvailable) / count once they settle: what the host loses, the
   judged figure (kernel + cgroup-charged pages are printed beside it).
4. Pause: ``pause_count`` sandboxes each write ``pause_mb`` MiB of heap-like content (text,
   pointer-like structures and random bytes mixed, as a process heap holds: ``heap_like``) to
   their writable layer (tmpfs: swap-backed memory charged to the sandbox), then all are
   paused: the host's MemTotal − MemAvailable before and after, and what share came back (the
   judged figure). The same with agent-like text alone (logs, source, JSON), which zram's
   lzo-rle compresses about 2×, and with random bytes on ``random_count`` sandboxes, which zram
   cannot compress at all: only a disk-backed swap (a swap file behind zswap) takes those.
   Then all are resumed and checked. The host's swap set-up is read (``swap_setup``) and each
   figure says which set-up it needs.
5. Cold memory: ``cold_count`` running sandboxes write the same text and idle, on a server with
   the cold-memory reclaimer on; host memory right after and ``cold_wait_s`` later.

Host memory counts zram's compressed pool (it is RAM), so "returned" is net of compression.
Other work on the host moves MemAvailable too, so each memory figure is also given by
accounting: what the sandboxes' cgroups held, less what zram kept of what they swapped out;
and the idle cost is also the slope of host memory over the sandbox count (a fit over every
step), which other work perturbs less than one difference.
The run is bounded by ``time_limit_s`` (the idle phase stops growing when time runs short);
every sandbox, container, mount and cgroup is removed, and ``dsec.local.leftovers`` is checked.
Results go to ``<state_dir>/bench-density.json``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs, Sandbox

from dsec import _sys, placement
from dsec.images.builders import build_busybox
from dsec.images.store import Image, LayerStore
from dsec.local import LocalServer, leftovers
from dsec.resources import cgroups, reclaim

RESULTS_FILE = "bench-density.json"
GOAL_IDLE_COUNT = 10_000
GOAL_IDLE_MIB = 2.0
GOAL_PAUSE_RETURNED = 0.80
CRUN = shutil.which("crun") or "/usr/bin/crun"
FILL_PATH = "/fill.txt"
HEAP_PATH = "/heap.bin"
# The idle fill stops when MemAvailable would fall under this share of RAM, and never under
# HOST_RESERVE_MIN: the host (and the other work on it) must keep answering; a limit hit there
# is the host's.
HOST_RESERVE_SHARE = 0.10
HOST_RESERVE_MIN = 4 << 30
# The idle sandboxes' memory limit: the smallest a sandbox may ask for (admission's
# MIN_MEMORY_MB); an idle busybox sandbox touches well under 1 MiB of it.
IDLE_MEMORY_MB = 16
# Which swap set-up each figure needs (the report prints it beside the figure).
NEEDS_NONE = "none (no swap used)"
NEEDS_ANY_SWAP = "any swap: zram (≈2× on text) or disk"
NEEDS_DISK_SWAP = "random bytes need a disk-backed swap (a swap file behind zswap); zram alone keeps them"


@dataclass
class Options:
    max_count: int = 0            # a safety cap on the idle fill (0: none, fill until a limit)
    step: int = 400
    batch: int = 100
    probe: int = 16
    peer_count: int = 400
    pause_count: int = 100
    pause_mb: int = 64
    text_count: int = 100
    random_count: int = 10
    cold_count: int = 20
    cold_wait_s: float = 40.0
    placement_nodes: int = 1000
    concurrency: int = 16
    time_limit_s: float = 2400.0
    strict: bool = False
    settle_scale: float = 1.0     # the waits for host memory to settle, scaled (a test's run: less)
    # The idle server's admission, as an operator of a node of idle sandboxes sets it: room for
    # ``max_sandboxes``, and memory limits committed up to ``memory_overcommit`` × RAM (0: as
    # much as ``max_sandboxes`` sandboxes of IDLE_MEMORY_MB commit). Admission stays on: past
    # these a create is refused, and that is a limit the fill reports.
    max_sandboxes: int = 16384
    memory_overcommit: float = 0.0
    only: str = ""                # one phase alone (placement, crun, idle, pause, cold); "": all


# -- host readings ------------------------------------------------------------------------------


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def used() -> int:
    m = meminfo()
    return m["MemTotal"] - m["MemAvailable"]


def swap_setup() -> dict[str, Any]:
    """The host's swap: zram devices (and their compressor), disk-backed swap (files or
    partitions), zswap in front of them; ``text`` says it in a line."""
    devices = []
    try:
        for line in Path("/proc/swaps").read_text().splitlines()[1:]:
            name, kind, size_kib = line.split()[:3]
            devices.append({"name": name, "type": kind, "size_gib": round(int(size_kib) / 2**20, 1),
                            "zram": "/zram" in name})
    except (OSError, ValueError):
        pass
    zram = [d for d in devices if d["zram"]]
    disk = [d for d in devices if not d["zram"]]
    algorithm = None
    if zram:
        try:
            text = Path(f"/sys/block/{Path(zram[0]['name']).name}/comp_algorithm").read_text()
            algorithm = text[text.index("[") + 1:text.index("]")]
        except (OSError, ValueError):
            pass
    try:
        zswap = Path("/sys/module/zswap/parameters/enabled").read_text().strip() in ("Y", "1")
    except OSError:
        zswap = False
    parts = [f"zram {sum(d['size_gib'] for d in zram):g} GiB ({algorithm or '?'})" if zram else "no zram",
             f"disk swap {sum(d['size_gib'] for d in disk):g} GiB" if disk else "no disk swap",
             "zswap on" if zswap else "zswap off"]
    return {"devices": devices, "zram": bool(zram), "zram_algorithm": algorithm, "disk": bool(disk), "zswap": zswap,
            "text": ", ".join(parts)}


async def settled_used(settle_s: float = 3.0, samples: int = 5, every_s: float = 0.2) -> int:
    """Host memory used (``used()``) once it settled: the median of ``samples`` readings
    ``every_s`` apart, after ``settle_s``."""
    await asyncio.sleep(settle_s)
    readings = []
    for _ in range(samples):
        readings.append(used())
        await asyncio.sleep(every_s)
    return int(statistics.median(readings))


def parent_memory(parent: str) -> int:
    path = (cgroups.CGROUP_ROOT / parent / "memory.current") if cgroups.is_v2() else (
        cgroups.CGROUP_ROOT / "memory" / parent / "memory.usage_in_bytes")
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def parent_swap(parent: str) -> int:
    """Bytes the sandboxes under ``parent`` have in swap."""
    if cgroups.is_v2():
        try:
            return int((cgroups.CGROUP_ROOT / parent / "memory.swap.current").read_text())
        except (OSError, ValueError):
            return 0
    try:
        for line in (cgroups.CGROUP_ROOT / "memory" / parent / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "total_swap":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


KERNEL_FIELDS = ("SUnreclaim", "SReclaimable", "PageTables", "KernelStack", "Percpu", "VmallocUsed")


def attributable(parent: str) -> dict[str, int]:
    """The parts of host memory that sandboxes under ``parent`` account for, less exposed to
    other work on the host than MemAvailable: the kernel's own allocations (slab, page tables,
    stacks, per-CPU, vmalloc: namespaces, mounts, cgroups live there) and what the sandboxes'
    cgroups are charged for beyond kernel memory (their processes and files)."""
    m = meminfo()
    kernel = sum(m.get(k, 0) for k in KERNEL_FIELDS)
    kmem = 0
    if not cgroups.is_v2():
        try:
            kmem = int((cgroups.CGROUP_ROOT / "memory" / parent / "memory.kmem.usage_in_bytes").read_text())
        except (OSError, ValueError):
            kmem = 0
    return {"kernel": kernel, "charged": max(0, parent_memory(parent) - kmem), "used": m["MemTotal"] - m["MemAvailable"]}


def per_unit(before: dict[str, int], after: dict[str, int], count: int) -> dict[str, float | None]:
    """MiB per sandbox (or container) of each part, and their sum."""
    out = {k: mib((after[k] - before[k]) / max(count, 1)) for k in before}
    out["kernel_plus_charged"] = (out["kernel"] or 0) + (out["charged"] or 0)
    return out


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x."""
    if len(points) < 3:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None


def zram_kept(swapped: int, before: dict[str, int], after: dict[str, int]) -> int:
    """RAM zram holds for ``swapped`` bytes: at the compression zram achieved meanwhile."""
    orig = after["orig_data_size"] - before["orig_data_size"]
    ram = after["mem_used_total"] - before["mem_used_total"]
    if swapped <= 0 or orig <= 0:
        return 0
    return int(swapped * max(0.0, ram) / orig)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def mib(n: float | None) -> float | None:
    return None if n is None else n / 2**20


async def workers(items: list, fn, concurrency: int, errors: list[str]) -> list:
    """``fn`` of each item, ``concurrency`` at a time; an item whose call failed has its
    exception in the answer, and the failure is one of ``errors``."""
    sem = asyncio.Semaphore(concurrency)

    async def one(x):
        async with sem:
            try:
                return await fn(x)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
                return exc

    return await asyncio.gather(*(one(x) for x in items))


# -- fill data ----------------------------------------------------------------------------------

_WORDS = ("request", "handler", "worker", "session", "token", "module", "config", "import", "return", "self",
          "value", "error", "result", "client", "server", "cache", "update", "status", "items", "index", "path",
          "build", "tests", "assert", "async", "await", "print", "open", "read", "write", "json", "data")


def agent_text(size: int, seed: int = 7) -> bytes:
    """Deterministic text like what an agent's sandbox holds: log lines, Python, JSON."""
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    i = 0
    while total < size:
        kind = i % 3
        w = [rng.choice(_WORDS) for _ in range(6)]
        if kind == 0:
            line = (f"2026-11-29T{rng.randrange(24):02d}:{rng.randrange(60):02d}:{rng.randrange(60):02d}."
                    f"{rng.randrange(1000):03d}Z INFO {w[0]}.{w[1]} {w[2]} {w[3]} id={rng.getrandbits(32):08x} "
                    f"took {rng.randrange(2000)}ms\n")
        elif kind == 1:
            line = f"    def {w[0]}_{w[1]}(self, {w[2]}, {w[3]}={rng.randrange(100)}):\n        return self.{w[4]}({w[5]})\n"
        else:
            line = f'{{"{w[0]}": {rng.randrange(10**6)}, "{w[1]}": "{w[2]}-{rng.getrandbits(24):06x}", "{w[3]}": [{rng.random():.4f}]}}\n'
        parts.append(line)
        total += len(line)
        i += 1
    return "".join(parts).encode()[:size]


def heap_like(size: int, seed: int = 11) -> bytes:
    """Deterministic content like a process heap's, in blocks of 64 KiB: half text (strings:
    the agent-like text above), a quarter structures (8-byte words: pointers into one 4 GiB
    region, small integers, zero padding) and a quarter random bytes (hashes, compressed or
    encrypted buffers, which no compressor shrinks). zram returns only part of such a page."""
    rng = random.Random(seed)
    block = 64 << 10
    blocks = -(-size // block)
    text = agent_text(blocks * block // 2, seed)
    out = bytearray()
    for i in range(blocks):
        out += text[i * block // 2:(i + 1) * block // 2]
        words = []
        for _ in range(block // 4 // 8):
            kind = rng.randrange(4)
            value = (0x00007F3A00000000 | rng.getrandbits(32)) if kind < 2 else rng.randrange(4096) if kind == 2 else 0
            words.append(value.to_bytes(8, "little"))
        out += b"".join(words)
        out += rng.randbytes(block // 4)
    return bytes(out[:size])


def fill_image(store: LayerStore, base: Image, size_mb: int, work: Path) -> Image:
    """``base`` plus a layer holding the fills (so each sandbox copies one into its own memory
    in a fraction of a second, instead of generating it): FILL_PATH (agent-like text) and
    HEAP_PATH (heap-like content)."""
    name = f"density-fill-heap-{size_mb}"
    if store.has_image(name):
        return store.get_image(name)
    src = work / "fill-layer"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    (src / FILL_PATH.lstrip("/")).write_bytes(agent_text(size_mb << 20))
    (src / HEAP_PATH.lstrip("/")).write_bytes(heap_like(size_mb << 20))
    digest = store.add_dir(src)
    shutil.rmtree(src, ignore_errors=True)
    return store.put_image(Image(name=name, layers=(*base.layers, digest), env=dict(base.env)))


# -- bare crun peer -----------------------------------------------------------------------------


class CrunPeer:
    """Idle ``crun run -d`` containers of a sleeping busybox on the busybox EROFS layer, under
    one cgroup parent; ``cleanup()`` removes everything (also an earlier killed run's)."""

    def __init__(self, work: Path, layer_file: Path) -> None:
        self.work = work.resolve()
        self.layer_file = layer_file
        self.rootfs = self.work / "rootfs"
        self.root = self.work / "crun"
        self.bundles = self.work / "bundles"
        self.parent = "dsecdensity-" + hashlib.sha1(str(self.work).encode()).hexdigest()[:10]
        self.spec: dict | None = None
        self.ids: list[str] = []

    def __enter__(self) -> CrunPeer:
        self.cleanup()
        for d in (self.rootfs, self.root, self.bundles):
            d.mkdir(parents=True, exist_ok=True)
        _sys.mount(str(self.layer_file), str(self.rootfs), "erofs", _sys.MS_RDONLY | _sys.MS_NODEV | _sys.MS_NOSUID)
        subprocess.run([CRUN, "spec"], cwd=self.work, check=True, capture_output=True)
        self.spec = json.loads((self.work / "config.json").read_text())
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    async def start(self, i: int) -> None:
        assert self.spec is not None
        cid = f"idle-{i}"
        config = json.loads(json.dumps(self.spec))
        config["process"].update(terminal=False, args=["/bin/sleep", "2147483647"])
        config["root"] = {"path": str(self.rootfs), "readonly": True}
        config["linux"]["cgroupsPath"] = f"/{self.parent}/{cid}"
        bundle = self.bundles / cid
        bundle.mkdir()
        (bundle / "config.json").write_text(json.dumps(config))
        with open(bundle / "crun.log", "w+b") as log:
            proc = await asyncio.create_subprocess_exec(
                CRUN, "--root", str(self.root), "run", "--detach", "--bundle", str(bundle), cid,
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT)
            if await proc.wait() != 0:
                log.seek(0)
                raise RuntimeError(f"crun run -d failed: {log.read()[-300:].decode(errors='replace')}")
        self.ids.append(cid)

    def cleanup(self) -> None:
        if self.root.is_dir():
            listed = subprocess.run([CRUN, "--root", str(self.root), "list", "-q"], capture_output=True, text=True)
            for cid in listed.stdout.split():
                subprocess.run([CRUN, "--root", str(self.root), "delete", "-f", cid], capture_output=True)
        deadline = time.monotonic() + 10
        while cgroups.sandbox_cgroup_dirs(self.parent) and time.monotonic() < deadline:
            for d in cgroups.sandbox_cgroup_dirs(self.parent):
                try:
                    d.rmdir()
                except OSError:
                    pass
            time.sleep(0.05)
        cgroups.remove_parent(self.parent)
        if os.path.ismount(self.rootfs):
            _sys.umount(str(self.rootfs), _sys.MNT_DETACH)
        shutil.rmtree(self.work, ignore_errors=True)
        self.ids.clear()

    def leftovers(self) -> list[str]:
        found = [f"cgroup {d}" for d in cgroups.sandbox_cgroup_dirs(self.parent)]
        if os.path.ismount(self.rootfs):
            found.append(f"mount {self.rootfs}")
        if self.work.exists():
            found.append(f"directory {self.work}")
        return found


# -- the benchmark ------------------------------------------------------------------------------


class Bench:
    def __init__(self, state_dir: Path, console: Console, opts: Options) -> None:
        self.state_dir = state_dir
        self.console = console
        self.opts = opts
        self.deadline = time.monotonic() + opts.time_limit_s
        self.parent = cgroups.parent_for(state_dir)
        self.r: dict[str, Any] = {}
        self.errors: list[str] = []
        self.notes: list[str] = []

    async def settled(self, settle_s: float, samples: int = 5) -> int:
        scale = self.opts.settle_scale
        return await settled_used(settle_s * scale, samples, 0.2 * scale)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, text: str) -> None:
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {text}")

    async def workers(self, items: list, fn, concurrency: int | None = None) -> list:
        return await workers(items, fn, concurrency or self.opts.concurrency, self.errors)

    # -- 1. placement -----------------------------------------------------------------------

    def placement(self) -> None:
        rng = random.Random(1)
        # 192 cores and 1.5 TB each, as the report's nodes; a fifth of them full.
        view = [placement.NodeLoad(node=f"n{i}", cpu_cores=192, memory_mb=1_500_000, max_sandboxes=4096,
                                   committed_cpu=rng.random() * 20000,
                                   committed_memory_mb=(3_750_000 if i % 5 == 0 else rng.random() * 3_000_000),
                                   sandboxes=rng.randrange(3000)) for i in range(self.opts.placement_nodes)]
        demand = placement.Demand(cpu_cores=1, memory_mb=512)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 2.0:
            placement.place(view, demand, 1, rng=rng)
            n += 1
        single = n / (time.perf_counter() - t0)
        batches, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 2.0:
            placement.place(view, demand, 1000, rng=rng)
            batches += 1
        batched = batches * 1000 / (time.perf_counter() - t0)
        self.r["placement"] = {"nodes": len(view), "single_decisions_per_s": single, "batched_decisions_per_s": batched}
        self.say(f"placement over {len(view)} nodes: {single:,.0f} single decisions/s, {batched:,.0f}/s in batches of 1000")

    # -- 2. bare crun -----------------------------------------------------------------------

    async def crun_floor(self, layer_file: Path) -> None:
        n = self.opts.peer_count
        with CrunPeer(self.state_dir / "peer", layer_file) as peer:
            before = await self.settled(2.0)
            parts0 = attributable(peer.parent)
            t0 = time.perf_counter()
            await self.workers(list(range(n)), peer.start, concurrency=8)
            secs = time.perf_counter() - t0
            after = await self.settled(3.0)
            made = len(peer.ids)
            parts = per_unit(parts0, attributable(peer.parent), made)
            self.r["crun"] = {"count": made, "host_mib_per_container": mib((after - before) / max(made, 1)),
                              "attributable_mib_per_container": parts, "started_per_s": made / secs}
            self.say(f"bare crun: {made} idle containers, {self.r['crun']['host_mib_per_container']:.2f} MiB each "
                     f"(kernel + charged: {parts['kernel_plus_charged']:.2f} MiB)")
        self.r["crun"]["leftovers"] = peer.leftovers()

    # -- 3. idle density ----------------------------------------------------------------------

    def server(self, *extra: str) -> LocalServer:
        return LocalServer(self.state_dir, extra_args=("--pool-max", "0", *extra), start_timeout_s=120)

    async def stop_all(self, client: DSecClient, sandboxes: list[Sandbox]) -> float:
        t0 = time.perf_counter()
        await self.workers(sandboxes, lambda s: s.stop(), concurrency=32)
        remaining = [s for s in await client.list_sandboxes() if s.status.value in ("running", "paused", "creating")]
        if remaining:
            self.notes.append(f"stopping {len(remaining)} sandboxes a failed phase left")
            await self.workers(remaining, lambda s: Sandbox(client, s).stop(), concurrency=32)
        secs = time.perf_counter() - t0
        self.say(f"stopped {len(sandboxes)} sandboxes in {secs:.0f} s")
        return secs

    async def probe(self, client: DSecClient, args: DSecContainerRunArgs, sandboxes: list[Sandbox],
                    base: int) -> dict:
        """Time ``probe`` single creates, one after another, with ``len(sandboxes)`` there (they
        stay, and count toward the total)."""
        at = len(sandboxes)
        lat, server_side = [], []
        for _ in range(self.opts.probe):
            t0 = time.perf_counter()
            s = await client.run_container(args, timeout=120)
            lat.append(time.perf_counter() - t0)
            server_side.append(s.info.create_s or 0.0)
            sandboxes.append(s)
        # Does the host still answer? A whole lifecycle (create, a command's answer, stop) of a
        # sandbox that does not stay, and a plain `true` on the host, a few times each.
        life, host_true = [], []
        for _ in range(max(1, min(5, self.opts.probe))):
            t0 = time.perf_counter()
            s = await client.run_container(args, timeout=120)
            try:
                await s.run_shell("true", timeout=60)
            finally:
                await s.stop()
            life.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            proc = await asyncio.create_subprocess_exec("true")
            await proc.wait()
            host_true.append(time.perf_counter() - t0)
        row = {"at": at, "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3, "max_ms": max(lat) * 1e3,
               "server_p50_ms": pct(server_side, 50) * 1e3,
               "lifecycle_p50_ms": pct(life, 50) * 1e3, "lifecycle_max_ms": max(life) * 1e3,
               "host_true_p50_ms": pct(host_true, 50) * 1e3, "host_true_max_ms": max(host_true) * 1e3,
               "loadavg": os.getloadavg()[0], "mem_available_mib": mib(meminfo()["MemAvailable"]),
               "host_mib_per_sandbox": mib((used() - base) / at) if at else None}
        self.say(f"{at:5d} sandboxes: create p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms; create + command + "
                 f"stop {row['lifecycle_p50_ms']:.0f} ms; host `true` {row['host_true_p50_ms']:.1f} ms; load "
                 f"{row['loadavg']:.1f}, MemAvailable {row['mem_available_mib']:,.0f} MiB")
        return row

    def idle_admission(self) -> tuple[str, ...]:
        """``dsec serve`` flags of a node meant for ``max_sandboxes`` idle sandboxes: admission
        commits each one's memory limit (IDLE_MEMORY_MB, far above what it touches) and CPU
        weight (one core's), so the overcommits that let them all in are set, as an operator of
        such a node would."""
        o = self.opts
        overcommit = o.memory_overcommit or round(
            o.max_sandboxes * IDLE_MEMORY_MB / (meminfo()["MemTotal"] >> 20) + 0.05, 1)
        cpu_overcommit = max(2048, -(-o.max_sandboxes // (os.cpu_count() or 1)))
        return ("--max-sandboxes", str(o.max_sandboxes), "--memory-overcommit", f"{overcommit:g}",
                "--cpu-overcommit", str(cpu_overcommit))

    async def idle(self) -> None:
        o = self.opts
        args = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=IDLE_MEMORY_MB, ttl_running_stop=7200)
        flags = self.idle_admission()
        self.r["idle_server_flags"] = " ".join(flags)
        self.say(f"idle server: dsec serve {' '.join(flags)}")
        server = self.server(*flags)
        await asyncio.to_thread(server.start)
        sandboxes: list[Sandbox] = []
        table: list[dict] = []
        points: list[tuple[int, int]] = []
        try:
            async with DSecClient(server.endpoint, token=server.token, max_connections=64) as client:
                base = await self.settled(2.0)
                base_meminfo = meminfo()
                parts0 = attributable(self.parent)
                t_start = time.perf_counter()
                reserve = max(HOST_RESERVE_MIN, int(HOST_RESERVE_SHARE * base_meminfo["MemTotal"]))
                batch = o.batch
                stopped_by = ""
                while not stopped_by:
                    # Enough time left to stop what is there and run the other phases?
                    if o.max_count and len(sandboxes) >= o.max_count:
                        stopped_by = f"cap: --max-count {o.max_count}"
                    elif self.left() < 420 + len(sandboxes) * 0.05:
                        stopped_by = "time limit"
                    elif (avail := meminfo()["MemAvailable"]) < reserve:
                        stopped_by = (f"limit: host memory (MemAvailable {mib(avail):,.0f} MiB under the reserve of "
                                      f"{mib(reserve):,.0f} MiB)")
                    if stopped_by:
                        break
                    try:
                        if len(sandboxes) % o.step == 0:
                            table.append(await self.probe(client, args, sandboxes, base))
                            points.append((len(sandboxes), used()))
                        n = min(batch, o.step - len(sandboxes) % o.step,
                                *([o.max_count - len(sandboxes)] if o.max_count else []))
                        sandboxes += await client.run_containers(args, count=n, timeout=600)
                    except Exception as exc:  # noqa: BLE001 - a refusal is the limit, the result
                        if batch > 1:  # near the limit: on one at a time, to find it to one sandbox
                            batch = 1
                            continue
                        stopped_by = f"limit: the server refused a create ({type(exc).__name__}: {exc})"[:300]
                if o.max_count and len(sandboxes) >= o.max_count:
                    table.append(await self.probe(client, args, sandboxes, base))  # at the top
                self.say(f"idle fill stopped at {len(sandboxes)} sandboxes: {stopped_by}")
                fill_s = time.perf_counter() - t_start
                count = len(sandboxes)
                after = await self.settled(5.0)
                points.append((len(sandboxes), after))
                after_meminfo = meminfo()
                parts = per_unit(parts0, attributable(self.parent), len(sandboxes))
                charged = parent_memory(self.parent)
                probe_lat = []
                for s in random.Random(3).sample(sandboxes, min(20, count)):
                    t0 = time.perf_counter()
                    await s.run_shell("true", timeout=60)
                    probe_lat.append(time.perf_counter() - t0)
                node = (await client.node_info())[0]
                breakdown = {k: mib((after_meminfo[k] - base_meminfo[k]) / max(count, 1))
                             for k in ("AnonPages", "Shmem", "Slab", "SUnreclaim", "KernelStack", "PageTables", "Percpu")
                             if k in after_meminfo}
                self.r["idle"] = {
                    "count": count, "stopped_by": stopped_by, "limit_hit": stopped_by.startswith("limit:"),
                    "fill_s": fill_s, "created_per_s": count / fill_s,
                    "host_mib_per_sandbox": mib((after - base) / max(count, 1)),
                    "host_mib_per_sandbox_slope": mib(slope(points)),
                    "cgroup_charged_mib_per_sandbox": mib(charged / max(count, 1)),
                    "attributable_mib_per_sandbox": parts,
                    "meminfo_mib_per_sandbox": breakdown, "latency_table": table,
                    "exec_at_max_p50_ms": pct(probe_lat, 50) * 1e3 if probe_lat else None,
                    "committed_memory_mb": node.committed_memory_mb, "memory_overcommit": node.memory_overcommit,
                    "committed_cpu": node.committed_cpu, "cpu_overcommit": node.cpu_overcommit,
                }
                self.say(f"idle: {count} sandboxes, {self.r['idle']['host_mib_per_sandbox']:.2f} MiB each; kernel + "
                         f"charged {parts['kernel_plus_charged']:.2f} MiB ({mib(charged / max(count, 1)):.2f} MiB charged "
                         f"to their cgroups)")
                self.r["idle"]["stop_all_s"] = await self.stop_all(client, sandboxes)
                self.r["idle"]["host_mib_per_sandbox_at_stop"] = mib((after - await self.settled(5.0)) / max(count, 1))
        finally:
            await asyncio.to_thread(server.stop)

    # -- 4. pause -------------------------------------------------------------------------------

    async def pause_group(self, client: DSecClient, image: str, count: int, fill_cmd: str, label: str) -> dict:
        # The writable layer may take half the memory limit: 3× the fill leaves room.
        args = DSecContainerRunArgs(container_image=image, memory_limit_mb=3 * self.opts.pause_mb, ttl_running_stop=7200)
        base = await self.settled(2.0)
        sandboxes = await client.run_containers(args, count=count, timeout=600)
        try:
            fills = await self.workers(sandboxes, lambda s: s.run_shell(fill_cmd, timeout=300), concurrency=4)
            digests = [f.stdout.strip() if not isinstance(f, Exception) else None for f in fills]
            filled = await self.settled(3.0)
            charged_filled = parent_memory(self.parent)
            swap0, zram0 = parent_swap(self.parent), reclaim.zram_stats()
            t0 = time.perf_counter()
            results = await self.workers(sandboxes, lambda s: s.pause(), concurrency=4)
            pause_wall = time.perf_counter() - t0
            paused = await self.settled(3.0)
            zram1, swap1, charged_paused = reclaim.zram_stats(), parent_swap(self.parent), parent_memory(self.parent)
            ok = [r for r in results if not isinstance(r, Exception)]
            t0 = time.perf_counter()
            checks = await self.workers(sandboxes, lambda s: s.run_shell("md5sum /root/fill | cut -c1-32", timeout=120),
                                        concurrency=4)
            resume_wall = time.perf_counter() - t0
            intact = sum(1 for c, d in zip(checks, digests)
                         if not isinstance(c, Exception) and d and c.stdout.strip() == d)
            touched = filled - base
            kept = zram_kept(swap1 - swap0, zram0, zram1)
            out = {
                "count": count, "fill_mib": self.opts.pause_mb, "paused_ok": len(ok),
                "host_used_before_mib": mib(filled - base), "host_used_after_mib": mib(paused - base),
                "returned_share": (filled - paused) / touched if touched > 0 else None,
                "cgroups_before_mib": mib(charged_filled), "cgroups_after_mib": mib(charged_paused),
                "swapped_mib": mib(swap1 - swap0), "zram_kept_mib": mib(kept),
                "returned_share_by_accounting": ((charged_filled - charged_paused - kept) / charged_filled
                                                 if charged_filled > 0 else None),
                "zram_orig_mib": mib(zram1["orig_data_size"] - zram0["orig_data_size"]),
                "zram_ram_mib": mib(zram1["mem_used_total"] - zram0["mem_used_total"]),
                "pause_p50_ms": pct([r.pause_s for r in ok], 50) * 1e3 if ok else None,
                "pause_wall_s": pause_wall, "resume_and_read_back_wall_s": resume_wall, "intact_after_resume": intact,
            }
            self.say(f"pause ({label}): {count} × {self.opts.pause_mb} MiB, host {out['host_used_before_mib']:.0f} → "
                     f"{out['host_used_after_mib']:.0f} MiB, {100 * (out['returned_share'] or 0):.0f}% returned "
                     f"({100 * (out['returned_share_by_accounting'] or 0):.0f}% by accounting)")
            return out
        finally:
            await self.stop_all(client, sandboxes)

    async def pause(self, store: LayerStore) -> None:
        o = self.opts
        image = fill_image(store, store.get_image("busybox"), o.pause_mb, self.state_dir)
        server = self.server()
        await asyncio.to_thread(server.start)
        try:
            async with DSecClient(server.endpoint, token=server.token, max_connections=64) as client:
                self.r["pause_heap"] = await self.pause_group(
                    client, image.name, o.pause_count, f"cat {HEAP_PATH} > /root/fill && md5sum /root/fill | cut -c1-32",
                    "heap-like: text, structures, random bytes")
                if o.text_count and self.left() > 300:
                    self.r["pause_text"] = await self.pause_group(
                        client, image.name, o.text_count,
                        f"cat {FILL_PATH} > /root/fill && md5sum /root/fill | cut -c1-32", "agent-like text")
                if o.random_count and self.left() > 240:
                    self.r["pause_random"] = await self.pause_group(
                        client, "busybox", o.random_count,
                        f"head -c {o.pause_mb << 20} /dev/urandom > /root/fill && md5sum /root/fill | cut -c1-32",
                        "random bytes")
        finally:
            await asyncio.to_thread(server.stop)

    # -- 5. cold memory -----------------------------------------------------------------------

    async def cold(self, store: LayerStore) -> None:
        o = self.opts
        image = fill_image(store, store.get_image("busybox"), o.pause_mb, self.state_dir)
        server = self.server("--cold-memory-idle-s", "10", "--cold-memory-interval-s", "2")
        await asyncio.to_thread(server.start)
        try:
            async with DSecClient(server.endpoint, token=server.token, max_connections=64) as client:
                args = DSecContainerRunArgs(container_image=image.name, memory_limit_mb=3 * o.pause_mb)
                base = await self.settled(2.0)
                sandboxes = await client.run_containers(args, count=o.cold_count, timeout=600)
                try:
                    await self.workers(sandboxes, lambda s: s.run_shell(f"cat {FILL_PATH} > /root/fill", timeout=300),
                                       concurrency=4)
                    filled = used()
                    charged0 = parent_memory(self.parent)
                    swap0, zram0 = parent_swap(self.parent), reclaim.zram_stats()
                    t0 = time.perf_counter()
                    await asyncio.sleep(o.cold_wait_s)
                    after = await self.settled(1.0, samples=3)
                    charged1 = parent_memory(self.parent)
                    kept = zram_kept(parent_swap(self.parent) - swap0, zram0, reclaim.zram_stats())
                    lat = []
                    for s in sandboxes[:5]:
                        t1 = time.perf_counter()
                        await s.run_shell("cat /root/fill > /dev/null", timeout=120)
                        lat.append(time.perf_counter() - t1)
                    self.r["cold"] = {
                        "count": o.cold_count, "fill_mib": o.pause_mb, "idle_s": 10, "waited_s": time.perf_counter() - t0,
                        "host_used_before_mib": mib(filled - base), "host_used_after_mib": mib(after - base),
                        "saved_share": (filled - after) / (filled - base) if filled > base else None,
                        "cgroups_before_mib": mib(charged0), "cgroups_after_mib": mib(charged1),
                        "zram_kept_mib": mib(kept),
                        "saved_share_by_accounting": (charged0 - charged1 - kept) / charged0 if charged0 > 0 else None,
                        "read_back_after_reclaim_ms_p50": pct(lat, 50) * 1e3,
                    }
                    self.say(f"cold memory: {o.cold_count} idle sandboxes, host {mib(filled - base):.0f} → "
                             f"{mib(after - base):.0f} MiB after {o.cold_wait_s:.0f} s")
                finally:
                    await self.stop_all(client, sandboxes)
        finally:
            await asyncio.to_thread(server.stop)


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "—"
    return f"{v:{spec}}"


def _goals(res: dict) -> dict[str, bool | None]:
    """Each goal met (True), missed (False) or not measured (None): what the table shows and
    what ``--strict`` exits on, judged once."""
    idle = res.get("idle") or {}
    mib_each = idle.get("host_mib_per_sandbox")
    share = (res.get("pause_heap") or {}).get("returned_share")
    if not idle:
        fit = None
    elif idle["count"] >= GOAL_IDLE_COUNT:
        fit = True  # at least that many fit, whatever stopped the fill
    else:
        fit = False if idle.get("limit_hit") else None  # a cap or the clock: the limit was not found
    return {"idle_count": fit,
            "idle_mib": None if mib_each is None else mib_each <= GOAL_IDLE_MIB,
            "pause_returned": None if share is None else share >= GOAL_PAUSE_RETURNED}


def _report(res: dict, console: Console) -> None:
    idle, crun = res.get("idle") or {}, res.get("crun") or {}
    goals = _goals(res)
    t = Table(title=f"dsec bench density — swap here: {(res.get('machine') or {}).get('swap', {}).get('text', '?')}")
    for col in ("measure", "DSec", "peer", "goal", "result", "swap set-up it needs"):
        t.add_column(col)

    def verdict(ok: bool | None) -> str:
        return {True: "[green]PASS[/green]", False: "[red]FAIL[/red]", None: "[yellow]not measured[/yellow]"}[ok]

    mib_each = (idle.get("attributable_mib_per_sandbox") or {}).get("kernel_plus_charged")
    crun_each = (crun.get("attributable_mib_per_container") or {}).get("kernel_plus_charged")
    t.add_row("idle sandboxes that fit (filled until a limit)", str(idle.get("count", "—")),
              idle.get("stopped_by", ""), f"≥ {GOAL_IDLE_COUNT}", verdict(goals["idle_count"]), NEEDS_NONE)
    t.add_row("MiB per idle sandbox the host loses: Δ(MemTotal − MemAvailable)", _fmt(idle.get("host_mib_per_sandbox")),
              f"{_fmt(crun.get('host_mib_per_container'))} (bare crun -d)", f"≤ {GOAL_IDLE_MIB:g}",
              verdict(goals["idle_mib"]), NEEDS_NONE)
    t.add_row("  slope over the fill / Δ at stop; kernel + cgroup-charged",
              f"{_fmt(idle.get('host_mib_per_sandbox_slope'))} / {_fmt(idle.get('host_mib_per_sandbox_at_stop'))}; "
              f"{_fmt(mib_each)}", f"{_fmt(crun_each)}", "", "info", NEEDS_NONE)
    for key, label, needs in (("pause_heap", "heap-like", NEEDS_DISK_SWAP), ("pause_text", "agent-like text", NEEDS_ANY_SWAP),
                              ("pause_random", "random bytes", NEEDS_DISK_SWAP)):
        p = res.get(key)
        if p:
            share, by_acct = p["returned_share"], p["returned_share_by_accounting"]
            goal = key == "pause_heap"
            t.add_row(f"pause {p['count']} × {p['fill_mib']} MiB ({label}): host MiB before → after",
                      f"{p['host_used_before_mib']:.0f} → {p['host_used_after_mib']:.0f} ({100 * (share or 0):.0f}% back)",
                      f"cgroups {p['cgroups_before_mib']:.0f} → {p['cgroups_after_mib']:.0f}, zram keeps "
                      f"{p['zram_kept_mib']:.0f}: {100 * (by_acct or 0):.0f}% back",
                      f"≥ {GOAL_PAUSE_RETURNED:.0%}" if goal else "",
                      verdict(goals["pause_returned"]) if goal else "info", needs)
    c = res.get("cold")
    if c:
        t.add_row(f"cold reclaimer, {c['count']} idle × {c['fill_mib']} MiB text: host MiB",
                  f"{c['host_used_before_mib']:.0f} → {c['host_used_after_mib']:.0f} "
                  f"({100 * (c['saved_share'] or 0):.0f}% saved)",
                  f"cgroups {c['cgroups_before_mib']:.0f} → {c['cgroups_after_mib']:.0f}, zram keeps "
                  f"{c['zram_kept_mib']:.0f}: {100 * (c['saved_share_by_accounting'] or 0):.0f}% saved", "", "info",
                  NEEDS_ANY_SWAP)
    pl = res.get("placement")
    if pl:
        t.add_row(f"placement decisions/s, {pl['nodes']} nodes", f"{pl['single_decisions_per_s']:,.0f} single",
                  f"{pl['batched_decisions_per_s']:,.0f} in batches", "", "info", "")
    console.print(t)
    if idle.get("latency_table"):
        lt = Table(title="create latency as the node fills (single creates, one at a time)")
        for col in ("sandboxes already there", "p50 ms", "p99 ms", "max ms", "server p50 ms",
                    "create+command+stop p50 / max ms", "host `true` p50 / max ms", "load", "host MiB/sandbox"):
            lt.add_column(col, justify="right")
        for row in idle["latency_table"]:
            lt.add_row(str(row["at"]), _fmt(row["p50_ms"], ".1f"), _fmt(row["p99_ms"], ".1f"), _fmt(row["max_ms"], ".1f"),
                       _fmt(row["server_p50_ms"], ".1f"),
                       f"{_fmt(row.get('lifecycle_p50_ms'), '.0f')} / {_fmt(row.get('lifecycle_max_ms'), '.0f')}",
                       f"{_fmt(row.get('host_true_p50_ms'), '.1f')} / {_fmt(row.get('host_true_max_ms'), '.1f')}",
                       _fmt(row.get("loadavg"), ".1f"), _fmt(row["host_mib_per_sandbox"]))
        console.print(lt)


async def _run(bench: Bench, store: LayerStore, layer_file: Path) -> None:
    if bench.opts.only in ("", "placement"):
        bench.placement()
    phases = [("crun", lambda: bench.crun_floor(layer_file)), ("idle", bench.idle),
              ("pause", lambda: bench.pause(store)), ("cold", lambda: bench.cold(store))]
    if bench.opts.only:
        phases = [p for p in phases if p[0] == bench.opts.only]
    for name, phase in phases:
        if bench.left() < 60:
            bench.notes.append(f"phase {name} skipped: time limit")
            continue
        try:
            await phase()
        except Exception as exc:  # noqa: BLE001 - reported; the other phases still run
            bench.errors.append(f"{name}: {type(exc).__name__}: {exc}"[:400])


def main(state_dir: Path, console: Console, **options: Any) -> int:
    """Run the benchmark, print the tables, write ``<state_dir>/bench-density.json``. Returns 0
    when it ran cleanly, 1 on errors or leftovers, 2 (``strict``) when a goal is missed."""
    opts = Options(**options)
    if opts.only not in ("", "placement", "crun", "idle", "pause", "cold"):
        raise ValueError(f"only={opts.only!r}: one of placement, crun, idle, pause, cold (or empty: all)")
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    store = LayerStore(state_dir / "store")
    busybox = store.get_image("busybox") if store.has_image("busybox") else build_busybox(store)
    bench = Bench(state_dir, console, opts)
    if stale := [i for i in leftovers(state_dir, settle_s=0) if not i.startswith("process ")]:
        bench.notes.append(f"{len(stale)} items of an earlier run were there at start (the server removes them)")
    console.print(f"[bold]dsec bench density[/bold]: state in {state_dir}; {os.cpu_count()} cores, "
                  f"{meminfo()['MemTotal'] / 2**30:.1f} GiB, swap {meminfo()['SwapTotal'] / 2**30:.1f} GiB, "
                  f"cgroups {cgroups.version()}; swap: {swap_setup()['text']}; time limit {opts.time_limit_s:.0f} s")
    try:
        asyncio.run(_run(bench, store, store.layer_path(busybox.layers[0])))
    except KeyboardInterrupt:
        bench.errors.append("interrupted")
    left = leftovers(state_dir)  # (not the benchmark itself, nor what started it: see leftovers)
    peer_left = (bench.r.get("crun") or {}).get("leftovers", [])
    res = {
        "benchmark": "dsec bench density", "started_at": started.isoformat(timespec="seconds"),
        "duration_s": round(time.perf_counter() - t0, 1), "options": asdict(opts),
        "machine": {"cores": os.cpu_count(), "memory_total_gib": round(meminfo()["MemTotal"] / 2**30, 1),
                    "swap_total_gib": round(meminfo()["SwapTotal"] / 2**30, 1), "kernel": os.uname().release,
                    "cgroups": cgroups.version(), "loadavg_at_end": open("/proc/loadavg").read().split()[:3],
                    "swap": swap_setup()},
        **bench.r, "leftovers": left + peer_left, "errors": bench.errors, "notes": bench.notes,
    }
    (state_dir / RESULTS_FILE).write_text(json.dumps(res, indent=1, default=str) + "\n")
    _report(res, console)
    for note in bench.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    for err in bench.errors[:20]:
        console.print(f"[red]error:[/red] {err}")
    console.print(f"leftovers: {left + peer_left or 'nothing'}; results: {state_dir / RESULTS_FILE} "
                  f"({res['duration_s']:.0f} s)")
    if bench.errors or left or peer_left:
        return 1
    missed = any(ok is not True for ok in _goals(res).values())  # not measured counts as missed
    return 2 if opts.strict and missed else 0
