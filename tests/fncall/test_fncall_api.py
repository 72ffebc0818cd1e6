"""FnCall through a real ``dsec serve``: the SDK (async and sync), the batch route, ``dsec call``,
and a server that stops leaving nothing behind (the ``server`` fixture checks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import libdsec
from libdsec import DSecFnCallArgs, SyncDSecClient

pytestmark = [pytest.mark.slow, pytest.mark.root]


async def test_fncall(client, python_image):
    r = await client.fncall(DSecFnCallArgs(code="import sys\nsys.stdout.buffer.write(open('in.bin', 'rb').read()[::-1])"
                                                "\nopen('out.bin', 'wb').write(bytes(range(256)))",
                                           files={"in.bin": b"\x00\x01\xff"}, fetch_files=["out.bin"]))
    assert r.ok and r.stdout == "\ufffd\x01\x00"  # output is text: invalid UTF-8 is replaced
    assert r.files == {"out.bin": bytes(range(256))}  # files are bytes
    r = await client.fncall(DSecFnCallArgs(code="while True: pass", timeout=0.5))
    assert r.timed_out and r.exit_code == -9 and not r.ok
    with pytest.raises(libdsec.InvalidRequest, match="unsupported language"):
        await client.fncall(DSecFnCallArgs(code="x", language="perl"))
    with pytest.raises(libdsec.ImageNotFound):
        await client.fncall(DSecFnCallArgs(code="x", image="nope"))
    assert not [s for s in await client.list_sandboxes() if s.image == "python"]  # workers are no sandboxes


async def test_fncall_many(client, python_image):
    calls = [DSecFnCallArgs(code=f"print({i} * {i})") for i in range(300)]
    calls[10] = DSecFnCallArgs(code="x", language="perl")
    calls[20] = DSecFnCallArgs(code="import sys; sys.exit(7)")
    results = await client.fncall_many(calls, per_request=64)
    assert len(results) == 300
    assert results[10].error.code == "invalid_request" and results[20].exit_code == 7
    assert all(r.stdout == f"{i * i}\n" for i, r in enumerate(results) if i not in (10, 20))


def test_sync_client(server, python_image):
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        assert client.fncall(DSecFnCallArgs(code="echo $((6 * 7))", language="bash")).stdout == "42\n"
        assert [r.stdout for r in client.fncall_many([DSecFnCallArgs(code="print(1)")] * 3)] == ["1\n"] * 3


def _dsec_call(server, *args: str, stdin: str | None = None, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token}
    return subprocess.run([sys.executable, "-m", "dsec", "call", *args], input=stdin, capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=120)


def test_dsec_call(server, python_image, tmp_path):
    done = _dsec_call(server, "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)")
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    (tmp_path / "data.txt").write_text("local data")
    done = _dsec_call(server, "-l", "bash", "--put", "in.txt=" + str(tmp_path / "data.txt"), "--fetch", "o.txt",
                      "--out", str(tmp_path / "got"), "-e", "X=1", "--stdin", str(tmp_path / "data.txt"),
                      "cat in.txt; echo; echo $X; cat; cp in.txt o.txt")
    assert done.returncode == 0 and done.stdout == "local data\n1\nlocal data", done.stderr
    assert (tmp_path / "got" / "o.txt").read_text() == "local data"
    done = _dsec_call(server, "--timeout", "0.5", "while True: pass")
    assert done.returncode == 124 and "timed out" in done.stderr
    done = _dsec_call(server, "--json", "-", stdin="print(5)")
    assert json.loads(done.stdout)["stdout"] == "5\n"
    done = _dsec_call(server, "-l", "cobol", "x")
    assert done.returncode == 1 and "unsupported language" in done.stderr
