"""``dsec bench burst``: a burst of sandboxes from many task images that share one base, with the
images read on demand (DSec) against pulling them first (eager) and against podman — the DSec
report's 8,192-container burst at this machine's scale.

The images. One base layer of at least 300 MB (by default the ``python`` image — Debian bookworm
minbase with python3, bash and git, 251 MB unpacked — plus 71 MB of Python packages, the ones in
this project's virtualenv, as a task base with its pip dependencies would hold; ``--base python``
takes the bare image) and ``images`` (M, 32) workspace layers, each a few hundred generated files
distinct per task with a ``task.py``. Task image i = base + workspace i.

The run. ``count`` (N, 256) sandboxes, N/M per image, all started at once; as soon as a sandbox
runs, its task runs in it: ``python3 /workspace/task.py`` reads five data files and a module of its
workspace and two files of the base, imports from the base's stdlib, writes one small file and
prints a digest the benchmark checks. Three arms, one after the other, each from a cold page
cache (``sync; echo 3 > /proc/sys/vm/drop_caches`` before it):

- DSec (on demand): one ``dsec serve`` (no warm pool); the M images are created with M concurrent
  ``run_containers(DSecContainerRunArgs(container_image=base, workspace=ws_i), count=N/M)``
  calls, and each sandbox's task runs through ``run_shell``. Layers are EROFS files mounted where
  they lie; the kernel reads only the blocks a task touches. A DSec sandbox's writable upper lives
  on a tmpfs (the edge's ``node/run``), charged to its memory limit: its writes never reach disk.
- The registry: before the arms (untimed) every task image is pushed, as the layered OCI image it
  is (the base layer and its workspace layer, uncompressed tars: no gunzip on the peers' side),
  with ``skopeo copy`` to a ``docker-registry`` (Debian's distribution 2.8) on 127.0.0.1; the
  registry holds the base blob once.
- eager (pull, then run; the peer the goals are judged against): each task image is pulled with
  ``podman pull`` from that registry into one containers-storage (overlay driver) under the
  state dir, a store that shares layers: the first image brings the base, the rest only their
  workspace layers, ``pull_concurrency`` at a time after the first. As soon as an image is
  pulled it is mounted (``podman image mount``: its layers' read-only overlay) and its sandboxes
  start with bare ``crun run --detach`` over a private overlay on it (upper and work dirs on disk,
  as a containerd snapshotter keeps them; crun state and bundles on a tmpfs, as under /run); each
  task runs with ``crun exec``. This is what a pull-then-run node (containerd and runc, or CRI-O)
  does, without the daemon's own overhead.
- podman: the same pulls into a podman storage of its own, then ``podman run --rm`` of the task
  for each sandbox of that image. podman can be capped at fewer sandboxes (``podman_max``; the
  images are cut in the same proportion) and says so.

A peer whose tools are missing (podman; docker-registry and skopeo for the registry) is skipped
with the package to install; DSec's arm still runs.

At most ``concurrency`` (32) creates and ``concurrency`` tasks are in flight at once in the peer
arms; DSec's server runs each batch with its own concurrency. Figures per arm: time to
all-running (the last sandbox running: DSec's create returned, crun's ``run --detach`` returned;
podman: the last task's own start stamp, the first moment podman shows a running container),
time to all-tasks-done, and bytes written to the block device that holds the state dir
(sectors written in ``/sys/dev/block/MAJ:MIN/stat`` × 512, read after a ``sync`` at the end of the
arm; untimed). That device is shared with everything else on the machine: the background write
rate is sampled before the arms and reported.

Everything runs on 127.0.0.1. At the end the server is stopped, every crun container, mount,
cgroup, podman image and container, unpacked dir, tar and generated workspace is removed (the
layer store under ``<state_dir>/store`` is kept as a cache), and ``leftovers()`` is printed.
Results go to ``<state_dir>/bench-burst.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import math
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs, Sandbox

from dsec import _sys
from dsec.images.builders import build_python
from dsec.images.sources import workspace_from_dir
from dsec.images.store import Image, LayerStore
from dsec.local import LocalServer, leftovers
from dsec.resources import cgroups

RESULTS_FILE = "bench-burst.json"
CRUN = shutil.which("crun") or "/usr/bin/crun"
PODMAN = shutil.which("podman") or "/usr/bin/podman"
PODMAN_RUN_FLAGS = ("--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
PYTHON = "/usr/bin/python3"
TASK_CMD = [PYTHON, "/workspace/task.py"]
BASE_NAME = "burst-base"
BASE_MIN_BYTES = 300 * 10**6
GOAL_SPEEDUP = 2.0          # eager all-tasks-done ÷ DSec's
GOAL_FEWER_WRITES = 0.70    # 1 − DSec bytes written ÷ eager's
REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"
SKOPEO = shutil.which("skopeo") or "/usr/bin/skopeo"
REPOSITORY = "dsec-burst/task"
# What each peer needs on the machine, and how to get it (Debian's packages).
PEER_TOOLS = {"registry": ((REGISTRY_BIN, "docker-registry"), (SKOPEO, "skopeo")), "podman": ((PODMAN, "podman"),)}


def missing_tools(peer: str) -> list[str]:
    """The Debian packages a peer needs that are not installed here."""
    return [package for path, package in PEER_TOOLS[peer] if not os.access(path, os.X_OK)]

# What every task reads: five data files and a module of its workspace, two files of its base.
WS_READS = ("data/f007.txt", "data/f042.txt", "data/f099.txt", "data/f123.txt", "data/f180.txt", "src/pkg/mod_017.py")
BASE_READS = ("/etc/debian_version", "/usr/lib/python3.11/json/decoder.py")

TASK_PY = '''\
import hashlib, json, os, sys, time
start = time.time()
import json.decoder, email.parser  # modules of the base
h = hashlib.sha256()
for path in {reads!r}:
    with open(path, "rb") as f:
        h.update(f.read())
with open("/workspace/out.txt", "w") as f:
    f.write(h.hexdigest())
print(json.dumps({{"task": {task}, "start": start, "digest": h.hexdigest(), "files": len(os.listdir("/workspace/data"))}}))
'''


@dataclass
class Options:
    count: int = 256              # N sandboxes
    images: int = 32              # M task images
    files: int = 300              # files per workspace (data/ + src/)
    concurrency: int = 32         # peer creates and tasks in flight
    pull_concurrency: int = 2     # images unpacked / imported at once (eager, podman)
    base: str = "python-pkgs"     # "python-pkgs" (python + site-packages) or "python"
    base_store: str = "/var/lib/dsec-test/store"  # where a built python image may be linked from
    podman: bool = True
    podman_max: int = 0           # most podman sandboxes (0: all N)
    memory_mb: int = 128           # every arm's memory limit per sandbox
    arm_timeout_s: float = 900.0
    quick: bool = False
    strict: bool = False


class BenchError(RuntimeError):
    pass


# -- host facts -----------------------------------------------------------------------------


def loadavg() -> list[str]:
    return open("/proc/loadavg").read().split()[:3]


def block_device_of(path: Path) -> tuple[str, str]:
    """(MAJ:MIN, name) of the block device holding ``path``, from the longest matching mount."""
    path = str(Path(path).resolve())
    best, best_len = None, -1
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            target = fields[4].encode().decode("unicode_escape")
            if (path == target or path.startswith(target.rstrip("/") + "/")) and len(target) > best_len:
                best, best_len = fields[2], len(target)
    if best is None or not Path(f"/sys/dev/block/{best}/stat").exists():
        raise BenchError(f"cannot find the block device of {path} (mount device {best})")
    name = Path(os.path.realpath(f"/sys/dev/block/{best}")).name
    return best, name


def sectors_written(majmin: str) -> int:
    return int(Path(f"/sys/dev/block/{majmin}/stat").read_text().split()[6])


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "not available"
    return out.splitlines()[0] if out else "not available"


def machine(state_dir: Path, majmin: str, dev: str) -> dict:
    mem = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal")).split()[1]) * 1024
    sysdev = Path(f"/sys/dev/block/{majmin}")
    disk = sysdev if (sysdev / "queue").exists() else sysdev.resolve().parent
    try:
        size = int((disk / "size").read_text()) * 512
        rotational = (disk / "queue/rotational").read_text().strip() == "1"
    except OSError:
        size, rotational = 0, None
    fstype = next((line.split()[2] for line in open("/proc/mounts")
                   if line.split()[1] == _mount_point(state_dir)), "?")
    return {
        "cores": os.cpu_count(), "memory_total_gib": round(mem / 2**30, 1), "kernel": platform.release(),
        "disk": f"/dev/{dev} ({majmin}), {size / 2**30:.0f} GiB virtual disk, "
                f"{'rotational' if rotational else 'non-rotational'}, {fstype}",
        "cgroups": cgroups.version(), "crun": _first_line([CRUN, "--version"]),
        "podman": _first_line([PODMAN, "--version"]), "python": platform.python_version(),
    }


def _mount_point(path: Path) -> str:
    p = Path(path).resolve()
    while not os.path.ismount(p):
        p = p.parent
    return str(p)


def _remove_tree(path: Path) -> None:
    """``rm -rf`` (hundreds of thousands of unpacked files go several times faster than with
    shutil.rmtree); shutil for what it leaves."""
    if path.exists():
        subprocess.run(["rm", "-rf", "--one-file-system", str(path)], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description:<52}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console)


async def _sh(*argv: str, timeout: float = 600.0, log: Path | None = None) -> tuple[int, str]:
    """Run a command; returns (exit code, stdout + stderr). With ``log`` the output goes to that
    file: ``crun run --detach`` hands its stdio to the container, which keeps a pipe open."""
    out_file = open(log, "w+b") if log is not None else None  # noqa: SIM115
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out_file or asyncio.subprocess.PIPE,
            stderr=out_file or asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return -1, f"{argv[0]} timed out after {timeout}s"
        if out_file is not None:
            out_file.seek(0)
            out, err = out_file.read(), b""
        return proc.returncode or 0, (out + err).decode(errors="replace")
    finally:
        if out_file is not None:
            out_file.close()


# -- inputs: base, workspaces, registry tars --------------------------------------------------


def _text(rng: random.Random, size: int) -> str:
    words = ("alpha", "beta", "gamma", "delta", "sandbox", "layer", "erofs", "overlay", "agent", "task",
             "reward", "episode", "tool", "shell", "python", "kernel")
    out, n = [], 0
    while n < size:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + f" {rng.getrandbits(32):08x}\n"
        out.append(line)
        n += len(line)
    return "".join(out)


def generate_workspace(root: Path, task: int, files: int) -> None:
    """``root`` becomes a workspace of ``files`` files, distinct per task, with ``task.py``."""
    rng = random.Random(f"dsec-burst-{task}")
    n_data = max(200, files * 2 // 3) if files >= 200 else files
    n_src = max(files - n_data, 18)
    (root / "data").mkdir(parents=True)
    (root / "src/pkg").mkdir(parents=True)
    for j in range(n_data):
        (root / "data" / f"f{j:03d}.txt").write_text(f"task {task} file {j}\n" + _text(rng, rng.randint(600, 4000)))
    for j in range(n_src):
        body = "".join(f"def f{k}(x):\n    return x * {rng.randint(2, 99)} + {k}  # task {task}\n\n"
                       for k in range(rng.randint(5, 40)))
        (root / "src/pkg" / f"mod_{j:03d}.py").write_text(body)
    (root / "src/pkg/__init__.py").write_text("")
    (root / "README.md").write_text(f"# task {task}\n\nA generated workspace for dsec bench burst.\n")
    reads = [f"/workspace/{r}" for r in WS_READS] + list(BASE_READS)
    (root / "task.py").write_text(TASK_PY.format(reads=reads, task=task))


def expected_digest(ws_root: Path, base_root: Path) -> str:
    h = hashlib.sha256()
    for rel in WS_READS:
        h.update((ws_root / rel).read_bytes())
    for path in BASE_READS:
        h.update((base_root / path.lstrip("/")).read_bytes())
    return h.hexdigest()


@contextlib.contextmanager
def mounted_layer(layer: Path, where: Path):
    where.mkdir(parents=True, exist_ok=True)
    _sys.mount(str(layer), str(where), "erofs", _sys.MS_RDONLY | _sys.MS_NODEV | _sys.MS_NOSUID)
    try:
        yield where
    finally:
        _sys.umount(str(where), _sys.MNT_DETACH)
        with contextlib.suppress(OSError):
            where.rmdir()


def ensure_python(store: LayerStore, base_store: Path, log) -> Image:
    """The ``python`` image in ``store``: already there, hard-linked (content-addressed layers)
    from ``base_store``, or built (about a minute)."""
    if store.has_image("python"):
        return store.get_image("python")
    other = LayerStore(base_store) if (Path(base_store) / "images/python.json").exists() else None
    if other is not None:
        image = other.get_image("python")
        for digest in image.layers:
            if not store.has_layer(digest):
                try:
                    os.link(other.layer_path(digest), store.layer_path(digest))
                except OSError:
                    shutil.copy2(other.layer_path(digest), store.layer_path(digest))
        log(f"python image linked from {base_store}")
        return store.put_image(image)
    log("building the python image (debootstrap, about a minute)")
    return build_python(store, log=log)


def site_packages() -> Path | None:
    import sysconfig

    p = Path(sysconfig.get_paths()["purelib"])
    return p if p.is_dir() else None


def ensure_base(store: LayerStore, opts: Options, work: Path, log) -> Image:
    python = ensure_python(store, Path(opts.base_store), log)
    if opts.base == "python":
        return python
    if store.has_image(BASE_NAME):
        return store.get_image(BASE_NAME)
    packages = site_packages()
    if packages is None or len(python.layers) != 1:
        raise BenchError("cannot build the python-pkgs base: no site-packages or a multi-layer python image")
    log(f"building {BASE_NAME}: python + the Python packages of {packages}")
    with tempfile.TemporaryDirectory(dir=store.tmp_dir) as tmp:
        root = Path(tmp, "root")
        with mounted_layer(store.layer_path(python.layers[0]), work / "mnt-python") as mnt:
            subprocess.run(["cp", "-a", f"{mnt}/.", str(root)], check=True)
        dest = root / "usr/local/lib/python3.11/dist-packages"
        shutil.copytree(packages, dest, symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__editable__*", "dsec-*.dist-info"))
        digest = store.add_dir(root)
    return store.put_image(Image(name=BASE_NAME, layers=(digest,), env=python.env, workdir=python.workdir))


@dataclass
class Inputs:
    base: Image
    base_bytes: int          # apparent size of the unpacked base
    base_files: int
    base_tar: Path
    base_tar_end: int        # offset of the end-of-archive marker (to stream base + workspace as one tar)
    workspaces: list[str] = field(default_factory=list)   # image names
    ws_tars: list[Path] = field(default_factory=list)
    ws_bytes: list[int] = field(default_factory=list)
    expected: list[str] = field(default_factory=list)
    refs: list[str] = field(default_factory=list)         # the task images in the loopback registry


def tree_size(root: Path) -> tuple[int, int]:
    total = files = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
            files += 1
    return total, files


def tar_end(path: Path) -> int:
    with tarfile.open(path) as tar:
        for _ in tar:
            pass
        return tar.offset


def prepare(store: LayerStore, opts: Options, work: Path, log, progress: Progress) -> Inputs:
    base = ensure_base(store, opts, work, log)
    if len(base.layers) != 1:
        raise BenchError(f"base image {base.name} has {len(base.layers)} layers; expected one")
    registry = work / "registry"
    gen = work / "gen"
    _remove_tree(gen)
    registry.mkdir(parents=True, exist_ok=True)
    base_tar = registry / "base.tar"
    with mounted_layer(store.layer_path(base.layers[0]), work / "mnt-base") as mnt:
        base_bytes, base_files = tree_size(mnt)
        log(f"base {base.name}: {base_bytes / 1e6:.0f} MB, {base_files} files; writing its registry tar")
        subprocess.run(["tar", "--numeric-owner", "-C", str(mnt), "-cf", str(base_tar), "."], check=True)
        inputs = Inputs(base=base, base_bytes=base_bytes, base_files=base_files, base_tar=base_tar,
                        base_tar_end=tar_end(base_tar))
        task = progress.add_task(f"inputs: {opts.images} workspaces + their tars", total=opts.images)
        for i in range(opts.images):
            src = gen / f"ws-{i:03d}" / "workspace"
            generate_workspace(src, i, opts.files)
            name = f"burst-ws-{i:03d}"
            workspace_from_dir(store, src, name)
            tar_path = registry / f"ws-{i:03d}.tar"
            subprocess.run(["tar", "--numeric-owner", "--owner=0", "--group=0", "-C", str(src.parent), "-cf",
                            str(tar_path), "workspace"], check=True)
            inputs.workspaces.append(name)
            inputs.ws_tars.append(tar_path)
            inputs.ws_bytes.append(tree_size(src)[0])
            inputs.expected.append(expected_digest(src, mnt))
            progress.advance(task)
    if inputs.base_bytes < BASE_MIN_BYTES:
        log(f"[yellow]note:[/yellow] the base is {inputs.base_bytes / 1e6:.0f} MB, under {BASE_MIN_BYTES / 1e6:.0f} MB")
    return inputs


# -- the loopback registry ------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Registry:
    """Debian's ``docker-registry`` on 127.0.0.1 (no auth, plain HTTP), its storage under
    ``root``. ``stop()`` ends it (it also gets SIGTERM if this process dies) and removes its data."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start(self) -> Registry:
        import httpx

        self.root.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        self.address = f"127.0.0.1:{port}"
        config = self.root / "config.yml"
        config.write_text(json.dumps({"version": 0.1, "log": {"level": "warn"},
                                      "storage": {"filesystem": {"rootdirectory": str(self.root / "data")}},
                                      "http": {"addr": self.address}}))
        log = open(self.root / "registry.log", "wb")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        log.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://{self.address}/v2/", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.root / "registry.log").read_text(errors="replace")[-1000:]
                self.stop()
                raise BenchError(f"docker-registry did not come up: {tail}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self.root, ignore_errors=True)


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def put_blob(blobs: Path, path: Path | None = None, data: bytes | None = None, move: bool = False) -> dict:
    """A file (linked, or moved with ``move``) or ``data`` as a blob of an OCI layout's
    ``blobs`` directory (``blobs/sha256``); its descriptor's digest and size."""
    h = hashlib.sha256()
    if path is not None:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    else:
        h.update(data or b"")
    target = blobs / h.hexdigest()
    if not target.exists():
        if path is not None:
            (os.replace if move else os.link)(path, target)
        else:
            target.write_bytes(data or b"")
    return {"digest": f"sha256:{h.hexdigest()}", "size": target.stat().st_size}


def push_images(inputs: Inputs, registry: Registry, work: Path, progress: Progress) -> None:
    """Every task image as a two-layer OCI image (uncompressed layer tars, the base shared) in
    one OCI layout, then each ``skopeo copy``-ed to the registry (the base blob goes once)."""
    layout = work / "oci"
    blobs = layout / "blobs/sha256"
    blobs.mkdir(parents=True)

    def blob(path: Path | None = None, data: bytes | None = None) -> dict:
        return put_blob(blobs, path, data)

    layer_type = "application/vnd.oci.image.layer.v1.tar"
    base = {"mediaType": layer_type, **blob(inputs.base_tar)}
    env = [f"{k}={v}" for k, v in inputs.base.env.items()]
    manifests = []
    for i, tar_path in enumerate(inputs.ws_tars):
        ws = {"mediaType": layer_type, **blob(tar_path)}
        config = {"architecture": "amd64", "os": "linux",
                  "config": {"Env": env, "WorkingDir": inputs.base.workdir or "/", "Cmd": ["/bin/sh"]},
                  "rootfs": {"type": "layers", "diff_ids": [base["digest"], ws["digest"]]}}
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                               **blob(data=json.dumps(config).encode())},
                    "layers": [base, ws]}
        manifests.append({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                          **blob(data=json.dumps(manifest).encode()),
                          "annotations": {"org.opencontainers.image.ref.name": f"{i:03d}"}})
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    task = progress.add_task(f"inputs: {len(manifests)} images pushed to the loopback registry", total=len(manifests))
    for i in range(len(manifests)):
        ref = f"{registry.address}/{REPOSITORY}:{i:03d}"
        proc = subprocess.run([SKOPEO, "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout}:{i:03d}",
                               f"docker://{ref}"], capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise BenchError(f"skopeo copy of image {i} to {ref}: {proc.stderr[-500:]}")
        inputs.refs.append(ref)
        progress.advance(task)
    shutil.rmtree(layout, ignore_errors=True)


# -- the arms ---------------------------------------------------------------------------------


def _groups(count: int, images: int) -> list[int]:
    """Sandboxes per image: N split as evenly as it goes over M images."""
    return [count // images + (1 if i < count % images else 0) for i in range(images)]


@dataclass
class ArmResult:
    name: str
    sandboxes: int
    images: int
    all_running_s: float | None = None
    all_done_s: float | None = None
    images_ready_s: float | None = None   # eager/podman: last image unpacked/imported
    bytes_written: int = 0
    sync_s: float = 0.0
    tasks_ok: int = 0
    failed: int = 0
    loadavg_before: list[str] = field(default_factory=list)
    loadavg_after: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class Arm:
    """Shared timing: t0, per-sandbox running and done times, task checks, disk counters."""

    def __init__(self, name: str, bench: Bench, groups: list[int]) -> None:
        self.name = name
        self.bench = bench
        self.groups = groups
        self.res = ArmResult(name=name, sandboxes=sum(groups), images=len(groups))
        self.running: list[float] = []
        self.done: list[float] = []
        self.ready: list[float] = []
        self.t0 = 0.0

    def start(self) -> None:
        self.res.loadavg_before = loadavg()
        drop_caches()
        self.sectors0 = sectors_written(self.bench.majmin)
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def check(self, i: int, stdout: str) -> dict:
        try:
            out = json.loads(stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise BenchError(f"task {i}: unexpected output {stdout[-300:]!r}") from None
        if out.get("task") != i or out.get("digest") != self.bench.inputs.expected[i]:
            raise BenchError(f"task {i}: wrong result {out!r}")
        return out

    def error(self, msg: str) -> None:
        self.res.failed += 1
        if len(self.res.errors) < 20:
            self.res.errors.append(msg[:400])

    async def gather(self, what: str, coros) -> None:
        """Run one image's tasks side by side; each that raises is a failed task."""
        for r in await asyncio.gather(*coros, return_exceptions=True):
            if isinstance(r, BaseException):
                self.error(f"{what}: {type(r).__name__}: {r}")

    async def run(self, image, timeout_s: float, label: str) -> ArmResult:
        """The timed part: ``image(i, k)`` for every image i and its k sandboxes, all at once."""
        self.start()
        try:
            await asyncio.wait_for(asyncio.gather(*(image(i, k) for i, k in enumerate(self.groups))), timeout_s)
        except TimeoutError:
            self.error(f"{label} arm timed out after {timeout_s}s")
        return self.finish()

    def finish(self) -> ArmResult:
        r = self.res
        r.all_running_s = max(self.running) if self.running else None
        r.all_done_s = max(self.done) if len(self.done) == r.sandboxes else None
        r.images_ready_s = max(self.ready) if self.ready else None
        r.tasks_ok = len(self.done)
        t = time.perf_counter()
        os.sync()
        r.sync_s = time.perf_counter() - t
        r.bytes_written = (sectors_written(self.bench.majmin) - self.sectors0) * 512
        r.loadavg_after = loadavg()
        if r.all_done_s is None:
            r.notes.append(f"only {len(self.done)} of {r.sandboxes} tasks finished")
        return r


class Bench:
    def __init__(self, state_dir: Path, console: Console, opts: Options) -> None:
        self.state_dir = state_dir
        self.console = console
        self.opts = opts
        self.majmin, self.dev = block_device_of(state_dir)
        self.tag = hashlib.sha1(str(state_dir).encode()).hexdigest()[:10]
        self.eager_dir = state_dir / "eager"
        self.podman_dir = state_dir / "podman"
        self.cgroup_parent = f"dsecburst-{self.tag}"
        self.podman_tag = f"dsec-burst-{self.tag}"
        self.inputs: Inputs
        self.registry: Registry | None = None
        self.errors: list[str] = []
        self.notes: list[str] = []

    def log(self, msg: str) -> None:
        self.console.print(msg)

    # -- DSec ----------------------------------------------------------------------------------

    async def dsec(self, progress: Progress) -> ArmResult:
        o = self.opts
        server = LocalServer(self.state_dir, extra_args=("--pool-max", "0"))
        await asyncio.to_thread(server.start)
        arm = Arm("DSec (on demand)", self, _groups(o.count, o.images))
        sandboxes: list[Sandbox] = []
        try:
            async with DSecClient(server.endpoint, token=server.token, max_connections=512, timeout=600) as client:
                await self._settle(client)
                up = progress.add_task("DSec: sandboxes running", total=o.count)
                done = progress.add_task("DSec: tasks done", total=o.count)
                sem = asyncio.Semaphore(o.concurrency)

                async def run_task(i: int, sandbox: Sandbox) -> None:
                    async with sem:
                        r = await sandbox.run_shell(shlex.join(TASK_CMD), timeout=300)
                    if r.exit_code != 0:
                        raise BenchError(f"task {i} exited {r.exit_code}: {r.stderr[-300:]}")
                    arm.check(i, r.stdout)
                    arm.done.append(arm.now())
                    progress.advance(done)

                async def group(i: int, k: int) -> None:
                    args = DSecContainerRunArgs(container_image=self.inputs.base.name,
                                                workspace=self.inputs.workspaces[i], memory_limit_mb=o.memory_mb,
                                                cpu_cores_limit=1.0, ttl_running_stop=1800)

                    def on_progress(n: int, total: int) -> None:
                        arm.running.append(arm.now())
                        progress.advance(up)

                    try:
                        made = await client.run_containers(args, count=k, timeout=o.arm_timeout_s, progress=on_progress)
                    except Exception as exc:  # noqa: BLE001 - counted
                        for _ in range(k):
                            arm.error(f"create image {i}: {type(exc).__name__}: {exc}")
                        return
                    sandboxes.extend(made)
                    await arm.gather(f"task {i}", (run_task(i, s) for s in made))

                res = await arm.run(group, o.arm_timeout_s, "DSec")
                stop = progress.add_task("DSec: stopping sandboxes", total=len(sandboxes))

                async def stop_one(s: Sandbox) -> None:
                    async with sem:
                        with contextlib.suppress(Exception):
                            await s.stop()
                    progress.advance(stop)

                await asyncio.gather(*(stop_one(s) for s in sandboxes))
                with contextlib.suppress(Exception):
                    left = [s for s in await client.list_sandboxes() if s.status.value in ("running", "creating")]
                    for info in left:
                        with contextlib.suppress(Exception):
                            await (await client.get_sandbox(info.id)).stop()
        finally:
            rc = await asyncio.to_thread(server.stop)
            if rc not in (0, None, -signal.SIGTERM):  # uvicorn re-raises SIGTERM after a clean shutdown
                self.errors.append(f"dsec serve exited {rc} on SIGTERM: {server.log_tail(600)}")
        res.notes.append("DSec's per-sandbox writable layers live on a tmpfs (node/run), not on the disk")
        return res

    async def _settle(self, client: DSecClient, most_s: float = 180.0) -> None:
        """A server in production is long up: wait until its start-up warm-ups are over (the VM
        backends probe the accelerator, once per state dir, by booting a guest) before the
        burst; and check that the node admits N sandboxes of ``memory_mb``."""
        t = time.perf_counter()
        while time.perf_counter() - t < most_s:
            node = (await client.node_info())[0]
            if "not probed" not in node.runtime:
                break
            await asyncio.sleep(0.5)
        waited = time.perf_counter() - t
        if waited > 1:
            self.notes.append(f"waited {waited:.0f} s after the server came up for its warm-ups (VM accelerator probe)")
        cap = int(node.memory_total_mb * getattr(node, "memory_overcommit", 1.0))
        if self.opts.count * self.opts.memory_mb > cap:
            raise BenchError(f"the node admits {cap} MB of memory limits: {self.opts.count} × {self.opts.memory_mb} MB "
                             f"do not fit; lower --count")

    # -- eager: unpack, then crun ---------------------------------------------------------------

    def _crun(self, *args: str) -> list[str]:
        return [CRUN, "--root", str(self.eager_dir / "run/crun"), *args]

    def _eager_config(self, cid: str, rootfs: Path) -> dict:
        config = copy.deepcopy(self._spec)
        config["process"]["terminal"] = False
        config["process"]["args"] = ["/bin/sleep", "infinity"]
        config["root"] = {"path": str(rootfs), "readonly": False}
        config["hostname"] = "sandbox"
        config["linux"]["cgroupsPath"] = f"/{self.cgroup_parent}/{cid}"
        mem = self.opts.memory_mb << 20
        config["linux"].setdefault("resources", {})["memory"] = {"limit": mem, "swap": mem}
        config["linux"]["resources"]["cpu"] = {"quota": 100_000, "period": 100_000}
        return config

    def eager_setup(self) -> None:
        run = self.eager_dir / "run"
        for d in (self.eager_dir / "snapshots", run):
            d.mkdir(parents=True, exist_ok=True)
        if not os.path.ismount(run):
            _sys.mount("dsec-burst-run", str(run), "tmpfs", _sys.MS_NODEV | _sys.MS_NOSUID, "mode=0700")
        (run / "crun").mkdir(exist_ok=True)
        (run / "bundles").mkdir(exist_ok=True)
        spec_dir = run / "spec"
        spec_dir.mkdir(exist_ok=True)
        subprocess.run([CRUN, "spec"], cwd=spec_dir, check=True, capture_output=True)
        self._spec = json.loads((spec_dir / "config.json").read_text())

    async def eager(self, progress: Progress) -> ArmResult:
        o = self.opts
        arm = Arm("eager (pull, then crun)", self, _groups(o.count, o.images))
        await asyncio.to_thread(self.eager_setup)
        run = self.eager_dir / "run"
        store = self.eager_dir / "containers"
        await asyncio.to_thread(self.podman_setup, store)
        first_in = asyncio.Event()
        pulled = progress.add_task("eager: images pulled", total=o.images)
        up = progress.add_task("eager: sandboxes running", total=o.count)
        done = progress.add_task("eager: tasks done", total=o.count)
        pull_sem = asyncio.Semaphore(o.pull_concurrency)
        create_sem = asyncio.Semaphore(o.concurrency)
        task_sem = asyncio.Semaphore(o.concurrency)

        async def sandbox(i: int, j: int, image_dir: Path) -> None:
            cid = f"b{i:03d}-{j:03d}"
            snap = self.eager_dir / "snapshots" / cid
            bundle = run / "bundles" / cid
            rootfs = bundle / "rootfs"
            async with create_sem:
                def mount() -> None:
                    for d in (snap / "upper", snap / "work", rootfs):
                        d.mkdir(parents=True)
                    _sys.mount("overlay", str(rootfs), "overlay", _sys.MS_NODEV,
                               f"lowerdir={image_dir},upperdir={snap / 'upper'},workdir={snap / 'work'}")
                    (bundle / "config.json").write_text(json.dumps(self._eager_config(cid, rootfs)))

                await asyncio.to_thread(mount)
                rc, out = await _sh(*self._crun("run", "--detach", "--bundle", str(bundle), cid), timeout=120,
                                    log=bundle / "crun.log")
                if rc != 0:
                    raise BenchError(f"crun run {cid} exited {rc}: {out[-300:]}")
            arm.running.append(arm.now())
            progress.advance(up)
            async with task_sem:
                rc, out = await _sh(*self._crun("exec", cid, *TASK_CMD), timeout=300)
            if rc != 0:
                raise BenchError(f"task {i} in {cid} exited {rc}: {out[-300:]}")
            arm.check(i, out)
            arm.done.append(arm.now())
            progress.advance(done)

        async def image(i: int, k: int) -> None:
            rc, out = await self.pull(i, store, first_in, pull_sem, o.arm_timeout_s)
            if rc == 0:
                rc, out = await _sh(*self._podman("image", "mount", self.inputs.refs[i], at=store))
            if rc != 0:
                for _ in range(k):
                    arm.error(f"pull and mount image {i}: {out[-300:]}")
                return
            image_dir = Path(out.strip().splitlines()[-1])
            arm.ready.append(arm.now())
            progress.advance(pulled)
            await arm.gather(f"image {i}", (sandbox(i, j, image_dir) for j in range(k)))

        res = await arm.run(image, o.arm_timeout_s, "eager")
        res.notes.append("pulled layered from the loopback registry into one containers-storage (the base once); "
                         "upper/work dirs on disk; crun state and bundles on a tmpfs")
        return res

    async def eager_cleanup(self, progress: Progress | None = None) -> None:
        run = self.eager_dir / "run"
        if (run / "crun").is_dir():
            rc, out = await _sh(*self._crun("list", "-q"))
            cids = out.split() if rc == 0 else []
            task = progress.add_task("eager: deleting crun containers", total=len(cids)) if progress else None
            sem = asyncio.Semaphore(16)

            async def delete(cid: str) -> None:
                async with sem:
                    await _sh(*self._crun("delete", "--force", cid))
                if progress is not None and task is not None:
                    progress.advance(task)

            await asyncio.gather(*(delete(c) for c in cids))
        store = self.eager_dir / "containers"
        if (store / "root").is_dir():
            for args in (("image", "unmount", "--all", "--force"), ("rmi", "-af"), ("system", "reset", "-f")):
                await _sh(*self._podman(*args, at=store), timeout=600)
        await asyncio.to_thread(self._eager_unmount_and_remove)
        await asyncio.to_thread(self._remove_runroot, store)

    def _eager_unmount_and_remove(self) -> None:
        prefix = str(self.eager_dir) + "/"
        targets = sorted((t for t in _sys.mounted_targets() if t.startswith(prefix)), key=len, reverse=True)
        for t in targets:
            with contextlib.suppress(OSError):
                _sys.umount(t, _sys.MNT_DETACH)
        deadline = time.monotonic() + 10
        while True:
            for d in cgroups.sandbox_cgroup_dirs(self.cgroup_parent):
                with contextlib.suppress(OSError):
                    d.rmdir()
            cgroups.remove_parent(self.cgroup_parent)
            if not self._cgroups_left() or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        _remove_tree(self.eager_dir)

    def _cgroups_left(self) -> list[str]:
        roots = [cgroups.CGROUP_ROOT] if cgroups.is_v2() else [p for p in cgroups.CGROUP_ROOT.iterdir() if p.is_dir()]
        return [str(r / self.cgroup_parent) for r in roots if (r / self.cgroup_parent).exists()]

    # -- podman -------------------------------------------------------------------------------

    def _podman(self, *args: str, at: Path | None = None) -> list[str]:
        """podman on a containers-storage of its own under ``at`` (the podman arm's by default).
        Its temporary files (a pulled blob before it is applied) go to ``at/tmp`` on the disk, as
        /var/tmp on a node."""
        d = at or self.podman_dir
        return [PODMAN, "--root", str(d / "root"), "--runroot", str(self._runroot(d)), "--storage-driver", "overlay",
                "--cgroup-manager", "cgroupfs", "--events-backend", "file", "--tmpdir", str(d / "tmp"), *args]

    def _runroot(self, at: Path) -> Path:
        """podman's runroot for the store at ``at``: under /run (a tmpfs, as on a node; podman
        takes at most 50 characters there)."""
        return Path(f"/run/dsec-burst-{self.tag}-{at.name}")

    def podman_setup(self, at: Path | None = None) -> None:
        at = at or self.podman_dir
        for d in ("root", "tmp"):
            (at / d).mkdir(parents=True, exist_ok=True)
        self._runroot(at).mkdir(mode=0o700, parents=True, exist_ok=True)

    def _remove_runroot(self, at: Path) -> None:
        run = self._runroot(at)
        for t in sorted((t for t in _sys.mounted_targets() if t.startswith(f"{run}/")), key=len, reverse=True):
            with contextlib.suppress(OSError):
                _sys.umount(t, _sys.MNT_DETACH)
        shutil.rmtree(run, ignore_errors=True)

    async def pull(self, i: int, at: Path, first_in: asyncio.Event, pull_sem: asyncio.Semaphore,
                   timeout_s: float) -> tuple[int, str]:
        """``podman pull`` of task image i from the loopback registry into the store at ``at``:
        image 0 alone first (it brings the shared base), then the others ``pull_concurrency``
        at a time (each brings only its workspace layer)."""
        if i > 0:
            await first_in.wait()
        try:
            async with pull_sem:
                return await _sh(*self._podman("pull", "--quiet", "--tls-verify=false", self.inputs.refs[i], at=at),
                                 timeout=timeout_s)
        finally:
            if i == 0:
                first_in.set()

    async def podman(self, progress: Progress) -> ArmResult:
        o = self.opts
        n = o.count if not o.podman_max else min(o.count, o.podman_max)
        m = o.images if n == o.count else max(1, min(o.images, math.ceil(o.images * n / o.count)))
        arm = Arm("podman (pull, then run --rm)", self, _groups(n, m))
        if n < o.count:
            arm.res.notes.append(f"capped at {n} sandboxes from {m} images (of {o.count} from {o.images}) to bound "
                                 f"the run time; its figures are for that smaller burst")
        await asyncio.to_thread(self.podman_setup)
        imported = progress.add_task("podman: images pulled", total=m)
        first_in = asyncio.Event()
        done = progress.add_task("podman: tasks done (run --rm)", total=n)
        pull_sem = asyncio.Semaphore(o.pull_concurrency)
        run_sem = asyncio.Semaphore(o.concurrency)
        wall_minus_perf = time.time() - time.perf_counter()

        async def task(i: int, j: int, ref: str) -> None:
            async with run_sem:
                rc, out = await _sh(*self._podman("run", "--rm", "--name", f"{self.podman_tag}-{i:03d}-{j:03d}",
                                                  *PODMAN_RUN_FLAGS, ref, *TASK_CMD), timeout=300)
            if rc != 0:
                raise BenchError(f"podman run of task {i} exited {rc}: {out[-300:]}")
            result = arm.check(i, out)
            arm.running.append(result["start"] - wall_minus_perf - arm.t0)
            arm.done.append(arm.now())
            progress.advance(done)

        async def image(i: int, k: int) -> None:
            ref = self.inputs.refs[i]
            rc, out = await self.pull(i, self.podman_dir, first_in, pull_sem, o.arm_timeout_s)
            if rc != 0:
                for _ in range(k):
                    arm.error(f"podman pull of image {i} exited {rc}: {out[-300:]}")
                return
            arm.ready.append(arm.now())
            progress.advance(imported)
            await arm.gather(f"image {i}", (task(i, j, ref) for j in range(k)))

        res = await arm.run(image, o.arm_timeout_s, "podman")
        res.notes.append("all-running = the last task's own start stamp (podman run --rm creates, runs and removes)")
        return res

    def podman_names(self) -> list[str]:
        if not (self.podman_dir / "root").is_dir():
            return []
        proc = subprocess.run(self._podman("ps", "-a", "--format", "{{.Names}}"), capture_output=True, text=True,
                              timeout=300)
        return proc.stdout.split()

    def podman_images(self) -> list[str]:
        if not (self.podman_dir / "root").is_dir():
            return []
        proc = subprocess.run(self._podman("images", "-q"), capture_output=True, text=True, timeout=300)
        return proc.stdout.split()

    def podman_cleanup(self) -> None:
        if (self.podman_dir / "root").is_dir():
            subprocess.run(self._podman("rm", "-af", "-t", "0"), capture_output=True, timeout=600)
            subprocess.run(self._podman("rmi", "-af"), capture_output=True, timeout=600)
            subprocess.run(self._podman("system", "reset", "-f"), capture_output=True, timeout=600)
        prefix = str(self.podman_dir) + "/"
        for t in sorted((t for t in _sys.mounted_targets() if t.startswith(prefix)), key=len, reverse=True):
            with contextlib.suppress(OSError):
                _sys.umount(t, _sys.MNT_DETACH)
        _remove_tree(self.podman_dir)
        self._remove_runroot(self.podman_dir)

    # -- everything ---------------------------------------------------------------------------

    def own_leftovers(self) -> list[str]:
        found = [f"podman container {n}" for n in self.podman_names()]
        found += [f"podman image {i}" for i in self.podman_images()]
        found += [f"cgroup {c}" for c in self._cgroups_left()]
        for d in (self.eager_dir, self.podman_dir, self.state_dir / "registry", self.state_dir / "registry-server",
                  self.state_dir / "oci", self.state_dir / "gen", self._runroot(self.podman_dir),
                  self._runroot(self.eager_dir / "containers")):
            if d.exists():
                found.append(f"directory {d}")
        # (the peer's containers were killed: their processes may take a moment to be gone)
        deadline = time.monotonic() + 10
        while (pids := self._pids_in_cgroup()) and time.monotonic() < deadline:
            time.sleep(0.1)
        found += [f"process {pid} in cgroup {self.cgroup_parent}" for pid in pids]
        return found

    def _pids_in_cgroup(self) -> list[str]:
        pids = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                with contextlib.suppress(OSError):
                    if f"/{self.cgroup_parent}/" in Path(f"/proc/{pid}/cgroup").read_text():
                        pids.append(pid)
        return pids

    def cleanup_inputs(self) -> None:
        if self.registry is not None:
            self.registry.stop()
        for d in ("registry", "registry-server", "oci", "gen", "mnt-base", "mnt-python"):
            p = self.state_dir / d
            if os.path.ismount(p):
                with contextlib.suppress(OSError):
                    _sys.umount(str(p), _sys.MNT_DETACH)
            shutil.rmtree(p, ignore_errors=True)
        store = LayerStore(self.state_dir / "store")
        for name in store.image_names():
            if name.startswith("burst-ws-"):
                store.remove_image(name)
        store.gc()


# -- report -------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def _fmt(v: float | None, spec: str = ".1f", unit: str = "") -> str:
    return "—" if v is None or v != v else f"{v:{spec}}{unit}"


def _mb(b: int | None) -> str:
    return "—" if b is None else f"{b / 1e6:,.0f} MB"


def summarise(res: dict) -> dict:
    arms = {a["name"].split()[0]: a for a in res["arms"]}
    d = arms.get("DSec", {})
    out: dict[str, Any] = {}
    for peer in ("eager", "podman"):
        p = arms.get(peer)
        if not p:
            continue
        same = p["sandboxes"] == d.get("sandboxes")
        out[peer] = {
            "same_size": same,
            "all_running_peer_over_dsec": _ratio(p["all_running_s"], d.get("all_running_s")) if same else None,
            "all_done_peer_over_dsec": _ratio(p["all_done_s"], d.get("all_done_s")) if same else None,
            "bytes_peer_over_dsec": _ratio(p["bytes_written"], d.get("bytes_written")) if same else None,
            "fewer_writes_dsec": (1 - d["bytes_written"] / p["bytes_written"]) if same and p["bytes_written"] else None,
            "per_sandbox_done_peer_over_dsec": _ratio(
                _ratio(p["all_done_s"], p["sandboxes"]), _ratio(d.get("all_done_s"), d.get("sandboxes"))),
        }
    e = out.get("eager", {})
    out["goals"] = [
        {"goal": f"completion ≥ {GOAL_SPEEDUP:g}× faster than eager", "value": e.get("all_done_peer_over_dsec"),
         "met": None if e.get("all_done_peer_over_dsec") is None else e["all_done_peer_over_dsec"] >= GOAL_SPEEDUP},
        {"goal": f"≥ {GOAL_FEWER_WRITES:.0%} fewer bytes written than eager", "value": e.get("fewer_writes_dsec"),
         "met": None if e.get("fewer_writes_dsec") is None else e["fewer_writes_dsec"] >= GOAL_FEWER_WRITES},
    ]
    return out


def table(res: dict) -> Table:
    arms = res["arms"]
    s = res["summary"]
    t = Table(title=f"dsec bench burst — {res['options']['count']} sandboxes from {res['options']['images']} images "
                    f"sharing a {res['inputs']['base_mb']:.0f} MB base")
    for col in ("arm", "sandboxes", "images ready", "all running", "all tasks done", "bytes written",
                "peer ÷ DSec: running", "done", "writes"):
        t.add_column(col, justify="left" if col == "arm" else "right")
    for a in arms:
        key = a["name"].split()[0]
        r = s.get(key, {})
        t.add_row(a["name"], str(a["sandboxes"]), _fmt(a["images_ready_s"], ".1f", " s"),
                  _fmt(a["all_running_s"], ".1f", " s"), _fmt(a["all_done_s"], ".1f", " s"), _mb(a["bytes_written"]),
                  _fmt(r.get("all_running_peer_over_dsec"), ".2f", "×"), _fmt(r.get("all_done_peer_over_dsec"), ".2f", "×"),
                  _fmt(r.get("bytes_peer_over_dsec"), ".1f", "×"))
    t.caption = "ratios: the peer's figure ÷ DSec's (above 1: DSec is faster / writes less)"
    return t


def _verdict(met: bool | None) -> str:
    return {True: "[green]PASS[/green]", False: "[red]FAIL[/red]", None: "[yellow]not measured[/yellow]"}[met]


# -- main -----------------------------------------------------------------------------------------


async def _run(bench: Bench, progress: Progress, res: dict) -> None:
    o = bench.opts
    store = LayerStore(bench.state_dir / "store")
    bench.inputs = await asyncio.to_thread(prepare, store, o, bench.state_dir, bench.log, progress)
    inp = bench.inputs
    res["inputs"] = {
        "base_image": inp.base.name, "base_mb": inp.base_bytes / 1e6, "base_files": inp.base_files,
        "base_layer_mb": store.layer_size(inp.base.layers[0]) / 1e6, "base_tar_mb": inp.base_tar.stat().st_size / 1e6,
        "workspace_kb_mean": sum(inp.ws_bytes) / len(inp.ws_bytes) / 1e3, "workspace_files": o.files,
    }
    # The disk's background write rate (other work on the machine), for judging the counters.
    await asyncio.to_thread(os.sync)
    s0, t = sectors_written(bench.majmin), time.perf_counter()
    await asyncio.sleep(5)
    res["background_write_mb_per_s"] = (sectors_written(bench.majmin) - s0) * 512 / (time.perf_counter() - t) / 1e6
    arms: list[ArmResult] = []
    res["arms_objects"] = arms

    def ended(arm: ArmResult) -> None:
        arms.append(arm)
        progress.console.print(
            f"{arm.name}: all running {_fmt(arm.all_running_s, '.1f', ' s')}, all done {_fmt(arm.all_done_s, '.1f', ' s')}, "
            f"{arm.bytes_written / 1e6:,.0f} MB written, {arm.tasks_ok}/{arm.sandboxes} ok; load {' '.join(arm.loadavg_after)}")
        for err in arm.errors[:5]:
            progress.console.print(f"  [red]error:[/red] {err}")
        partial = {k: v for k, v in res.items() if k != "arms_objects"}
        partial["arms"] = [asdict(a) for a in arms]
        (bench.state_dir / RESULTS_FILE).write_text(json.dumps(partial, indent=1, default=str) + "\n")

    peers = []
    if lacking := missing_tools("registry") + (missing_tools("podman")):
        bench.notes.append(f"the eager and podman peers skipped: {', '.join(lacking)} missing here "
                           f"(apt-get install {' '.join(lacking)}); DSec's arm runs alone, its goals unjudged")
    else:
        bench.registry = Registry(bench.state_dir / "registry-server")
        await asyncio.to_thread(bench.registry.start)
        await asyncio.to_thread(push_images, inp, bench.registry, bench.state_dir, progress)
        peers = ["eager"] + (["podman"] if o.podman else [])
    ended(await bench.dsec(progress))
    if "eager" in peers:
        try:
            ended(await bench.eager(progress))
        finally:
            await bench.eager_cleanup(progress)
    if "podman" in peers:
        try:
            ended(await bench.podman(progress))
        finally:
            await asyncio.to_thread(bench.podman_cleanup)


def main(state_dir: Path, console: Console, command: str = "dsec bench burst", **options: Any) -> int:
    opts = Options(**options)
    if opts.quick:
        opts.count, opts.images = min(opts.count, 32), min(opts.images, 4)
    if not 1 <= opts.images <= opts.count:
        console.print("[red]error:[/red] need 1 ≤ images ≤ count")
        return 1
    if os.geteuid() != 0:
        console.print("[red]error:[/red] dsec bench burst runs as root (mounts, crun, drop_caches)")
        return 1
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    cgroups.fix_hybrid_hugetlb()
    bench = Bench(state_dir, console, opts)
    started = datetime.now(timezone.utc)
    t_start = time.perf_counter()
    mach = machine(state_dir, bench.majmin, bench.dev)
    mach["loadavg_at_start"] = loadavg()
    console.print(f"[bold]dsec bench burst[/bold]: {opts.count} sandboxes from {opts.images} images; state in "
                  f"{state_dir} on /dev/{bench.dev}; {mach['cores']} cores, {mach['memory_total_gib']} GiB, kernel "
                  f"{mach['kernel']}; load average {' '.join(mach['loadavg_at_start'])}")
    # Remains of a killed run.
    asyncio.run(bench.eager_cleanup())
    bench.podman_cleanup()
    res: dict[str, Any] = {"benchmark": "dsec bench burst", "started_at": started.isoformat(timespec="seconds"),
                           "command": command, "machine": mach, "options": asdict(opts), "inputs": {"base_mb": 0}}
    interrupted = False
    try:
        with _progress(console) as progress:
            asyncio.run(_run(bench, progress, res))
    except KeyboardInterrupt:
        interrupted = True
        bench.errors.append("interrupted")
    except Exception as exc:  # noqa: BLE001 - reported, then cleaned up
        bench.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        with contextlib.suppress(Exception):
            asyncio.run(bench.eager_cleanup())
        with contextlib.suppress(Exception):
            bench.podman_cleanup()
        with contextlib.suppress(Exception):
            bench.cleanup_inputs()
    arms = res.pop("arms_objects", [])
    res["arms"] = [asdict(a) for a in arms]
    res["summary"] = summarise(res)
    mach["loadavg_at_end"] = loadavg()
    left = leftovers(state_dir)
    own = bench.own_leftovers()
    res["leftovers"] = {"dsec": left, "peers": own}
    res["errors"] = bench.errors + [f"{a.name}: {e}" for a in arms for e in a.errors]
    res["notes"] = bench.notes
    res["duration_s"] = round(time.perf_counter() - t_start, 1)
    out = state_dir / RESULTS_FILE
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")

    if res["arms"]:
        console.print(table(res))
    inp = res["inputs"]
    if "base_files" in inp:
        console.print(f"base {inp['base_image']}: {inp['base_mb']:.0f} MB in {inp['base_files']} files (EROFS layer "
                      f"{inp['base_layer_mb']:.0f} MB, tar {inp['base_tar_mb']:.0f} MB); workspaces {opts.files} "
                      f"files, {inp['workspace_kb_mean']:.0f} kB each")
    console.print(f"disk /dev/{bench.dev}: background writes {_fmt(res.get('background_write_mb_per_s'), '.2f')} MB/s "
                  f"before the arms (other work on this machine)")
    for a in arms:
        console.print(f"{a.name}: {a.tasks_ok}/{a.sandboxes} tasks ok, sync at end {a.sync_s:.1f} s, load average "
                      f"{' '.join(a.loadavg_before)} → {' '.join(a.loadavg_after)}")
        for note in a.notes:
            console.print(f"  [yellow]note:[/yellow] {note}")
    for note in bench.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    for g in res["summary"]["goals"]:
        v = g["value"]
        shown = "—" if v is None else (f"{v:.2%}" if "fewer" in g["goal"] else f"{v:.2f}×")
        console.print(f"goal: {g['goal']}: {shown} {_verdict(g['met'])}")
    for err in res["errors"][:20]:
        console.print(f"[red]error:[/red] {err}")
    console.print(f"leftovers(state_dir): {left or 'nothing'}")
    console.print(f"peer leftovers: {own or 'nothing'}")
    console.print(f"results: {out} ({res['duration_s']:.0f} s)")
    if interrupted:
        return 130
    if res["errors"] or left or own:
        return 1
    if opts.strict and any(g["met"] is False for g in res["summary"]["goals"]):
        return 2
    return 0
