"""SWE-ReX's own client (``swerex.runtime.remote.RemoteRuntime``, from the swe-rex package)
against a real ``dsec serve``: sessions with SWE-ReX's semantics, execute, files, upload, errors,
``DSecDeployment``, and the ``swe-agent`` image with what SWE-agent's commands assume."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime

from libdsec import DSecContainerRunArgs, InvalidRequest, SandboxNotFound

pytestmark = [pytest.mark.slow, pytest.mark.root]

logging.getLogger("rex-runtime").setLevel(logging.CRITICAL + 1)  # its own logging of the errors we provoke


@pytest.fixture
async def sandbox(client, python_image):
    async with await client.run_container(DSecContainerRunArgs(container_image=python_image, memory_limit_mb=512)) as sb:
        yield sb


@pytest.fixture
async def swe_agent_sandbox(client, swe_agent_image):
    async with await client.run_container(DSecContainerRunArgs(container_image=swe_agent_image, memory_limit_mb=512)) as sb:
        yield sb


def runtime_of(server, sandbox_id: str, token: str | None = None) -> RemoteRuntime:
    return RemoteRuntime(host=f"{server.endpoint}/v1/sandboxes/{sandbox_id}/swerex", port=None,
                         auth_token=token or server.token, timeout=10)


async def run(rt: RemoteRuntime, command: str, **kw):
    return await rt.run_in_session(BashAction(command=command, **kw))


async def test_a_bash_session_keeps_state_checks_exit_codes_and_times_out(server, sandbox):
    rt = runtime_of(server, sandbox.id)
    assert (await rt.is_alive()).is_alive
    await sandbox.write_file("/root/rc.sh", "export FROM_RC=yes\nshopt -s extglob\n")
    await rt.create_session(CreateBashSessionRequest(startup_source=["/root/rc.sh"]))
    with pytest.raises(SessionExistsError):
        await rt.create_session(CreateBashSessionRequest())

    assert (await run(rt, "cd /tmp && export A=1 && f() { echo fn$1; }")).exit_code == 0
    obs = await run(rt, "pwd; echo $A $FROM_RC; f 2; echo to-stderr >&2; [[ abc == a* ]] && echo bash")
    assert obs.output == "/tmp\n1 yes\nfn2\nto-stderr\nbash\n" and obs.exit_code == 0, obs

    with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
        await run(rt, "echo out; (exit 3)", error_msg="while testing")
    assert (await run(rt, "false", check="silent")).exit_code == 1
    assert (await run(rt, "false", check="ignore")).exit_code is None
    with pytest.raises(BashIncorrectSyntaxError) as syntax:
        await run(rt, "export B=2\nif then fi; echo never")
    assert "syntax error" in syntax.value.extra_info["bash_stderr"]
    assert (await run(rt, "echo B=$B; ls /no-such 2>&1 >/dev/null | wc -l; (exit 2)", check="silent")).model_dump(
        include={"output", "exit_code"}) == {"output": "B=\n1\n", "exit_code": 2}  # nothing of it ran

    # Past its timeout the command is interrupted; SWE-agent's interrupt then finds the shell free.
    with pytest.raises(CommandTimeoutError):
        await run(rt, "sleep 30", timeout=1)
    assert (await rt.run_in_session(BashInterruptAction())).exit_code == 0
    assert (await run(rt, "echo still $A")).output == "still 1\n"

    # An interrupt from elsewhere while a command runs (Ctrl-C): the command ends, the shell stays.
    running = asyncio.create_task(run(rt, "sleep 30; echo not-reached", check="silent", timeout=60))
    await asyncio.sleep(1.5)
    await rt.run_in_session(BashInterruptAction())
    obs = await asyncio.wait_for(running, 20)
    assert "not-reached" not in obs.output and obs.exit_code != 0, obs
    assert (await run(rt, "echo $A; pwd")).output == "1\n/tmp\n"

    await rt.close_session(CloseBashSessionRequest())
    with pytest.raises(SessionDoesNotExistError):
        await run(rt, "echo gone")
    with pytest.raises(SessionDoesNotExistError):
        await rt.close_session(CloseBashSessionRequest())


async def test_an_interactive_program_in_a_session(server, sandbox):
    rt = runtime_of(server, sandbox.id)
    await rt.create_session(CreateBashSessionRequest(session="py"))
    await run(rt, "mkdir -p /srv/w && cd /srv/w && export GREETING=hello", session="py")
    started = await run(rt, "python3", session="py", is_interactive_command=True, expect=[">>> "], timeout=20)
    assert started.expect_string == ">>> ", started
    await run(rt, "import os; x = 6 * 7", session="py", is_interactive_command=True, expect=[">>> "], timeout=10)
    obs = await run(rt, "print(x, os.getcwd(), os.environ['GREETING'])", session="py",
                    is_interactive_command=True, expect=[">>> "], timeout=10)
    assert obs.output == "42 /srv/w hello", obs
    # A long computation, interrupted (Ctrl-C at its terminal): back at the prompt.
    with pytest.raises(CommandTimeoutError):
        await run(rt, "import time; time.sleep(60)", session="py", is_interactive_command=True, expect=[">>> "],
                  timeout=1)
    obs = await rt.run_in_session(BashInterruptAction(session="py", expect=[">>> "], timeout=5))
    assert obs.expect_string == ">>> " and "KeyboardInterrupt" in obs.output, obs
    obs = await run(rt, "print('after', x)", session="py", is_interactive_command=True, expect=[">>> "], timeout=10)
    assert obs.output == "after 42", obs
    await run(rt, "exit()", session="py", is_interactive_quit=True, timeout=10)
    obs = await run(rt, "echo back in $(pwd)", session="py")
    assert obs.output == "back in /srv/w\n", obs
    await rt.close()
    with pytest.raises(SessionDoesNotExistError):
        await run(rt, "true", session="py")


async def test_the_swe_agent_image_has_python_less_and_git(swe_agent_sandbox):
    r = await swe_agent_sandbox.run_shell("python --version; less --version | head -1; git --version; command -v bash")
    lines = r.stdout.splitlines()
    assert r.exit_code == 0 and len(lines) == 4, r
    assert lines[0].startswith("Python 3.") and lines[1].startswith("less ") and lines[2].startswith("git version ")


async def test_commands_as_swe_agent_sends_them(server, swe_agent_sandbox):
    """Blank and comment-only commands, heredocs, python's REPL, and an interactive program past
    its timeout, as SWE-ReX's own tests send them."""
    rt = runtime_of(server, swe_agent_sandbox.id)
    await rt.create_session(CreateBashSessionRequest())
    for nothing in ("", "\n", "\n\n \n", "# echo 'hello world'", "  # one\n\n# two"):
        obs = await run(rt, nothing)
        assert (obs.output, obs.exit_code) == ("", 0), (nothing, obs)

    obs = await run(rt, "python <<EOF\nprint('hello world')\nprint('x' * 3)\nEOF")
    assert obs.output == "hello world\nxxx\n", obs
    obs = await run(rt, "cat <<'END' > /tmp/lit.txt\n$((6 * 7)) `echo no`\nEND\ncat /tmp/lit.txt <<EOF\nignored\nEOF\n"
                        "cat <<EOF\n$((6 * 7))\nEOF")
    assert obs.output == "$((6 * 7)) `echo no`\n42\n", obs

    # An interactive program that never says what is expected: a timeout, then SWE-agent's
    # interrupt ends it and the shell is back.
    with pytest.raises(CommandTimeoutError):
        await run(rt, "python", is_interactive_command=True, expect=["WONTHITTHIS"], timeout=0.5)
    await rt.run_in_session(BashInterruptAction())
    assert (await run(rt, "echo shell; python -c 'print(1)'")).output == "shell\n1\n"

    await run(rt, "python", is_interactive_command=True, expect=[">>> "], timeout=10)
    obs = await run(rt, "print('hello world')", is_interactive_command=True, expect=[">>> "], timeout=10)
    assert obs.output == "hello world", obs
    await run(rt, "quit()\n", is_interactive_quit=True, timeout=10)
    assert (await run(rt, "echo 'hello\nworld'")).output == "hello\nworld\n"
    await rt.close_session(CloseBashSessionRequest())


