"""DSec as Inspect's sandbox "dsec", driven by Inspect's own code: an eval of its ``mockllm``
model whose bash and python tool calls run in DSec sandboxes, the same through ``inspect eval``
and ``inspect sandbox cleanup``, exec and file semantics, and Inspect's conformance suite for
sandbox providers (``inspect_ai.util._sandbox.self_check``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from inspect_ai import Task, eval as inspect_eval
from inspect_ai.dataset import Sample
from inspect_ai.log import read_eval_log
from inspect_ai.model import ChatMessageTool, ChatMessageUser, ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, accuracy, scorer
from inspect_ai.solver import generate, use_tools
from inspect_ai.tool import bash, python
from inspect_ai.util import OutputLimitExceededError, SandboxUnavailableError, sandbox
from inspect_ai.util._sandbox import self_check
from inspect_ai.util._sandbox.events import SandboxEnvironmentProxy
from inspect_ai.util._sandbox.limits import override_max_exec_output_size, override_max_read_file_size

# The shared venv's dsec metadata predates the entry point (pyproject.toml): imported here, as
# Inspect imports it through the entry point once dsec is installed (the CLI test does that).
from dsec.integrations.inspect import DSecSandboxConfig, DSecSandboxEnvironment

pytestmark = [pytest.mark.slow, pytest.mark.root]

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


@pytest.fixture
def dsec_env(server, python_image, monkeypatch) -> dict[str, str]:
    """The server as the SDK's discovery finds it (DSEC_ENDPOINT, DSEC_TOKEN)."""
    env = {"DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
async def sandbox_env(dsec_env, client):
    """One sample's sandbox, as Inspect's sample_init makes it; gone after sample_cleanup."""
    environments = await DSecSandboxEnvironment.sample_init("test", DSecSandboxConfig(), {})
    env = environments["default"].as_type(DSecSandboxEnvironment)
    yield env
    await DSecSandboxEnvironment.sample_cleanup("test", None, environments, False)
    assert env.sandbox.id not in {s.id for s in await client.list_sandboxes()}


def test_the_entry_point_is_declared():
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert entry_points["inspect_ai"] == {"dsec": "dsec.integrations.inspect"}
    from inspect_ai.util._sandbox.registry import registry_find_sandboxenv

    assert registry_find_sandboxenv("dsec") is DSecSandboxEnvironment


# -- an eval, in process ------------------------------------------------------------------

def _script(messages, tools, tool_choice, config) -> ModelOutput:
    """The mock model: bash writes the answer to a file, python reads it back, then it stops."""
    question = next(m.text for m in messages if isinstance(m, ChatMessageUser))
    step = sum(isinstance(m, ChatMessageTool) for m in messages)
    if step == 0:
        output = ModelOutput.for_tool_call("mockllm/model", "bash",
                                           {"command": f"python3 -c 'print({question})' > answer.txt && whoami"})
    elif step == 1:
        output = ModelOutput.for_tool_call("mockllm/model", "python",
                                           {"code": "import os; print(os.getcwd(), open('answer.txt').read())"})
    else:
        output = ModelOutput.from_content("mockllm/model", "done")
    output.usage = USAGE  # else mockllm counts tokens with tiktoken, which downloads its tables
    return output


USAGE = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)


@scorer(metrics=[accuracy()])
def answer_file():
    async def score(state, target) -> Score:
        answer = (await sandbox().read_file("answer.txt")).strip()
        connection = await sandbox().connection()
        return Score(value=CORRECT if answer == target.text else INCORRECT, answer=answer,
                     metadata={"sandbox": connection.container, "shell": connection.command})

    return score


async def test_an_eval_of_mockllm_runs_its_tool_calls_in_dsec(dsec_env, client, tmp_path):
    task = Task(dataset=[Sample(input="6*7", target="42"), Sample(input="2**10", target="1024")],
                solver=[use_tools([bash(), python()]), generate()], scorer=answer_file(),
                sandbox=("dsec", _config_file(tmp_path)))
    model = get_model("mockllm/model", custom_outputs=_script)
    [log] = await asyncio.to_thread(inspect_eval, task, model=model, log_dir=str(tmp_path / "logs"),
                                    display="none")
    assert log.status == "success", log.error
    assert log.results.scores[0].metrics["accuracy"].value == 1.0
    used = set()
    for sample in log.samples:
        tool_outputs = [m.text for m in sample.messages if isinstance(m, ChatMessageTool)]
        assert tool_outputs[0].strip() == "root"  # whoami, after the file was written
        assert tool_outputs[1].strip() == f"/work {sample.target}"  # the config's workdir
        score = sample.scores["answer_file"]
        assert score.metadata["shell"] == f"dsec shell {score.metadata['sandbox']} --command 'bash -l'"
        used.add(score.metadata["sandbox"])
    assert len(used) == 2  # one sandbox per sample
    assert not used & {s.id for s in await client.list_sandboxes()}


