"""``dsec snapshot …``: named snapshots from the command line (take one of a running sandbox,
list, inspect and remove them), through the SDK (``sandbox.snapshot``, ``client.list_snapshots``,
``get_snapshot``, ``remove_snapshot``)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.table import Table

from libdsec import DSecClient, Snapshot

from .cli_common import console, fail, run_sdk

snapshot_app = typer.Typer(help="Named snapshots: a sandbox's files (filesystem) or its memory too (full, microVMs), "
                                "kept until removed; run args' snapshot= start sandboxes from one.",
                           no_args_is_help=True)

Ref = Annotated[str, typer.Argument(help="The snapshot's id or name.")]
AsJson = Annotated[bool, typer.Option("--json", help="As JSON.")]


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _print_one(snap: Snapshot, as_json: bool) -> None:
    if as_json:
        print(snap.model_dump_json(indent=2))
        return
    table = Table("FIELD", "VALUE", show_header=False)
    for field, value in snap.model_dump(mode="json").items():
        table.add_row(field, "" if value is None else str(value))
    console.print(table)


@snapshot_app.command("create")
def snapshot_create(
    sandbox: Annotated[str, typer.Argument(help="The running sandbox to keep (it runs on).")],
    name: Annotated[Optional[str], typer.Option("--name", help="A name of its own (unique among snapshots).")] = None,
    mode: Annotated[Optional[str], typer.Option("--mode", help="full (memory, devices and files: microVMs) or "
                                                 "filesystem (its files: every kind); the kind's fullest by default.")] = None,
    as_json: AsJson = False,
) -> None:
    """Take a snapshot of a running sandbox."""
    if mode not in (None, "full", "filesystem"):
        fail(f"--mode {mode!r}: a snapshot is full or filesystem")

    async def go():
        async with DSecClient() as client:
            return await (await client.get_sandbox(sandbox)).snapshot(mode, name=name)  # type: ignore[arg-type]

    snap = run_sdk(go())
    if as_json:
        _print_one(snap, True)
        return
    console.print(f"snapshot {snap.id}{f' ({snap.name})' if snap.name else ''}: {snap.mode} of {snap.kind} "
                  f"{snap.sandbox_id}, {_size(snap.size_bytes)} in {snap.save_s:.2f} s")


@snapshot_app.command("ls")
def snapshot_ls(as_json: AsJson = False) -> None:
    """The snapshots of the token's project (every one, for the root token), oldest first."""

    async def go():
        async with DSecClient() as client:
            return await client.list_snapshots()

    snaps = run_sdk(go())
    if as_json:
        print(json.dumps([s.model_dump(mode="json") for s in snaps], indent=2))
        return
    table = Table("ID", "NAME", "MODE", "KIND", "FROM SANDBOX", "NODE", "PROJECT", "SIZE", "CREATED")
    for s in snaps:
        table.add_row(s.id, s.name or "", s.mode, s.kind, s.sandbox_id, s.node, s.project, _size(s.size_bytes),
                      f"{s.created_at:%Y-%m-%d %H:%M:%S}")
    console.print(table)


@snapshot_app.command("inspect")
def snapshot_inspect(ref: Ref, as_json: AsJson = False) -> None:
    """One snapshot, by id or name."""

    async def go():
        async with DSecClient() as client:
            return await client.get_snapshot(ref)

    _print_one(run_sdk(go()), as_json)


@snapshot_app.command("rm")
def snapshot_rm(ref: Ref, as_json: AsJson = False) -> None:
    """Remove a snapshot (its record, memory and image); refused while sandboxes started from it run."""

    async def go():
        async with DSecClient() as client:
            return await client.remove_snapshot(ref)

    snap = run_sdk(go())
    if as_json:
        _print_one(snap, True)
        return
    console.print(f"removed snapshot {snap.id}{f' ({snap.name})' if snap.name else ''}")
