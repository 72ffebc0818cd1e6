// The DSec dashboard: polls /dashboard/stats (a ClusterStats, see libdsec.protocol) and draws it.
// Plain script, no dependencies: tables, tiles and two SVG line charts.
"use strict";

const INTERVAL_MS = Number(new URLSearchParams(location.search).get("interval")) || 1000;
const WINDOW_S = 60;          // the latency window ("last 60 s")
const CHART_S = 300;          // the most the charts show (less while the page is younger)
const RATE_S = 5;             // rates are over the readings of the last few seconds
const history = [];           // {t, creates, commands, states: {state: n}, create: hist, command: hist}

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

function row(tbody, cells) {
  const tr = el("tr");
  for (const c of cells) tr.appendChild(typeof c === "object" ? c : el("td", String(c)));
  tbody.appendChild(tr);
}

function fill(tableId, rows) {
  const tbody = $(tableId).querySelector("tbody");
  tbody.replaceChildren();
  for (const cells of rows) row(tbody, cells);
}

// -- histograms (LatencyHistogram: counts per bucket of latency_bounds, the last one open) -------

function emptyHist(n) { return { counts: new Array(n).fill(0), sum_s: 0 }; }

function addHist(a, b) {
  return { counts: a.counts.map((x, i) => x + (b.counts[i] || 0)), sum_s: a.sum_s + b.sum_s };
}

function subHist(a, b) {
  return { counts: a.counts.map((x, i) => Math.max(0, x - (b.counts[i] || 0))), sum_s: Math.max(0, a.sum_s - b.sum_s) };
}

function total(h) { return h.counts.reduce((s, x) => s + x, 0); }

// As LatencyHistogram.quantile (and Prometheus' histogram_quantile): interpolated in its bucket.
function quantile(h, q, bounds) {
  const n = total(h);
  if (n === 0) return null;
  const rank = q * n;
  let seen = 0;
  for (let i = 0; i < h.counts.length; i++) {
    const c = h.counts[i];
    if (c && seen + c >= rank) {
      if (i === bounds.length) return bounds[bounds.length - 1];
      const low = i ? bounds[i - 1] : 0;
      return low + (bounds[i] - low) * Math.max(0, rank - seen) / c;
    }
    seen += c;
  }
  return bounds[bounds.length - 1];
}

function ms(seconds) { return seconds === null ? "–" : (seconds * 1000).toFixed(1); }

function mergedByKind(nodes, attr, n) {
  const out = {};
  for (const node of nodes) {
    for (const [kind, h] of Object.entries(node[attr])) out[kind] = addHist(out[kind] || emptyHist(n), h);
  }
  return out;
}

function sumValues(obj) { return Object.values(obj).reduce((s, x) => s + x, 0); }

// -- charts --------------------------------------------------------------------------------------

function chart(svgId, series) {
  const svg = $(svgId);
  const W = 600, H = 140, PAD = 14;
  const now = history.length ? history[history.length - 1].t : 0;
  const span = Math.min(CHART_S, Math.max(30, history.length ? now - history[0].t : 0));
  let top = 1;
  for (const s of series) for (const [, v] of s.points) top = Math.max(top, v);
  const x = (t) => W - (now - t) / span * W;
  const y = (v) => H - PAD - v / top * (H - 2 * PAD);
  const parts = [`<line x1="0" y1="${H - PAD}" x2="${W}" y2="${H - PAD}" stroke="#d9dde5"/>`,
                 `<text x="4" y="12" font-size="11" fill="#6b7385">${top.toFixed(top < 10 ? 1 : 0)}</text>`,
                 `<text x="${W - 4}" y="12" font-size="11" fill="#6b7385" text-anchor="end">last ${Math.round(span)} s</text>`];
  for (const s of series) {
    if (s.points.length < 2) continue;
    const pts = s.points.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
    parts.push(`<polyline fill="none" stroke="${s.color}" stroke-width="2" points="${pts}"/>`);
  }
  svg.innerHTML = parts.join("");
}

function ratePoints(key) {
  const out = [];
  for (let i = 1; i < history.length; i++) {
    const a = history[i - 1], b = history[i];
    const dt = b.t - a.t;
    if (dt > 0) out.push([b.t, Math.max(0, b[key] - a[key]) / dt]);
  }
  return out;
}

// -- one frame -----------------------------------------------------------------------------------

