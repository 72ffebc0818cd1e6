"""``dsec bench pulls``: pulling many task images that share a base, from a registry on loopback.

The inputs (untimed): a base (the ``python`` image's layer, about 400 MB, or busybox with
``--base busybox``) and ``images`` small workspaces of their own (``burst.generate_workspace``),
each task image the base's layer and its workspace's, gzip-compressed as a registry serves
them, pushed to Debian's ``docker-registry`` on 127.0.0.1 (the base blob once).

Then, in the same run, from the same registry, each into a store of its own made for the run:

- **DSec** ``dsec image pull --many`` (``images.pulls.pull_many``): each blob fetched once, each
  layer converted once to EROFS, ``concurrency`` images at a time;
- **the peer** ``skopeo copy docker://… containers-storage:…`` of each image into one
  containers-storage (overlay driver: layers shared, the base applied once), the first alone
  and the rest ``concurrency`` at a time, as DSec's.

Timed from the first fetch to the last image ready; beside each: the bytes its store holds.
The goal (issue: "pulling 32 images that share a base ≥ 2× faster than skopeo copy of each into
containers-storage in the same run") is the ratio. Results go to ``<state_dir>.json``;
everything is removed at the end (stores, the registry, containers-storage's mounts).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dsec import _sys
from dsec.images.builders import build_busybox
from dsec.images.pulls import pull_many
from dsec.images.store import LayerStore
from .burst import SKOPEO, Registry, ensure_python, generate_workspace, mounted_layer, put_blob
from .results import save_results, source_commit

GOAL_RATIO = 2.0
TEST_STORE = Path("/var/lib/dsec-test/store")
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def _du(path: Path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else 0


def _cpu_since(c0: os.times_result) -> float:
    """CPU seconds this process and the children it waited for (skopeo, mkfs.erofs, conversion
    processes) used since ``c0``: beside the wall time, what a way costs when other work shares
    the machine's cores (the registry's own is neither way's)."""
    c1 = os.times()
    return sum(c1[i] - c0[i] for i in range(4))


def _gzip_tar(src: Path, out: Path, *members: str) -> None:
    # /dev's nodes stay out, as an image built by docker or buildah has none (a layer may not
    # carry device nodes: DSec refuses them).
    with open(out, "wb") as f:
        tar = subprocess.Popen(["tar", "--numeric-owner", "--exclude=./dev/*", "-C", str(src), "-cf", "-", *members],
                               stdout=subprocess.PIPE)
        subprocess.run(["gzip", "-1", "-n"], stdin=tar.stdout, stdout=f, check=True)
        if tar.wait() != 0:
            raise RuntimeError(f"tar of {src} failed")


