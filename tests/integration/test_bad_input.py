"""Bad input against a real ``dsec serve``: each gets its own error class and a message naming
the problem, the server keeps serving, and nothing is left behind (the module's server fixture
checks the host on the way out; each test checks that no sandbox outlives it)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

import libdsec
from libdsec import (
    CapacityExceeded,
    CommandTimeout,
    DSecClient,
    DSecContainerRunArgs,
    ImageNotFound,
    InvalidRequest,
    LimitOutOfRange,
    SandboxFileNotFound,
    SandboxNotFound,
    SandboxStateError,
    SandboxStatus,
    Unauthenticated,
)
from libdsec.protocol import MAX_BATCH_COUNT, MAX_SANDBOX_BATCH

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.usefixtures("no_sandbox_outlives_the_test")]


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(**{"container_image": "busybox", "memory_limit_mb": 64, **kw})




@pytest.fixture
async def sandbox(client):
    async with await client.run_container(args()) as s:
        yield s


async def assert_still_serving(client) -> None:
    async with await client.run_container(args()) as s:
        result = await s.run_shell("echo alive")
        assert (result.exit_code, result.stdout) == (0, "alive\n")


# -- create ---------------------------------------------------------------------------------


async def test_unknown_image(client):
    # The names it might have meant (sharing its first characters), not the whole store.
    with pytest.raises(ImageNotFound, match="'busybix'.*known: .*busybox") as info:
        await client.run_container(args(container_image="busybix"))
    assert isinstance(info.value, LookupError)
    with pytest.raises(ImageNotFound, match="'no-such-image'; known: ") as info:
        await client.run_container(args(container_image="no-such-image"))
    assert len(str(info.value)) < 4000
    with pytest.raises(ImageNotFound, match="no-such-image"):
        await client.run_containers(args(container_image="no-such-image"), count=3)
    with pytest.raises(ImageNotFound, match="unknown image"):
        await client.run_container(args(container_image="../../etc/passwd"))
    await assert_still_serving(client)


OUT_OF_RANGE = [
    ("memory_limit_mb", 0), ("memory_limit_mb", 15), ("memory_limit_mb", -64), ("memory_limit_mb", 10**8),
    ("cpu_cores_limit", 0), ("cpu_cores_limit", 0.001), ("cpu_cores_limit", -1), ("cpu_cores_limit", 4096),
    ("ttl_running_stop", 0), ("ttl_running_stop", 0.5), ("ttl_running_stop", -10), ("ttl_running_stop", 10**9),
    ("pids_limit", 0), ("pids_limit", 15), ("pids_limit", -1), ("pids_limit", 10**7),
    ("cpu_cores_cap", 0.001), ("cpu_cores_cap", 4096),
]


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
async def test_limit_out_of_range(client, field, value):
    with pytest.raises(LimitOutOfRange, match=rf"{field}=.*out of range") as info:
        await client.run_container(args(**{field: value}))
    assert isinstance(info.value, InvalidRequest) and isinstance(info.value, ValueError)
    with pytest.raises(LimitOutOfRange, match=field):
        await client.run_containers(args(**{field: value}), count=2)


async def test_server_serves_after_limit_errors(client):
    await assert_still_serving(client)


async def test_network_rules_are_refused(client):
    with pytest.raises(InvalidRequest, match="network_rules"):
        await client.run_container(args(network_rules={"pypi": True}))


async def test_unknown_init_user(client):
    with pytest.raises(InvalidRequest, match="unknown user 'nobody-here'"):
        await client.run_container(args(init_user="nobody-here"))
    with pytest.raises(InvalidRequest, match="unknown user"):
        await client.run_containers(args(init_user="nobody-here"), count=3)


async def test_workdir_that_is_a_file(client):
    with pytest.raises(InvalidRequest, match="/etc/passwd"):
        await client.run_container(args(workdir="/etc/passwd/sub"))


@pytest.mark.parametrize("count", [0, -3, MAX_SANDBOX_BATCH + 1, 10**9])
async def test_batch_count_out_of_range(client, server, count):
    with pytest.raises(LimitOutOfRange, match=f"count={count}"):
        await client.run_containers(args(), count=count)
    # The same request sent raw: the server refuses it too.
    async with httpx.AsyncClient(base_url=server.endpoint, headers={"authorization": f"Bearer {server.token}"}) as http:
        r = await http.post("/v1/sandboxes:batch", json={"args": {"container_image": "busybox"}, "count": count})
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "invalid_request" and "count" in r.json()["error"]["message"]


async def test_huge_batch_beyond_node_capacity_leaves_nothing(client):
    """A batch the node cannot hold fails as a whole, refused before any of it is made (the
    batch's undo of what it made is tested in test_ttl_and_batch)."""
    node = (await client.node_info())[0]
    with pytest.raises(CapacityExceeded, match="is full|cannot admit"):
        await client.run_containers(args(memory_limit_mb=node.memory_total_mb), count=MAX_BATCH_COUNT, timeout=120)
    # (the autouse check waits for the batch's sandboxes to be gone)


# -- exec -----------------------------------------------------------------------------------


async def test_command_timeout(sandbox):
    start = time.monotonic()
    with pytest.raises(CommandTimeout, match="timed out after 1s") as info:
        await sandbox.run_shell("echo started; sleep 30", timeout=1)
    assert time.monotonic() - start < 10
    assert isinstance(info.value, TimeoutError) and "started" in str(info.value)
    result = await sandbox.run_shell("echo still here")
    assert (result.exit_code, result.stdout) == (0, "still here\n")
    assert (await sandbox.refresh()).status is SandboxStatus.running


async def _sleepers(sandbox) -> list[str]:
    ps = await sandbox.run_shell("ps -o pid,args")
    return [line for line in ps.stdout.splitlines() if "sleep 10" in line]


async def test_timeout_kills_background_children(sandbox):
    """Children in the background, double-forked (re-parented to the sandbox's init) or nohup'd:
    all go with the command that timed out."""
    command = "sleep 1001 & (sleep 1002 &); nohup sleep 1003 >/dev/null 2>&1 & sh -c 'sleep 1004 &'; sleep 1005"
    with pytest.raises(CommandTimeout):
        await sandbox.run_shell(command, timeout=1)
    deadline = time.monotonic() + 10
    while (left := await _sleepers(sandbox)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert left == [], f"still running after the timeout: {left}"
    assert (await sandbox.run_shell("echo ok")).stdout == "ok\n"


async def test_timeout_does_not_touch_other_commands(sandbox):
    """Only the timed-out command's processes are killed, not a concurrent command's."""
    other = asyncio.create_task(sandbox.run_shell("sleep 3; echo survived", timeout=30))
    await asyncio.sleep(0.3)
    with pytest.raises(CommandTimeout):
        await sandbox.run_shell("(sleep 1010 &); sleep 1011", timeout=1)
    result = await other
    assert (result.exit_code, result.stdout) == (0, "survived\n")


async def test_output_flood_is_capped(sandbox):
    result = await sandbox.run_shell("yes | head -c 5000000", timeout=30, max_output_bytes=65536)
    assert result.exit_code == 0
    assert len(result.stdout) == 65536 and result.stdout.startswith("y\ny\n")
    assert result.stdout_truncated and result.stdout_bytes == 5_000_000
    assert not result.stderr_truncated and result.stderr_bytes == 0
    # The default cap (1 MiB), and stderr floods the same way.
    result = await sandbox.run_shell("yes | head -c 3000000; yes err | head -c 2000000 >&2", timeout=30)
    assert len(result.stdout) == 1 << 20 and result.stdout_bytes == 3_000_000 and result.stdout_truncated
    assert len(result.stderr) == 1 << 20 and result.stderr_bytes == 2_000_000 and result.stderr_truncated


async def test_endless_output_under_a_timeout(sandbox):
    # Stopped by a timeout inside the sandbox: the capped output and the count come back.
    result = await sandbox.run_shell("timeout 1 yes", timeout=30, max_output_bytes=1000)
    assert result.exit_code != 0
    assert len(result.stdout) == 1000 and result.stdout_truncated and result.stdout_bytes > 1_000_000
    # Stopped by the command's own timeout: CommandTimeout, promptly.
    start = time.monotonic()
    with pytest.raises(CommandTimeout, match="timed out after 2s"):
        await sandbox.run_shell("yes", timeout=2, max_output_bytes=1000)
    assert time.monotonic() - start < 12
    assert (await sandbox.run_shell("echo ok")).stdout == "ok\n"


async def test_stdin_flood_and_binary_output(sandbox):
    data = "x" * 3_000_000
    result = await sandbox.run_shell("wc -c", stdin=data, timeout=30)
    assert result.stdout.strip() == "3000000"
    result = await sandbox.run_shell("printf '\\377\\376ok'")
    assert result.exit_code == 0 and result.stdout.endswith("ok")


async def test_bad_exec_arguments(sandbox):
    with pytest.raises(InvalidRequest, match="workdir '/nope'"):
        await sandbox.run_shell("pwd", workdir="/nope")
    with pytest.raises(InvalidRequest, match="unknown user 'ghost'"):
        await sandbox.run_shell("id", user="ghost")
    assert (await sandbox.run_shell("echo ok")).stdout == "ok\n"


# -- files ----------------------------------------------------------------------------------


async def test_read_missing_file(sandbox):
    with pytest.raises(SandboxFileNotFound, match="/no/such/file") as info:
        await sandbox.read_file("/no/such/file")
    assert isinstance(info.value, FileNotFoundError)


async def test_read_directory_and_special_files(sandbox, client):
    with pytest.raises(InvalidRequest, match="/etc.*directory"):
        await sandbox.read_file("/etc")
    with pytest.raises(InvalidRequest, match="/dev/null.*not a regular file"):
        await sandbox.read_file("/dev/null")
    # A FIFO with no writer must not hang the call.
    assert (await sandbox.run_shell("mkfifo /tmp/fifo")).exit_code == 0
    with pytest.raises(InvalidRequest, match="/tmp/fifo.*not a regular file"):
        await asyncio.wait_for(sandbox.read_file("/tmp/fifo"), 10)
    with pytest.raises(InvalidRequest, match="/tmp/fifo"):
        await asyncio.wait_for(sandbox.write_file("/tmp/fifo", b"x"), 10)
    # The connection and the server are fine afterwards.
    assert (await sandbox.run_shell("echo ok")).stdout == "ok\n"
    await assert_still_serving(client)


async def test_write_through_symlinks_stays_inside(sandbox):
    host_target = Path("/etc/passwd-test")
    assert not host_target.exists()
    host_hostname = Path("/etc/hostname").read_bytes() if Path("/etc/hostname").exists() else None
    setup = ("ln -s /etc /tmp/x && ln -s /etc/hostname /tmp/h && ln -s ../../../../../../../../etc /tmp/up"
             " && ln -s /proc/1/root /tmp/magic")
    assert (await sandbox.run_shell(setup)).exit_code == 0
    await sandbox.write_file("/tmp/x/passwd-test", "inside\n")
    await sandbox.write_file("/tmp/up/passwd-test2", "inside too\n")
    await sandbox.write_file("/tmp/h", "sandbox-host\n")
    assert not host_target.exists() and not Path("/etc/passwd-test2").exists()
    if host_hostname is not None:
        assert Path("/etc/hostname").read_bytes() == host_hostname
    result = await sandbox.run_shell("cat /etc/passwd-test /etc/passwd-test2 /etc/hostname")
    assert result.stdout == "inside\ninside too\nsandbox-host\n"
    assert await sandbox.read_file("/tmp/x/passwd-test") == b"inside\n"
    # Reads resolve inside too: the host's /etc/shadow is not the sandbox's (it has none).
    with pytest.raises(SandboxFileNotFound):
        await sandbox.read_file("/tmp/up/shadow")
    # /proc magic links are not followed at all.
    with pytest.raises(InvalidRequest):
        await sandbox.write_file("/tmp/magic/escape", "x")
    with pytest.raises(InvalidRequest):
        await sandbox.read_file("/tmp/magic/etc/passwd")


async def test_bad_file_paths(sandbox):
    with pytest.raises(InvalidRequest, match="absolute"):
        await sandbox.write_file("relative/path", "x")
    with pytest.raises(InvalidRequest, match="not a file path"):
        await sandbox.write_file("/", "x")
    with pytest.raises(InvalidRequest, match="mode"):
        await sandbox.write_file("/tmp/m", "x", mode=0o70000)
    with pytest.raises(InvalidRequest, match="/etc/passwd"):
        await sandbox.write_file("/etc/passwd/child", "x")


# -- the wire -------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "mentions"), [
    (b"{not json", "json"),
    (b"\xff\xfe", "json"),
    (json.dumps({"container_image": "busybox", "memory_limit_mb": "lots"}).encode(), "memory_limit_mb"),
    (json.dumps({"container_image": ["busybox"]}).encode(), "container_image"),
    (json.dumps({"container_image": "busybox", "memroy_limit_mb": 64}).encode(), "memroy_limit_mb"),
    (json.dumps({"container_image": "busybox", "env": {"A": 1}}).encode(), "env"),
    (json.dumps({}).encode(), "container_image"),
])
async def test_malformed_request(server, client, body, mentions):
    async with httpx.AsyncClient(base_url=server.endpoint, headers={"authorization": f"Bearer {server.token}"}) as http:
        r = await http.post("/v1/sandboxes", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_request" and mentions in err["message"].lower()
        r = await http.post("/v1/sandboxes/n0-0123456789abcdef/exec", json={"command": "ls", "timeout": "soon"})
        assert r.status_code == 422 and "timeout" in r.json()["error"]["message"]
        r = await http.post("/v1/sandboxes/n0-0123456789abcdef/exec", json={"command": "ls", "shell": "bash"})
        assert r.status_code == 422 and "shell" in r.json()["error"]["message"]
    await assert_still_serving(client)


async def test_unauthenticated(server, monkeypatch, tmp_path):
    async with httpx.AsyncClient(base_url=server.endpoint) as http:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": server.token}):
            r = await http.post("/v1/sandboxes", json={"container_image": "busybox"}, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "unauthenticated" and "token" in r.json()["error"]["message"]
            # FnCall's lane (in front of FastAPI) checks the caller before it reads the call.
            for path, body in (("/v1/fncall", {"code": 5}), ("/v1/fncall:batch", {"calls": []})):
                r = await http.post(path, json=body, headers=headers)
                assert (r.status_code, r.json()["error"]["code"]) == (401, "unauthenticated"), path
    async with DSecClient(server.endpoint, token="wrong") as bad:
        with pytest.raises(Unauthenticated, match="token") as info:
            await bad.run_container(args())
        assert isinstance(info.value, PermissionError)
        with pytest.raises(Unauthenticated):
            await bad.run_containers(args(), count=2)
        with pytest.raises(Unauthenticated):
            await bad.get_sandbox("n0-0123456789abcdef")
    monkeypatch.delenv("DSEC_TOKEN", raising=False)
    monkeypatch.setenv("DSEC_STATE_DIR", str(tmp_path))  # no token file
    async with DSecClient(server.endpoint) as none:
        with pytest.raises(Unauthenticated):
            await none.list_sandboxes()


async def test_calls_on_a_stopped_sandbox(client):
    sandbox = await client.run_container(args())
    await sandbox.stop()
    for call in (sandbox.run_shell("echo hi"), sandbox.read_file("/etc/passwd"), sandbox.write_file("/tmp/x", "x")):
        with pytest.raises(SandboxStateError, match=f"{sandbox.id} is stopped") as info:
            await call
        assert isinstance(info.value, RuntimeError)
    await sandbox.stop()  # a second stop does nothing
    again = await client.get_sandbox(sandbox.id)
    assert again.status is SandboxStatus.stopped and again.info.reason == "stopped by request"
    await again.stop()


async def test_unknown_and_malformed_sandbox_ids(client):
    with pytest.raises(SandboxNotFound, match="n0-0123456789abcdef"):
        await client.get_sandbox("n0-0123456789abcdef")
    with pytest.raises(SandboxNotFound, match="'n9'"):
        await client.get_sandbox("n9-0123456789abcdef")
    for bad in ("bogus", "n0-XYZ", "n0-0123456789abcdef0", "N0-0123456789abcdef"):
        with pytest.raises(InvalidRequest, match="malformed sandbox id"):
            await client.get_sandbox(bad)
    ghost = libdsec.Sandbox(client, (await client.run_container(args())).info)
    await ghost.stop()
    phantom = libdsec.Sandbox(client, ghost.info.model_copy(update={"id": "n0-00000000000000ff",
                                                                       "status": SandboxStatus.running}))
    with pytest.raises(SandboxNotFound):
        await phantom.run_shell("true")
    with pytest.raises(SandboxNotFound):
        await phantom.read_file("/etc/passwd")
    with pytest.raises(SandboxNotFound):
        await phantom.stop()