async def test_files_as_swe_rex_reads_and_writes_them(server, client):
    """Paths relative to the sandbox's working directory (as ``execute``'s), the errors Python's
    own file calls raise, a large file, and an empty command."""
    async with await client.run_container(DSecContainerRunArgs(container_image="busybox", memory_limit_mb=128,
                                                               workdir="/srv/task")) as sb:
        rt = runtime_of(server, sb.id)
        await rt.write_file(WriteFileRequest(path="notes/a.txt", content="relative"))
        assert (await rt.read_file(ReadFileRequest(path="notes/a.txt"))).content == "relative"
        assert (await rt.execute(Command(command="cat /srv/task/notes/a.txt", shell=True))).stdout == "relative"
        big = "x" * (1 << 20) + "\n"
        await rt.write_file(WriteFileRequest(path="/tmp/big.txt", content=big))
        assert (await rt.read_file(ReadFileRequest(path="/tmp/big.txt"))).content == big

        with pytest.raises(FileNotFoundError):
            await rt.read_file(ReadFileRequest(path="notes/none.txt"))
        with pytest.raises(IsADirectoryError):
            await rt.read_file(ReadFileRequest(path="/tmp"))
        with pytest.raises(IsADirectoryError):
            await rt.write_file(WriteFileRequest(path="notes", content="x"))
        with pytest.raises(NotADirectoryError):
            await rt.read_file(ReadFileRequest(path="notes/a.txt/b"))
        with pytest.raises(FileExistsError):  # (its parent would be made: there is a file)
            await rt.write_file(WriteFileRequest(path="notes/a.txt/b", content="x"))

        await sb.write_file("/tmp/latin.txt", b"caf\xe9")
        with pytest.raises(ValueError):
            await rt.read_file(ReadFileRequest(path="/tmp/latin.txt"))
        assert (await rt.read_file(ReadFileRequest(path="/tmp/latin.txt", encoding="latin-1"))).content == "café"
        assert (await rt.read_file(ReadFileRequest(path="/tmp/latin.txt", errors="replace"))).content == "caf\ufffd"
        with pytest.raises(LookupError):
            await rt.read_file(ReadFileRequest(path="/tmp/latin.txt", encoding="no-such-codec"))

        for nothing in ("", "\n"):
            r = await rt.execute(Command(command=nothing, shell=True, check=True))
            assert (r.stdout, r.stderr, r.exit_code) == ("", "", 0)
    async with await client.run_container(DSecContainerRunArgs(container_image="busybox", memory_limit_mb=64,
                                                               init_user="agent")) as sb:
        with pytest.raises(PermissionError):  # (the sandbox's user cannot make its parent)
            await runtime_of(server, sb.id).write_file(WriteFileRequest(path="/root/new/a.txt", content="x"))


