"""DSec's E2B API driven by the official ``e2b`` SDK (issues 19 and 21).

The SDK's tests are in ``e2b_sdk/`` (they import only ``e2b``): each e2b release here runs them
in a pytest of its own, in its own Python environment, against one ``dsec serve``:

- the newest pinned in the ``test`` extra (this environment's ``e2b``);
- ``E2B_OLD``, three months older (it refuses, before sending anything, an API key that is not
  ``e2b_`` + hex: the test's key is made by ``create_project_token(…, e2b=True)``), in a venv
  under /tmp made by this test from the package registry (kept for the next run).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from libdsec import SyncDSecClient

pytestmark = [pytest.mark.slow, pytest.mark.root]

E2B_OLD = "2.45.1"
SDK_TESTS = Path(__file__).parent / "e2b_sdk"


def _pinned(name: str) -> str:
    """``name==VERSION`` as this environment has it (the old venv's pytest is this one's)."""
    from importlib.metadata import version

    return f"{name}=={version(name)}"


def old_sdk_python() -> Path:
    venv = Path(os.environ.get("DSEC_E2B_OLD_VENV", f"/tmp/dsec-e2b-sdk-{E2B_OLD}"))
    python = venv / "bin" / "python"
    ready = venv / ".dsec-ready"
    if not ready.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"e2b=={E2B_OLD}", _pinned("pytest"),
                        _pinned("pytest-asyncio")], check=True, timeout=600)
        ready.touch()
    return python


@pytest.fixture(scope="module")
def e2b_env(server, python_image):
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        key = client.create_project_token("root", e2b=True)
    return {"E2B_API_URL": f"{server.endpoint}/e2b", "E2B_SANDBOX_URL": f"{server.endpoint}/e2b/envd",
            "E2B_API_KEY": key, "DSEC_E2B_TEMPLATE": python_image}


def test_e2b_tokens_are_accepted_everywhere_a_token_is(server):
    with SyncDSecClient(server.endpoint, token=server.token) as root:
        root_key = root.create_project_token("root", e2b=True)
        root.create_project("e2b-team")
        team_key = root.create_project_token("e2b-team", e2b=True)
        assert root.create_project_token("e2b-team").startswith("dsp_")  # the usual form stays
    for key in (root_key, team_key):
        assert re.fullmatch(r"e2b_[0-9a-f]{40}", key), key
    with SyncDSecClient(server.endpoint, token=root_key) as client:
        assert {p.name for p in client.list_projects()} >= {"root", "e2b-team"}  # it is root's
    with SyncDSecClient(server.endpoint, token=team_key) as client:
        assert [p.name for p in client.list_projects()] == ["e2b-team"]
    cli = subprocess.run([sys.executable, "-m", "dsec", "project", "token", "root", "--e2b"], capture_output=True,
                         text=True, env={**os.environ, "DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token})
    assert cli.returncode == 0 and re.fullmatch(r"e2b_[0-9a-f]{40}\n", cli.stdout), cli.stderr


@pytest.mark.parametrize("release", ["newest", E2B_OLD])
def test_the_e2b_sdk_tests_pass(release, e2b_env, tmp_path):
    python = Path(sys.executable) if release == "newest" else old_sdk_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "PYTHONPATH"))}
    run = subprocess.run([str(python), "-m", "pytest", "-c", str(SDK_TESTS / "pytest.ini"), "--rootdir", str(SDK_TESTS),
                          "-q", f"--basetemp={tmp_path / 'sdk'}", str(SDK_TESTS)],
                         capture_output=True, text=True, env={**env, **e2b_env}, cwd=SDK_TESTS, timeout=600)
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('e2b'))"],
                             capture_output=True, text=True).stdout.strip()
    assert run.returncode == 0, f"e2b {version}:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, run.stdout[-2000:]


async def test_e2b_fork_maps_onto_dsecs(e2b_env, monkeypatch, server):
    """``sandbox.fork(count)`` of the newest SDK (the older one has none): each child on its own,
    with the parent's files and E2B's timeout as its TTL; a killed sandbox is E2B's not-found."""
    from e2b import AsyncSandbox, InvalidArgumentException, SandboxNotFoundException

    for name, value in e2b_env.items():
        monkeypatch.setenv(name, value)
    parent = await AsyncSandbox.create(template=e2b_env["DSEC_E2B_TEMPLATE"], timeout=120)
    try:
        await parent.files.write("/root/state.txt", "before the fork")
        forks = await parent.fork(count=2, timeout=45)
        assert len(forks) == 2 and all(isinstance(f, AsyncSandbox) for f in forks), forks
        try:
            assert len({f.sandbox_id for f in forks} | {parent.sandbox_id}) == 3
            for child in forks:
                assert await child.files.read("/root/state.txt") == "before the fork"
                assert (await child.get_info()).end_at  # E2B's view of the TTL
            with SyncDSecClient(server.endpoint, token=server.token) as dsec:
                assert [dsec.get_sandbox(f.sandbox_id).info.ttl_running_stop for f in forks] == [45.0, 45.0]
            await forks[0].files.write("/root/state.txt", "in the fork")
            assert await parent.files.read("/root/state.txt") == "before the fork"
        finally:
            for child in forks:
                await child.kill()
    finally:
        await parent.kill()
    with pytest.raises(SandboxNotFoundException):
        await parent.fork()
    with pytest.raises(InvalidArgumentException):
        await AsyncSandbox.fork(parent.sandbox_id, count=21)
