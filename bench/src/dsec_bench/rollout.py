"""``dsec bench rollout``: a SWE-style RL rollout, end to end, beside the same loop through podman exec.

The task set (``build_task_set``): ``tasks`` (32) small git repositories, each a workspace
layer over the ``python`` base (an image ``rollout-task-NN`` = python's layers + one layer with
``/testbed``, a git repository whose ``calc.scale`` has a bug its ``test_calc.py`` catches, and
``/grader/grade.py``, the task's grader, outside the kept path). Episode ``n`` (``episode``) on
task ``n % tasks``:

1. a sandbox from the task image;
2. a scripted policy (``plan``, seeded by ``n``): 3–10 commands — reads (``cat``, ``ls``, ``git
   log``), the tests (fail), a patch written as a file and applied with ``git apply`` (right in
   some episodes, wrong in the others: the ground truth), the tests again; a share of the wrong
   ones also plant a ``python3`` that exits 0 in ``/usr/local/bin`` (the clean copy must not
   see it);
3. for a share of episodes (``branch_every``), a mid-episode ``pack_diff`` and a sandbox started
   from it (the branch), which runs the tests and stops;
4. the verdict: ``clean_copy(keep=["/testbed"])`` runs ``/grader/grade.py``; exit 0 = solved;
5. stop.

The peer does the same through podman: ``podman run -d`` of the task's root filesystem (the
same two EROFS layers, overlaid read-only, ``--rootfs DIR:O``), each command a ``podman exec``,
the file written through ``podman exec -i … cat``, the branch and the clean copy each a fresh
container of the task with ``/testbed`` copied in (``tar`` between two ``podman exec``).

Printed: episodes/s, p50/p99 episode time, verdict accuracy against the script's ground truth
(must be 100 %), host memory in use (MemTotal − MemAvailable) above the start, peak and mean,
for both, and the ratio of episodes/s (goal ≥ 5×). A progress bar while it runs. Results go to
``<state_dir>.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import secrets
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from libdsec import DSecClient, DSecContainerRunArgs, Sandbox

from dsec import _sys, hostcheck
from dsec.images import loopdev
from dsec.images.builders import build_python
from dsec.images.store import Image, LayerStore
from dsec.local import serving
from .lifecycle_peers import PODMAN, PODMAN_FLAGS, SLEEP_ARGS, _finish, podman_detached
from .results import run_noting, save_results, source_commit

KEEP = ["/testbed"]
GRADE = "python3 -I -S /grader/grade.py"
MEMORY_MB = 256


# -- the task set ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class TaskSpec:
    index: int
    image: str
    factor: int
    offset: int

    @property
    def right_patch(self) -> str:
        return _patch(self, f"x * {self.factor} + {self.offset}")

    @property
    def wrong_patch(self) -> str:
        return _patch(self, f"x * {self.factor} + {self.offset + 1}")


def _calc(factor: int, body: str) -> str:
    return f'"""Task calc."""\n\n\ndef scale(x):\n    """x times {factor}, plus the offset."""\n    return {body}\n'


def _patch(task: TaskSpec, body: str) -> str:
    old, new = f"x * {task.factor} - {task.offset}", body
    return (f"--- a/calc.py\n+++ b/calc.py\n@@ -5,2 +5,2 @@ def scale(x):\n"
            f'     """x times {task.factor}, plus the offset."""\n-    return {old}\n+    return {new}\n')


def _git(repo: Path, *args: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "dsec", "GIT_AUTHOR_EMAIL": "dsec@localhost",
           "GIT_COMMITTER_NAME": "dsec", "GIT_COMMITTER_EMAIL": "dsec@localhost",
           "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, env=env)


def build_task_set(store: LayerStore, tasks: int = 32, work: Path | None = None) -> list[TaskSpec]:
    """The task images in ``store`` (made once: layers are named by their content)."""
    python = store.get_image("python") if store.has_image("python") else build_python(store)
    out = []
    for i in range(tasks):
        spec = TaskSpec(i, f"rollout-task-{i:02d}", factor=2 + i % 7, offset=1 + i)
        out.append(spec)
        if store.has_image(spec.image):
            continue
        root = Path(work or store.root / "tmp") / f"rollout-ws-{i:02d}-{secrets.token_hex(3)}"
        try:
            repo = root / "testbed"
            repo.mkdir(parents=True)
            (repo / "calc.py").write_text(_calc(spec.factor, f"x * {spec.factor} - {spec.offset}"))
            (repo / "test_calc.py").write_text(
                "import calc\n\n\ndef test_scale():\n"
                f"    assert calc.scale(3) == {3 * spec.factor + spec.offset}\n"
                f"    assert calc.scale(-2) == {-2 * spec.factor + spec.offset}\n\n\n"
                "if __name__ == '__main__':\n    test_scale()\n    print('ok')\n")
            (repo / "README").write_text(f"task {i}: calc.scale(x) is x * {spec.factor} + {spec.offset}\n")
            _git(repo, "init", "-q", "-b", "main")
            _git(repo, "add", ".")
            _git(repo, "commit", "-q", "-m", f"task {i}")
            grader = root / "grader"
            grader.mkdir()
            (grader / "grade.py").write_text(
                "import sys\nsys.path.insert(0, '/testbed')\nimport calc\n"
                f"ok = calc.scale(3) == {3 * spec.factor + spec.offset} and calc.scale(10) == "
                f"{10 * spec.factor + spec.offset}\nprint('solved' if ok else 'unsolved')\nsys.exit(0 if ok else 1)\n")
            layer = store.add_dir(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        store.put_image(Image(name=spec.image, layers=python.layers + (layer,), roles=python.roles + ("workspace",),
                              env=python.env, workdir="/testbed"))
    return out


# -- the scripted policy -------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    kind: str  # "sh" (a command), "write" (a file), "branch" (pack_diff + a sandbox from it)
    text: str = ""
    path: str = ""


def plan(n: int, task: TaskSpec, branch_every: int) -> tuple[list[Step], bool]:
    """Episode ``n``'s steps and whether its patch is right (the ground truth)."""
    rng = random.Random(n)
    right = rng.random() < 0.5
    reads = ["cat calc.py", "ls -la", "git log --oneline", "cat README", "cat test_calc.py", "git status --short"]
    steps = [Step("sh", t) for t in rng.sample(reads, rng.randint(1, 4))]
    steps.append(Step("sh", "python3 test_calc.py"))  # fails: the bug
    steps.append(Step("write", task.right_patch if right else task.wrong_patch, "/tmp/fix.patch"))
    steps.append(Step("sh", "git apply /tmp/fix.patch && git diff --stat"))
    if branch_every and n % branch_every == 0:
        steps.append(Step("branch"))
    steps.append(Step("sh", "python3 test_calc.py"))
    if not right and rng.random() < 0.3:  # forge the test runner the grader would call by name
        steps.append(Step("sh", "printf '#!/bin/sh\\necho ok\\nexit 0\\n' > /usr/local/bin/python3 && "
                                "chmod +x /usr/local/bin/python3"))
    commands = sum(s.kind == "sh" for s in steps)
    assert 3 <= commands <= 10, commands
    return steps, right