async def test_execute_read_write_and_upload(server, sandbox, tmp_path):
    rt = runtime_of(server, sandbox.id)
    r = await rt.execute(Command(command=["sh", "-c", "echo $0 $X; pwd; echo e >&2", "arg0"], env={"X": "x"}, cwd="/tmp"))
    assert (r.stdout, r.stderr, r.exit_code) == ("arg0 x\n/tmp\n", "e\n", 0)
    r = await rt.execute(Command(command="echo a; echo b >&2; exit 2", shell=True, merge_output_streams=True))
    assert (r.stdout, r.stderr, r.exit_code) == ("a\nb\n", "", 2)
    with pytest.raises(NonZeroExitCodeError):
        await rt.execute(Command(command="exit 2", shell=True, check=True))
    with pytest.raises(CommandTimeoutError):
        await rt.execute(Command(command="sleep 30", shell=True, timeout=1))

    await rt.write_file(WriteFileRequest(path="/srv/new/dir/a.txt", content="héllo\n"))
    assert (await rt.read_file(ReadFileRequest(path="/srv/new/dir/a.txt"))).content == "héllo\n"
    with pytest.raises(FileNotFoundError):
        await rt.read_file(ReadFileRequest(path="/srv/no-such-file"))

    single = tmp_path / "single.txt"
    single.write_text("one file")
    await rt.upload(UploadRequest(source_path=str(single), target_path="/srv/up/one.txt"))
    tree = tmp_path / "tree"
    (tree / "pkg/sub").mkdir(parents=True)
    (tree / "pkg/sub/mod.py").write_text("VALUE = 7\n")
    (tree / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tree / "run.sh").chmod(0o755)
    await rt.upload(UploadRequest(source_path=str(tree), target_path="/srv/repo"))
    r = await rt.execute(Command(command="cat /srv/up/one.txt; echo; /srv/repo/run.sh; "
                                         "cd /srv/repo && python3 -c 'from pkg.sub.mod import VALUE; print(VALUE)'",
                                 shell=True))
    assert r.stdout == "one file\nran\n7\n", r


