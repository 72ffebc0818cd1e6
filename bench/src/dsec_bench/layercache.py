"""``dsec bench layercache``: a burst of sandboxes from images whose layer store is on a
distributed filesystem (a GlusterFS volume of the benchmark's own, through its FUSE client, as
``tests/cluster`` runs it), with and without the node's layer cache (dsec.images.layercache),
against the same burst with the store on local disk, in the same run. One node: the issue's
burst spreads 256 tasks over three; this is one node's share of such a burst.

The images: the burst benchmark's (``dsec bench burst``): one base layer (python + Python
packages, over 300 MB; ``--base python``: the bare python image, 251 MB) and ``images`` (M)
workspace layers of a few hundred generated files, task image i = base + workspace i. Each
sandbox runs its task (``python3 /workspace/task.py``: imports from the base's stdlib, reads
files of its workspace and its base) and the digest it prints is checked.

Five arms, one after the other, each one ``dsec serve`` (no warm pool) and each from a cold page
cache (``sync; echo 3 > /proc/sys/vm/drop_caches``): the store on local disk; the store on the
volume with no cache (what a node did before the cache); the store on the volume with an empty
cache (cold); the same server's node stopped and started again and the page cache dropped, its
cache kept on its disk (warm); the store on local disk again, last (how far the machine's load
moved the baseline over the run: the ratios are to the first; each arm's load average is kept
at its start and end). In each arm the burst: all M images at once, ``per_image`` (K)
sandboxes of each (``run_containers(count=K)``), each task run as soon as its batch is up;
timed: each batch's create, each task, and the whole to all tasks done.

Bytes read from the shared filesystem: gluster's own count of what its brick served to reads
(``gluster volume profile``), before and after the arm: everything the node read of the volume
(layers, manifests, the store's checks). The images' bytes: the sizes of their distinct layer
files (the base once). The goals (issue 35): a warm cache reads nothing of the volume; a burst
reads at most 15% of the images' bytes per node and is done within 1.3× of the same burst on
local disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs
from dsec.images.sources import workspace_from_dir
from dsec.images.store import LayerStore
from dsec.local import LocalServer, leftovers

from . import burst
from .gluster import GlusterVolume, missing

RESULTS_FILE = "bench-layercache.json"
# (local-again: the local arm once more, last: how far the machine's load moved the baseline
# over the run; the ratios are to the first)
ARMS = ("local", "shared-nocache", "shared-cold", "shared-warm", "local-again")


def _images(store: LayerStore, work: Path, images: int, base: str, base_store: str,
            log) -> tuple[str, list[str], list[str]]:
    """The base and task images in ``store`` (made when missing): (base, names, the digests
    their tasks print)."""
    image = burst.ensure_base(store, burst.Options(base=base, base_store=base_store), work, log)
    names, expected = [], []
    with burst.mounted_layer(store.layer_path(image.layers[0]), work / "mnt-base") as mnt:
        for i in range(images):
            src = work / "gen" / f"ws-{i:03d}" / "workspace"
            shutil.rmtree(src.parent, ignore_errors=True)
            burst.generate_workspace(src, i, 300)
            name = f"lc-ws-{i:03d}"
            workspace_from_dir(store, src, name)
            names.append(name)
            expected.append(burst.expected_digest(src, mnt))
            shutil.rmtree(src.parent, ignore_errors=True)
    return image.name, names, expected


def _copy_images(src: LayerStore, dst: LayerStore, names: list[str], base: str) -> int:
    """The images (and the base) copied to ``dst``; their distinct layer bytes."""
    total = 0
    seen: set[str] = set()
    for name in [base, *names]:
        image = src.get_image(name)
        for digest in image.layers:
            if digest not in seen:
                seen.add(digest)
                total += src.layer_size(digest)
            if not dst.has_layer(digest):
                tmp = dst.tmp_dir / f"{digest}.copy"
                shutil.copyfile(src.layer_path(digest), tmp)
                os.replace(tmp, dst.layer_path(digest))
        dst.put_image(image)
    return total


def _server(arm_dir: Path, store_dir: Path, cache_mb: int) -> LocalServer:
    """A ``dsec serve`` of ``arm_dir`` whose store is ``store_dir`` (its ``store`` a link to it)."""
    arm_dir.mkdir(parents=True, exist_ok=True)
    link = arm_dir / "store"
    if link.is_symlink() or link.exists():
        (link.unlink if link.is_symlink() else lambda: shutil.rmtree(link))()
    link.symlink_to(store_dir)
    return LocalServer(arm_dir, extra_args=("--pool-max", "0", "--fncall-max", "0"),
                       env={"DSEC_LAYER_CACHE_MB": str(cache_mb), "DSEC_VMS": "0"}, start_timeout_s=120).start()


async def _burst(server: LocalServer, base: str, names: list[str], expected: list[str], per_image: int,
                 read_bytes, errors: list[str]) -> dict:
    """A burst: every image created ``per_image`` times, all images at once (one
    ``run_containers`` each), each sandbox's task run as soon as its batch is up. Per image its
    batch's create time; per sandbox its task time; the time to all tasks done; the bytes read
    from the volume (None: not on the volume)."""
    out: dict[str, Any] = {"create_s": [], "task_s": []}
    before = read_bytes()
    t0 = time.perf_counter()
    async with DSecClient(server.endpoint, token=server.token) as client:
        async def image(name: str, digest: str) -> None:
            t1 = time.perf_counter()
            sandboxes = await client.run_containers(DSecContainerRunArgs(
                container_image=base, workspace=name, memory_limit_mb=256, cpu_cores_limit=1), count=per_image)
            out["create_s"].append(time.perf_counter() - t1)
            try:
                await asyncio.gather(*(task(name, digest, s) for s in sandboxes))
            finally:
                await asyncio.gather(*(s.stop() for s in sandboxes), return_exceptions=True)

        async def task(name: str, digest: str, s) -> None:
            t1 = time.perf_counter()
            result = await s.run_shell(" ".join(burst.TASK_CMD), timeout=300)
            out["task_s"].append(time.perf_counter() - t1)
            try:
                got = json.loads(result.stdout.strip().splitlines()[-1])["digest"]
            except (ValueError, IndexError, KeyError):
                got = None
            if result.exit_code != 0 or got != digest:
                errors.append(f"{name}: task exit {result.exit_code}, digest {got} (want {digest}): "
                              f"{result.stderr[-300:]}")

        done = await asyncio.gather(*(image(n, d) for n, d in zip(names, expected)), return_exceptions=True)
    out["all_done_s"] = time.perf_counter() - t0
    errors += [f"{type(e).__name__}: {e}" for e in done if isinstance(e, BaseException)]
    after = read_bytes()
    out["read_bytes"] = None if before is None else after - before
    return out


class _Arm:
    """One arm's DSec: one ``dsec serve`` of ``arm_dir`` (``nodes`` 1), or ``dsec serve --ray``
    over a Ray cluster of ``nodes`` dsec_edge nodes of this machine (their state dirs in
    ``arm_dir/nodes``), its layer store ``store_dir``, each node's layer cache ``cache_mb``."""

    def __init__(self, arm_dir: Path, store_dir: Path, cache_mb: int, nodes: int) -> None:
        self.arm_dir, self.nodes = arm_dir, nodes
        self.cluster = None
        self.server: LocalServer | None = None
        if nodes == 1:
            self.server = _server(arm_dir, store_dir, cache_mb)
            return
        from ray.cluster_utils import Cluster

        os.environ["DSEC_LAYER_CACHE_MB"] = str(cache_mb)  # the nodes' edges, Ray's workers, take it
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False, "object_store_memory": 80 << 20})
        try:
            for i in range(nodes):
                self.cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=80 << 20,
                                      resources={"dsec_edge": 1}, labels={"dsec-node": f"n{i + 1}"})
            self.server = LocalServer(arm_dir / "api", extra_args=(
                "--ray", self.cluster.address, "--node-state-dir", str(arm_dir / "nodes"), "--store-dir", str(store_dir),
                "--pool-max", "0", "--fncall-max", "0"), env={"DSEC_VMS": "0"}, start_timeout_s=180).start()
            asyncio.run(self._wait_for_nodes())
        except BaseException:
            self.stop()
            raise

    async def _wait_for_nodes(self) -> None:
        async with DSecClient(self.server.endpoint, token=self.server.token) as client:
            deadline = time.monotonic() + 120
            while len(await client.node_info()) < self.nodes:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {len(await client.node_info())} of {self.nodes} nodes joined")
                await asyncio.sleep(0.5)

    def cache_stats(self) -> dict[str, dict]:
        """Each node's layer cache's counters, by node."""
        if self.nodes == 1:
            stats = self.arm_dir / "node" / "layer-cache" / "mnt" / ".stats"
            return {"node": json.loads(stats.read_text())} if stats.exists() else {}
        return {p.parents[3].name: json.loads(p.read_text())
                for p in (self.arm_dir / "nodes").glob("*/node/layer-cache/mnt/.stats")}

    def node_dirs(self) -> list[Path]:
        return [self.arm_dir] if self.nodes == 1 else sorted((self.arm_dir / "nodes").glob("*"))

    def stop(self) -> None:
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.server.stop_sandboxes()
            with contextlib.suppress(Exception):
                self.server.stop()
            self.server = None
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
            from dsec.node import reset_node

            for node_dir in self.node_dirs():  # (their caches stay on disk: the warm arm's)
                asyncio.run(reset_node(node_dir))


