"""Where a benchmark's results go (its errors printed, its figures as JSON beside its state dir
or in it), and what several benchmarks start from: the commit measured, a busybox store."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Callable, Coroutine
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dsec.images.builders import build_busybox
from dsec.images.store import Image, LayerStore
from dsec.local import leftovers


def source_commit() -> str:
    """The checkout's commit, ``+changes`` when its tracked files differ from it."""
    here = Path(__file__).resolve().parent
    proc = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (proc.stdout.strip() or "unknown") + ("+changes" if dirty else "")


def busybox_store_beside(state_dir: Path) -> tuple[LayerStore, Image]:
    """The layer store at ``<state_dir>-store`` (it outlives the server's state dir, whose
    ``store`` links to it: the peers run from its layer) and its busybox image, built once."""
    store_dir = state_dir.parent / f"{state_dir.name}-store"
    store = LayerStore(store_dir)
    if not (state_dir / "store").is_symlink():
        (state_dir / "store").symlink_to(store_dir)
    return store, store.get_image("busybox") if store.has_image("busybox") else build_busybox(store)


def finish_on_server(console: Console, state_dir: Path, results_file: str, r: dict, errors: list[str], opts: dict,
                     table: Callable[[dict], Table], measured: str) -> int:
    """The end of a benchmark run on one server of ``state_dir`` (stopped by now): what it left,
    its figures as JSON in the state dir, its table once ``measured`` (a key of ``r``) is there,
    its errors. 0 when it ran cleanly and left nothing, else 1."""
    left = leftovers(state_dir)
    r.update({"errors": errors, "leftovers": left, "options": opts})
    (state_dir / results_file).write_text(json.dumps(r, indent=1, default=str) + "\n")
    if measured in r:
        console.print(table(r))
    for e in errors:
        console.print(f"[red]error:[/red] {e}")
    if left:
        console.print(f"[red]left behind:[/red] {left}")
    return 1 if errors or left else 0


def run_noting(main: Coroutine, r: dict, errors: list[str]) -> None:
    """Run a benchmark's coroutine to its end: an exception is one of the run's ``errors`` (what
    was measured before it is still reported), and the load average at the end goes in ``r``."""
    try:
        asyncio.run(main)
    except Exception as exc:  # noqa: BLE001 - reported
        errors.append(f"{type(exc).__name__}: {exc}")
    r["load_end"] = os.getloadavg()[0]


def save_results(console: Console, state_dir: Path, results: dict, errors: list[str]) -> Path:
    """Print ``errors``, write ``results`` to ``<state dir>.json`` and say where; returns that path."""
    for e in errors:
        console.print(f"[red]error:[/red] {e}")
    out = state_dir.parent / f"{state_dir.name}.json"
    out.write_text(json.dumps(results, indent=1))
    console.print(f"results in {out}")
    return out


def median_of_rounds(rates: list[float]) -> float:
    """The figure a benchmark with rounds is judged on: the median round (with an even count, the
    mean of the middle two), never the best: the best flatters whichever side wanders most."""
    if not rates:
        raise ValueError("no rounds")
    ordered = sorted(rates)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
