"""The SDK installs alone (issue #29): ``libdsec`` from this checkout into a fresh venv (no
system site-packages, nothing of the test run's) brings none of the server's dependencies, and
drives a real ``dsec serve`` from there: a container made, a command's output read, the sandbox
stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# The server's run-time dependencies (pyproject.toml at the root, and its cluster extra), the
# server and the benchmarks: none of them may come with the SDK.
NOT_WITH_THE_SDK = ("fastapi", "starlette", "uvicorn", "uvloop", "asyncpg", "typer", "rich", "websockets",
                    "prometheus_client", "multipart", "dockerfile_parse", "ray", "dsec", "dsec_bench")


def _clean_env() -> dict[str, str]:
    """This process's environment without what would show the venv the test run's packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.fixture(scope="session")
def sdk_python(tmp_path_factory) -> Path:
    """The python of a venv holding the libdsec distribution of this checkout and its
    dependencies only (made once a session; pip takes them from the machine's configured index)."""
    venv = tmp_path_factory.mktemp("libdsec-alone") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_clean_env(), timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", str(REPO / "libdsec")],
                               capture_output=True, text=True, env=_clean_env(), cwd=venv, timeout=600)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    return python


def _run(python: Path, script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    (cwd / "script.py").write_text(textwrap.dedent(script))
    return subprocess.run([str(python), str(cwd / "script.py"), *args], capture_output=True, text=True,
                          env=_clean_env(), cwd=cwd, timeout=300)


def test_the_sdk_alone_has_none_of_the_servers_dependencies(sdk_python, tmp_path):
    done = _run(sdk_python, """\
        import importlib.util, json, sys
        import libdsec
        print(json.dumps({"libdsec": libdsec.__file__, "prefix": sys.prefix,
                          "found": [m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None]}))
        """, *NOT_WITH_THE_SDK, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert seen["found"] == []
    # The installed copy, not this checkout's source tree.
    assert seen["libdsec"].startswith(seen["prefix"]) and not seen["libdsec"].startswith(str(REPO))


def test_the_sdk_alone_drives_a_server(sdk_python, server, tmp_path):
    done = _run(sdk_python, """\
        import json, sys
        from libdsec import DSecContainerRunArgs, SyncDSecClient

        endpoint, token = sys.argv[1:3]
        with SyncDSecClient(endpoint, token=token) as client:
            with client.run_container(DSecContainerRunArgs(container_image="busybox", memory_limit_mb=64),
                                      timeout=60) as sandbox:
                result = sandbox.run_shell("echo made in $(cat /proc/1/comm)", timeout=30)
                sandbox.stop()
            left = [s.id for s in client.list_sandboxes() if s.id == sandbox.id]
        print(json.dumps({"exit_code": result.exit_code, "stdout": result.stdout, "left": left}))
        """, server.endpoint, server.token, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout)
    assert answer["exit_code"] == 0 and answer["stdout"].startswith("made in "), answer
    assert answer["left"] == []