# -- one episode each way --------------------------------------------------------------------------

@dataclass
class Episode:
    seconds: float
    right: bool
    verdict: bool
    commands: int
    branched: bool


async def episode(client: DSecClient, n: int, tasks: list[TaskSpec], branch_every: int) -> Episode:
    task = tasks[n % len(tasks)]
    steps, right = plan(n, task, branch_every)
    t0 = time.perf_counter()
    args = DSecContainerRunArgs(container_image=task.image, memory_limit_mb=MEMORY_MB)
    async with await client.run_container(args) as sandbox:
        for step in steps:
            if step.kind == "sh":
                await sandbox.run_shell(step.text, workdir="/testbed")
            elif step.kind == "write":
                await sandbox.write_file(step.path, step.text)
            else:
                await _branch(client, sandbox, args)
        async with await sandbox.clean_copy(keep=KEEP) as grader:
            verdict = (await grader.run_shell(GRADE)).exit_code == 0
    return Episode(time.perf_counter() - t0, right, verdict, sum(s.kind == "sh" for s in steps),
                   any(s.kind == "branch" for s in steps))


async def _branch(client: DSecClient, sandbox: Sandbox, args: DSecContainerRunArgs) -> None:
    snapshot = await sandbox.pack_diff()
    try:
        async with await client.run_container(args.model_copy(update={"container_image": snapshot.image})) as branch:
            await branch.run_shell("python3 test_calc.py", workdir="/testbed")
    finally:
        await client.remove_image(snapshot.image)