def _summary(arm: dict) -> dict:
    return {"create_p50_s": statistics.median(arm["create_s"]), "create_max_s": max(arm["create_s"]),
            "task_p50_s": statistics.median(arm["task_s"])}


def main(state_dir: Path, console: Console, command: str = "dsec bench layercache", images: int = 8,
         per_image: int = 8, cache_mb: int = 4096, base: str = "python-pkgs", nodes: int = 1,
         base_store: str = "/var/lib/dsec-test/store") -> int:
    if os.geteuid() != 0:
        console.print("[red]error:[/red] dsec bench layercache runs as root (mounts, GlusterFS, drop_caches)")
        return 1
    why = missing()
    if why:
        console.print(f"[red]error:[/red] {why}")
        return 1
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    started = datetime.now(timezone.utc)
    res: dict[str, Any] = {"benchmark": "dsec bench layercache", "started_at": started.isoformat(timespec="seconds"),
                           "command": command, "loadavg_at_start": burst.loadavg(),
                           "options": {"images": images, "per_image": per_image, "cache_mb": cache_mb, "base": base,
                                       "nodes": nodes}, "arms": {}}
    if nodes > 1:
        ray_tmp = Path(f"/tmp/dsec-lc-ray-{os.getpid()}")  # (Ray's sockets: short paths)
        ray_tmp.mkdir(parents=True, exist_ok=True)
        os.environ.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "DSEC_VMS": "0",
                           "RAY_TMPDIR": str(ray_tmp)})
    console.print(f"[bold]dsec bench layercache[/bold]: a burst of {images} images × {per_image} per arm on "
                  f"{nodes} node(s); state in "
                  f"{state_dir}; load average {' '.join(res['loadavg_at_start'])}")
    local = LayerStore(state_dir / "store")
    work = state_dir / "work"
    work.mkdir(exist_ok=True)
    base, names, expected = _images(local, work, images, base, base_store, console.print)
    volume = GlusterVolume(Path(f"/tmp/dsec-lc-{os.getpid()}"))
    running: list[_Arm] = []
    node_dirs: set[Path] = set()
    try:
        volume.start()
        shared = LayerStore(volume.mountpoint / "store")
        image_bytes = _copy_images(local, shared, names, base)
        res["image_bytes"] = image_bytes
        volume.start_profile()
        for arm in ARMS:
            arm_dir = state_dir / ("arm-" + ("warm-cold" if arm in ("shared-cold", "shared-warm") else arm))
            if arm != "shared-warm":
                shutil.rmtree(arm_dir, ignore_errors=True)
            burst.drop_caches()
            on_local = arm in ("local", "local-again")
            store_dir = local.root if on_local else shared.root
            dsec = _Arm(arm_dir, store_dir, 0 if on_local or arm == "shared-nocache" else cache_mb, nodes)
            running.append(dsec)
            read = (lambda: None) if on_local else volume.data_read
            console.print(f"arm {arm}: the burst")
            loadavg = burst.loadavg()
            measured = asyncio.run(_burst(dsec.server, base, names, expected, per_image, read, errors))
            measured["loadavg"] = [loadavg, burst.loadavg()]  # (at its start and end)
            measured["cache"] = dsec.cache_stats()
            dsec.stop()
            running.remove(dsec)
            node_dirs.update(dsec.node_dirs())
            res["arms"][arm] = {**measured, **_summary(measured)}
    except Exception as exc:  # noqa: BLE001 - reported, then cleaned up
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        for dsec in running:
            with contextlib.suppress(Exception):
                dsec.stop()
        if errors:  # (what the GlusterFS client logged, as an EBADFD from a manifest's stat)
            res["gluster_client_errors"] = volume.client_errors()
        volume.close()
        left = volume.leftovers()
        for node_dir in sorted(node_dirs):
            left += leftovers(node_dir)
        res["leftovers"] = left
        if nodes > 1:
            shutil.rmtree(ray_tmp, ignore_errors=True)
    res["errors"] = errors
    arms = res["arms"]
    warm = arms.get("shared-warm", {}).get("read_bytes")
    # A warm create reads nothing of the volume: judged on one node (on several, the warm burst
    # places an image's sandboxes on nodes that may not have had it in the cold one).
    res["goal_met"] = None if warm is None or nodes > 1 else warm == 0
    if "local" in arms and "shared-cold" in arms and res.get("image_bytes"):
        res["cold_read_fraction"] = arms["shared-cold"]["read_bytes"] / res["image_bytes"]
        res["cold_over_local"] = arms["shared-cold"]["all_done_s"] / arms["local"]["all_done_s"]
        per_node = [c["fetched_bytes"] for c in arms["shared-cold"].get("cache", {}).values()]
        res["cold_node_fraction_max"] = max(per_node) / res["image_bytes"] if per_node else None
        res["burst_goal_met"] = ((res["cold_node_fraction_max"] or res["cold_read_fraction"]) <= 0.15
                                 and res["cold_over_local"] <= 1.3)
    _report(console, res)
    (state_dir / RESULTS_FILE).write_text(json.dumps(res, indent=1))
    console.print(f"results: {state_dir / RESULTS_FILE}")
    return 1 if errors or res["leftovers"] else 0


