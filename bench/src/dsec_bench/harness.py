"""``dsec bench harness``: what a harness pays for a task's environment, against podman, in one run.

A typical task's environment (a Harbor task's ``environment/Dockerfile``: ``FROM python``, a
source tree copied in, one command run over it, ``ENV`` and ``WORKDIR``; no ``apt``) on the
``python`` image, through a ``dsec serve`` of the benchmark's own. Measured, one after another:

- **build**: ``client.build_image(…, no_cache=True)`` (DSec's own builder: a sandbox of the base,
  the steps, the changes packed as a layer) against ``podman build --no-cache`` of the same
  Dockerfile over the same base (DSec's ``python`` image imported into podman: its layers
  mounted, their overlay tarred into ``podman import``), ``build_rounds`` each, medians. Goal:
  DSec no slower.
- **rebuild, nothing changed**: ``client.build_image`` of the same content (answered from the
  store by its content key) and ``podman build`` with its layer cache, ``rebuild_rounds`` each.
  Goal: DSec ≤ 1 s.
- **start to first answer**: a sandbox of the built image created and a command run in it, from
  the create call to the command's answer (what a harness's ``start()`` and first ``exec`` cost),
  ``start_rounds`` one after another (after two: the first, printed apart, finds no sandbox of
  the image in the warm pool), the sandbox stopped untimed after each; against ``podman run -d``
  of the built image then ``podman exec``. Goal: DSec p50 ≤ 150 ms.
- **Harbor oracle trials per minute**: Harbor's own CLI (``harbor run -a oracle -n N``, from the
  venv ``tests/integration/test_harbor.py`` makes) over the Harbor tasks of ``tests/harbor_tasks``
  whose network policy is public, once on DSec's environment
  (``dsec.integrations.harbor:DSecEnvironment``, this benchmark's server) and once on Harbor's
  docker environment (``dsec_bench.harbor_peer``: a dockerd of its own, DSec's ``python`` image
  imported, ``--no-delete`` so its builds stay cached); each after one warm-up run of the same
  (every image built, pools warm); trials over the ``harbor run``'s wall time. Every trial must
  reward 1. Goal: DSec ≥ 5× the peer.

Everything runs on this machine; the server runs containers only. Podman, Harbor's venv or
dockerd missing: their arms are skipped, said so, and the rest runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs

from dsec.images.builders import build_python
from dsec.images.store import LayerStore
from dsec.local import serving
from . import harbor_peer
from .lifecycle_peers import PODMAN, PODMAN_FLAGS, image_root
from .results import save_results, source_commit

DOCKERFILE = """\
FROM {base}
ENV APP_HOME=/app PYTHONDONTWRITEBYTECODE=0
WORKDIR /app
COPY src/ ./src/
COPY requirements.txt tests/ ./
RUN python3 -m compileall -q src && echo "{nonce}" > /app/.built
"""


# As the run's: no network (a DSec build sandbox has none), and the limits this host lets be set.
BUILD_FLAGS = ("--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")


def python_store(state_dir: Path, store_dir: Path | None, console: Console) -> LayerStore:
    """The layer store of a bench's server on ``state_dir`` (``store_dir``, else
    ``<state_dir>-store``: it outlives the run), with the ``python`` image in it; the server
    serves containers only."""
    os.environ.setdefault("DSEC_VMS", "0")
    state_dir.mkdir(parents=True, exist_ok=True)
    store = LayerStore(store_dir or state_dir.parent / f"{state_dir.name}-store")
    if not (state_dir / "store").is_symlink():
        (state_dir / "store").symlink_to(store.root)
    if not store.has_image("python"):
        console.print("building the python image (debootstrap, about a minute the first time) …")
        build_python(store)
    return store


def _task(root: Path, files: int, nonce: str, base: str) -> Path:
    """A task environment: ``files`` Python modules (about 2 KB each) under src/, a test, the
    Dockerfile FROM ``base``."""
    (root / "src").mkdir(parents=True, exist_ok=True)
    (root / "tests").mkdir(exist_ok=True)
    for n in range(files):
        body = "".join(f"def f{n}_{i}(x):\n    return x * {i} + {n}\n\n" for i in range(40))
        (root / "src" / f"mod{n:04d}.py").write_text(body)
    (root / "requirements.txt").write_text("# none: the image has what the task needs\n")
    (root / "tests" / "test_task.py").write_text("def test_it():\n    assert True\n")
    (root / "Dockerfile").write_text(DOCKERFILE.format(base=base, nonce=nonce))
    return root / "Dockerfile"


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": 1000 * statistics.median(xs), "min_ms": 1000 * xs[0], "max_ms": 1000 * xs[-1],
            "p90_ms": 1000 * xs[min(len(xs) - 1, int(0.9 * len(xs)))]}


def _podman(*args: str, timeout: float = 600, input: bytes | None = None) -> str:
    proc = subprocess.run([PODMAN, *args], capture_output=True, timeout=timeout, input=input)
    if proc.returncode != 0:
        raise RuntimeError(f"podman {args[0]} failed: {proc.stderr.decode(errors='replace')[-500:]}")
    return proc.stdout.decode()


def _import_into_podman(store: LayerStore, name: str, tag: str, work: Path) -> None:
    with image_root(store, name, work) as root:
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        proc = subprocess.run([PODMAN, "import", "-", tag], stdin=tar.stdout, capture_output=True, timeout=600)
        tar.wait()
        if proc.returncode != 0 or tar.returncode != 0:
            raise RuntimeError(f"podman import of {name} failed: {proc.stderr.decode(errors='replace')[-500:]}")


async def _dsec(client: DSecClient, task: Path, o: dict, console: Console) -> dict:
    name = f"bench-task-{secrets.token_hex(3)}"
    builds, rebuilds, starts = [], [], []
    for n in range(o["build_rounds"]):
        t = time.perf_counter()
        result = await client.build_image(name, task, no_cache=True)
        builds.append(time.perf_counter() - t)
        assert not result.cached
    for n in range(o["rebuild_rounds"]):
        t = time.perf_counter()
        result = await client.build_image(name, task)
        rebuilds.append(time.perf_counter() - t)
        assert result.cached, "a rebuild with nothing changed was not answered from the store"
    args = DSecContainerRunArgs(container_image=name, memory_limit_mb=256)
    for n in range(o["start_rounds"] + 2):  # (two warm-ups: the pool learns the image)
        t = time.perf_counter()
        sandbox = await client.run_container(args)
        answer = await sandbox.run_shell("cat /app/.built")
        took = time.perf_counter() - t
        await sandbox.stop()
        if answer.exit_code != 0:
            raise RuntimeError(f"the built image does not hold what its build made: {answer.stderr}")
        if n == 0:
            first = took  # no sandbox of this image in the warm pool yet
        if n >= 2:
            starts.append(took)
        await asyncio.sleep(0.05)
    await client.remove_image(name)
    return {"build": _stats(builds), "rebuild": _stats(rebuilds), "start": _stats(starts),
            "first_start_ms": 1000 * first}


def _podman_arms(store: LayerStore, task: Path, work: Path, o: dict) -> dict:
    base = f"localhost/dsec-bench-python-{secrets.token_hex(3)}"
    tag = f"localhost/dsec-bench-task-{secrets.token_hex(3)}"
    _import_into_podman(store, "python", base, work / "import")
    peer = task.parent.parent / "podman-task"
    shutil.copytree(task.parent, peer)
    (peer / "Dockerfile").write_text(task.read_text().replace("FROM python", f"FROM {base}", 1))
    builds, rebuilds, starts = [], [], []
    try:
        for n in range(o["build_rounds"]):
            t = time.perf_counter()
            _podman("build", "--no-cache", "-q", *BUILD_FLAGS, "-t", tag, str(peer))
            builds.append(time.perf_counter() - t)
        for n in range(o["rebuild_rounds"]):
            t = time.perf_counter()
            _podman("build", "-q", *BUILD_FLAGS, "-t", tag, str(peer))
            rebuilds.append(time.perf_counter() - t)
        for n in range(o["podman_start_rounds"] + 1):
            cname = f"dsec-bench-harness-{secrets.token_hex(3)}"
            t = time.perf_counter()
            _podman("run", "-d", "--rm", *PODMAN_FLAGS, "--name", cname, tag, "sleep", "infinity")
            out = _podman("exec", cname, "cat", "/app/.built")
            took = time.perf_counter() - t
            _podman("rm", "-f", "-t", "0", cname)
            if not out.strip():
                raise RuntimeError("podman's image does not hold what its build made")
            if n >= 1:
                starts.append(took)
    finally:
        subprocess.run([PODMAN, "rmi", "-f", tag, base], capture_output=True, timeout=600)
        subprocess.run([PODMAN, "image", "prune", "-f"], capture_output=True, timeout=600)
    return {"build": _stats(builds), "rebuild": _stats(rebuilds), "start": _stats(starts)}


HARBOR_VENV = Path("/var/lib/dsec-test/harbor-venv-0.25.0")
HARBOR_TASKS = Path(__file__).resolve().parents[3] / "tests" / "harbor_tasks"
HARBOR_GOAL = 5.0


def _harbor_skipped(venv: Path, tasks: Path) -> str | None:
    if not (venv / "bin" / "harbor").exists():
        return f"no Harbor venv at {venv} (tests/integration/test_harbor.py makes it; --harbor-venv names another)"
    if not tasks.is_dir():
        return f"no Harbor tasks at {tasks} (a source checkout's tests/harbor_tasks)"
    return harbor_peer.missing()


def _harbor_run(o: dict, env: dict, environment: tuple[str, ...], names: list[str], work: Path) -> dict:
    """One ``harbor run -a oracle`` of ``names``: its wall time, trials per minute, the rewards."""
    jobs = Path(tempfile.mkdtemp(prefix="jobs-", dir=work))
    include = [arg for name in names for arg in ("-i", name)]
    t = time.perf_counter()
    done = subprocess.run([str(o["harbor_venv"] / "bin" / "harbor"), "run", "-p", str(o["harbor_tasks"]),
                           "-a", "oracle", *environment, "-o", str(jobs), "-y", "-n", str(o["harbor_concurrency"]),
                           *include], capture_output=True, text=True, env=env, timeout=3600)
    took = time.perf_counter() - t
    rewards = {}
    for path in jobs.glob("*/*/result.json"):
        result = json.loads(path.read_text())
        rewards[result["task_name"]] = ((result.get("verifier_result") or {}).get("rewards") or {}).get("reward")
    shutil.rmtree(jobs, ignore_errors=True)
    if sorted(rewards) != sorted(names) or any(v != 1.0 for v in rewards.values()):
        raise RuntimeError(f"harbor run {' '.join(environment)}: rewards {rewards} "
                           f"(exit {done.returncode}): {(done.stdout + done.stderr)[-1500:]}")
    return {"seconds": took, "trials": len(rewards), "trials_per_min": 60 * len(rewards) / took}


def _sources_path() -> str:
    """PYTHONPATH for Harbor's own venv: the directories this process imports dsec and libdsec
    from (two distributions, each in its own source tree in a checkout)."""
    import dsec
    import libdsec

    return os.pathsep.join(dict.fromkeys(str(Path(m.__file__).resolve().parents[1]) for m in (dsec, libdsec)))


def _harbor_arm(server, store: LayerStore, cache_dir: Path, o: dict, console: Console) -> dict:
    names = sorted(o["harbor_task_names"] or harbor_peer.public_tasks(o["harbor_tasks"]))
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-harbor-"))
    env = {**os.environ, "HOME": str(work), "HARBOR_TELEMETRY": "0", "DSEC_ENDPOINT": server.endpoint,
           "DSEC_TOKEN": server.token, "PYTHONPATH": _sources_path(), "COLUMNS": "2000"}
    r: dict = {"tasks": len(names), "concurrency": o["harbor_concurrency"]}
    try:
        ours = ("--env", "dsec.integrations.harbor:DSecEnvironment")
        console.print(f"Harbor: {len(names)} tasks, -n {o['harbor_concurrency']}, on DSec (a warm-up run, then the measured one) …")
        _harbor_run(o, env, ours, names, work)
        r["dsec"] = _harbor_run(o, env, ours, names, work)
        console.print("Harbor: the same on its docker environment (a dockerd of the benchmark's own) …")
        with harbor_peer.docker_peer(store, cache_dir) as peer:
            theirs = (*peer.harbor_args, "--no-delete")
            _harbor_run(o, {**env, **peer.env}, theirs, names, work)
            r["docker"] = _harbor_run(o, {**env, **peer.env}, theirs, names, work)
            r["docker"]["dockerd_dir"] = str(peer.root)  # (gone after the run)
        r["ratio"] = r["dsec"]["trials_per_min"] / r["docker"]["trials_per_min"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return r


def main(state_dir: Path, console: Console, files: int = 200, build_rounds: int = 3, rebuild_rounds: int = 5,
         start_rounds: int = 30, podman_start_rounds: int = 10, podman: bool = True,
         store_dir: Path | None = None, harbor: bool = True, harbor_venv: Path = HARBOR_VENV,
         harbor_tasks: Path = HARBOR_TASKS, harbor_concurrency: int = 4,
         harbor_task_names: tuple[str, ...] = ()) -> int:
    """Run it, print the table and the goals, write ``<state_dir>.json``; 0 when it ran cleanly.
    The layer store (``store_dir``, else ``<state_dir>-store``) outlives the run."""
    state_dir = Path(state_dir).resolve()
    started = datetime.now(timezone.utc)
    store = python_store(state_dir, store_dir, console)
    o = {"files": files, "build_rounds": build_rounds, "rebuild_rounds": rebuild_rounds,
         "start_rounds": start_rounds, "podman_start_rounds": podman_start_rounds,
         "harbor_concurrency": harbor_concurrency}
    r: dict = {"commit": source_commit(), "started": started.isoformat(timespec="seconds"), **o,
               "load_start": os.getloadavg()[0]}
    o.update(harbor_venv=Path(harbor_venv), harbor_tasks=Path(harbor_tasks), harbor_task_names=tuple(harbor_task_names))
    harbor_skipped = "--no-harbor" if not harbor else _harbor_skipped(o["harbor_venv"], o["harbor_tasks"])
    if harbor_skipped:
        r["harbor_skipped"] = harbor_skipped
    console.print(f"[bold]dsec bench harness[/bold]: a task of {files} source files, commit {r['commit']}, "
                  f"load {r['load_start']:.1f}")
    errors: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-harness-"))
    task = _task(work / "task", files, secrets.token_hex(8), "python")

    async def run() -> None:
        with serving(state_dir, "--pool-max", str(max(4, harbor_concurrency)), "--fncall-max", "0") as server:
            try:
                async with DSecClient(server.endpoint, token=server.token) as client:
                    r["dsec"] = await _dsec(client, task, o, console)
            except Exception as exc:  # noqa: BLE001 - reported
                errors.append(f"DSec: {type(exc).__name__}: {exc}")
            if not harbor_skipped:
                try:
                    r["harbor"] = await asyncio.to_thread(_harbor_arm, server, store, store.root.parent, o, console)
                except Exception as exc:  # noqa: BLE001 - reported
                    errors.append(f"Harbor: {type(exc).__name__}: {exc}")

    try:
        asyncio.run(run())
    except Exception as exc:  # noqa: BLE001 - reported
        errors.append(f"DSec's server: {type(exc).__name__}: {exc}")
    if not podman:
        r["podman_skipped"] = "--no-podman"
    elif not os.path.exists(PODMAN):
        r["podman_skipped"] = f"podman not found at {PODMAN}: apt-get install podman (scripts/setup-host.sh does)"
    else:
        try:
            r["podman"] = _podman_arms(store, task, work, o)
        except Exception as exc:  # noqa: BLE001 - reported
            errors.append(f"podman: {type(exc).__name__}: {exc}")
    shutil.rmtree(work, ignore_errors=True)
    r["load_end"] = os.getloadavg()[0]
    r["errors"] = errors
    _report(console, r)
    save_results(console, state_dir, r, errors)
    return 0 if not errors else 1


def _report(console: Console, r: dict) -> None:
    table = Table(title=f"a task's environment: build, rebuild, start to first answer (commit {r['commit']})")
    for col in ("arm", "DSec p50 ms", "podman p50 ms", "podman / DSec", "goal"):
        table.add_column(col)
    goals = {}
    d, p = r.get("dsec"), r.get("podman")
    for arm, goal in (("build", "DSec no slower"), ("rebuild", "DSec ≤ 1 s"), ("start", "DSec p50 ≤ 150 ms")):
        mine = d[arm]["p50_ms"] if d else None
        theirs = p[arm]["p50_ms"] if p else None
        ratio = theirs / mine if mine and theirs else None
        met = {"build": ratio is not None and ratio >= 1.0, "rebuild": mine is not None and mine <= 1000,
               "start": mine is not None and mine <= 150}[arm]
        goals[arm] = met
        table.add_row(arm, f"{mine:.0f}" if mine else "-", f"{theirs:.0f}" if theirs else "-",
                      f"{ratio:.2f}×" if ratio else "-", f"{goal}: {'met' if met else 'MISSED'}")
    console.print(table)
    if d:
        console.print(f"DSec's first start of the image (no sandbox of it in the warm pool yet): "
                      f"{d['first_start_ms']:.0f} ms; p90 of the others {d['start']['p90_ms']:.0f} ms")
    if "podman_skipped" in r:
        console.print(f"podman skipped: {r['podman_skipped']}")
    h = r.get("harbor")
    if h and "docker" in h:
        table = Table(title=f"Harbor oracle trials per minute: {h['tasks']} tasks, harbor run -n {h['concurrency']}, "
                            "images built (after a warm-up run each way)")
        for col in ("arm", "DSec", "Harbor docker", "DSec / docker", "goal"):
            table.add_column(col)
        goals["harbor"] = h["ratio"] >= HARBOR_GOAL
        table.add_row("trials / min", f"{h['dsec']['trials_per_min']:.1f}", f"{h['docker']['trials_per_min']:.1f}",
                      f"{h['ratio']:.1f}×", f"DSec ≥ {HARBOR_GOAL:.0f}× docker: {'met' if goals['harbor'] else 'MISSED'}")
        table.add_row("wall s", f"{h['dsec']['seconds']:.1f}", f"{h['docker']['seconds']:.1f}", "", "")
        console.print(table)
    if "harbor_skipped" in r:
        console.print(f"Harbor oracle trials per minute skipped: {r['harbor_skipped']}")
    r["goals"] = goals
