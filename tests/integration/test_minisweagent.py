"""mini-swe-agent's own code on DSec (``dsec.integrations.minisweagent.DSecEnvironment``) against
a real ``dsec serve``: its ``DefaultAgent`` with its ``DeterministicModel`` solving a task, its
SWE-bench batch runner (``mini-extra swebench``) over 16 local tasks on 4 workers, and bad input.

mini-swe-agent is imported only once the ``mswea`` fixture has pointed its config dir, HOME and
Hugging Face's caches at a temporary directory and turned the hub off: importing it makes its
global config dir, and its batch runner loads the tasks with ``datasets``."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import threading

import pytest
import yaml

from libdsec import ImageNotFound, SandboxStateError, ServerUnavailable, SyncDSecClient, Unauthenticated

pytestmark = [pytest.mark.slow, pytest.mark.root]

ENVIRONMENT_CLASS = "dsec.integrations.minisweagent.DSecEnvironment"
# LitellmTextbasedModelConfig.action_regex (importing that module imports litellm, which goes
# to the internet for its price list).
ACTION_REGEX = r"```mswea_bash_command\s*\n(.*?)\n```"


@pytest.fixture(scope="module")
def mswea(server, tmp_path_factory):
    """mini-swe-agent offline, writing nowhere but a temporary directory; DSEC_ENDPOINT and
    DSEC_TOKEN name the module's server, so the environment finds it as the SDK does."""
    home = tmp_path_factory.mktemp("mswea-home")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {
            "HOME": str(home), "MSWEA_SILENT_STARTUP": "1", "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mswea"),
            "HF_HOME": str(home / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token,
        }.items():
            patch.setenv(name, value)
        import minisweagent

        assert minisweagent.global_config_dir == home / "mswea", "mini-swe-agent was imported before this module"
        yield


def scripted(*commands: str) -> list[dict]:
    """``DeterministicModel`` outputs as a text-based model's replies, each parsed by
    mini-swe-agent's own parser."""
    from minisweagent.models.test_models import make_output
    from minisweagent.models.utils.actions_text import parse_regex_actions

    replies = [f"THOUGHT: the next step.\n\n```mswea_bash_command\n{command}\n```" for command in commands]
    return [make_output(reply, parse_regex_actions(reply, action_regex=ACTION_REGEX, format_error_template="{{error}}"))
            for reply in replies]


def sync_threads() -> int:
    return sum(t.name == "libdsec-sync" for t in threading.enumerate())


async def test_its_default_agent_fixes_a_script_in_a_sandbox_and_submits(
        mswea, client, python_image, tmp_path, no_sandbox_outlives_the_test):
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import get_config_from_spec
    from minisweagent.environments import get_environment
    from minisweagent.models.test_models import DeterministicModel

    config = get_config_from_spec("mini_textbased.yaml")
    env = get_environment({**config["environment"], "environment_class": ENVIRONMENT_CLASS,
                           "image": python_image, "cwd": "/work", "timeout": 2})
    try:
        assert env.execute({"command": "printf 'print(6 * 8)\\n' > calc.py"})["returncode"] == 0
        model = DeterministicModel(outputs=scripted(
            "python3 calc.py; echo to-stderr >&2",
            "cd /tmp && export GONE=1 && touch kept",
            "pwd; echo GONE=$GONE; ls /tmp/kept",
            "sleep 30",
            "sed -i 's/6 \\* 8/6 * 7/' calc.py && python3 calc.py",
            "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py",
        ))
        agent = DefaultAgent(model, env, **{**config["agent"], "cost_limit": 0, "output_path": tmp_path / "traj.json"})
        info = agent.run("Make calc.py print 42.")

        assert info == {"exit_status": "Submitted", "submission": "print(6 * 7)\n"}
        observations = [m["extra"] for m in agent.messages[2:] if m["role"] == "user"]
        assert [(o["raw_output"], o["returncode"]) for o in observations[:3] + observations[4:]] == [
            ("48\nto-stderr\n", 0),  # stderr merged into the output, as docker's
            ("", 0),
            ("/work\nGONE=\n/tmp/kept\n", 0),  # a fresh shell per action: files stay, cd and export do not
            ("42\n", 0),
        ]
        timed_out = observations[3]  # killed past the environment's timeout: an observation, as docker's
        assert timed_out["returncode"] == -1 and "timed out after 2s" in timed_out["exception_info"], timed_out
        assert agent.messages[-1]["role"] == "exit"

        saved = (tmp_path / "traj.json").read_text()
        trajectory = json.loads(saved)
        assert trajectory["info"]["exit_status"] == "Submitted"
        assert trajectory["info"]["sandbox_id"] == env.sandbox_id
        assert trajectory["info"]["config"]["environment_type"] == ENVIRONMENT_CLASS
        assert os.environ["DSEC_TOKEN"] not in saved  # the config is in the trajectory, its token is not

        sandbox = await client.get_sandbox(env.sandbox_id)  # still there until cleanup
        assert await sandbox.read_file("/work/calc.py") == b"print(6 * 7)\n"
    finally:
        env.cleanup()


