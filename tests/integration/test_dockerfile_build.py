"""Dockerfile builds as a call (``client.build_image``) against a real ``dsec serve``: a task's
Dockerfile (FROM a DSec image, COPY, ADD of a tar, ENV, ARG, WORKDIR, USER, RUN) built by DSec's
own builders, its log streamed, the result cached by content (a rebuild with nothing changed runs
nothing), concurrent builds of one content run once, and each bad input a clear error with
nothing left running."""

from __future__ import annotations

import asyncio
import io
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from libdsec import DSecContainerRunArgs, ImageBuildFailed, ImageNotFound, InvalidRequest

pytestmark = [pytest.mark.slow, pytest.mark.root]

DOCKERFILE = """\
# A task's environment, as Harbor's tasks write them.
FROM python
ARG GREETING=hello
ENV APP_HOME=/app TASK_NAME="a task"
WORKDIR $APP_HOME
COPY src/ ./src/
COPY nonce.txt data.txt /app/inputs/
ADD bundle.tar /opt/bundle/
RUN python3 src/make.py "$GREETING" > made.txt && echo "built in $(pwd)"
RUN ["sh", "-c", "id -un > /app/builder"]
RUN useradd -m taskuser
COPY --chown=taskuser:taskuser data.txt /home/taskuser/
USER taskuser
CMD ["sleep", "infinity"]
"""


def task_context(root: Path) -> Path:
    """A task directory: environment/Dockerfile and its context (a nonce makes its content new
    to the store each run)."""
    env = root / "environment"
    (env / "src").mkdir(parents=True)
    (env / "Dockerfile").write_text(DOCKERFILE)
    (env / "src/make.py").write_text("import sys\nprint(sys.argv[1].upper())\n")
    (env / "nonce.txt").write_text(uuid.uuid4().hex)
    (env / "data.txt").write_text("data\n")
    (env / "ignored.log").write_text("not sent\n")
    (env / ".dockerignore").write_text("*.log\n")
    with tarfile.open(env / "bundle.tar", "w") as tar:
        info = tarfile.TarInfo("tool/run.sh")
        body = b"#!/bin/sh\necho tool\n"
        info.size, info.mode = len(body), 0o755
        tar.addfile(info, io.BytesIO(body))
    return env / "Dockerfile"


async def forget(client, *names: str) -> None:
    for name in names:
        try:
            await client.remove_image(name)
        except ImageNotFound:
            pass


async def test_a_task_dockerfile_builds_runs_and_rebuilds_from_the_cache(client, python_image, tmp_path,
                                                                        no_sandbox_outlives_the_test):
    dockerfile = task_context(tmp_path)
    log: list[str] = []
    built = await client.build_image("task-hello", dockerfile, build_args={"GREETING": "hi there"},
                                     on_log=log.append)
    try:
        assert built.image == "task-hello" and not built.cached and len(built.key) == 64
        assert any(line.startswith("step 5/") for line in log), log  # the steps, as they run
        assert "built in /app" in log, log  # a RUN step's own output, streamed
        assert any("CMD is not kept" in line for line in log), log
        info = await client.inspect_image("task-hello")
        assert info.roles[-1] == "step" and info.parent == "python"
        async with await client.run_container(DSecContainerRunArgs(container_image="task-hello")) as sandbox:
            seen = await sandbox.run_shell(
                "pwd; id -un; cat made.txt; cat /app/builder; echo $TASK_NAME; ls /app/inputs; /opt/bundle/tool/run.sh; "
                "stat -c %U /home/taskuser/data.txt; test -e /app/ignored.log || echo no-log; ls /app/src")
            assert seen.exit_code == 0, seen.stderr
            assert seen.stdout.split("\n")[:-1] == [
                "/app", "taskuser", "HI THERE", "root", "a task", "data.txt", "nonce.txt", "tool", "taskuser", "no-log",
                "make.py"], seen.stdout
        # Nothing changed: from the cache, at once, with nothing run.
        started = time.monotonic()
        again = await client.build_image("task-hello-2", dockerfile, build_args={"GREETING": "hi there"})
        assert again.cached and again.key == built.key and time.monotonic() - started < 1.0
        # A build arg or a copied file that changed is a new build.
        other = await client.build_image("task-hello-3", dockerfile, build_args={"GREETING": "bye"})
        assert not other.cached and other.key != built.key
        (dockerfile.parent / "data.txt").write_text("changed\n")
        changed = await client.build_image("task-hello-3", dockerfile, build_args={"GREETING": "bye"})
        assert not changed.cached and changed.key not in (built.key, other.key)
    finally:
        await forget(client, "task-hello", "task-hello-2", "task-hello-3",
                     *(f"dockerfile-{k[:32]}" for k in {built.key, locals().get("other", built).key,
                                                        locals().get("changed", built).key}))


