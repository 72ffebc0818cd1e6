"""``dsec bench all``: every benchmark in one go, and docs/BENCHMARKS.md's glance table rewritten
from what the run measured.

With ``--quick`` each benchmark runs at its developer size (``QUICK``), the whole within a budget
of 20 minutes: a benchmark whose estimate no longer fits is skipped and says so. Without it
each runs with its own defaults (the full runs, hours). Each runs as a child process
(``python -m dsec_bench NAME …``) with its own state dir under ``--state-root``, its output in
``<state-root>/NAME.log``; its figures are read back from the JSON it writes, a row built for
the glance table (``ROWS``), misses shown as misses. A benchmark whose peer is missing on this
machine (podman, a registry, bwrap, Ray, QEMU) runs without that peer where it can, or is
skipped, and the row says what to install; the rest run. Ctrl-C stops the running child (which
cleans up after itself, as every benchmark does on SIGINT) and writes nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

BUDGET_S = 20 * 60
GLANCE_HEADING = "## At a glance"


@dataclass
class Bench:
    name: str
    anchor: str                     # the section of docs/BENCHMARKS.md
    quick: list[str]                # the quick mode's arguments (after the state dir's)
    estimate_s: float               # the quick mode's usual time here (for the budget)
    results: Callable[[Path], Path]  # where its JSON lands, from its state dir
    state_option: str = "--state-dir"
    needs: list[tuple[str, str]] = field(default_factory=list)  # (what, how to install): skipped without
    without: dict[str, list[str]] = field(default_factory=dict)  # peer → the arguments that leave it out
    store: str = "in"               # where its layer store is: "in" (<state>/store), "beside" (<state>-store), ""
    # A state dir of its own, short: Ray's sockets live under it and a socket's path holds 107 bytes.
    state_dir: Path | None = None


def _inside(name: str) -> Callable[[Path], Path]:
    return lambda state: state / name


def _beside(state: Path) -> Path:
    return state.parent / f"{state.name}.json"


PODMAN_HOW = "apt-get install podman (scripts/setup-host.sh does)"
# The tests' layer store: the VM benchmarks and the desktop one take their images from it.
TEST_STORE = Path("/var/lib/dsec-test/store")
QUICK: list[Bench] = [
    Bench("lifecycle", "lifecycle", ["--idle-count", "16", "--lifecycles", "48", "--rounds", "2", "--concurrency", "8",
                                     "--latency-rounds", "1", "--cold-rounds", "1", "--pool-max", "16", "--crun-runs", "36",
                                     "--podman-runs", "6", "--strict"],
          70, _inside("bench-lifecycle.json"), without={"podman": ["--no-podman"]}),
    Bench("desktop", "desktop", ["--samples", "20", "--peer-samples", "5", "--creates", "2"], 35,
          _inside("bench-desktop.json"),
          needs=[("desktop-image", "the desktop image in the tests' store: `dsec image build desktop` or its tests")]),
    # (512 MiB in all: at 80 MiB what the host gives back is lost in its own noise, ±30%.)
    Bench("pause", "pausing-a-job-pause", ["-n", "16", "--mb", "32"], 25, _beside, store="beside"),
    Bench("pulls", "pulling-many-images-pulls", ["--images", "8", "--base", "busybox"], 10, _beside,
          needs=[("skopeo", "apt-get install skopeo (scripts/setup-host.sh does)"),
                 ("registry", "apt-get install docker-registry (scripts/setup-host.sh does)")], store=""),
    Bench("fork", "fork", ["--children", "10", "--changed-mb", "5", "--files", "200", "--concurrency", "4"], 15,
          _beside, without={"podman": ["--no-podman"]}, store="beside"),
    Bench("inside", "inside-a-sandbox", ["--samples", "20", "--podman-samples", "5", "--slow-s", "3", "--tree-mb", "20"],
          30, _inside("bench-inside.json"), without={"podman": ["--no-podman"]}),
    Bench("clean-copy", "clean-copy", ["--rounds", "5", "--pack-rounds", "2", "--podman-rounds", "2", "--tree-mb", "20",
                                       "--files", "200"], 30, _beside, without={"podman": ["--no-podman"]},
          store="beside"),
    Bench("fncall", "fncall", ["--quick", "--strict"], 45, _inside("bench-fncall.json"),
          needs=[("bwrap", "apt-get install bubblewrap")]),
    # (at the goal's 32 in flight, 5 rounds of 160 lifecycles: 40 a round at 8 in flight were 0.3 s
    # rounds, their ramps a large share, and judged a rate the goal does not name; with rounds swinging
    # by a quarter on a shared host, the median of 5 holds still where that of 3 did not)
    Bench("joblog", "job-log", ["--lifecycles", "800", "--rounds", "5", "--concurrency", "32"], 30, _beside),
    Bench("cluster", "cluster", ["--nodes", "16", "--processes", "2", "--batch", "1000", "--singles", "1000",
                                 "--in-flight", "64", "--paced-rate", "500", "--crun-count", "32", "--crun-in-flight",
                                 "8", "--strict"], 50,
          lambda state: state.parent / f"{state.name}.json", state_option="--results", store=""),
    Bench("ports", "ports", ["--seconds", "1", "--samples", "30"], 30, _inside("bench-ports.json")),
    Bench("tti", "time-to-interactive-tti", ["--iterations", "4", "--stagger-ms", "50"], 50, _beside,
          without={"podman": ["--systems", "dsec,e2b"]}, store="beside"),
    Bench("soak", "soak", ["--lifecycles", "600", "--sample-every", "150", "--concurrency", "8"], 30,
          lambda state: state.with_suffix(".json")),
    Bench("rollout", "rl-rollout", ["--episodes", "36", "--podman-episodes", "4", "--concurrency", "8", "--tasks", "4"],
          50, _beside, without={"podman": ["--podman-episodes", "0"]}, store="beside"),
    Bench("harness", "a-tasks-environment-harness", ["--files", "20", "--build-rounds", "1", "--rebuild-rounds", "2",
                                                     "--start-rounds", "3", "--podman-start-rounds", "2", "--no-harbor"],
          55, _beside, without={"podman": ["--no-podman"]}, store="beside"),
    Bench("density", "density-and-resources", ["--quick", "--max-count", "200", "--step", "100", "--peer-count", "50",
                                               "--pause-count", "8", "--text-count", "0", "--random-count", "0",
                                               "--cold-count", "4", "--cold-wait-s", "8", "--strict"],
          170, _inside("bench-density.json")),
    Bench("burst", "burst-images-on-demand", ["--quick", "--base", "python", "--strict"], 120, _inside("bench-burst.json"),
          store=""),
    Bench("images", "images-at-production-size", ["--quick", "--repeat", "3"], 45, _inside("images.json"), store=""),
    Bench("layercache", "layer-cache-layercache", ["--images", "2", "--per-image", "2", "--cache-mb", "256",
                                                   "--base", "python"], 40, _inside("bench-layercache.json"),
          needs=[("gluster", "apt-get install glusterfs-server glusterfs-client (scripts/setup-host.sh does)")]),
    # (160 lifecycles a round at the full mode's 16 in flight: 20 a round were served from the warm pools)
    Bench("cluster-ray", "cluster", ["--lifecycles", "480", "--rounds", "3", "--concurrency", "16"], 65, _beside,
          needs=[("ray", "pip install 'ray[default]' into this environment")], store="",
          state_dir=Path("/var/lib/dsec-bench-all-ray")),
    Bench("microvm", "microvm", ["--idle", "1", "--many", "2", "--memory", "256"], 120, _beside,
          needs=[("qemu", "apt-get install qemu-system-x86"), ("vm-assets", "a kernel cache: run the VM tests once")],
          store=""),
    Bench("vm-pause", "paused-microvms-vm-pause", ["-n", "2", "--state-mb", "8", "--strict"], 60, _beside,
          needs=[("qemu", "apt-get install qemu-system-x86"), ("vm-assets", "a kernel cache: run the VM tests once")],
          store=""),
]


def seed_store(target: Path, seed: Path, names: tuple[str, ...] = ("python", "busybox", "desktop")) -> list[str]:
    """Link the images ``names`` from the layer store ``seed`` into ``target`` (layers are
    content-addressed files: hard links, or copies across file systems), so that no benchmark
    builds them again (debootstrap). Returns the names linked."""
    from dsec.images.store import LayerStore

    if not (seed / "images").is_dir() or target.resolve() == seed.resolve():
        return []
    source, store, done = LayerStore(seed), LayerStore(target), []
    for name in names:
        if store.has_image(name) or not source.has_image(name):
            continue
        image = source.get_image(name)
        for digest in image.layers:
            if not store.has_layer(digest):
                try:
                    os.link(source.layer_path(digest), store.layer_path(digest))
                except OSError:
                    shutil.copy2(source.layer_path(digest), store.layer_path(digest))
        store.put_image(image)
        done.append(name)
    return done


def have(what: str) -> bool:
    """Whether a peer or tool a benchmark needs is on this machine."""
    if what == "podman":
        return shutil.which("podman") is not None
    if what == "skopeo":
        return shutil.which("skopeo") is not None
    if what == "registry":
        return shutil.which("docker-registry") is not None
    if what == "bwrap":
        return shutil.which("bwrap") is not None
    if what == "qemu":
        return shutil.which("qemu-system-x86_64") is not None
    if what == "vm-assets":
        assets = Path(os.environ.get("DSEC_VM_ASSETS", "/var/lib/dsec-test/vm"))
        return (assets / "kernel").exists()
    if what == "gluster":
        return all(shutil.which(tool) for tool in ("glusterd", "gluster", "glusterfs"))
    if what == "ray":
        import importlib.util

        return importlib.util.find_spec("ray") is not None
    if what == "desktop-image":
        from dsec.images.store import LayerStore

        return TEST_STORE.is_dir() and LayerStore(TEST_STORE).has_image("desktop")
    raise ValueError(what)


# -- the glance rows, from each benchmark's JSON ---------------------------------------------


def _met(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "**missed**")


def _f(v: Any, spec: str = ",.1f") -> str:
    return "—" if v is None else format(v, spec)


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _row_lifecycle(r: dict) -> tuple[str, str, str]:
    goals = {g["goal"]: g for g in r.get("goals", [])}
    t = _get(r, "dsec", "throughput", "lifecycles_per_s")
    p50 = _get(r, "dsec", "create_warm", "latency", "p50_ms")
    podman = _get(r, "podman", "throughput", "lifecycles_per_s")
    crun = _get(r, "crun", "throughput", "lifecycles_per_s")
    verdicts = "; ".join(f"{name} {_met(g['met'])}" for name, g in goals.items())
    return (f"{_f(t)} lifecycles/s (median round); warm create p50 {_f(p50)} ms",
            f"podman {_f(podman, '.2f')}/s; bare crun {_f(crun)}/s", verdicts)


def _row_inside(r: dict) -> tuple[str, str, str]:
    first, session = _get(r, "first_byte", "stream_shell_p50_ms"), _get(r, "session", "true_p50_ms")
    trees = r.get("trees") or {}
    return (f"first stdout byte {_f(first)} ms; session `true` {_f(session)} ms; {trees.get('mb', '—')} MB tree up "
            f"{_f(trees.get('upload_s'), '.2f')} s, down {_f(trees.get('download_s'), '.2f')} s",
            f"`podman exec` {_f(_get(r, 'podman_exec', 'echo_first_byte_p50_ms'))} / "
            f"{_f(_get(r, 'podman_exec', 'true_p50_ms'))} ms; local tar {_f(trees.get('local_tar_s'), '.2f')} s",
            f"≤ 5 ms {_met(None if first is None else first <= 5)}, ≤ 3 ms "
            f"{_met(None if session is None else session <= 3)}")


def _row_density(r: dict) -> tuple[str, str, str]:
    from .density import GOAL_IDLE_COUNT, _goals

    idle, g = r.get("idle") or {}, _goals(r)
    heap = r.get("pause_heap") or {}
    share = heap.get("returned_share")
    return (f"{idle.get('count', '—')} idle sandboxes fit ({idle.get('stopped_by', '—')}), "
            f"{_f(idle.get('host_mib_per_sandbox'), '.2f')} MiB each to the host; pause returns "
            f"{'—' if share is None else f'{share:.0%}'} of heap-like content "
            f"(swap: {_get(r, 'machine', 'swap', 'text') or '?'})",
            f"bare crun {_f(_get(r, 'crun', 'host_mib_per_container'), '.2f')} MiB",
            f"≥ {GOAL_IDLE_COUNT:,} fit {_met(g['idle_count'])}; ≤ 2 MiB {_met(g['idle_mib'])}; pause ≥ 80% "
            f"{_met(g['pause_returned'])}")


def _row_burst(r: dict) -> tuple[str, str, str]:
    arms = {a["name"].split()[0]: a for a in r.get("arms", [])}
    d, e = arms.get("DSec") or {}, arms.get("eager") or {}
    s = r.get("summary") or {}
    goals = "; ".join(f"{g['goal']} {_met(g['met'])}" for g in s.get("goals", []))
    ratio = _get(s, "eager", "all_done_peer_over_dsec")
    return (f"{d.get('sandboxes', '—')} tasks done in {_f(d.get('all_done_s'))} s, "
            f"{_f((d.get('bytes_written') or 0) / 1e6, ',.0f')} MB written",
            f"pull (layered, loopback registry) then crun {_f(e.get('all_done_s'))} s "
            f"({_f(ratio, '.2f')}×), {_f((e.get('bytes_written') or 0) / 1e6, ',.0f')} MB" if e else
            "eager peer not run (see the notes)", goals or "not measured")


def _row_clean_copy(r: dict) -> tuple[str, str, str]:
    p50 = _get(r, "dsec", "clean_copy", "p50_ms")
    return (f"p50 {_f(p50)} ms for {r.get('tree_mb', '—')} MB", f"podman + tar {_f(_get(r, 'podman', 'p50_ms'))} ms "
            f"({_f(r.get('podman_over_dsec'))}×)", f"≤ 100 ms {_met(None if p50 is None else p50 <= 100)}")


def _row_fncall(r: dict) -> tuple[str, str, str]:
    s = r.get("summary") or {}
    single = _get(r, "dsec", "sequential", "round_trip") or {}
    batched = _get(r, "dsec", "sequential_batched", "round_trip") or {}
    return (f"{_f(s.get('calls_per_s'), ',.0f')} calls/s; at the client, 1 in flight: p50 {_f(single.get('p50_ms'), '.2f')} "
            f"ms a call a request, {_f(batched.get('p50_ms'), '.2f')} ms 8 a request",
            f"bwrap `python3 -c` {_f(_get(r, 'peers', 'bwrap', 'calls_per_s'), ',.0f')}/s ({_f(s.get('vs_bwrap'))}×); "
            f"the floor (`pass`) {_f(s.get('floor_calls_per_s'), ',.0f')}/s "
            f"({_f(None if s.get('floor_share') is None else s['floor_share'] * 100)}%)",
            "; ".join(f"{k} {_met(v)}" for k, v in (s.get("goals") or {}).items()))


def _row_joblog(r: dict) -> tuple[str, str, str]:
    ratio = r.get("ratio_recorded_over_unrecorded")
    return (f"recorded {_f(_get(r, 'recorded', 'lifecycles_per_s'))} lifecycles/s (median round)",
            f"unrecorded {_f(_get(r, 'unrecorded', 'lifecycles_per_s'))}/s ({_f(ratio, '.2f')}×)",
            f"≥ 0.90× {_met(None if ratio is None else ratio >= 0.90)}")


def _row_cluster(r: dict) -> tuple[str, str, str]:
    rem, emb = _get(r, "arms", "remote") or {}, _get(r, "arms", "embedded") or {}
    goals = _get(r, "summary", "goals") or []
    return (f"on the **fake backend** (both arms): batch {_f(_get(rem, 'batch', 'per_s'), ',.0f')}/s; "
            f"{_f(_get(rem, 'singles', 'per_s'), ',.0f')} single creates/s; p99 {_f(_get(rem, 'paced', 'p99_ms'))} ms "
            f"offered {_f(_get(r, 'options', 'paced_rate'), ',.0f')}/s",
            f"in-process edges, fake backend: {_f(_get(emb, 'batch', 'per_s'), ',.0f')}/s, "
            f"{_f(_get(emb, 'singles', 'per_s'), ',.0f')}/s",
            "; ".join(f"{g['goal']} {_met(g['met'])}" for g in goals))


def _row_cluster_ray(r: dict) -> tuple[str, str, str]:
    ratio = r.get("ratio")
    return (f"3 Ray nodes {_f(r.get('ray'))} lifecycles/s (median round; {_f(ratio, '.2f')}× embedded); node loss "
            f"seen in {_f(r.get('lost_s'), '.2f')} s", f"embedded {_f(r.get('embedded'))}/s, real crun",
            f"≥ 0.85× {_met(None if ratio is None else ratio >= 0.85)}")


def _row_rollout(r: dict) -> tuple[str, str, str]:
    ratio = r.get("ratio")
    return (f"{_f(_get(r, 'dsec', 'episodes_per_s'), '.2f')} episodes/s", f"podman exec "
            f"{_f(_get(r, 'podman', 'episodes_per_s'), '.2f')}/s ({_f(ratio)}×)",
            f"≥ 5× {_met(None if ratio is None else ratio >= 5)}")


def _row_tti(r: dict) -> tuple[str, str, str]:
    def medians(system: str) -> str:
        return " / ".join(_f(_get(r, system, m, "median_ms"), ",.0f") for m in ("sequential", "staggered", "burst"))

    return (f"median time to interactive, sequential / staggered / burst: {medians('dsec')} ms",
            f"podman {medians('podman')} ms; e2b SDK on DSec {medians('e2b')} ms", "none set (a figure to compare)")


def _row_soak(r: dict) -> tuple[str, str, str]:
    samples = r.get("samples") or []
    first, last = (samples[0], samples[-1]) if samples else ({}, {})
    flat = bool(samples) and all(last.get(k) == first.get(k) for k in ("mounts", "sandbox_cgroups"))
    rss = (last.get("server_rss_mib") or 0) - (first.get("server_rss_mib") or 0)
    return (f"{last.get('lifecycles', '—')} lifecycles: mounts {first.get('mounts', '—')} → {last.get('mounts', '—')}, "
            f"cgroups {first.get('sandbox_cgroups', '—')} → {last.get('sandbox_cgroups', '—')}, server RSS "
            f"{rss:+.1f} MiB; {len(r.get('errors') or [])} errors", "its own first reading",
            f"flat {_met(flat and not r.get('errors'))}")


def _row_ports(r: dict) -> tuple[str, str, str]:
    direct = r.get("rps_direct")
    shares = [None if not direct or r.get(k) is None else r[k] / direct for k in ("rps_port_url", "rps_host_name")]
    pct = ["—" if x is None else f"{x:.0%}" for x in shares]
    first = [r.get("first_byte_port_url_ms"), r.get("first_byte_host_name_ms")]
    ws = [r.get("ws_rtt_port_url_ms"), r.get("ws_rtt_host_name_ms")]
    return (f"requests/s through port_url {pct[0]}, host name {pct[1]} of the port reached directly; first byte "
            f"{' / '.join(_f(x, '.1f') for x in first)} ms; WebSocket RTT {' / '.join(_f(x, '.2f') for x in ws)} ms",
            f"the port from inside its network namespace, {_f(direct, ',.0f')} requests/s",
            f"≥ 50% {_met(None if None in shares else min(shares) >= 0.5)}; ≤ 5 ms "
            f"{_met(None if None in first else max(first) <= 5)}; ≤ 2 ms {_met(None if None in ws else max(ws) <= 2)}")


def _row_harness(r: dict) -> tuple[str, str, str]:
    d, p = r.get("dsec") or {}, r.get("podman") or {}
    goals = r.get("goals") or {}
    harbor = (f"; Harbor oracle {_f(_get(r, 'harbor', 'dsec', 'trials_per_min'))} trials/min"
              if _get(r, "harbor", "dsec") else "")
    return (f"a task's Dockerfile built in {_f(_get(d, 'build', 'p50_ms'), ',.0f')} ms, rebuilt in "
            f"{_f(_get(d, 'rebuild', 'p50_ms'), ',.0f')} ms; start to a first answer p50 "
            f"{_f(_get(d, 'start', 'p50_ms'), ',.0f')} ms{harbor}",
            f"`podman build` {_f(_get(p, 'build', 'p50_ms'), ',.0f')} / {_f(_get(p, 'rebuild', 'p50_ms'), ',.0f')} ms; "
            f"`podman run` + `exec` {_f(_get(p, 'start', 'p50_ms'), ',.0f')} ms" if p else "podman not measured",
            "; ".join(f"{k} {_met(v)}" for k, v in goals.items()) or "not measured")


def _row_fork(r: dict) -> tuple[str, str, str]:
    d, ratio = r.get("dsec") or {}, r.get("podman_over_dsec")
    goals = r.get("goals") or {}
    return (f"{r.get('children', '—')} children of a container with {r.get('changed_mb', '—')} MB changed in "
            f"{r.get('files', '—')} files, all answering in {_f(d.get('all_answering_s'), '.2f')} s; parent frozen "
            f"{_f(_ms(d.get('frozen_s')), ',.0f')} ms",
            f"`podman commit` + a `podman run` per child: {_f(_get(r, 'podman', 'all_answering_s'), '.2f')} s "
            f"({_f(ratio)}×)",
            f"all answer ≤ 2 s {_met(goals.get('all_answering'))}; ≥ 20× {_met(goals.get('ratio'))}")


def _row_pause(r: dict) -> tuple[str, str, str]:
    p, a, goals = r.get("pause") or {}, r.get("auto_resume") or {}, r.get("goals") or {}
    share = p.get("returned_share")
    return (f"a job of {r.get('count', '—')} sandboxes × {r.get('mb', '—')} MiB paused in one call in "
            f"{_f(p.get('seconds'), '.2f')} s, {_f(None if share is None else 100 * share, '.0f')}% of their memory "
            f"back ({_get(r, 'swap', 'text') or '?'}); resumed in {_f(_get(r, 'resume', 'seconds'), '.2f')} s; "
            f"auto-resume adds {_f(a.get('added_p50_ms'), '.0f')} ms",
            "none pauses a job as one call",
            f"≤ 10 s {_met(goals.get('pause_s'))}; ≥ 80% back {_met(goals.get('returned'))}; resume ≤ 10 s "
            f"{_met(goals.get('resume_s'))}; auto-resume ≤ 200 ms {_met(goals.get('auto_resume'))}")


def _row_pulls(r: dict) -> tuple[str, str, str]:
    d, p = r.get("dsec") or {}, r.get("peer") or {}
    return (f"{r.get('images', '—')} task images sharing a {r.get('base', '—')} base pulled in "
            f"{_f(d.get('seconds'), '.2f')} s, the base converted {d.get('base_layers', '—')}×",
            f"`skopeo copy` into containers-storage {_f(p.get('seconds'), '.2f')} s ({_f(r.get('ratio'), '.2f')}×)",
            f"≥ 2× {_met(r.get('goal_met'))}")


def _row_desktop(r: dict) -> tuple[str, str, str]:
    d, pm, ratios = r.get("dsec") or {}, r.get("podman_exec") or {}, r.get("ratios") or {}
    goals = r.get("goals") or {}
    shot, move, first = d.get("screenshot_p50_ms"), d.get("move_p50_ms"), r.get("create_to_first_screenshot_p50_s")
    return (f"screenshot p50 {_f(shot)} ms; pointer move {_f(move, '.2f')} ms, key press "
            f"{_f(d.get('press_p50_ms'), '.2f')} ms; create to first screenshot {_f(first, '.2f')} s",
            f"`scrot` / `xdotool` by `podman exec` on the same image {_f(pm.get('scrot_p50_ms'))} / "
            f"{_f(pm.get('xdotool_move_p50_ms'))} ms ({_f(ratios.get('screenshot_podman_exec_over_dsec'))}× / "
            f"{_f(ratios.get('move_podman_exec_over_dsec'))}×)",
            f"≤ 25 ms {_met(goals.get('screenshot_p50_le_25ms'))}, ≥ 4× {_met(goals.get('screenshot_ge_4x_podman'))}; "
            f"input ≤ 5 ms {_met(goals.get('input_p50_le_5ms'))}, ≥ 10× {_met(goals.get('input_ge_10x_podman'))}; "
            f"≤ 1.5 s {_met(None if first is None else first <= 1.5)}")


def _row_microvm(r: dict) -> tuple[str, str, str]:
    many, answering = r.get("many") or 0, r.get("many_answering") or 0
    speedup, saving = r.get("restore_speedup"), r.get("memory_saving")
    return (f"restore to a shell {_f(_ms(r.get('restore_s')), '.0f')} ms; {r.get('idle', '—')} idle microVMs on "
            f"pmem/DAX + KSM hold {_f(r.get('shared_mb'), '.0f')} MiB; {answering} of {many} clones answering",
            f"cold boot {_f(_ms(r.get('boot_s')), '.0f')} ms ({_f(speedup)}×); private copies "
            f"{_f(r.get('private_mb'), '.0f')} MiB ({_f(None if saving is None else 100 * saving, '.0f')}% less)",
            f"≥ 10× {_met(None if speedup is None else speedup >= 10)}; ≥ 40% less memory "
            f"{_met(None if saving is None else saving >= 0.40)}; ≥ 50 idle microVMs "
            + (_met(answering >= 50) if many >= 50 else f"not measured ({many} at this size)"))


def _row_vm_pause(r: dict) -> tuple[str, str, str]:
    paused, stopped = _get(r, "paused", "held"), _get(r, "stopped", "held")
    saving = None if not paused or not stopped or not r.get("swap_total") else 1 - paused / stopped
    count, intact = r.get("count"), r.get("intact")
    return (f"{count} paused microVMs hold {_f(None if paused is None else paused / 2**20, '.0f')} MiB; "
            f"{intact} of {count} resumed intact; first command after resume "
            f"{_f(r.get('resume_latency_ms'), '.0f')} ms",
            f"QMP `stop` {_f(None if stopped is None else stopped / 2**20, '.0f')} MiB"
            + ("" if saving is None else f" ({100 * saving:.1f}% less)"),
            f"≥ 50% less {_met(None if saving is None else saving >= 0.5)}; all intact "
            f"{_met(None if intact is None else intact == count)}")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _row_generic(r: dict) -> tuple[str, str, str]:
    return ("ran", "", "")


def _row_images(r: dict) -> tuple[str, str, str]:
    c, o, ratio = r.get("creates") or {}, r.get("options") or {}, r.get("ratio") or {}
    gc = [_get(r, "timings", k, "gc", "median_ms") for k in ("big", "small")]
    return (f"create p50 / p99 with {_f(o.get('workspaces'), ',.0f')} workspaces: {_f(_get(c, 'big', 'p50_ms'))} / "
            f"{_f(_get(c, 'big', 'p99_ms'))} ms; gc {_f(gc[0], '.2f')} ms",
            f"10 workspaces: {_f(_get(c, 'small', 'p50_ms'))} / {_f(_get(c, 'small', 'p99_ms'))} ms "
            f"({_f(ratio.get('p50'), '.2f')}× / {_f(ratio.get('p99'), '.2f')}×); gc {_f(gc[1], '.2f')} ms",
            f"within 1.1× {_met(r.get('goal_met'))}")


def _row_layercache(r: dict) -> tuple[str, str, str]:
    arms = r.get("arms") or {}
    local = _get(arms, "local", "create_p50_s")
    warm = _get(arms, "shared-warm", "create_p50_s")
    ratio = warm / local if warm and local else None
    return (f"store on GlusterFS, node cache warm: {_f(_get(arms, 'shared-warm', 'read_bytes'), ',.0f')} bytes read "
            f"from the volume; create p50 {_f(_ms(warm))} ms; cold "
            f"{_f(None if _get(arms, 'shared-cold', 'read_bytes') is None else _get(arms, 'shared-cold', 'read_bytes') / 1e6)} MB read",
            f"store on local disk {_f(_ms(local))} ms ({_f(ratio, '.2f')}×)",
            f"warm create reads nothing {_met(r.get('goal_met'))}")


ROWS: dict[str, Callable[[dict], tuple[str, str, str]]] = {
    "lifecycle": _row_lifecycle, "inside": _row_inside, "density": _row_density, "burst": _row_burst,
    "clean-copy": _row_clean_copy, "fncall": _row_fncall, "joblog": _row_joblog, "cluster": _row_cluster,
    "cluster-ray": _row_cluster_ray, "rollout": _row_rollout, "tti": _row_tti, "soak": _row_soak,
    "ports": _row_ports, "harness": _row_harness, "fork": _row_fork, "pause": _row_pause, "pulls": _row_pulls,
    "desktop": _row_desktop, "images": _row_images, "layercache": _row_layercache, "microvm": _row_microvm,
    "vm-pause": _row_vm_pause,
}


# -- running them -----------------------------------------------------------------------------


@dataclass
class Outcome:
    bench: Bench
    status: str            # "ran", "failed", "skipped", "timed out"
    seconds: float = 0.0
    code: int | None = None
    why: str = ""
    row: tuple[str, str, str] | None = None


def _run_one(b: Bench, state_root: Path, quick: bool, timeout_s: float, missing_peers: set[str],
             console: Console, seed: Path | None = None) -> Outcome:
    state = b.state_dir or state_root / b.name
    log = state_root / f"{b.name}.log"
    if seed is not None and b.store:
        state.mkdir(parents=True, exist_ok=True)
        seed_store(state / "store" if b.store == "in" else state.parent / f"{state.name}-store", seed)
    results = b.results(state)
    results.unlink(missing_ok=True)
    args = [sys.executable, "-m", "dsec_bench", b.name, b.state_option, str(results if b.state_option == "--results"
                                                                               else state)]
    if quick:
        args += b.quick
    notes = []
    for peer, leave_out in b.without.items():
        if peer in missing_peers:
            args += leave_out
            notes.append(f"without {peer} ({PODMAN_HOW})")
    env = dict(os.environ)
    if b.name in ("microvm", "vm-pause"):
        env.setdefault("DSEC_VM_ASSETS", "/var/lib/dsec-test/vm")
    if b.name in ("microvm", "vm-pause", "desktop") and TEST_STORE.is_dir():
        args += ["--store", str(TEST_STORE)]
    console.print(f"[bold]{b.name}[/bold]: {' '.join(args[3:])}  (log {log})")
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env={**env, "COLUMNS": "200"},
                                start_new_session=True)
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)  # the benchmark's own clean-up runs on Ctrl-C
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return Outcome(b, "timed out", time.monotonic() - t0, None, f"over its {timeout_s:.0f} s")
        except BaseException:  # Ctrl-C or SIGTERM here: the child (its own session) cleans up on SIGINT
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(300)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
    seconds = time.monotonic() - t0
    outcome = Outcome(b, "ran" if code in (0, 2) else "failed", seconds, code, "; ".join(notes))
    if code == 2:
        outcome.why = "; ".join([*notes, "a goal missed (exit 2)"])
    if b.state_dir is not None and results.exists():  # kept with the others, under the state root
        results = Path(shutil.move(results, state_root / f"{b.name}.json"))
    try:
        outcome.row = ROWS.get(b.name, _row_generic)(json.loads(results.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if outcome.status == "ran":
            judged = "--strict" in b.quick and quick
            outcome.row = (f"ran; figures in its log ({log.name})", "",
                           (_met(code == 0) + f" (--strict exit {code})") if judged else
                           "not judged at the quick size (see its log)")
        outcome.why = outcome.why or ("it writes no JSON" if isinstance(exc, FileNotFoundError)
                                      else f"its results unread ({type(exc).__name__})")
    if outcome.status == "failed":
        lines = [line.strip(" │|") for line in log.read_text(errors="replace").splitlines() if line.strip(" │|")]
        said = next((line for line in reversed(lines) if re.search(r"(?i)error|failed|missing|not found", line)),
                    lines[-1] if lines else "")
        outcome.why = f"exit {code}: {said[:300]}"
    return outcome


def glance_table(outcomes: list[Outcome]) -> list[str]:
    lines = ["| benchmark | headline | peer, same run | goal |", "| --- | --- | --- | --- |"]
    for o in outcomes:
        link = f"[{o.bench.name}](#{o.bench.anchor})"
        if o.status == "skipped":
            lines.append(f"| {link} | **skipped**: {o.why} | | not measured |")
        elif o.status in ("failed", "timed out") or o.row is None:
            lines.append(f"| {link} | **{o.status}**: {o.why} | | not measured |")
        else:
            headline, peer, goal = o.row
            lines.append(f"| {link} | {headline} | {peer} | {goal} |")
    return lines


def _row_name(line: str) -> str | None:
    m = re.match(r"\| \[([^\]]+)\]", line)
    return m.group(1) if m else None


def rewrite_glance(doc: Path, table: list[str], preface: str, partial: bool = False) -> None:
    """Replace the table under ``## At a glance`` (and the line before it that says which run it
    is, if this wrote one) with ``table``; the rest of the document stays as it is. ``partial``
    (some benchmarks only): their rows replace the rows of the same name, the others stay."""
    text = doc.read_text()
    head = text.index(GLANCE_HEADING) + len(GLANCE_HEADING)
    rest = text[head:]
    start = rest.index("\n| ")
    end = start + 1
    lines = rest[start + 1:].split("\n")
    n = 0
    while n < len(lines) and lines[n].startswith("|"):
        n += 1
    end = start + 1 + len("\n".join(lines[:n]))
    if partial:
        fresh = {_row_name(line): line for line in table[2:]}
        old_rows = lines[2:n]
        merged = [fresh.pop(_row_name(line), line) for line in old_rows]
        table = table[:2] + merged + list(fresh.values())
    before = re.sub(r"\n_(Quick|Full|Some) runs \(`dsec bench all[^\n]*\n", "\n", rest[:start])
    new = before.rstrip("\n") + "\n\n" + preface + "\n\n" + "\n".join(table) + rest[end:]
    doc.write_text(text[:head] + new)


def _commit() -> str:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def main(console: Console, *, state_root: Path, doc: Path | None, quick: bool, only: list[str], skip: list[str],
         budget_s: float = BUDGET_S, seed: Path | None = None) -> int:
    if os.geteuid() != 0:
        console.print("[red]error:[/red] dsec bench all runs as root (the benchmarks mount, run crun, drop caches)")
        return 1
    chosen = [b for b in QUICK if (not only or b.name in only) and b.name not in skip]
    state_root.mkdir(parents=True, exist_ok=True)
    missing_peers = {p for p in ("podman",) if not have(p)}
    for p in sorted(missing_peers):
        console.print(f"[yellow]{p} is missing here[/yellow]: the benchmarks that measure it run without it "
                      f"({PODMAN_HOW})")
    started, t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.monotonic()
    load0 = os.getloadavg()[0]
    outcomes: list[Outcome] = []

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        for b in chosen:
            lacking = [(what, how) for what, how in b.needs if not have(what)]
            left = budget_s - (time.monotonic() - t0) if quick else float("inf")
            if lacking:
                outcomes.append(Outcome(b, "skipped", why="; ".join(f"{w} missing here ({how})" for w, how in lacking)))
            elif quick and left < b.estimate_s:
                outcomes.append(Outcome(b, "skipped", why=f"the {budget_s / 60:.0f}-minute budget ({left:.0f} s left, "
                                                          f"it takes about {b.estimate_s:.0f} s)"))
            else:
                outcomes.append(_run_one(b, state_root, quick, min(left, 3 * b.estimate_s) if quick else 24 * 3600,
                                         missing_peers, console, seed))
            o = outcomes[-1]
            console.print(f"  {o.bench.name}: {o.status} in {o.seconds:.0f} s" + (f" — {o.why}" if o.why else ""))
    except KeyboardInterrupt:
        console.print("[red]interrupted[/red]: the running benchmark cleaned up; the document is unchanged")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    total = time.monotonic() - t0
    table = glance_table(outcomes)
    preface = (f"_Quick runs (`dsec bench all --quick`) at commit {_commit()}, {started}, {total / 60:.1f} min in all, "
               f"load average {load0:.1f} at the start: developer sizes on a shared machine; each section below "
               f"holds its full run._" if quick else
               f"_Full runs (`dsec bench all`) at commit {_commit()}, {started}, {total / 60:.0f} min in all._")
    console.print("\n".join([preface, "", *table]), markup=False, highlight=False)
    partial = bool(only or skip)
    if partial:
        preface = (f"_Some runs (`dsec bench all{' --quick' if quick else ''}` of "
                   f"{', '.join(o.bench.name for o in outcomes)}) at commit {_commit()}, {started}; the other rows "
                   f"as the run before left them._")
    if doc is not None:
        rewrite_glance(doc, table, preface, partial)
        console.print(f"rewrote the glance table of {doc}")
    console.print(f"all: {total / 60:.1f} min; logs and results under {state_root}")
    return 0 if all(o.status in ("ran", "skipped") for o in outcomes) else 1