async def test_a_call_sent_again_with_its_request_id_runs_once(server, sandbox):
    """RemoteRuntime sends each call with an ``X-Request-ID`` and its retries with the same: the
    retry gets the first answer, awaited if the first still runs, and nothing runs twice."""
    import httpx

    url = f"{server.endpoint}/v1/sandboxes/{sandbox.id}/swerex"
    body = {"command": "sleep 0.5; echo x >> /tmp/count; wc -l < /tmp/count", "shell": True}
    async with httpx.AsyncClient(headers={"X-API-Key": server.token}, timeout=30) as http:
        async def call(request_id: str) -> httpx.Response:
            return await http.post(f"{url}/execute", json=body, headers={"X-Request-ID": request_id})

        # Two at once (the first one's connection broken, its retry sent), then once more later.
        first, again = await asyncio.gather(call("r-1"), call("r-1"))
        later = await call("r-1")
        assert first.status_code == 200 and first.json()["stdout"] == "1\n", first.text
        assert again.json() == first.json() == later.json()
        # Another id is another call; so is one with no id.
        assert (await call("r-2")).json()["stdout"] == "2\n"
        plain = await http.post(f"{url}/execute", json=body)
        assert plain.json()["stdout"] == "3\n"
        # An error is the call's answer too: a timed-out command is not run again.
        slow = {"command": "echo y >> /tmp/slow; sleep 30", "shell": True, "timeout": 0.5}
        answers = [await http.post(f"{url}/execute", json=slow, headers={"X-Request-ID": "r-3"}) for _ in range(2)]
        assert [a.status_code for a in answers] == [511, 511]
        assert answers[0].json() == answers[1].json()
        assert answers[0].json()["swerexception"]["class_path"] == "swerex.exceptions.CommandTimeoutError"
        assert (await sandbox.read_file("/tmp/slow")) == b"y\n"
        # The id answers only who may see the sandbox.
        stranger = await http.post(f"{url}/execute", json=body, headers={"X-Request-ID": "r-1", "X-API-Key": "bad"})
        assert stranger.status_code == 401


async def test_unknown_sandbox_and_bad_token(server, client, sandbox):
    gone = runtime_of(server, sandbox.id[:-4] + "0000")
    alive = await gone.is_alive()
    assert not alive.is_alive and "404" in alive.message
    with pytest.raises(aiohttp.ClientResponseError) as err:
        await gone.execute(Command(command="true", shell=True))
    assert err.value.status == 404

    # Another project's token sees no such sandbox.
    await client.create_project("swerex-other")
    other = await client.create_project_token("swerex-other")
    alive = await runtime_of(server, sandbox.id, token=other).is_alive()
    assert not alive.is_alive and "404" in alive.message
    await client.remove_project("swerex-other")

    bad = runtime_of(server, sandbox.id, token="not-a-token")
    alive = await bad.is_alive()
    assert not alive.is_alive and "401" in alive.message
    with pytest.raises(aiohttp.ClientResponseError) as err:
        await bad.create_session(CreateBashSessionRequest())
    assert err.value.status == 401


async def test_an_image_without_bash_is_refused_by_name(server, client):
    async with await client.run_container(DSecContainerRunArgs(container_image="busybox", memory_limit_mb=64)) as sb:
        with pytest.raises(RuntimeError, match="no bash in the sandbox's image"):
            await runtime_of(server, sb.id).create_session(CreateBashSessionRequest())
        with pytest.raises(InvalidRequest, match="no bash in the sandbox's image"):  # and the SDK's own call
            await sb.open_session(shell="bash")


async def test_dsec_deployment_starts_and_stops_its_sandbox(server, client, swe_agent_image):
    from dsec.compat.swerex_deployment import DSecDeployment

    steps: list[str] = []

    class Hook:
        def on_custom_step(self, message: str) -> None:
            steps.append(message)

    deployment = DSecDeployment(image=swe_agent_image, endpoint=server.endpoint, token=server.token, memory_limit_mb=256)
    deployment.add_hook(Hook())
    async with deployment:
        assert (await deployment.is_alive()).is_alive
        r = await deployment.runtime.execute(Command(command="cat /etc/debian_version", shell=True))
        assert r.exit_code == 0 and r.stdout.strip()
        await deployment.runtime.create_session(CreateBashSessionRequest())
        obs = await run(deployment.runtime, "# SWE-agent's first look\npython <<'EOF'\nimport sys; print(sys.version_info[0])\nEOF")
        assert obs.output == "3\n", obs
        sandbox_id = deployment.sandbox_id
        assert (await client.get_sandbox(sandbox_id)).status.value == "running"
    assert "Starting runtime" in steps
    try:
        assert (await client.get_sandbox(sandbox_id)).status.value == "stopped"
    except SandboxNotFound:
        pass  # (gone from the list already)
    await deployment.stop()  # a second stop does nothing