async def test_concurrent_builds_of_one_content_run_once(client, python_image, tmp_path, no_sandbox_outlives_the_test):
    text = f"FROM python\nRUN echo {uuid.uuid4().hex} > /nonce && sleep 1\n"
    logs: list[list[str]] = [[], [], []]
    results = await asyncio.gather(*(client.build_image(f"same-{n}", dockerfile_text=text, on_log=logs[n].append)
                                     for n in range(3)))
    try:
        assert len({r.key for r in results}) == 1
        ran = [n for n, log in enumerate(logs) if any(line.startswith("step 1/") for line in log)]
        assert len(ran) == 1, logs  # the others waited for it, then took its image
        for n in range(3):
            sandbox = await client.run_container(DSecContainerRunArgs(container_image=f"same-{n}"))
            async with sandbox:
                assert (await sandbox.run_shell("cat /nonce")).stdout.strip() == text.split()[4]
    finally:
        await forget(client, "same-0", "same-1", "same-2", f"dockerfile-{results[0].key[:32]}")


@pytest.mark.parametrize(("dockerfile", "files", "error", "says"), [
    ("RUN echo hi\n", {}, ImageBuildFailed, "RUN before FROM"),
    ("FROM python\nRUN echo one && exit 3\n", {}, ImageBuildFailed, "line 2 ('RUN echo one && exit 3') failed with exit code 3"),
    ("FROM python AS a\nFROM python\n", {}, ImageBuildFailed, "multi-stage builds are not supported"),
    ("FROM python\nCOPY --from=a /x /y\n", {}, ImageBuildFailed, "COPY --from"),
    ("FROM python\nCOPY missing.txt /x\n", {}, ImageBuildFailed, "'missing.txt' is not in the build context"),
    ("FROM python\nCOPY ../escape /x\n", {}, ImageBuildFailed, "is outside the build context"),
    ("FROM python\nADD http://example.invalid/x /x\n", {}, ImageBuildFailed, "ADD of a URL is not supported"),
    ("FROM python\nONBUILD RUN true\n", {}, ImageBuildFailed, "ONBUILD is not supported"),
    ("FROM python\nRUN <<EOF\necho\nEOF\n", {}, ImageBuildFailed, "heredocs"),
    ("FROM localhost:1/nobody/serves:this\n", {}, ImageNotFound, "FROM localhost:1/nobody/serves:this: no image"),
    ("FROM python\nCOPY link /x\n", {"link": "/etc/passwd"}, InvalidRequest, "'link', which links out of the context"),
])
async def test_bad_dockerfiles_are_clear_errors(client, python_image, tmp_path, dockerfile, files, error, says,
                                                no_sandbox_outlives_the_test):
    context = tmp_path / "ctx"
    context.mkdir()
    for name, target in files.items():
        (context / name).symlink_to(target)
    log: list[str] = []
    with pytest.raises(error) as raised:
        await client.build_image("bad", dockerfile_text=dockerfile, context=context, on_log=log.append)
    assert says in str(raised.value), str(raised.value)
    if "exit code 3" in says:
        assert "one" in str(raised.value)  # the log's end comes with it
    assert "bad" not in {i.name for i in (await client.list_images()).images}
    # The server keeps serving.
    assert (await client.build_image("fine", dockerfile_text="FROM python\nENV X=1\n")).image == "fine"
    await forget(client, "fine")