class PodmanRig:
    """The task root filesystems for podman: the python base layer and each task's workspace
    layer mounted read-only, overlaid (two lower layers, no upper) per task; podman puts its own
    overlay on top (``--rootfs DIR:O``). ``cleanup()`` removes every container and mount."""

    def __init__(self, work: Path, store: LayerStore, tasks: list[TaskSpec]) -> None:
        self.work = Path(work).resolve()
        self.store = store
        self.tasks = tasks
        self.prefix = f"dsec-rollout-{hashlib.sha1(str(self.work).encode()).hexdigest()[:10]}-"
        self._n = 0

    def rootfs(self, task: TaskSpec) -> Path:
        return self.work / "tasks" / task.image

    def __enter__(self) -> PodmanRig:
        self.cleanup()
        flags = _sys.MS_RDONLY | _sys.MS_NODEV | _sys.MS_NOSUID
        for task in self.tasks:
            layers = self.store.get_image(task.image).layers
            lowers = []
            for digest in reversed(layers):  # top first, as overlayfs wants them
                target = self.work / "layers" / digest[:16]
                lowers.append(str(target))
                if os.path.ismount(target):
                    continue
                target.mkdir(parents=True, exist_ok=True)
                if hostcheck.layer_attach() == "file":
                    _sys.mount(str(self.store.layer_path(digest)), str(target), "erofs", flags)
                else:
                    with loopdev.attached(self.store.layer_path(digest)) as device:
                        _sys.mount(device, str(target), "erofs", flags)
            merged = self.rootfs(task)
            merged.mkdir(parents=True, exist_ok=True)
            _sys.mount("overlay", str(merged), "overlay", _sys.MS_RDONLY, "lowerdir=" + ":".join(lowers))
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def cleanup(self) -> None:
        names = subprocess.run([PODMAN, "ps", "-a", "--format", "{{.Names}}", "--filter", f"name=^{self.prefix}"],
                               capture_output=True, text=True, timeout=120).stdout.split()
        for i in range(0, len(names), 64):
            subprocess.run([PODMAN, "rm", "-f", "-t", "0", *names[i:i + 64]], capture_output=True, timeout=300)
        for sub in ("tasks", "layers"):
            base = self.work / sub
            if base.is_dir():
                for target in base.iterdir():
                    with contextlib.suppress(OSError):
                        if os.path.ismount(target):
                            _sys.umount(str(target), _sys.MNT_DETACH)
        shutil.rmtree(self.work, ignore_errors=True)

    async def _run(self, *argv: str, stdin: bytes | None = None) -> tuple[int, bytes]:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        if stdin is not None:
            out, _ = await asyncio.wait_for(proc.communicate(stdin), 120)
            return proc.returncode or 0, out
        rc, out, _ = await _finish(proc, argv[1], pipes=True)
        return rc, out

    async def start(self, task: TaskSpec) -> str:
        self._n += 1
        name = f"{self.prefix}{self._n}-{secrets.token_hex(2)}"
        await podman_detached([PODMAN, "run", "--rm", "--detach", "--name", name, *PODMAN_FLAGS, "--memory",
                               f"{MEMORY_MB}m", "--workdir", "/testbed", "--rootfs", f"{self.rootfs(task)}:O",
                               *SLEEP_ARGS], self.work / f"{name}.log")
        return name

    async def sh(self, name: str, command: str) -> int:
        return (await self._run(PODMAN, "exec", "-w", "/testbed", name, "/bin/sh", "-c", command))[0]

    async def write(self, name: str, path: str, text: str) -> None:
        rc, out = await self._run(PODMAN, "exec", "-i", name, "/bin/sh", "-c", f"cat > {path}", stdin=text.encode())
        if rc != 0:
            raise RuntimeError(f"podman exec -i could not write {path}: {out.decode(errors='replace')[-300:]}")

    async def copy_of(self, name: str, task: TaskSpec) -> str:
        """A fresh container of the task with ``name``'s /testbed copied in."""
        other = await self.start(task)
        pipe = (f"{PODMAN} exec {name} tar -C / -cf - testbed | "
                f"{PODMAN} exec -i {other} sh -c 'rm -rf /testbed && tar -C / -xf -'")
        rc, out = await self._run("/bin/sh", "-c", pipe)
        if rc != 0:
            raise RuntimeError(f"the copy of /testbed into {other} failed: {out.decode(errors='replace')[-300:]}")
        return other

    async def remove(self, *names: str) -> None:
        await self._run(PODMAN, "rm", "-f", "-t", "0", *names)


