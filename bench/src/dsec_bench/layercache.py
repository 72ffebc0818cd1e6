"""``dsec bench layercache``: creates of images whose layer store is on a distributed filesystem
(a GlusterFS volume of the benchmark's own, through its FUSE client, as ``tests/cluster`` runs
it), with and without the node's layer cache (dsec.images.layercache), against the same creates
with the store on local disk, in the same run.

The images: the burst benchmark's (``dsec bench burst``): one base layer (python + Python
packages, over 300 MB; ``--base python``: the bare python image, 251 MB) and ``images`` (M) workspace layers of a few hundred generated files, task
image i = base + workspace i. Each create runs its task (``python3 /workspace/task.py``: imports
from the base's stdlib, reads files of its workspace and its base) and the digest it prints is
checked.

Four arms, one after the other, each one ``dsec serve`` (no warm pool) and each from a cold page
cache (``sync; echo 3 > /proc/sys/vm/drop_caches``): the store on local disk; the store on the
volume with no cache (what a node did before the cache); the store on the volume with an empty
cache (cold); the same server's node stopped and started again and the page cache dropped, its
cache kept on its disk (warm). In each arm every image is created ``per_image`` times, one
image after another (``run_containers(count=per_image)``), each create and task timed.

Bytes read from the shared filesystem: gluster's own count of what its brick served to reads
(``gluster volume profile``), taken before and after each image's creates: everything a node
read of the volume (layers, manifests, the store's checks). The images' bytes: the sizes of their
distinct layer files (the base once). The goal (issue 35): a warm cache reads nothing of an
image's layers from the shared filesystem; the cold reads are the fraction a task needs.
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
ARMS = ("local", "shared-nocache", "shared-cold", "shared-warm")


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


async def _creates(server: LocalServer, base: str, names: list[str], expected: list[str], per_image: int,
                   read_bytes, errors: list[str]) -> dict:
    """Every image created ``per_image`` times, one image after another: per image its create
    and task times and the bytes read from the volume (None: not on the volume)."""
    out: dict[str, Any] = {"create_s": [], "task_s": [], "read_bytes": []}
    async with DSecClient(server.endpoint, token=server.token) as client:
        for name, digest in zip(names, expected):
            before = read_bytes()
            t0 = time.perf_counter()
            sandboxes = await client.run_containers(DSecContainerRunArgs(
                container_image=base, workspace=name, memory_limit_mb=256, cpu_cores_limit=1), count=per_image)
            created = time.perf_counter() - t0
            out["create_s"].append(created)
            try:
                for s in sandboxes:
                    t1 = time.perf_counter()
                    result = await s.run_shell(" ".join(burst.TASK_CMD), timeout=120)
                    out["task_s"].append(time.perf_counter() - t1)
                    try:
                        got = json.loads(result.stdout.strip().splitlines()[-1])["digest"]
                    except (ValueError, IndexError, KeyError):
                        got = None
                    if result.exit_code != 0 or got != digest:
                        errors.append(f"{name}: task exit {result.exit_code}, digest {got} (want {digest}): "
                                      f"{result.stderr[-300:]}")
            finally:
                await asyncio.gather(*(s.stop() for s in sandboxes), return_exceptions=True)
            after = read_bytes()
            out["read_bytes"].append(None if before is None else after - before)
    return out


def _summary(arm: dict, per_image: int) -> dict:
    creates = arm["create_s"]
    reads = [r for r in arm["read_bytes"] if r is not None]
    return {
        "create_p50_s": statistics.median(creates), "create_max_s": max(creates),
        "create_per_sandbox_s": statistics.median(creates) / per_image,
        "task_p50_s": statistics.median(arm["task_s"]),
        "read_bytes": sum(reads) if reads else None,
    }


def main(state_dir: Path, console: Console, command: str = "dsec bench layercache", images: int = 4,
         per_image: int = 4, cache_mb: int = 4096, base: str = "python-pkgs",
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
                           "options": {"images": images, "per_image": per_image, "cache_mb": cache_mb, "base": base}, "arms": {}}
    console.print(f"[bold]dsec bench layercache[/bold]: {images} images × {per_image} creates per arm; state in "
                  f"{state_dir}; load average {' '.join(res['loadavg_at_start'])}")
    local = LayerStore(state_dir / "store")
    work = state_dir / "work"
    work.mkdir(exist_ok=True)
    base, names, expected = _images(local, work, images, base, base_store, console.print)
    volume = GlusterVolume(Path(f"/tmp/dsec-lc-{os.getpid()}"))
    servers: list[LocalServer] = []
    try:
        volume.start()
        shared = LayerStore(volume.mountpoint / "store")
        image_bytes = _copy_images(local, shared, names, base)
        res["image_bytes"] = image_bytes
        volume.start_profile()
        for arm in ARMS:
            arm_dir = state_dir / ("arm-" + ("warm-cold" if arm in ("shared-cold", "shared-warm") else arm))
            if arm == "shared-cold":
                shutil.rmtree(arm_dir, ignore_errors=True)
            if arm != "shared-warm":
                shutil.rmtree(arm_dir / "node" / "layer-cache", ignore_errors=True)
            burst.drop_caches()
            store_dir = local.root if arm == "local" else shared.root
            server = _server(arm_dir, store_dir, 0 if arm in ("local", "shared-nocache") else cache_mb)
            servers.append(server)
            read = (lambda: None) if arm == "local" else volume.data_read
            console.print(f"arm {arm}: creating")
            measured = asyncio.run(_creates(server, base, names, expected, per_image, read, errors))
            server.stop_sandboxes()
            server.stop()
            servers.remove(server)
            res["arms"][arm] = {**measured, **_summary(measured, per_image)}
    except Exception as exc:  # noqa: BLE001 - reported, then cleaned up
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        for server in servers:
            with contextlib.suppress(Exception):
                server.stop_sandboxes()
                server.stop()
        volume.close()
        left = volume.leftovers()
        for arm_dir in state_dir.glob("arm-*"):
            left += leftovers(arm_dir)
        res["leftovers"] = left
    res["errors"] = errors
    warm = res["arms"].get("shared-warm", {}).get("read_bytes")
    res["goal_met"] = None if warm is None else warm == 0  # a warm create reads nothing of the volume
    _report(console, res)
    (state_dir / RESULTS_FILE).write_text(json.dumps(res, indent=1))
    console.print(f"results: {state_dir / RESULTS_FILE}")
    return 1 if errors or res["leftovers"] else 0


def _report(console: Console, res: dict) -> None:
    arms = res["arms"]
    total = res.get("image_bytes") or 0
    table = Table(title=f"creates of {res['options']['images']} images × {res['options']['per_image']} "
                        f"(images: {total / 1e6:.0f} MB of layers)")
    for col in ("arm", "create p50 (s)", "create max (s)", "task p50 (s)", "read from the volume", "per create",
                "of the images", "create p50 ÷ local"):
        table.add_column(col, no_wrap=col == "arm")
    base = arms.get("local", {}).get("create_p50_s")
    for arm, a in arms.items():
        read = a["read_bytes"]
        creates = len(a["task_s"]) or 1
        table.add_row(arm, f"{a['create_p50_s']:.3f}", f"{a['create_max_s']:.3f}", f"{a['task_p50_s']:.3f}",
                      "—" if read is None else f"{read / 1e6:.2f} MB",
                      "—" if read is None else f"{read / creates / 1e6:.2f} MB",
                      "—" if read is None or not total else f"{100 * read / total:.1f}%",
                      f"{a['create_p50_s'] / base:.2f}×" if base else "—")
    console.print(table)
    if "shared-warm" in arms:
        console.print(f"warm cache (after a node restart): {arms['shared-warm']['read_bytes']} bytes read from the "
                      "volume in all (goal: none)")
    for e in res["errors"]:
        console.print(f"[red]error:[/red] {e}")
    for left in res["leftovers"]:
        console.print(f"[red]left behind:[/red] {left}")
