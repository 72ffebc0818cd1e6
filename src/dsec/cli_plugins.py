"""Command groups other distributions add to ``dsec``: ``dsec bench …`` is ``dsec-bench``'s.

A distribution declares a typer app under the entry-point group ``dsec.cli``; the entry point's
name is the group's name on the command line (dsec-bench: ``bench = "dsec_bench.cli:app"``). So a
server's install carries no benchmark, and once ``dsec-bench`` is installed ``dsec bench NAME``
works as before. A group in ``KNOWN`` whose distribution is not installed is still listed, and
says which distribution to install.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Iterable

import typer

from .cli_common import fail

GROUP = "dsec.cli"
# Each group another distribution of this repository adds, and that distribution.
KNOWN = {"bench": "dsec-bench"}


def register(app: typer.Typer, found: Iterable[EntryPoint] | None = None) -> None:
    """Add each installed group (``found``: the entry points of ``GROUP``, looked up when None),
    and a stand-in naming the distribution for each known one that is not installed."""
    found = {ep.name: ep for ep in (entry_points(group=GROUP) if found is None else found)}
    for name, ep in found.items():
        app.add_typer(ep.load(), name=name)
    for name, dist in KNOWN.items():
        if name not in found:
            app.command(name, help=f"(not installed: pip install {dist})", add_help_option=False,
                        context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
                _not_installed(name, dist))


def _not_installed(name: str, dist: str):
    def command(ctx: typer.Context) -> None:
        fail(f"`dsec {name}` comes with the {dist} distribution, which is not installed here: "
             f"pip install {dist} (from a checkout of DSec: pip install -e ./{name})")

    return command