async def podman_episode(rig: PodmanRig, n: int, tasks: list[TaskSpec], branch_every: int) -> Episode:
    task = tasks[n % len(tasks)]
    steps, right = plan(n, task, branch_every)
    t0 = time.perf_counter()
    name = await rig.start(task)
    try:
        for step in steps:
            if step.kind == "sh":
                await rig.sh(name, step.text)
            elif step.kind == "write":
                await rig.write(name, step.path, step.text)
            else:
                branch = await rig.copy_of(name, task)
                await rig.sh(branch, "python3 test_calc.py")
                await rig.remove(branch)
        grader = await rig.copy_of(name, task)
        verdict = await rig.sh(grader, GRADE) == 0
        await rig.remove(grader)
    finally:
        await rig.remove(name)
    return Episode(time.perf_counter() - t0, right, verdict, sum(s.kind == "sh" for s in steps),
                   any(s.kind == "branch" for s in steps))


# -- running it ------------------------------------------------------------------------------------

def _memory_used() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0])) * 1024


async def run_episodes(label: str, count: int, concurrency: int, one, progress: Progress) -> dict:
    """``count`` episodes, ``concurrency`` at a time; figures and host memory while they ran."""
    todo = iter(range(count))
    done: list[Episode] = []
    task = progress.add_task(label, total=count)
    base, samples = _memory_used(), []

    async def sample() -> None:
        while True:
            samples.append(_memory_used() - base)
            await asyncio.sleep(0.5)

    async def worker() -> None:
        for n in todo:
            done.append(await one(n))
            progress.advance(task)

    sampler = asyncio.create_task(sample())
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        sampler.cancel()
    wall = time.perf_counter() - t0
    times = sorted(e.seconds for e in done)
    return {"episodes": len(done), "seconds": wall, "episodes_per_s": len(done) / wall,
            "p50_ms": statistics.median(times) * 1000, "p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))] * 1000,
            "accuracy": sum(e.verdict == e.right for e in done) / len(done),
            "solved": sum(e.verdict for e in done), "right": sum(e.right for e in done),
            "branched": sum(e.branched for e in done), "commands": sum(e.commands for e in done),
            "memory_peak_mb": max(samples or [0]) / 1e6, "memory_mean_mb": statistics.fmean(samples or [0]) / 1e6}


