"""What every ``dsec`` command module shares: the consoles, the state-dir option, and how an
error ends a command (one red line naming it, exit status 1)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console

from libdsec import DSecError

console = Console()
err_console = Console(stderr=True)

StateDir = Annotated[Path, typer.Option("--state-dir", envvar="DSEC_STATE_DIR", help="State directory.")]
DEFAULT_STATE = Path("/var/lib/dsec")


def fail(exc: Exception | str) -> NoReturn:
    err_console.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(1)


def run_sdk(coro):
    """Run a coroutine of the SDK; a DSecError ends the command with its message."""
    try:
        return asyncio.run(coro)
    except DSecError as exc:
        fail(exc)
