"""``dsec bench inside``: what an agent does inside a container sandbox, against peers measured in
the same run (see docs/BENCHMARKS.md, "Inside a sandbox").

- time to the first streamed byte of ``echo x`` (``stream_shell``) and of the whole one-shot
  ``run_shell``, against ``podman exec`` of the same command in a podman container of the same
  root filesystem;
- a command in an open session (``true``): its round trip, against ``podman exec … true``;
- ``yes`` streamed to a client that reads at ``--read-mb-s``: the server's RSS before, at most
  during, and after;
- ``upload_dir`` / ``download_dir`` of a tree of small and large files, against a local
  ``tar c | tar x`` of the same tree.

Its server runs containers only, on 127.0.0.1, with its state under ``--state-dir``; everything
it makes is removed at the end (and checked)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs

from dsec.images.builders import build_busybox
from dsec.images.store import LayerStore
from dsec.local import LocalServer
from .lifecycle_peers import PODMAN, PeerRig
from .results import finish_on_server

RESULTS_FILE = "bench-inside.json"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def _make_tree(root: Path, total_mb: int) -> int:
    """Half the bytes in 4 KiB files, half in 8 MiB ones; returns the bytes written."""
    root.mkdir(parents=True)
    half = total_mb << 19
    written, i = 0, 0
    while written < half:
        d = root / f"d{i // 100}"
        d.mkdir(exist_ok=True)
        (d / f"f{i}.txt").write_bytes(os.urandom(4096))
        written, i = written + 4096, i + 1
    big = 0
    while big < half:
        (root / f"big{big >> 23}.bin").write_bytes(os.urandom(8 << 20))
        big += 8 << 20
    return written + big


async def _podman_exec_s(name: str, *argv: str, first_byte: bool = False) -> float:
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(PODMAN, "exec", name, *argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    if first_byte:
        await proc.stdout.read(1)
        took = time.perf_counter() - start
        await proc.communicate()
        return took
    await proc.communicate()
    return time.perf_counter() - start


async def _run(server: LocalServer, rig: PeerRig | None, work: Path, opts: dict, console: Console) -> dict:
    r: dict = {}
    # Disk is half the memory limit: room for the tree and its tar on the way in.
    args = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=2048, cpu_cores_limit=1)
    async with DSecClient(server.endpoint, token=server.token) as client:
        async with await client.run_container(args) as sandbox:
            await sandbox.run_shell("true")
            # -- first byte and one-shot round trip ----------------------------------------
            stream_first, run_whole = [], []
            for _ in range(opts["samples"]):
                start = time.perf_counter()
                async for event in sandbox.stream_shell("echo x"):
                    if event.event == "stdout":
                        stream_first.append(time.perf_counter() - start)
                start = time.perf_counter()
                await sandbox.run_shell("echo x")
                run_whole.append(time.perf_counter() - start)
            r["first_byte"] = {"stream_shell_p50_ms": _p50(stream_first), "run_shell_p50_ms": _p50(run_whole)}
            # -- a session's round trip ----------------------------------------------------
            async with await sandbox.open_session() as session:
                trips = []
                for _ in range(opts["samples"]):
                    start = time.perf_counter()
                    await session.run_shell("true")
                    trips.append(time.perf_counter() - start)
            r["session"] = {"true_p50_ms": _p50(trips), "per_s": 1 / statistics.median(trips)}
            # -- a slow reader -------------------------------------------------------------
            pid = server.proc.pid
            before, peak, got = _rss(pid), 0, 0
            start = time.perf_counter()
            rate = opts["read_mb_s"] * 1e6
            async for event in sandbox.stream_shell("yes", timeout=opts["slow_s"] + 60, max_output_bytes=1 << 20):
                got += len(event.data)
                peak = max(peak, _rss(pid))
                ahead = got / rate - (time.perf_counter() - start)
                if ahead > 0:
                    await asyncio.sleep(ahead)
                if time.perf_counter() - start > opts["slow_s"]:
                    break
            r["slow_reader"] = {"seconds": round(time.perf_counter() - start, 1), "read_mb": round(got / 1e6, 1),
                                "rss_before_mib": before / 2**20, "rss_peak_mib": peak / 2**20,
                                "rss_growth_mib": (peak - before) / 2**20}
            # -- trees -----------------------------------------------------------------------
            src, back, local = work / "tree", work / "back", work / "local"
            for d in (src, back, local):
                shutil.rmtree(d, ignore_errors=True)
            size = _make_tree(src, opts["tree_mb"])
            start = time.perf_counter()
            await sandbox.files.upload_dir(src, "/tmp/tree")
            up = time.perf_counter() - start
            start = time.perf_counter()
            await sandbox.files.download_dir("/tmp/tree", back)
            down = time.perf_counter() - start
            local.mkdir()
            start = time.perf_counter()
            subprocess.run(f"tar c -C {src} . | tar x -C {local}", shell=True, check=True)
            peer = time.perf_counter() - start
            same = subprocess.run(["diff", "-r", str(src), str(back)], capture_output=True).returncode == 0
            r["trees"] = {"mb": round(size / 1e6), "upload_s": up, "download_s": down, "local_tar_s": peer,
                          "upload_ratio": up / peer, "download_ratio": down / peer, "identical": same}
            for d in (src, back, local):
                shutil.rmtree(d, ignore_errors=True)
    # -- the peer: podman exec in a podman container of the same root filesystem -----------------
    if rig is not None:
        name = await rig.podman_start_idle()
        try:
            await _podman_exec_s(name, "/bin/true")
            firsts = [await _podman_exec_s(name, "/bin/echo", "x", first_byte=True) for _ in range(opts["podman_samples"])]
            trues = [await _podman_exec_s(name, "/bin/true") for _ in range(opts["podman_samples"])]
            r["podman_exec"] = {"echo_first_byte_p50_ms": _p50(firsts), "true_p50_ms": _p50(trues),
                                "per_s": 1 / statistics.median(trues)}
        finally:
            await rig.podman_remove([name])
        r["ratios"] = {"session_rate_vs_podman_exec": r["session"]["per_s"] / r["podman_exec"]["per_s"],
                       "first_byte_podman_over_dsec": r["podman_exec"]["echo_first_byte_p50_ms"]
                       / r["first_byte"]["stream_shell_p50_ms"]}
    return r


def _table(r: dict) -> Table:
    t = Table(title="dsec bench inside")
    t.add_column("measure")
    t.add_column("DSec", justify="right")
    t.add_column("peer (same run)", justify="right")
    pe = r.get("podman_exec", {})
    t.add_row("first streamed byte of `echo x`, p50", f"{r['first_byte']['stream_shell_p50_ms']:.1f} ms",
              f"podman exec {pe.get('echo_first_byte_p50_ms', float('nan')):.1f} ms")
    t.add_row("one-shot run_shell `echo x`, p50", f"{r['first_byte']['run_shell_p50_ms']:.1f} ms", "")
    t.add_row("session command `true`, p50", f"{r['session']['true_p50_ms']:.1f} ms ({r['session']['per_s']:.0f}/s)",
              f"podman exec {pe.get('true_p50_ms', float('nan')):.1f} ms ({pe.get('per_s', 0):.0f}/s)")
    s = r["slow_reader"]
    t.add_row(f"`yes` read at {s['read_mb'] / s['seconds']:.1f} MB/s for {s['seconds']} s: server RSS growth",
              f"{s['rss_growth_mib']:.1f} MiB", "")
    tr = r["trees"]
    t.add_row(f"upload_dir of {tr['mb']} MB", f"{tr['upload_s']:.2f} s ({tr['upload_ratio']:.1f}×)",
              f"local tar c | tar x {tr['local_tar_s']:.2f} s")
    t.add_row(f"download_dir of {tr['mb']} MB", f"{tr['download_s']:.2f} s ({tr['download_ratio']:.1f}×)",
              "identical" if tr["identical"] else "DIFFERS")
    return t


def main(state_dir: Path, console: Console, **opts) -> int:
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    store = LayerStore(state_dir / "store")
    image = store.get_image("busybox") if store.has_image("busybox") else build_busybox(store)
    os.environ.setdefault("DSEC_VMS", "0")
    work = state_dir / "work"
    work.mkdir(exist_ok=True)
    errors: list[str] = []
    r: dict = {}
    server = LocalServer(state_dir).start()
    try:
        rig_ctx = PeerRig(state_dir / "peers", store.layer_path(image.layers[0]), secrets.token_hex(3)) \
            if opts.pop("podman") and os.path.exists(PODMAN) else None
        if rig_ctx is not None:
            with rig_ctx as rig:
                r = asyncio.run(_run(server, rig, work, opts, console))
        else:
            r = asyncio.run(_run(server, None, work, opts, console))
    except Exception as exc:  # noqa: BLE001 - reported, then cleaned up and checked
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return finish_on_server(console, state_dir, RESULTS_FILE, r, errors, opts, _table, "trees")