function render(stats) {
  const bounds = stats.latency_bounds;
  const nb = bounds.length + 1;
  const nodes = stats.nodes;
  const t = Date.parse(stats.at) / 1000;

  const states = {};
  const groups = [];
  let sandboxes = 0;
  for (const n of nodes) {
    for (const c of n.sandboxes) {
      states[c.status] = (states[c.status] || 0) + c.count;
      sandboxes += c.count;
      groups.push([c.status, c.kind, c.project, c.count, n.info.node]);
    }
  }
  const createHists = mergedByKind(nodes, "create_seconds", nb);
  const commandHists = mergedByKind(nodes, "command_seconds", nb);
  const allCreates = Object.values(createHists).reduce(addHist, emptyHist(nb));
  const allCommands = Object.values(commandHists).reduce(addHist, emptyHist(nb));
  const creates = nodes.reduce((s, n) => s + sumValues(n.creates), 0);
  const commands = total(allCommands);

  history.push({ t, creates, commands, states, create: allCreates, command: allCommands, createHists, commandHists });
  while (history.length > 2 && t - history[0].t > CHART_S) history.shift();
  const last = history.find((h) => t - h.t <= RATE_S && h.t < t) || history[history.length - 2];
  const windowStart = history.find((h) => t - h.t <= WINDOW_S) || history[0];

  $("nodes-up").textContent = nodes.length;
  $("nodes-lost").textContent = stats.lost_nodes.length;
  $("nodes-lost").className = "v" + (stats.lost_nodes.length ? " bad" : "");
  $("sandboxes-total").textContent = sandboxes;
  $("sandboxes-running").textContent = states.running || 0;
  $("sandboxes-paused").textContent = states.paused || 0;
  $("creates-total").textContent = creates;
  $("commands-total").textContent = commands;
  const dt = last ? t - last.t : 0;
  $("create-rate").textContent = dt > 0 ? (Math.max(0, creates - last.creates) / dt).toFixed(1) : "–";
  $("command-rate").textContent = dt > 0 ? (Math.max(0, commands - last.commands) / dt).toFixed(1) : "–";
  $("security-total").textContent = nodes.reduce((s, n) => s + sumValues(n.security_events), 0);

  const latencyRows = [];
  const addLatency = (label, key, now, before) => {
    const recent = before ? subHist(now, before) : emptyHist(nb);
    const tr = [label, total(now), ms(quantile(now, 0.5, bounds)), ms(quantile(now, 0.9, bounds)),
                ms(quantile(now, 0.99, bounds)), ms(quantile(recent, 0.5, bounds)), ms(quantile(recent, 0.99, bounds))];
    const cells = tr.map((v) => el("td", String(v)));
    cells[0].dataset.latency = key;
    latencyRows.push(cells);
  };
  for (const [kind, h] of Object.entries(createHists).sort()) {
    addLatency(`create (${kind})`, `create-${kind}`, h, windowStart.createHists[kind]);
  }
  for (const [kind, h] of Object.entries(commandHists).sort()) {
    addLatency(`command (${kind})`, `command-${kind}`, h, windowStart.commandHists[kind]);
  }
  fill("latency", latencyRows);

  groups.sort((a, b) => (a[0] + a[1] + a[2]).localeCompare(b[0] + b[1] + b[2]));
  const merged = {};
  for (const [s, k, p, c] of groups) merged[[s, k, p].join("\u0000")] = (merged[[s, k, p].join("\u0000")] || 0) + c;
  fill("sandboxes", Object.entries(merged).map(([key, c]) => [...key.split("\u0000"), c]));

  fill("nodes", nodes.map((n) => {
    const i = n.info;
    const name = el("td", i.node);
    name.dataset.node = i.node;
    return [name, i.sandboxes, i.paused, `${i.committed_cpu.toFixed(2)}`, `${n.cpu_used_cores.toFixed(2)}`, i.cpu_cores,
            `${i.committed_memory_mb} MB`, `${n.memory_used_mb} MB`, `${i.memory_total_mb} MB`, n.pool_hits,
            n.pool_misses, sumValues(n.admission_refusals), n.pauses, n.fncalls];
  }).concat(stats.lost_nodes.map((name) => [el("td", name, "bad"), el("td", "lost", "bad"),
                                               "", "", "", "", "", "", "", "", "", "", "", ""])));

  const events = [];
  for (const n of nodes) for (const e of n.recent_security_events) events.push([n.info.node, e]);
  events.sort((a, b) => Date.parse(b[1].event.at) - Date.parse(a[1].event.at));
  fill("events", events.slice(0, 30).map(([node, e]) => [
    new Date(e.event.at).toLocaleTimeString(), node, e.sandbox_id, e.event.kind, e.event.count,
    el("td", e.event.detail, "text")]));

  chart("chart-rates", [{ color: "#2e7d32", points: ratePoints("creates") },
                        { color: "#6a1b9a", points: ratePoints("commands") }]);
  const statePoints = (pick) => history.map((h) => [h.t, pick(h.states)]);
  chart("chart-states", [
    { color: "#2e7d32", points: statePoints((s) => s.running || 0) },
    { color: "#1565c0", points: statePoints((s) => s.paused || 0) },
    { color: "#6b7385", points: statePoints((s) => sumValues(s) - (s.running || 0) - (s.paused || 0)) },
  ]);

  $("updated").textContent = new Date(stats.at).toLocaleTimeString();
  $("status").textContent = `${nodes.length} node${nodes.length === 1 ? "" : "s"}`;
  $("status").className = "muted";
  document.body.dataset.frames = String(Number(document.body.dataset.frames || 0) + 1);
}

async function poll() {
  try {
    const answer = await fetch("/dashboard/stats", { credentials: "same-origin", cache: "no-store" });
    if (!answer.ok) {
      const body = await answer.json().catch(() => ({}));
      throw new Error(body.error ? body.error.message : `HTTP ${answer.status}`);
    }
    render(await answer.json());
  } catch (err) {
    $("status").textContent = `error: ${err.message}`;
    $("status").className = "bad";
  }
  setTimeout(poll, INTERVAL_MS);
}

poll();
