"""``dsec bench …`` is the dsec-bench distribution's, added by its entry point (``dsec.cli_plugins``):
listed and run once installed, and named for installing when not."""

from __future__ import annotations

import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import typer
from typer.testing import CliRunner

from dsec import cli_plugins

REPO = Path(__file__).resolve().parents[2]


def _app(found: list[EntryPoint]) -> typer.Typer:
    app = typer.Typer(no_args_is_help=True)

    @app.command()
    def serve() -> None:  # a second command, so that typer keeps the groups by name
        pass

    cli_plugins.register(app, found)
    return app


def test_bench_is_the_entry_point_dsec_bench_declares():
    declared = tomllib.loads((REPO / "bench" / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared == {cli_plugins.GROUP: {"bench": "dsec_bench.cli:app"}}
    assert cli_plugins.KNOWN == {"bench": "dsec-bench"}


def test_installed_bench_lists_every_benchmark():
    found = [EntryPoint(name="bench", value="dsec_bench.cli:app", group=cli_plugins.GROUP)]
    result = CliRunner().invoke(_app(found), ["bench", "--help"])
    assert result.exit_code == 0, result.output
    for name in ("lifecycle", "density", "fncall", "tti", "harness", "cluster"):
        assert name in result.output


def test_bench_without_dsec_bench_names_the_distribution_to_install():
    app = _app([])
    for args in (["bench"], ["bench", "lifecycle", "--rounds", "1"], ["bench", "--help"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
        assert "pip install dsec-bench" in " ".join(result.output.split())
    listing = CliRunner().invoke(app, ["--help"]).output
    assert "bench" in listing and "dsec-bench" in listing