def main(state_dir: Path, console: Console, store_dir: Path | None = None, episodes: int = 1000,
         concurrency: int = 16, tasks: int = 32, branch_every: int = 8, podman_episodes: int = 48,
         pool_max: int = 16) -> int:
    """Run it, print the table, write ``<state_dir>.json``; 0 when it ran cleanly with every
    verdict right, 1 otherwise."""
    state_dir = Path(state_dir).resolve()
    os.environ.setdefault("DSEC_VMS", "0")
    os.environ.setdefault("DSEC_GUEST_KERNEL_PACKAGE", "dsec-bench-rollout-no-guest-kernel")
    store_dir = Path(store_dir or state_dir.parent / f"{state_dir.name}-store").resolve()
    store = LayerStore(store_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    if not (state_dir / "store").is_symlink():
        (state_dir / "store").symlink_to(store_dir)
    r: dict = {"commit": source_commit(), "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "episodes": episodes, "podman_episodes": podman_episodes, "concurrency": concurrency, "tasks": tasks,
               "branch_every": branch_every, "load_start": os.getloadavg()[0]}
    console.print(f"[bold]dsec bench rollout[/bold]: {episodes} episodes over {tasks} tasks, {concurrency} at a "
                  f"time (podman: {podman_episodes}), commit {r['commit']}, load {r['load_start']:.1f}")
    t0 = time.perf_counter()
    task_set = build_task_set(store, tasks)
    r["task_set_s"] = time.perf_counter() - t0
    errors: list[str] = []

    async def run() -> None:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            with serving(state_dir, "--pool-max", str(pool_max)) as server:
                async with DSecClient(server.endpoint, token=server.token) as client:
                    await run_episodes("warm-up", min(concurrency, episodes), concurrency,
                                       lambda n: episode(client, n + episodes, task_set, branch_every), progress)
                    r["dsec"] = await run_episodes("DSec", episodes, concurrency,
                                                   lambda n: episode(client, n, task_set, branch_every), progress)
            if podman_episodes and os.path.exists(PODMAN):
                with PodmanRig(state_dir.parent / f"{state_dir.name}-podman", store, task_set) as rig:
                    r["podman"] = await run_episodes("podman exec", podman_episodes, concurrency,
                                                     lambda n: podman_episode(rig, n, task_set, branch_every), progress)

    run_noting(run(), r, errors)
    table = Table(title=f"SWE-style rollout: {tasks} tasks, concurrency {concurrency}, commit {r['commit']}")
    for col in ("way", "episodes", "episodes/s", "p50 ms", "p99 ms", "verdicts right", "branched",
                "host mem peak MB", "mean MB"):
        table.add_column(col)
    for key, label in (("dsec", "DSec"), ("podman", "podman exec (peer)")):
        if key in r:
            a = r[key]
            table.add_row(label, str(a["episodes"]), f"{a['episodes_per_s']:.2f}", f"{a['p50_ms']:.0f}",
                          f"{a['p99_ms']:.0f}", f"{a['accuracy'] * 100:.1f}%", str(a["branched"]),
                          f"{a['memory_peak_mb']:.0f}", f"{a['memory_mean_mb']:.0f}")
            if a["accuracy"] != 1.0:
                errors.append(f"{label}: verdicts right in {a['accuracy'] * 100:.1f}% of episodes, not 100%")
    console.print(table)
    if "dsec" in r and "podman" in r:
        r["ratio"] = r["dsec"]["episodes_per_s"] / r["podman"]["episodes_per_s"]
        console.print(f"DSec / podman episodes/s: {r['ratio']:.1f}× (goal ≥ 5×: {'met' if r['ratio'] >= 5 else 'MISSED'})")
    r["errors"] = errors
    save_results(console, state_dir, r, errors)
    return 0 if not errors else 1
