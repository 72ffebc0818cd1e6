"""``dsec top``: the dashboard's figures in the terminal (a rich Live view polling
``/v1/stats``); ``--once`` prints one frame and exits (for scripts and tests). Added to the main
command line by ``register(app)``.

Rates are over the last interval; with ``--once`` (one reading) they are averages since each
node's edge started. Latency percentiles are since the edges started, and over the last
minute once the view has run that long.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Annotated

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from libdsec import DSecClient
from libdsec.protocol import ClusterStats, LatencyHistogram

from .cli_common import console, run_sdk

WINDOW_S = 60.0


@dataclass(frozen=True)
class Summary:
    """What one reading of ``ClusterStats`` adds up to, over every node."""

    at: float
    sandboxes: dict[str, int]  # by state
    creates: int
    commands: int
    create_seconds: dict[str, LatencyHistogram]  # by kind
    command_seconds: dict[str, LatencyHistogram]
    uptime_s: float  # of the longest-running edge

    @classmethod
    def of(cls, stats: ClusterStats) -> Summary:
        states: dict[str, int] = {}
        creates, commands = 0, 0
        create_h: dict[str, LatencyHistogram] = {}
        command_h: dict[str, LatencyHistogram] = {}
        for n in stats.nodes:
            for c in n.sandboxes:
                states[c.status.value] = states.get(c.status.value, 0) + c.count
            creates += sum(n.creates.values())
            for kind, h in n.create_seconds.items():
                create_h[kind] = create_h[kind].plus(h) if kind in create_h else h
            for kind, h in n.command_seconds.items():
                command_h[kind] = command_h[kind].plus(h) if kind in command_h else h
                commands += h.count
        at = stats.at.timestamp()
        uptime = max((at - n.started_at.timestamp() for n in stats.nodes), default=0.0)
        return cls(at, states, creates, commands, create_h, command_h, uptime)


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.1f}"


def _rate(now: Summary, before: Summary | None, attr: str) -> str:
    if before is not None and now.at > before.at:
        return f"{max(0, getattr(now, attr) - getattr(before, attr)) / (now.at - before.at):.1f}"
    if now.uptime_s > 0:
        return f"{getattr(now, attr) / now.uptime_s:.1f} (avg)"
    return "–"


def frame(stats: ClusterStats, history: deque[Summary] | None = None) -> Group:
    """One screen of ``dsec top`` for ``stats``; ``history``: the earlier readings (oldest first)."""
    now = Summary.of(stats)
    before = history[-1] if history else None
    window = next((h for h in history or () if now.at - h.at <= WINDOW_S), None)

    total = sum(now.sandboxes.values())
    head = Text.assemble(
        ("DSec  ", "bold"), f"nodes {len(stats.nodes)} up",
        (f", {len(stats.lost_nodes)} lost ({', '.join(stats.lost_nodes)})", "red") if stats.lost_nodes else "",
        f"   sandboxes {total}: ",
        ", ".join(f"{state} {n}" for state, n in sorted(now.sandboxes.items())) or "none",
        f"   made {now.creates}, commands {now.commands}",
        f"   creates/s {_rate(now, before, 'creates')}, commands/s {_rate(now, before, 'commands')}",
    )

    nodes = Table("NODE", "SANDBOXES", "PAUSED", "CPU COMMITTED", "CPU USED", "CORES", "MEM COMMITTED", "MEM USED",
                  "MEMORY", "POOL HITS", "MISSES", "REFUSALS", "PAUSES", "FNCALLS", "SECURITY", title="nodes")
    for n in stats.nodes:
        i = n.info
        nodes.add_row(i.node, str(i.sandboxes), str(i.paused), f"{i.committed_cpu:g}", f"{n.cpu_used_cores:.2f}",
                      str(i.cpu_cores), f"{i.committed_memory_mb} MB", f"{n.memory_used_mb} MB",
                      f"{i.memory_total_mb} MB", str(n.pool_hits), str(n.pool_misses),
                      str(sum(n.admission_refusals.values())), str(n.pauses), str(n.fncalls),
                      str(sum(n.security_events.values())))
    for node in stats.lost_nodes:
        nodes.add_row(Text(node, "red"), Text("lost", "red"))

    latency = Table("LATENCY (ms)", "COUNT", "P50", "P90", "P99", f"P50 {WINDOW_S:.0f} s", f"P99 {WINDOW_S:.0f} s",
                    title="latency")
    for label, hists, earlier in (("create", now.create_seconds, window.create_seconds if window else {}),
                                  ("command", now.command_seconds, window.command_seconds if window else {})):
        for kind, h in sorted(hists.items()):
            recent = h.minus(earlier[kind]) if kind in earlier else LatencyHistogram()
            latency.add_row(f"{label} ({kind})", str(h.count), _ms(h.quantile(0.5)), _ms(h.quantile(0.9)),
                            _ms(h.quantile(0.99)), _ms(recent.quantile(0.5)), _ms(recent.quantile(0.99)))

    groups = Table("STATE", "KIND", "PROJECT", "SANDBOXES", title="sandboxes")
    merged: dict[tuple[str, str, str], int] = {}
    for n in stats.nodes:
        for c in n.sandboxes:
            key = (c.status.value, c.kind.value, c.project)
            merged[key] = merged.get(key, 0) + c.count
    for (state, kind, project), count in sorted(merged.items()):
        groups.add_row(state, kind, project, str(count))

    events = Table("AT", "NODE", "SANDBOX", "KIND", "COUNT", "DETAIL", title="recent security events")
    recent = sorted(((e.event.at, n.info.node, e) for n in stats.nodes for e in n.recent_security_events),
                    key=lambda item: item[0], reverse=True)[:10]
    for at, node, e in recent:
        events.add_row(at.strftime("%H:%M:%S"), node, e.sandbox_id, e.event.kind, str(e.event.count), e.event.detail)
    return Group(head, nodes, latency, groups, events)


def register(app: typer.Typer) -> None:
    @app.command()
    def top(
        once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
        interval: Annotated[float, typer.Option(help="Seconds between readings.")] = 1.0,
    ) -> None:
        """Live view of the cluster: nodes, sandboxes by state, rates, latency, security events."""

        async def go() -> None:
            async with DSecClient() as client:
                if once:
                    console.print(frame(await client.stats()))
                    return
                if not console.is_terminal:  # piped: a frame after another (Live draws nothing there)
                    while True:
                        console.print(frame(await client.stats()))
                        await asyncio.sleep(max(0.1, interval))
                history: deque[Summary] = deque()
                with Live(console=console, auto_refresh=False, screen=False) as live:
                    while True:
                        stats = await client.stats()
                        live.update(frame(stats, history), refresh=True)
                        history.append(Summary.of(stats))
                        while history and history[-1].at - history[0].at > WINDOW_S + 2 * interval:
                            history.popleft()
                        await asyncio.sleep(max(0.1, interval))

        try:
            run_sdk(go())
        except KeyboardInterrupt:
            pass


__all__ = ["Summary", "frame", "register"]
