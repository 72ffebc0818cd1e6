"""``dsec bench desktop``: a sandbox's desktop (``sandbox.desktop``) against E2B Desktop's way of
doing the same on the same X server in the same run (docs/BENCHMARKS.md, "Desktop").

- screenshot of the whole screen (1280x800 by default), PNG bytes in the caller's hands, p50:
  ``sandbox.desktop.screenshot()`` (one request to the desktop agent, which holds one X
  connection) against ``scrot`` run through ``crun exec`` into the same container and the file
  read back (E2B Desktop runs ``scrot`` and reads the file; ``crun exec`` is the floor of
  ``podman exec``, which adds conmon), and against the same ``scrot`` through DSec's own exec
  and file read (E2B Desktop on DSec's E2B API takes this path);
- an input action (``move``, alternating points), p50: ``sandbox.desktop.move`` against
  ``xdotool mousemove`` through ``crun exec`` and through DSec's exec;
- create to first screenshot, p50 over ``--creates`` sandboxes made one after another.

Its own server (containers only, no warm pool) runs on 127.0.0.1 with its state under
``--state-dir``; the ``desktop`` image is built there on first use (a few minutes), or taken
from ``--store`` (a layer store that has it). Everything it makes is removed at the end (and
checked).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from libdsec import DesktopSpec, DSecClient, DSecContainerRunArgs

from dsec.images.builders import build_desktop
from dsec.images.store import LayerStore
from dsec.local import LocalServer

from .results import finish_on_server

RESULTS_FILE = "bench-desktop.json"
CRUN = shutil.which("crun") or "/usr/bin/crun"


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _crun_root(state_dir: Path) -> Path:
    for top, dirs, _ in os.walk(state_dir):
        if Path(top).name == "run" and "crun" in dirs:
            return Path(top) / "crun"
        if len(Path(top).relative_to(state_dir).parts) >= 3:
            dirs[:] = []
        dirs[:] = [d for d in dirs if d != "store"]
    raise RuntimeError(f"no crun state root under {state_dir}")


def _crun_exec_ms(root: Path, cid: str, *argv: str) -> tuple[float, bytes]:
    start = time.perf_counter()
    proc = subprocess.run([CRUN, "--root", str(root), "exec", "--user", "1000:1000", "--env", "DISPLAY=:0",
                           "--env", "HOME=/home/user", "--env", "PATH=/usr/local/bin:/usr/bin:/bin", cid, *argv], capture_output=True, timeout=60)
    took = (time.perf_counter() - start) * 1000
    if proc.returncode != 0:
        raise RuntimeError(f"crun exec {' '.join(argv)} failed: {proc.stderr.decode(errors='replace')[-300:]}")
    return took, proc.stdout


def _with_desktop(root: Path) -> str:
    """The container (of those under crun's state root ``root``) that runs an X server."""
    for entry in root.iterdir():
        if entry.is_dir() and subprocess.run([CRUN, "--root", str(root), "exec", entry.name, "pgrep", "-x", "Xvfb"],
                                             capture_output=True, timeout=30).returncode == 0:
            return entry.name
    raise RuntimeError(f"no container under {root} runs Xvfb")


async def _run(server: LocalServer, state_dir: Path, o: dict, console: Console) -> dict:
    r: dict = {"width": o["width"], "height": o["height"]}
    args = DSecContainerRunArgs(container_image="desktop", memory_limit_mb=1024,
                                desktop=DesktopSpec(width=o["width"], height=o["height"], dpi=96))
    async with DSecClient(server.endpoint, token=server.token, timeout=120) as client:
        firsts = []
        for _ in range(o["creates"]):
            start = time.perf_counter()
            sandbox = await client.run_container(args)
            await sandbox.desktop.screenshot()
            firsts.append(time.perf_counter() - start)
            await sandbox.stop()
        r["create_to_first_screenshot_p50_s"] = _p50(firsts)
        console.print(f"create to first screenshot: p50 {r['create_to_first_screenshot_p50_s']:.2f} s")

        async with await client.run_container(args) as sandbox:
            desktop = sandbox.desktop
            await asyncio.sleep(2)  # the session settled (its backdrop and panel drawn)
            shots, sizes = [], []
            for _ in range(o["samples"]):
                start = time.perf_counter()
                png = await desktop.screenshot()
                shots.append((time.perf_counter() - start) * 1000)
                sizes.append(len(png))
            moves = []
            for i in range(o["samples"] * 4):
                start = time.perf_counter()
                await desktop.move(100 + i % 2 * 300, 100 + i % 2 * 200)
                moves.append((time.perf_counter() - start) * 1000)
            presses = []
            for _ in range(o["samples"]):
                start = time.perf_counter()
                await desktop.press("shift")
                presses.append((time.perf_counter() - start) * 1000)
            r["dsec"] = {"screenshot_p50_ms": _p50(shots), "png_bytes": int(_p50(sizes)),
                         "move_p50_ms": _p50(moves), "press_p50_ms": _p50(presses)}

            # E2B Desktop's way through DSec's own exec and file read.
            e2b_shots, e2b_moves = [], []
            for _ in range(o["peer_samples"]):
                start = time.perf_counter()
                done = await sandbox.run_shell("scrot -o -p /tmp/.bench-shot.png")
                await sandbox.read_file("/tmp/.bench-shot.png")
                e2b_shots.append((time.perf_counter() - start) * 1000)
                assert done.exit_code == 0, done
            for i in range(o["peer_samples"]):
                start = time.perf_counter()
                await sandbox.run_shell(f"xdotool mousemove --sync {100 + i % 2 * 300} {100 + i % 2 * 200}")
                e2b_moves.append((time.perf_counter() - start) * 1000)
            r["dsec_exec"] = {"scrot_p50_ms": _p50(e2b_shots), "xdotool_move_p50_ms": _p50(e2b_moves)}

            # The peer: the same commands through crun exec into the same container.
            root = _crun_root(state_dir)
            cid = _with_desktop(root)
            crun_shots, crun_moves = [], []
            for _ in range(o["peer_samples"]):
                took, png = _crun_exec_ms(root, cid, "/bin/sh", "-c", "scrot -o -p /tmp/.bench-shot.png && "
                                          "cat /tmp/.bench-shot.png")
                assert png[:4] == b"\x89PNG"
                crun_shots.append(took)
            for i in range(o["peer_samples"]):
                crun_moves.append(_crun_exec_ms(root, cid, "xdotool", "mousemove", "--sync", str(100 + i % 2 * 300),
                                                str(100 + i % 2 * 200))[0])
            r["crun_exec"] = {"scrot_p50_ms": _p50(crun_shots), "xdotool_move_p50_ms": _p50(crun_moves)}
    d, c = r["dsec"], r["crun_exec"]
    r["ratios"] = {"screenshot_crun_exec_over_dsec": c["scrot_p50_ms"] / d["screenshot_p50_ms"],
                   "move_crun_exec_over_dsec": c["xdotool_move_p50_ms"] / d["move_p50_ms"]}
    return r


def _table(r: dict) -> Table:
    d, x, c = r["dsec"], r["dsec_exec"], r["crun_exec"]
    t = Table(title=f"desktop {r['width']}x{r['height']}: p50, ms")
    for col in ("", "sandbox.desktop", "scrot/xdotool by DSec exec", "by crun exec (peer)", "peer / DSec"):
        t.add_column(col)
    t.add_row("screenshot (PNG in hand)", f"{d['screenshot_p50_ms']:.1f}", f"{x['scrot_p50_ms']:.1f}",
              f"{c['scrot_p50_ms']:.1f}", f"{r['ratios']['screenshot_crun_exec_over_dsec']:.1f}x")
    t.add_row("pointer move", f"{d['move_p50_ms']:.2f}", f"{x['xdotool_move_p50_ms']:.1f}",
              f"{c['xdotool_move_p50_ms']:.1f}", f"{r['ratios']['move_crun_exec_over_dsec']:.1f}x")
    t.add_row("key press (shift)", f"{d['press_p50_ms']:.2f}", "", "", "")
    t.add_row("create to first screenshot", f"{r['create_to_first_screenshot_p50_s'] * 1000:.0f}", "", "", "")
    return t


def main(state_dir: Path, console: Console, store: Path | None = None, **opts) -> int:
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    if store is not None and not (state_dir / "store").exists():
        (state_dir / "store").symlink_to(Path(store).resolve())
    layers = LayerStore(state_dir / "store")
    if not layers.has_image("desktop"):
        console.print("building the desktop image (a few minutes, once)")
        build_desktop(layers, log=console.print)
    os.environ.setdefault("DSEC_VMS", "0")
    errors: list[str] = []
    r: dict = {}
    server = LocalServer(state_dir, extra_args=("--pool-max", "0")).start()
    try:
        r = asyncio.run(_run(server, state_dir, opts, console))
    except Exception as exc:  # noqa: BLE001 - reported, then cleaned up and checked
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        server.stop()
    return finish_on_server(console, state_dir, RESULTS_FILE, r, errors, opts, _table, "ratios")