def _report(console: Console, res: dict) -> None:
    arms = res["arms"]
    total = res.get("image_bytes") or 0
    o = res["options"]
    table = Table(title=f"a burst of {o['images']} images × {o['per_image']} (images: {total / 1e6:.0f} MB of layers)")
    for col in ("arm", "all tasks done (s)", "÷ local", "create p50 / max (s)", "task p50 (s)", "read from the volume",
                "of the images", "fetched per node (caches)", "read requests / cache CPU s, per node",
                "load at start / end"):
        table.add_column(col, no_wrap=col == "arm")
    local = arms.get("local", {}).get("all_done_s")
    for arm, a in arms.items():
        read = a["read_bytes"]
        table.add_row(arm, f"{a['all_done_s']:.2f}", f"{a['all_done_s'] / local:.2f}×" if local else "—",
                      f"{a['create_p50_s']:.3f} / {a['create_max_s']:.3f}", f"{a['task_p50_s']:.3f}",
                      "—" if read is None else f"{read / 1e6:.2f} MB",
                      "—" if read is None or not total else f"{100 * read / total:.1f}%",
                      ", ".join(f"{c['fetched_bytes'] / 1e6:.1f} MB" for c in (a.get("cache") or {}).values()) or "—",
                      ", ".join(f"{c['read_requests']} / {c.get('server_cpu_s', 0):.2f}"
                                for c in (a.get("cache") or {}).values()) or "—",
                      " / ".join(load[0] for load in a.get("loadavg", ())) or "—")
    console.print(table)
    if "shared-warm" in arms:
        console.print(f"warm cache (after a node restart): {arms['shared-warm']['read_bytes']} bytes read from the "
                      "volume in all (goal: none)")
    for e in res["errors"]:
        console.print(f"[red]error:[/red] {e}")
    for left in res["leftovers"]:
        console.print(f"[red]left behind:[/red] {left}")
