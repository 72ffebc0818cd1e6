"""The density arm of ``dsec bench desktop`` (``--density N``): how many idle desktops one node
holds, and what each costs the host (docs/BENCHMARKS.md, "Desktop", density).

DSec: N sandboxes made with ``desktop=DesktopSpec(width, height, session=...)`` in batches, left
idle until the host's memory settles, then what the host lost measured as the density bench
measures it (``density.settled_used``: Δ(MemTotal − MemAvailable) ÷ N, the whole host's, so the
image's page cache, read by the first desktop and shared by the rest, is in it once), beside the
memory their cgroups are charged (the first one's page cache included) and the host's meminfo
parts per desktop. Then a screenshot of every one, each a PNG of the screen's size, and all
stopped. A fill stops early when the node refuses a create (admission: its reason is the
result) or when the host's MemAvailable would drop under ``reserve_gib``.

The peer, in the same run: the same number (or ``peer_count``) of ``podman run`` of the same
image running the same session as E2B Desktop's template starts it (Xvfb, then the session:
``dbus-run-session -- xfce4-session``, or ``xfwm4`` alone for ``wm``), measured the same way.
"""

from __future__ import annotations

import asyncio
import resource
import secrets
import shutil
import statistics
import struct
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console

from libdsec import DesktopSpec, DSecClient, DSecContainerRunArgs, Sandbox

from dsec.images.store import LayerStore
from dsec.resources import cgroups

from .density import meminfo, mib, settled_used
from .lifecycle_peers import image_root

PODMAN = shutil.which("podman") or "/usr/bin/podman"
# The peer's nproc: the host's, within what podman may set here (65536 is refused, 16384 is not).
NPROC = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 16384)
# The goals: >= 150 idle desktops at 1280x800 on this machine, each <= 100 MiB of host memory.
GOALS = {"count": 150, "host_mib_per_desktop": 100.0}
MEMINFO_PARTS = ("AnonPages", "Shmem", "Slab", "SUnreclaim", "KernelStack", "PageTables", "Percpu")


