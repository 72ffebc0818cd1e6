"""``dsec bench clean-copy``: the cost of a grader's clean copy, beside the ways to get one without it.

An agent's sandbox (busybox, through a ``dsec serve`` of the benchmark's own) holds a kept tree
of ``tree_mb`` MB in ``files`` files under ``/testbed`` (random bytes, ten directories), and has
replaced ``/etc/profile``. Measured, one after another, each ``rounds`` times:

- **DSec** ``sandbox.clean_copy(keep=["/testbed"])``: from the call to the running copy, as the
  client sees it (the server's own figure, ``copy_s``, beside it); the copy is stopped after
  each round, untimed, and a short pause lets the warm pool refill, as between episodes.
- **DSec pack_diff + run**: ``pack_diff()`` and a sandbox of the snapshot (what a trainer did
  before; it carries everything, tampering included: a cost reference, not a clean copy).
- **podman** (the peer): a fresh ``podman run -d`` of the same image layer (``--rootfs DIR:O``)
  and a full copy of the tree into it, ``podman exec src tar -c … | podman exec -i dst tar -x``.

The tree's digest is checked in the first and last copy of each way. Everything runs on this
machine; the server runs containers only (no VM warm-up, no download).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs

from dsec.local import serving
from .lifecycle_peers import PODMAN, PeerRig, _finish
from .results import busybox_store_beside, run_noting, save_results, source_commit

DIGEST = "cd /testbed && find . -type f | sort | xargs md5sum | md5sum | cut -c1-32"


def _fill(tree_mb: int, files: int) -> str:
    size = tree_mb * (1 << 20) // files
    return (f"set -e; i=0; while [ $i -lt {files} ]; do d=/testbed/d$((i % 10)); mkdir -p $d;"
            f" head -c {size} /dev/urandom > $d/f$i; i=$((i + 1)); done; {DIGEST}")


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": statistics.median(xs) * 1000, "p90_ms": xs[int(0.9 * (len(xs) - 1))] * 1000,
            "min_ms": xs[0] * 1000, "max_ms": xs[-1] * 1000}


async def _dsec(client: DSecClient, rounds: int, pack_rounds: int, tree_mb: int, files: int, console: Console) -> dict:
    args = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=1024)
    out: dict = {}
    async with await client.run_container(args) as source:
        filled = await source.run_shell(_fill(tree_mb, files), timeout=600)
        if filled.exit_code != 0:
            raise RuntimeError(f"cannot fill the tree: {filled.stderr[-300:]}")
        digest = filled.stdout.strip()
        await source.run_shell("echo 'echo forged' > /etc/profile")
        for _ in range(2):  # warm-up: the pool of this image and size fills
            async with await source.clean_copy(keep=["/testbed"]):
                pass
            await asyncio.sleep(0.5)
        wall, server, checked = [], [], []
        for i in range(rounds):
            t0 = time.perf_counter()
            copy = await source.clean_copy(keep=["/testbed"])
            wall.append(time.perf_counter() - t0)
            result = copy.clean_copy_result
            server.append(result.copy_s)
            if i in (0, rounds - 1):
                checked.append((await copy.run_shell(DIGEST)).stdout.strip() == digest)
                checked.append((await copy.run_shell("cat /etc/profile 2>/dev/null || true")).stdout != "echo forged\n")
            await copy.stop()
            await asyncio.sleep(0.3)
        out["clean_copy"] = {**_stats(wall), "server": _stats(server), "checked": all(checked),
                             "files": result.files, "bytes": result.bytes, "tampered": result.tampered}
        console.print(f"  clean_copy: p50 {out['clean_copy']['p50_ms']:.1f} ms over {rounds}")
        wall, checked = [], []
        for i in range(pack_rounds):
            t0 = time.perf_counter()
            snap = await source.pack_diff()
            copy = await client.run_container(args.model_copy(update={"container_image": snap.image}))
            wall.append(time.perf_counter() - t0)
            if i in (0, pack_rounds - 1):
                checked.append((await copy.run_shell(DIGEST)).stdout.strip() == digest)
            await copy.stop()
            await client.remove_image(snap.image)
        out["pack_diff_run"] = {**_stats(wall), "checked": all(checked)}
        console.print(f"  pack_diff + run: p50 {out['pack_diff_run']['p50_ms']:.1f} ms over {pack_rounds}")
    out["digest"] = digest
    return out


async def _podman(rig: PeerRig, rounds: int, tree_mb: int, files: int, console: Console) -> dict:
    async def sh(*argv: str, stdin=None) -> tuple[int, bytes, bytes]:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=stdin or asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        return await _finish(proc, argv[1], pipes=True)

    source = await rig.podman_start_idle()
    try:
        rc, out, err = await sh(PODMAN, "exec", source, "/bin/sh", "-c", _fill(tree_mb, files))
        if rc != 0:
            raise RuntimeError(f"podman exec could not fill the tree: {err.decode()[-300:]}")
        own = out.decode().strip()  # (random bytes: a tree and digest of its own)
        wall, checked = [], []
        for i in range(rounds):
            t0 = time.perf_counter()
            dst = await rig.podman_start_idle()
            try:
                # The tree, copied whole into the fresh container (as `cp -a` would, across two).
                pipe = f"{PODMAN} exec {source} tar -C / -cf - testbed | {PODMAN} exec -i {dst} tar -C / -xf -"
                rc, _, err = await sh("/bin/sh", "-c", pipe)
                wall.append(time.perf_counter() - t0)
                if rc != 0:
                    raise RuntimeError(f"the copy into {dst} failed: {err.decode()[-300:]}")
                if i in (0, rounds - 1):
                    rc, out, _ = await sh(PODMAN, "exec", dst, "/bin/sh", "-c", DIGEST)
                    checked.append(out.decode().strip() == own)
            finally:
                await rig.podman_remove([dst])
        console.print(f"  podman run + tar copy: p50 {statistics.median(wall) * 1000:.1f} ms over {rounds}")
        return {**_stats(wall), "checked": all(checked)}
    finally:
        await rig.podman_remove([source])


def main(state_dir: Path, console: Console, rounds: int = 20, pack_rounds: int = 5, podman_rounds: int = 5,
         tree_mb: int = 50, files: int = 500, podman: bool = True, goal_ms: float = 100.0) -> int:
    """Run it, print the table, write ``<state_dir>.json`` (the layer store is kept beside it, in
    ``<state_dir>-store``); 0 when it ran cleanly (and every copy held the tree), 1 otherwise."""
    state_dir = Path(state_dir).resolve()
    os.environ.setdefault("DSEC_VMS", "0")
    os.environ.setdefault("DSEC_GUEST_KERNEL_PACKAGE", "dsec-bench-clean-copy-no-guest-kernel")
    started = datetime.now(timezone.utc)
    state_dir.mkdir(parents=True, exist_ok=True)
    store, image = busybox_store_beside(state_dir)
    r: dict = {"commit": source_commit(), "started": started.isoformat(timespec="seconds"), "rounds": rounds,
               "tree_mb": tree_mb, "files": files, "load_start": os.getloadavg()[0]}
    console.print(f"[bold]dsec bench clean-copy[/bold]: a {tree_mb} MB kept tree in {files} files, "
                  f"{rounds} rounds, commit {r['commit']}, load {r['load_start']:.1f}")
    errors: list[str] = []
    peers = state_dir.parent / f"{state_dir.name}-peers"
    layer_file = store.layer_path(image.layers[0])

    async def run() -> None:
        with serving(state_dir, "--pool-max", "4") as server:
            async with DSecClient(server.endpoint, token=server.token) as client:
                r["dsec"] = await _dsec(client, rounds, pack_rounds, tree_mb, files, console)
        if podman and os.path.exists(PODMAN):
            with PeerRig(peers, layer_file, secrets.token_hex(3)) as rig:
                r["podman"] = await _podman(rig, podman_rounds, tree_mb, files, console)

    run_noting(run(), r, errors)
    r["errors"] = errors
    table = Table(title=f"clean copy of a {tree_mb} MB kept tree ({files} files), commit {r['commit']}")
    for col in ("way", "p50 ms", "p90 ms", "min ms", "runs", "tree checked"):
        table.add_column(col)
    rows = []
    if "dsec" in r:
        cc = r["dsec"]["clean_copy"]
        rows.append(("DSec clean_copy", cc))
        rows.append(("  (server side: copy_s)", {**cc["server"], "checked": cc["checked"]}))
        rows.append(("DSec pack_diff + run (carries everything)", r["dsec"]["pack_diff_run"]))
    if "podman" in r:
        rows.append(("podman run + tar copy of the tree (peer)", r["podman"]))
    for name, s in rows:
        table.add_row(name, f"{s['p50_ms']:.1f}", f"{s['p90_ms']:.1f}", f"{s['min_ms']:.1f}", str(s["n"]),
                      "yes" if s.get("checked") else "NO")
    console.print(table)
    if "dsec" in r and "podman" in r:
        ratio = r["podman"]["p50_ms"] / r["dsec"]["clean_copy"]["p50_ms"]
        r["podman_over_dsec"] = ratio
        p50 = r["dsec"]["clean_copy"]["p50_ms"]
        console.print(f"clean_copy p50 {p50:.1f} ms (goal ≤ {goal_ms:g} ms: {'met' if p50 <= goal_ms else 'MISSED'}); "
                      f"the podman way takes {ratio:.1f}× as long")
    save_results(console, state_dir, r, errors)
    ok = not errors and all(s.get("checked") for _, s in rows)
    return 0 if ok else 1