def _config_file(tmp_path: Path) -> str:
    path = tmp_path / "dsec.yaml"
    path.write_text("image: python\nmemory_limit_mb: 512\nworkdir: /work\n")
    return str(path)


# -- the same on the command line, Inspect finding dsec through the entry point ------------

TASK_FILE = '''
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import ChatMessageTool, ChatMessageUser, ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import includes
from inspect_ai.solver import generate, use_tools
from inspect_ai.tool import bash


def script(messages, tools, tool_choice, config):
    question = next(m.text for m in messages if isinstance(m, ChatMessageUser))
    if not any(isinstance(m, ChatMessageTool) for m in messages):
        output = ModelOutput.for_tool_call("mockllm/model", "bash", {"command": f"echo $(({question}))"})
    else:
        output = ModelOutput.from_content("mockllm/model", "the answer is " + messages[-1].text)
    output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)  # (no tiktoken)
    return output


@task
def arithmetic():
    return Task(dataset=[Sample(input="6*7", target="42"), Sample(input="2+3", target="5")],
                solver=[use_tools([bash()]), generate()], scorer=includes(), sandbox="dsec",
                model=get_model("mockllm/model", custom_outputs=script))
'''


def _entry_points_dir(tmp_path: Path) -> Path:
    """A distribution on PYTHONPATH declaring pyproject.toml's entry points (the shared venv's
    dsec is not reinstalled for a test): Inspect loads ``dsec`` from them as after ``pip install``."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["inspect_ai"]
    info = tmp_path / "eps" / "dsec_entry_points_under_test-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dsec-entry-points-under-test\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[inspect_ai]\n" + "".join(f"{k} = {v}\n" for k, v in declared.items()))
    return info.parent


def _inspect(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "inspect"), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300)


async def test_inspect_eval_and_sandbox_cleanup_on_the_command_line(dsec_env, client, tmp_path):
    (tmp_path / "arithmetic.py").write_text(TASK_FILE)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **dsec_env,
           "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'libdsec' / 'src'}:{_entry_points_dir(tmp_path)}",
           "INSPECT_LOG_DIR": str(tmp_path / "logs"), "INSPECT_DISPLAY": "none", "INSPECT_LOG_LEVEL": "warning"}
    done = await asyncio.to_thread(_inspect, ["eval", "arithmetic.py"], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [log_file] = (tmp_path / "logs").iterdir()
    log = read_eval_log(str(log_file))
    assert log.status == "success" and log.eval.sandbox.type == "dsec"
    assert log.results.scores[0].metrics["accuracy"].value == 1.0
    assert not [s for s in await client.list_sandboxes() if "inspect_ai.task" in s.labels]

    # --no-sandbox-cleanup leaves the two sandboxes running; `inspect sandbox cleanup dsec` stops them.
    done = await asyncio.to_thread(_inspect, ["eval", "arithmetic.py", "--no-sandbox-cleanup"], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    left = [s.id for s in await client.list_sandboxes() if s.labels.get("inspect_ai.task") == "arithmetic"]
    assert len(left) == 2
    assert all(sandbox_id in done.stdout + done.stderr for sandbox_id in left)
    done = await asyncio.to_thread(_inspect, ["sandbox", "cleanup", "dsec"], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [s for s in await client.list_sandboxes() if "inspect_ai.task" in s.labels]


# -- exec and files -----------------------------------------------------------------------

async def test_exec_input_cwd_env_user(sandbox_env):
    assert (await sandbox_env.exec(["cat"], input="to stdin\n")).stdout == "to stdin\n"
    assert (await sandbox_env.exec(["sh", "-c", "cat > bin.out"], input=b"\xff\x00\xc3(")).success
    assert await sandbox_env.read_file("bin.out", text=False) == b"\xff\x00\xc3("
    await sandbox_env.exec(["mkdir", "-p", "/tmp/sub"])
    assert (await sandbox_env.exec(["pwd"], cwd="/tmp/sub")).stdout == "/tmp/sub\n"
    assert (await sandbox_env.exec(["pwd"], cwd="tmp")).stdout == "/tmp\n"  # the workdir's (/)
    result = await sandbox_env.exec(["sh", "-c", 'echo "$A $B"; echo oops >&2; exit 3'], env={"A": "1", "B": "two"})
    assert (result.success, result.returncode, result.stdout, result.stderr) == (False, 3, "1 two\n", "oops\n")
    assert (await sandbox_env.exec(["id", "-un"], user="nobody")).stdout == "nobody\n"
    assert (await sandbox_env.exec(["id", "-u"])).stdout == "0\n"
    unknown = await sandbox_env.exec(["id"], user="nosuchuser")
    assert unknown.returncode == 126 and "nosuchuser" in unknown.stderr
    with pytest.raises(PermissionError):
        await sandbox_env.exec(["/etc/passwd"])
    assert (await sandbox_env.exec(["nosuchcommand"])).returncode == 127


async def test_exec_timeout_raises_timeout_error_with_the_output_so_far(sandbox_env):
    with pytest.raises(TimeoutError) as caught:
        await sandbox_env.exec(["sh", "-c", "echo started; sleep 30"], timeout=1)
    assert caught.value.truncated_output == "started\n"
    assert (await sandbox_env.exec(["sh", "-c", "ps -eo args | grep -c '^sleep 30'"])).stdout == "0\n"


async def test_exec_output_keeps_the_tail_within_the_limit_as_docker_does(sandbox_env):
    proxy = SandboxEnvironmentProxy(sandbox_env)  # what Inspect hands tools: it checks the size
    with override_max_exec_output_size(1024):
        result = await proxy.exec(["sh", "-c", "head -c 5000 /dev/zero | tr '\\0' a; echo END; "
                                               "head -c 3000 /dev/zero | tr '\\0' b >&2"])
    assert len(result.stdout) == 1024 and result.stdout.endswith("a" * 1020 + "END\n")
    assert result.stderr == "b" * 1024


async def test_files_round_trip_and_inspects_errors(sandbox_env):
    await sandbox_env.write_file("/tmp/deep/er/a.txt", "text\r\nwith crlf ✨")
    assert await sandbox_env.read_file("/tmp/deep/er/a.txt") == "text\r\nwith crlf ✨"
    await sandbox_env.write_file("relative/b.bin", bytes(range(256)))
    assert await sandbox_env.read_file("/relative/b.bin", text=False) == bytes(range(256))
    await sandbox_env.write_file("run.sh", "#!/bin/sh\necho one\n")
    await sandbox_env.exec(["chmod", "755", "run.sh"])
    await sandbox_env.write_file("run.sh", "#!/bin/sh\necho two\n")  # keeps its mode, as tee does
    assert (await sandbox_env.exec(["/run.sh"])).stdout == "two\n"
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        await sandbox_env.read_file("missing.txt")
    with pytest.raises(IsADirectoryError):
        await sandbox_env.read_file("/tmp/deep")
    with pytest.raises(IsADirectoryError):
        await sandbox_env.write_file("/tmp/deep", "x")
    with override_max_read_file_size(10), pytest.raises(OutputLimitExceededError):
        await sandbox_env.read_file("/tmp/deep/er/a.txt")


async def test_task_cleanup_stops_what_sample_cleanup_did_not(dsec_env, client):
    config = DSecSandboxConfig(memory_limit_mb=256)
    environments = await DSecSandboxEnvironment.sample_init("left", config, {})
    made = environments["default"].as_type(DSecSandboxEnvironment)
    assert made.sandbox.id in {s.id for s in await client.list_sandboxes()}
    await DSecSandboxEnvironment.task_cleanup("shutdown", config, True)
    assert made.sandbox.id not in {s.id for s in await client.list_sandboxes()}
    with pytest.raises(SandboxUnavailableError):  # a tool error for the model, not a crash
        await made.exec(["true"])
    await made.client.close()


# -- Inspect's conformance suite for sandbox providers --------------------------------------

# Checks DSec does not pass, and why.
KNOWN_FAILURES = {
    # Writes go through the node as the sandbox's root (as docker's default user, root, does):
    # a file without write permission is still written.
    "test_write_text_file_without_permissions": "root writes a read-only file",
    "test_write_binary_file_without_permissions": "root writes a read-only file",
}


@pytest.mark.parametrize("check", [
    pytest.param(name, marks=[pytest.mark.xfail(reason=KNOWN_FAILURES[name], strict=True)] if name in KNOWN_FAILURES else [])
    for name in self_check.__all__
])
async def test_inspect_self_check(check, sandbox_env):
    await getattr(self_check, check)(sandbox_env)