def png_size(png: bytes) -> tuple[int, int] | None:
    """(width, height) of a PNG's header, or None if ``png`` is not one."""
    if len(png) < 24 or png[:8] != b"\x89PNG\r\n\x1a\n" or png[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", png[16:24])


def cgroup_memory(path: str) -> tuple[int, int]:
    """(bytes charged, of which anonymous) of the memory cgroup at ``path`` and below it."""
    v2 = cgroups.is_v2()
    d = _cgroup_dir(path)
    try:
        usage = int((d / ("memory.current" if v2 else "memory.usage_in_bytes")).read_text())
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return 0, 0
    return usage, int(stat.get("anon" if v2 else "total_rss", 0))


# The session's last programs: a desktop counts as up (for the settle) once its cgroup runs them all.
SESSION_UP = {"xfce4": ("xfwm4", "xfdesktop", "xfce4-panel", "xfsettingsd"), "wm": ("xfwm4",), "none": ("Xvfb",)}


def _cgroup_dir(path: str) -> Path:
    return cgroups.CGROUP_ROOT / path.strip("/") if cgroups.is_v2() else cgroups.CGROUP_ROOT / "memory" / path.strip("/")


def sessions_up(paths: list[str], session: str) -> int:
    """How many of the cgroups at ``paths`` (each with those below it) run all of the session's
    last programs."""
    up = 0
    for path in paths:
        names: set[str] = set()
        for procs in _cgroup_dir(path).rglob("cgroup.procs"):
            for pid in procs.read_text().split():
                try:
                    names.add(Path(f"/proc/{pid}/comm").read_text().strip())
                except OSError:
                    pass
        up += all(p in names for p in SESSION_UP[session])
    return up


async def wait_sessions_up(paths_of, count: int, session: str, timeout_s: float) -> tuple[int, float]:
    """Wait until ``count`` desktops have their whole session up (``paths_of()``: their cgroups)
    or ``timeout_s``: (how many are up, seconds waited)."""
    started = time.perf_counter()
    while True:
        up = await asyncio.to_thread(lambda: sessions_up(paths_of(), session))
        if up >= count or time.perf_counter() - started > timeout_s:
            return up, time.perf_counter() - started
        await asyncio.sleep(1.0)


def _low_memory(reserve: int) -> str:
    avail = meminfo()["MemAvailable"]
    if avail < reserve:
        return (f"limit: host memory (MemAvailable {mib(avail):,.0f} MiB under the reserve of "
                f"{mib(reserve):,.0f} MiB)")
    return ""


def _parts(before: dict[str, int], after: dict[str, int], count: int) -> dict[str, float | None]:
    return {k: mib((after[k] - before[k]) / max(count, 1)) for k in MEMINFO_PARTS if k in after}


async def dsec_arm(client: DSecClient, state_dir: Path, o: dict, console: Console) -> dict:
    n, session = o["density"], o["density_session"]
    args = DSecContainerRunArgs(container_image="desktop", memory_limit_mb=o["density_memory_mb"],
                                ttl_running_stop=7200,
                                desktop=DesktopSpec(width=o["width"], height=o["height"], dpi=96, session=session))
    parent = cgroups.parent_for(state_dir)
    reserve = int(o["density_reserve_gib"] * 2**30)
    base = await settled_used(2.0)
    base_meminfo, (base_charged, base_anon) = meminfo(), cgroup_memory(parent)
    load = Path("/proc/loadavg").read_text().split()[:3]
    sandboxes: list[Sandbox] = []
    stopped_by = ""
    started = time.perf_counter()
    try:
        while len(sandboxes) < n:
            if stopped_by := _low_memory(reserve):
                break
            batch = min(o["density_batch"], n - len(sandboxes))
            made = await asyncio.gather(*(client.run_container(args, timeout=300) for _ in range(batch)),
                                        return_exceptions=True)
            sandboxes += [s for s in made if isinstance(s, Sandbox)]
            refused = [e for e in made if isinstance(e, BaseException)]
            if refused:  # the node said no: which limit is the result
                e = refused[0]
                stopped_by = f"limit: the node refused a create ({type(e).__name__}: {e})"[:300]
                break
            console.print(f"  {len(sandboxes)} desktops ({session}) up")
        fill_s = time.perf_counter() - started
        count = len(sandboxes)

        def sandbox_cgroups() -> list[str]:
            return [f"{parent}/{d.name}" for d in _cgroup_dir(parent).iterdir() if d.is_dir()]

        up, up_wait_s = await wait_sessions_up(sandbox_cgroups, count, session, 120 + count)
        after = await settled_used(o["density_settle_s"])
        after_meminfo, (charged, anon) = meminfo(), cgroup_memory(parent)
        # A screenshot of every one: all must answer with a PNG of the screen's size.
        shots, bad = [], []
        for s in sandboxes:
            t0 = time.perf_counter()
            try:
                png = await s.desktop.screenshot()
            except Exception as exc:  # noqa: BLE001 - a desktop that does not answer is the result
                bad.append(f"{s.id}: {type(exc).__name__}: {exc}"[:200])
                continue
            shots.append((time.perf_counter() - t0) * 1000)
            if png_size(png) != (o["width"], o["height"]):
                bad.append(f"{s.id}: not a {o['width']}x{o['height']} PNG ({png_size(png)}, {len(png)} bytes)")
        after_shots = await settled_used(2.0)
    finally:
        stop_started = time.perf_counter()
        sem = asyncio.Semaphore(16)

        async def stop(s: Sandbox) -> None:
            async with sem:
                await s.stop()

        await asyncio.gather(*(stop(s) for s in sandboxes), return_exceptions=True)
        stop_s = time.perf_counter() - stop_started
    r = {
        "session": session, "asked": n, "count": count, "stopped_by": stopped_by or f"asked: {n}",
        "limit_hit": bool(stopped_by), "fill_s": fill_s, "stop_s": stop_s, "load_average": load,
        "sessions_up": up, "sessions_up_wait_s": up_wait_s,
        "host_mib_per_desktop": mib((after - base) / max(count, 1)),
        "host_mib_per_desktop_after_screenshots": mib((after_shots - base) / max(count, 1)),
        "cgroup_charged_mib_per_desktop": mib((charged - base_charged) / max(count, 1)),
        "cgroup_anon_mib_per_desktop": mib((anon - base_anon) / max(count, 1)),
        "meminfo_mib_per_desktop": _parts(base_meminfo, after_meminfo, count),
        "screenshots_ok": count - len(bad), "screenshot_failures": bad[:10],
        "screenshot_p50_ms": statistics.median(shots) if shots else None,
        "mem_available_mib_at_top": mib(after_meminfo["MemAvailable"]),
    }
    console.print(f"DSec: {count} idle desktops ({session}, {up} with the whole session up), {r['host_mib_per_desktop']:.1f} MiB of host memory each "
                  f"({r['cgroup_charged_mib_per_desktop']:.1f} MiB charged to their cgroups); screenshots "
                  f"{r['screenshots_ok']}/{count}; stopped by {r['stopped_by']}")
    return r


def _podman_start(o: dict, session: str) -> str:
    """E2B Desktop's template's start-up: Xvfb, then the session (as the latency peer runs it)."""
    program = "dbus-run-session -- xfce4-session" if session == "xfce4" else (
        "xfwm4" if session == "wm" else "sleep infinity")
    return (f"Xvfb :0 -screen 0 {o['width']}x{o['height']}x24 -dpi 96 -nolisten tcp >/tmp/xvfb.log 2>&1 & "
            "for i in $(seq 100); do [ -e /tmp/.X11-unix/X0 ] && break; sleep 0.05; done; "
            f"exec {program}")


def _podman_run(root: Path, name: str, command: str) -> str:
    run = subprocess.run(
        # (nproc 16384, not the latency peer's 1024: the limit counts the threads of every
        # container running as the same host uid 1000, and past ~14 xfce4 desktops it kept their
        # sessions from starting)
        [PODMAN, "run", "-d", "--name", name, "--network", "none", "--ulimit", "nofile=1024:1024",
         "--ulimit", f"nproc={NPROC}:{NPROC}", "--user", "1000:1000", "-e", "HOME=/home/user", "-e", "DISPLAY=:0",
         "--workdir", "/home/user", "--rootfs", f"{root}:O", "/bin/sh", "-c", command],
        capture_output=True, timeout=300)
    return "" if run.returncode == 0 else run.stderr.decode(errors="replace")[-300:]


def _podman_charged(paths: list[str]) -> tuple[int, int]:
    """(bytes charged, of which anonymous) summed over the memory cgroups of podman's containers."""
    charged = anon = 0
    for path in paths:
        c, a = cgroup_memory(path)
        charged, anon = charged + c, anon + a
    return charged, anon


def _podman_running(names: list[str]) -> int:
    out = subprocess.run([PODMAN, "ps", "--format", "{{.Names}}"], capture_output=True, text=True, timeout=120)
    return len(set(out.stdout.split()) & set(names))


def podman_arm(store: LayerStore, work: Path, o: dict, console: Console) -> dict:
    n, session = o["density_peer"], o["density_session"]
    reserve = int(o["density_reserve_gib"] * 2**30)
    prefix = f"dsec-bench-deskdens-{secrets.token_hex(3)}"
    names: list[str] = []
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    stopped_by, errors = "", []
    try:
        with image_root(store, "desktop", work) as root:
            base = asyncio.run(settled_used(2.0))
            base_meminfo = meminfo()
            command = _podman_start(o, session)
            started = time.perf_counter()
            with ThreadPoolExecutor(4) as pool:
                while len(names) < n:
                    if stopped_by := _low_memory(reserve):
                        break
                    batch = [f"{prefix}-{len(names) + i}" for i in range(min(o["density_batch"], n - len(names)))]
                    names += batch
                    errors += [e for e in pool.map(lambda nm: _podman_run(root, nm, command), batch) if e]
                    if errors:
                        stopped_by = f"podman run failed: {errors[0]}"
                        break
            fill_s = time.perf_counter() - started
            paths = subprocess.run([PODMAN, "inspect", "--format", "{{.State.CgroupPath}}", *names],
                                   capture_output=True, text=True, timeout=120).stdout.split()
            up, up_wait_s = asyncio.run(wait_sessions_up(lambda: paths, len(paths), session, 120 + len(paths)))
            after = asyncio.run(settled_used(o["density_settle_s"]))
            after_meminfo = meminfo()
            running = _podman_running(names)
            charged, anon = _podman_charged(paths)
            try:
                subprocess.run([PODMAN, "rm", "-f", "-t", "0", *names], capture_output=True, timeout=600)
            finally:
                names_left = _podman_running(names)
    finally:
        if names:
            subprocess.run([PODMAN, "rm", "-f", "-t", "0", "--ignore", *names], capture_output=True, timeout=600)
        shutil.rmtree(work, ignore_errors=True)
    count = len(names) - len(errors)
    if not count:
        raise RuntimeError(f"the podman peer started no desktop: {stopped_by}")
    r = {"session": session, "asked": n, "count": count, "running_at_top": running, "stopped_by": stopped_by or f"asked: {n}",
         "fill_s": fill_s, "sessions_up": up, "sessions_up_wait_s": up_wait_s,
         "host_mib_per_desktop": mib((after - base) / count), "cgroup_charged_mib_per_desktop": mib(charged / count),
         "cgroup_anon_mib_per_desktop": mib(anon / count),
         "meminfo_mib_per_desktop": _parts(base_meminfo, after_meminfo, count), "left_running": names_left}
    console.print(f"podman: {count} idle desktops ({session}, {up} with the whole session up), {r['host_mib_per_desktop']:.1f} MiB of host memory each "
                  f"({r['cgroup_charged_mib_per_desktop']:.1f} MiB charged to their cgroups); {running} running at the top")
    return r


async def run(client: DSecClient, state_dir: Path, o: dict, console: Console) -> dict:
    """Both arms, DSec's first, then the peer's on a host back where it was."""
    d = await dsec_arm(client, state_dir, o, console)
    await asyncio.sleep(3)  # the stopped sandboxes' memory back
    pm = await asyncio.to_thread(podman_arm, LayerStore(state_dir / "store"), state_dir / "podman-density", o, console)
    ratio = pm["host_mib_per_desktop"] / d["host_mib_per_desktop"] if d["host_mib_per_desktop"] else None
    return {
        "dsec": d, "podman": pm, "podman_over_dsec_host_mib": ratio,
        "goals": {
            "count_ge_150": d["count"] >= GOALS["count"] and d["screenshots_ok"] == d["count"],
            # (a figure under 0 is other work on the host freeing memory meanwhile: not judged)
            "host_mib_per_desktop_le_100": d["host_mib_per_desktop"] is not None
            and 0 < d["host_mib_per_desktop"] <= GOALS["host_mib_per_desktop"],
            "all_screenshots": d["screenshots_ok"] == d["count"],
        },
    }
