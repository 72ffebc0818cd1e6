"""Where a benchmark's results go: its errors printed, its figures as JSON beside its state dir."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console


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
