"""What operators see, against a live ``dsec serve`` with sandboxes running: the dashboard as
headless Chromium (Debian's ``chromium``) renders it, ``dsec top --once`` and ``/metrics``, each
checked against the figures the API gives."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from libdsec import DSecContainerRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root]

ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class _Figures(HTMLParser):
    """The text of every element with an ``id`` or a ``data-latency``/``data-node`` attribute,
    the rows of the latency table, and the body's attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.rows: dict[str, list[str]] = {}  # latency key -> its row's cells
        self.nodes: list[str] = []
        self.body: dict[str, str] = {}
        self._open: list[tuple[str, str]] = []  # (what, key) of elements whose text is wanted
        self._row: list[str] | None = None
        self._row_key: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = {k: v or "" for k, v in a.items()}
        if tag == "tr":
            self._row, self._row_key = [], None
        if tag == "td" and self._row is not None:
            self._cell = []
            if "data-latency" in a:
                self._row_key = a["data-latency"]
            if "data-node" in a:
                self.nodes.append(a["data-node"])
        if "id" in a:
            self._open.append((tag, a["id"]))
            self.by_id[a["id"]] = ""

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        if tag == "tr" and self._row is not None:
            if self._row_key:
                self.rows[self._row_key] = self._row
            self._row = None
        if self._open and self._open[-1][0] == tag:
            self._open.pop()

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        for _, key in self._open:
            self.by_id[key] += data


@pytest.fixture
async def running(client):
    """Three sandboxes: two ran a command, one of those is paused."""
    sandboxes = [await client.run_container(ARGS, timeout=60) for _ in range(3)]
    try:
        for s in sandboxes[:2]:
            assert (await s.run_shell("echo hi", timeout=30)).stdout == "hi\n"
        await sandboxes[1].pause()
        yield sandboxes
    finally:
        for s in sandboxes:
            await s.stop()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (scripts/setup-host.sh installs Debian's)")
async def test_dashboard_in_chromium(server, client, running, tmp_path):
    stats = await client.stats()
    profile = tmp_path / "chromium-profile"
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         "--disable-background-networking", "--disable-sync", "--disable-component-update",
         f"--user-data-dir={profile}", "--virtual-time-budget=4000", "--dump-dom",
         f"{server.endpoint}/dashboard?token={server.token}&interval=1000"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = _Figures()
    page.feed(proc.stdout)
    assert int(page.body.get("data-frames", "0")) >= 1, proc.stdout[-3000:]
    assert page.by_id["status"] == "1 node", page.by_id["status"]

    node = stats.nodes[0]
    states: dict[str, int] = {}
    for c in node.sandboxes:
        states[c.status.value] = states.get(c.status.value, 0) + c.count
    assert states == {"running": 2, "paused": 1}
    figures = page.by_id
    assert figures["nodes-up"] == "1" and figures["nodes-lost"] == "0"
    assert figures["sandboxes-total"] == "3"
    assert figures["sandboxes-running"] == "2" and figures["sandboxes-paused"] == "1"
    assert figures["creates-total"] == str(sum(node.creates.values()))
    commands = node.command_seconds["container"]
    assert figures["commands-total"] == str(commands.count) and commands.count >= 2
    assert figures["security-total"] == str(sum(node.security_events.values()))
    assert page.nodes == [node.info.node]

    for key, label, hist in (("create-container", "create (container)", node.create_seconds["container"]),
                             ("command-container", "command (container)", commands)):
        row = page.rows[key]
        assert row[:2] == [label, str(hist.count)]
        # Milliseconds to one decimal (JavaScript and Python may round a tie apart).
        shown = [float(v) for v in row[2:5]]
        assert shown == pytest.approx([hist.quantile(q) * 1000 for q in (0.5, 0.9, 0.99)], abs=0.051)
    # The charts were drawn (a polyline once two readings were in).
    assert "<polyline" in proc.stdout

    # Without the token the page is refused.
    assert httpx.get(f"{server.endpoint}/dashboard").status_code == 401


async def test_top_once_and_metrics(server, client, running):
    env = {**os.environ, "DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token, "COLUMNS": "220"}
    out = subprocess.run([sys.executable, "-m", "dsec", "top", "--once"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    stats = await client.stats()
    node = stats.nodes[0]
    assert "nodes 1 up" in out.stdout and "sandboxes 3: paused 1, running 2" in out.stdout, out.stdout
    assert f"made {sum(node.creates.values())}, commands {node.command_seconds['container'].count}" in out.stdout

    answer = httpx.get(f"{server.endpoint}/metrics", headers={"authorization": f"Bearer {server.token}"})
    assert answer.status_code == 200
    held = {}
    for family in text_string_to_metric_families(answer.text):
        if family.name == "dsec_sandboxes":
            for s in family.samples:
                held[s.labels["state"]] = held.get(s.labels["state"], 0) + s.value
    assert held == {"running": 2, "paused": 1}
    assert httpx.get(f"{server.endpoint}/metrics").status_code == 401