async def test_its_swebench_batch_runner_runs_16_tasks_on_4_workers_each_in_a_sandbox_of_its_own(
        mswea, python_image, tmp_path, no_sandbox_outlives_the_test):
    from minisweagent.run.benchmarks import swebench

    numbers = {f"dsec__square-{i:02d}": i + 2 for i in range(16)}
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "instances.jsonl").write_text("".join(
        json.dumps({"instance_id": iid, "problem_statement": f"Write the square of {n} to answer.txt.", "n": n}) + "\n"
        for iid, n in numbers.items()))
    # What a user adds to the benchmark's own swebench.yaml to run it on DSec (and a scripted model).
    (tmp_path / "dsec.yaml").write_text(yaml.safe_dump({
        "environment": {"environment_class": ENVIRONMENT_CLASS, "image": python_image},
        "run": {"env_startup_command": "echo {{ n }} > n.txt"},
        "model": {"model_class": "deterministic", "model_name": "deterministic", "outputs": scripted(
            # A sandbox that served another task has .seen: the answer would then be the other's.
            "test ! -e .seen && touch .seen && python3 -c 'n = int(open(\"n.txt\").read()); print(n * n)' > answer.txt",
            "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat answer.txt",
        )},
        "agent": {"cost_limit": 0},
    }))
    out = tmp_path / "out"
    most_at_once = watch_sandbox_count()

    swebench.app(["--subset", str(tmp_path / "tasks"), "--split", "train", "--workers", "4", "--output", str(out),
                  "-c", "swebench.yaml", "-c", str(tmp_path / "dsec.yaml")], standalone_mode=False)

    preds = json.loads((out / "preds.json").read_text())
    assert {iid: pred["model_patch"] for iid, pred in preds.items()} == {
        iid: f"{n * n}\n" for iid, n in numbers.items()}
    trajectories = [json.loads((out / iid / f"{iid}.traj.json").read_text()) for iid in numbers]
    assert [t["info"]["exit_status"] for t in trajectories] == ["Submitted"] * 16
    assert len({t["info"]["sandbox_id"] for t in trajectories}) == 16
    [report] = out.glob("exit_statuses_*.yaml")
    assert sorted(yaml.safe_load(report.read_text())["instances_by_exit_status"]["Submitted"]) == sorted(numbers)
    assert most_at_once.stop() >= 2, "the 4 workers never ran two tasks at once"
    # The runner drops each environment without cleanup(): __del__ stops its sandbox.
    gc.collect()


class watch_sandbox_count:
    """Counts the server's sandboxes every 50 ms in a thread; ``stop()`` is the most seen."""

    def __init__(self) -> None:
        self.most = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch)
        self._thread.start()

    def _watch(self) -> None:
        with SyncDSecClient() as client:
            while not self._done.wait(0.05):
                self.most = max(self.most, len(client.list_sandboxes()))

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.most


async def test_bad_input_is_a_clear_error_and_leaves_nothing(
        mswea, server, client, python_image, no_sandbox_outlives_the_test):
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments import get_environment
    from minisweagent.models.test_models import DeterministicModel

    from dsec.integrations.minisweagent import DSecEnvironment
    from dsec.local import free_port

    threads = sync_threads()
    with pytest.raises(ImageNotFound, match="no-such-image"):
        get_environment({"environment_class": ENVIRONMENT_CLASS, "image": "no-such-image"})
    with pytest.raises(ServerUnavailable):
        DSecEnvironment(image=python_image, endpoint=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(Unauthenticated):
        DSecEnvironment(image=python_image, token="not-the-token")
    with pytest.raises(ValueError, match="workdir must be an absolute path"):
        DSecEnvironment(image=python_image, cwd="relative")
    assert sync_threads() == threads  # each failed start closed its client

    env = DSecEnvironment(image=python_image)
    sandbox_id = env.sandbox_id
    env.cleanup()
    env.cleanup()  # a second cleanup does nothing
    assert sandbox_id not in {s.id for s in await client.list_sandboxes()}
    with pytest.raises(SandboxStateError, match="cleaned up"):
        env.execute({"command": "true"})
    assert env.serialize()["info"]["sandbox_id"] is None

    # The sandbox gone under a running agent: the platform's error ends the run, with its name
    # as the exit status mini-swe-agent records, rather than an observation the agent reads.
    env = DSecEnvironment(image=python_image)
    try:
        await (await client.get_sandbox(env.sandbox_id)).stop()
        agent = DefaultAgent(DeterministicModel(outputs=scripted("ls")), env, system_template="s", instance_template="t")
        with pytest.raises(SandboxStateError, match="is stopped"):
            agent.run("")
        assert agent.messages[-1]["extra"]["exit_status"] == "SandboxStateError"
    finally:
        env.cleanup()  # its sandbox is stopped already: nothing to do, no error
    assert sync_threads() == threads


async def test_a_process_that_ends_with_its_environment_alive_stops_its_sandbox(
        mswea, client, python_image, no_sandbox_outlives_the_test):
    """``mini`` keeps its environment to the end and never calls cleanup(): the atexit hook."""
    script = ("from dsec.integrations.minisweagent import DSecEnvironment\n"
              f"env = DSecEnvironment(image={python_image!r})\n"
              "print(env.sandbox_id, flush=True)\n")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert proc.returncode == 0 and out.strip()
    assert out.decode().strip() not in {s.id for s in await client.list_sandboxes()}
