"""``dsec bench fork``: forking a live sandbox into many, against what one has without a fork.

Two arms (``kind``): ``container`` (below) and ``microvm`` (``fork_microvm``: a microVM parent
holding memory forked into children restored from one memory image, against as many cold boots).

Container: forking a live container into many, against the way a container engine does it
(``podman commit`` of the parent, then a ``podman run`` of the result for each child).

A parent container (busybox, through a ``dsec serve`` of the benchmark's own) has ``changed_mb``
MB changed in ``files`` files (random bytes, under ``/work``). Measured, one way after the other:

- **DSec** ``sandbox.fork(count=children)``: from the call until every child answered a command
  (``cat`` of one of the parent's files), as the client sees it; the server's own ``fork_s`` and
  how long the parent was frozen (``frozen_s``) beside it; the layer the fork packed, written once
  for all the children.
- **podman** (the peer): ``podman commit`` of a parent made the same way (from a podman image of
  the same busybox layer), then ``children`` × ``podman run -d`` of the committed image, at most
  ``concurrency`` at once, until every child answered the same command (``podman exec``).

Each child's copy of one file is checked against the parent's digest. Everything runs on this
machine; the server runs containers only.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs

from dsec.local import serving
from .lifecycle_peers import PODMAN, PODMAN_FLAGS, SLEEP_ARGS, PeerRig, _finish
from .results import busybox_store_beside, run_noting, save_results, source_commit

CHECK = "md5sum /work/d0/f0 | cut -c1-32"


def _fill(changed_mb: int, files: int) -> str:
    size = max(1, changed_mb * (1 << 20) // files)
    return (f"set -e; i=0; while [ $i -lt {files} ]; do d=/work/d$((i % 20)); mkdir -p $d;"
            f" head -c {size} /dev/urandom > $d/f$i; i=$((i + 1)); done; {CHECK}")


async def _dsec(client: DSecClient, children: int, changed_mb: int, files: int, console: Console) -> dict:
    # A writable layer holds up to half the memory limit (dsec.isolation.disk): room for the changes.
    args = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=max(64, 3 * changed_mb + 16))
    async with await client.run_container(args) as parent:
        filled = await parent.run_shell(_fill(changed_mb, files), timeout=600)
        if filled.exit_code != 0:
            raise RuntimeError(f"cannot fill the parent: {filled.stderr[-300:]}")
        digest = filled.stdout.strip()
        t0 = time.perf_counter()
        made = await parent.fork(count=children)
        forked = time.perf_counter() - t0
        try:
            answers = await asyncio.gather(*(child.run_shell(CHECK) for child in made))
            answering = time.perf_counter() - t0
        finally:
            await asyncio.gather(*(child.stop() for child in made), return_exceptions=True)
        result = made[0].fork_result
        checked = all(a.exit_code == 0 and a.stdout.strip() == digest for a in answers)
        alive = (await parent.run_shell(CHECK)).stdout.strip() == digest
    out = {"children": children, "fork_s": forked, "all_answering_s": answering, "server_fork_s": result.fork_s,
           "frozen_s": result.frozen_s, "kind": result.kind, "checked": checked and alive, "layer": result.layer}
    console.print(f"  DSec fork: {children} children in {forked:.2f} s, all answering at {answering:.2f} s "
                  f"(parent frozen {result.frozen_s * 1000:.0f} ms)")
    return out


async def _sh(*argv: str, stdin=None) -> tuple[int, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(*argv, stdin=stdin or asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    return await _finish(proc, argv[1] if len(argv) > 1 else argv[0], pipes=True)


async def _podman(rig: PeerRig, children: int, changed_mb: int, files: int, concurrency: int,
                  console: Console) -> dict:
    base, committed = f"{rig.podman_prefix}base", f"{rig.podman_prefix}committed"
    rc, _, err = await _sh("/bin/sh", "-c", f"tar -C {rig.rootfs} -cf - . | {PODMAN} import - {base}")
    if rc != 0:
        raise RuntimeError(f"podman import of the busybox layer failed: {err.decode()[-300:]}")
    parent = rig.podman_prefix + "parent"
    names: list[str] = []
    try:
        rc, _, err = await _sh(PODMAN, "run", "-d", "--name", parent, *PODMAN_FLAGS, base, *SLEEP_ARGS)
        if rc != 0:
            raise RuntimeError(f"podman run of the parent failed: {err.decode()[-300:]}")
        rc, out, err = await _sh(PODMAN, "exec", parent, "/bin/sh", "-c", _fill(changed_mb, files))
        if rc != 0:
            raise RuntimeError(f"podman exec could not fill the parent: {err.decode()[-300:]}")
        digest = out.decode().strip()
        room = asyncio.Semaphore(concurrency)

        async def child(i: int) -> bool:
            name = f"{rig.podman_prefix}child{i}"
            names.append(name)
            async with room:
                rc, _, err = await _sh(PODMAN, "run", "-d", "--name", name, *PODMAN_FLAGS, committed, *SLEEP_ARGS)
                if rc != 0:
                    raise RuntimeError(f"podman run of child {i} failed: {err.decode()[-300:]}")
                rc, out, _ = await _sh(PODMAN, "exec", name, "/bin/sh", "-c", CHECK)
                return rc == 0 and out.decode().strip() == digest

        t0 = time.perf_counter()
        rc, _, err = await _sh(PODMAN, "commit", "-q", parent, committed)
        if rc != 0:
            raise RuntimeError(f"podman commit failed: {err.decode()[-300:]}")
        committed_s = time.perf_counter() - t0
        answers = await asyncio.gather(*(child(i) for i in range(children)))
        answering = time.perf_counter() - t0
    finally:
        await rig.podman_remove([parent, *names])
        await _sh(PODMAN, "rmi", "-f", committed, base)
    console.print(f"  podman commit + {children} runs: commit {committed_s:.2f} s, all answering at {answering:.2f} s")
    return {"children": children, "commit_s": committed_s, "all_answering_s": answering, "checked": all(answers)}


def main(state_dir: Path, console: Console, children: int = 100, changed_mb: int = 50, files: int = 2000,
         podman: bool = True, concurrency: int = 8, goal_ratio: float = 20.0, goal_s: float = 2.0) -> int:
    """Run it, print the table, write ``<state_dir>.json`` (the layer store is kept beside it, in
    ``<state_dir>-store``); 0 when it ran cleanly and every child held the parent's files."""
    state_dir = Path(state_dir).resolve()
    os.environ.setdefault("DSEC_VMS", "0")
    os.environ.setdefault("DSEC_GUEST_KERNEL_PACKAGE", "dsec-bench-fork-no-guest-kernel")
    started = datetime.now(timezone.utc)
    state_dir.mkdir(parents=True, exist_ok=True)
    store, image = busybox_store_beside(state_dir)
    r: dict = {"commit": source_commit(), "started": started.isoformat(timespec="seconds"), "children": children,
               "changed_mb": changed_mb, "files": files, "load_start": os.getloadavg()[0]}
    console.print(f"[bold]dsec bench fork[/bold]: a parent with {changed_mb} MB changed in {files} files forks "
                  f"{children} children; commit {r['commit']}, load {r['load_start']:.1f}")
    errors: list[str] = []

    async def run() -> None:
        with serving(state_dir, "--pool-max", "0") as server:
            async with DSecClient(server.endpoint, token=server.token) as client:
                r["dsec"] = await _dsec(client, children, changed_mb, files, console)
                # Written once for all the children (each child's own writable layer holds its
                # machine id only).
                r["dsec"]["layer_bytes"] = store.layer_size(r["dsec"]["layer"])
        if podman and os.path.exists(PODMAN):
            peers = state_dir.parent / f"{state_dir.name}-peers"
            with PeerRig(peers, store.layer_path(image.layers[0]), secrets.token_hex(3)) as rig:
                r["podman"] = await _podman(rig, children, changed_mb, files, concurrency, console)

    run_noting(run(), r, errors)
    r["errors"] = errors
    table = Table(title=f"fork of a parent with {changed_mb} MB in {files} files into {children} children")
    for col in ("way", "until all answer (s)", "of which", "children checked"):
        table.add_column(col)
    if "dsec" in r:
        d = r["dsec"]
        table.add_row(f"DSec fork ({d['kind']})", f"{d['all_answering_s']:.2f}",
                      f"fork {d['fork_s']:.2f} s, parent frozen {d['frozen_s'] * 1000:.0f} ms, "
                      f"one layer of {d['layer_bytes'] / 1e6:.1f} MB written",
                      "yes" if d["checked"] else "NO")
    if "podman" in r:
        p = r["podman"]
        table.add_row("podman commit + run each (peer)", f"{p['all_answering_s']:.2f}", f"commit {p['commit_s']:.2f} s",
                      "yes" if p["checked"] else "NO")
    console.print(table)
    if "dsec" in r and "podman" in r:
        ratio = r["podman"]["all_answering_s"] / r["dsec"]["all_answering_s"]
        r["podman_over_dsec"] = ratio
        r["goals"] = {"ratio": ratio >= goal_ratio, "all_answering": r["dsec"]["all_answering_s"] <= goal_s}
        console.print(f"podman takes {ratio:.1f}× as long as DSec's fork (goal ≥ {goal_ratio:g}×: "
                      f"{'met' if r['goals']['ratio'] else 'MISSED'}); DSec's children all answer in "
                      f"{r['dsec']['all_answering_s']:.2f} s (goal ≤ {goal_s:g} s: "
                      f"{'met' if r['goals']['all_answering'] else 'MISSED'})")
    save_results(console, state_dir, r, errors)
    ok = not errors and all(r[w]["checked"] for w in ("dsec", "podman") if w in r)
    return 0 if ok else 1