def prepare(work: Path, base: str, images: int, files: int, registry: Registry, log) -> list[str]:
    """The task images pushed to ``registry``; their references."""
    inputs = LayerStore(work / "inputs-store")
    if base == "python":
        image = ensure_python(inputs, TEST_STORE if TEST_STORE.is_dir() else Path("/var/lib/dsec/store"), log)
    else:
        image = inputs.get_image("busybox") if inputs.has_image("busybox") else build_busybox(inputs)
    layout = work / "oci"
    blobs = layout / "blobs/sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def blob(path: Path | None = None, data: bytes | None = None) -> dict:
        return put_blob(blobs, path, data, move=True)  # (the next workspace's tar takes its path)

    def diff_id(entry: dict) -> str:
        h = hashlib.sha256()
        with gzip.open(blobs / entry["digest"].split(":")[1]) as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return f"sha256:{h.hexdigest()}"

    log(f"inputs: the {base} layer as a gzip layer, {images} workspaces of {files} files")
    with mounted_layer(inputs.layer_path(image.layers[0]), work / "mnt-base") as mnt:
        _gzip_tar(mnt, work / "base.tgz", ".")
    base_entry = {"mediaType": LAYER, **blob(work / "base.tgz")}
    base_diff = diff_id(base_entry)
    refs = []
    for i in range(images):
        src = work / "gen" / f"ws-{i:03d}"
        generate_workspace(src / "workspace", i, files)
        _gzip_tar(src, work / "ws.tgz", "workspace")
        shutil.rmtree(src)
        ws = {"mediaType": LAYER, **blob(work / "ws.tgz")}
        config = {"architecture": "amd64", "os": "linux",
                  "config": {"Env": [f"{k}={v}" for k, v in image.env.items()], "WorkingDir": "/workspace",
                             "Cmd": ["/bin/sh"]},
                  "rootfs": {"type": "layers", "diff_ids": [base_diff, diff_id(ws)]}}
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                               **blob(data=json.dumps(config).encode())},
                    "layers": [base_entry, ws]}
        m = blob(data=json.dumps(manifest).encode())
        (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", **m}]}))
        (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        ref = f"{registry.address}/bench/task-{i:03d}:v1"
        subprocess.run([SKOPEO, "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout}", f"docker://{ref}"],
                       check=True, capture_output=True, timeout=900)
        refs.append(ref)
    shutil.rmtree(layout, ignore_errors=True)
    return refs


def dsec_arm(work: Path, refs: list[str], concurrency: int) -> dict:
    store = LayerStore(work / "dsec-store")
    marks: dict[str, float] = {}

    def event(_name: str, stage: str, _done: int, _total: int) -> None:
        marks.setdefault(stage, time.perf_counter())  # the first image to reach each stage

    c0, t0 = os.times(), time.perf_counter()
    results = pull_many(store, [(f"task-{i:03d}", ref) for i, ref in enumerate(refs)], insecure=True,
                        concurrency=concurrency, on_event=event, processes=True)  # (as the CLI's)
    seconds = time.perf_counter() - t0
    cpu = _cpu_since(c0)
    errors = [str(r) for r in results if isinstance(r, Exception)]
    images = [r for r in results if not isinstance(r, Exception)]
    return {"seconds": seconds, "cpu_s": cpu, "fetched_s": marks.get("converting", t0) - t0, "images": len(images),
            "errors": errors,
            "distinct_layers": len({d for i in images for d in i.layers}),
            "base_layers": len({i.layers[0] for i in images}), "store_bytes": _du(store.layers_dir)}


class ContainersStorage:
    """One containers-storage (overlay driver) under ``root``, its runroot under /run; ``close``
    unmounts what it mounted and removes both."""

    def __init__(self, root: Path, tag: str) -> None:
        self.root, self.run = root, Path(f"/run/dsec-bench-pulls-{tag}")

    def transport(self, ref: str) -> str:
        return f"containers-storage:[overlay@{self.root}+{self.run}]{ref.split('/', 1)[1]}"

    def close(self) -> None:
        for base in (self.run, self.root):
            for t in sorted((t for t in _sys.mounted_targets() if t == str(base) or t.startswith(f"{base}/")),
                            key=len, reverse=True):
                with contextlib.suppress(OSError):
                    _sys.umount(t, _sys.MNT_DETACH)
            shutil.rmtree(base, ignore_errors=True)


def peer_arm(work: Path, refs: list[str], concurrency: int) -> dict:
    storage = ContainersStorage(work / "containers", hashlib.sha1(str(work).encode()).hexdigest()[:8])
    errors: list[str] = []

    def copy(ref: str) -> None:
        proc = subprocess.run([SKOPEO, "copy", "--quiet", "--src-tls-verify=false", f"docker://{ref}",
                               storage.transport(ref)], capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            errors.append(f"skopeo copy {ref}: {proc.stderr.strip()[-300:]}")

    try:
        c0, t0 = os.times(), time.perf_counter()
        copy(refs[0])
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(copy, refs[1:]))
        seconds = time.perf_counter() - t0
        cpu = _cpu_since(c0)
        size = _du(storage.root)
    finally:
        storage.close()
    return {"seconds": seconds, "cpu_s": cpu, "images": len(refs) - len(errors), "errors": errors, "store_bytes": size}


def main(state_dir: Path, console: Console, images: int = 32, files: int = 200, base: str = "python",
         concurrency: int = 4, peer: bool = True) -> int:
    state_dir = Path(state_dir).resolve()
    r: dict = {"commit": source_commit(), "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "images": images, "files": files, "base": base, "concurrency": concurrency,
               "load_start": os.getloadavg()[0]}
    console.print(f"[bold]dsec bench pulls[/bold]: {images} task images over one {base} base from a loopback "
                  f"registry; commit {r['commit']}, load {r['load_start']:.1f}")
    errors: list[str] = []
    if shutil.which(SKOPEO) is None and not os.path.exists(SKOPEO):
        console.print("[red]error:[/red] skopeo is needed (apt-get install skopeo; scripts/setup-host.sh does)")
        return 2
    shutil.rmtree(state_dir, ignore_errors=True)
    state_dir.mkdir(parents=True)
    registry = Registry(state_dir / "registry")
    try:
        registry.start()
        with console.status("inputs …") as status:
            refs = prepare(state_dir, base, images, files, registry, status.update)
        with console.status(f"DSec: pull --many of {images} images …"):
            r["dsec"] = dsec_arm(state_dir, refs, concurrency)
        errors += r["dsec"]["errors"]
        console.print(f"  DSec: {r['dsec']['images']} images in {r['dsec']['seconds']:.2f} s "
                      f"({r['dsec']['cpu_s']:.1f} CPU s), {r['dsec']['distinct_layers']} layers converted")
        if peer:
            with console.status(f"peer: skopeo copy of each into containers-storage ({images}) …"):
                r["peer"] = peer_arm(state_dir, refs, concurrency)
            errors += r["peer"]["errors"]
            console.print(f"  skopeo into containers-storage: {r['peer']['images']} images in "
                          f"{r['peer']['seconds']:.2f} s ({r['peer']['cpu_s']:.1f} CPU s)")
    except Exception as exc:  # noqa: BLE001 - reported
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        registry.stop()
        with contextlib.suppress(OSError):
            _sys.umount(str(state_dir / "mnt-base"), _sys.MNT_DETACH)
        shutil.rmtree(state_dir, ignore_errors=True)
    r["load_end"] = os.getloadavg()[0]
    if "dsec" in r and "peer" in r and r["dsec"]["seconds"] > 0:
        r["ratio"] = r["peer"]["seconds"] / r["dsec"]["seconds"]
        r["goal_met"] = r["ratio"] >= GOAL_RATIO
    table = Table(title=f"{images} task images sharing a {base} base, from a registry on loopback, "
                        f"{concurrency} at a time")
    for col in ("way", "all images ready (s)", "CPU (s)", "store bytes", "notes"):
        table.add_column(col)
    if "dsec" in r:
        d = r["dsec"]
        table.add_row("DSec `image pull --many`", f"{d['seconds']:.2f}", f"{d['cpu_s']:.1f}",
                      f"{d['store_bytes'] / 1e6:.0f} MB",
                      f"all fetched at {d['fetched_s']:.2f} s; {d['distinct_layers']} EROFS layers; the base "
                      f"converted {d['base_layers']}×")
    if "peer" in r:
        table.add_row("`skopeo copy` into containers-storage (peer)", f"{r['peer']['seconds']:.2f}",
                      f"{r['peer']['cpu_s']:.1f}",
                      f"{r['peer']['store_bytes'] / 1e6:.0f} MB", "overlay driver")
    console.print(table)
    if "ratio" in r:
        console.print(f"the peer takes {r['ratio']:.2f}× as long (goal ≥ {GOAL_RATIO:g}×: "
                      f"{'met' if r['goal_met'] else 'MISSED'})")
    r["errors"] = errors
    save_results(console, state_dir, r, errors)
    return 0 if not errors else 1
