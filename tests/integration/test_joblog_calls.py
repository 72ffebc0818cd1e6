"""Every call kind of the SDK against a job log (issue 17, part 2), on a real ``dsec serve``: the
calls a log records with their results (creates, commands, file writes and reads, pauses,
resumes, TTLs, stops) fast-forward on a resume and are replayed by ``dsec job replay``; the
others (a background process, a streamed command, a session, file-tree calls) are logged as
made, and a resume refuses them while the sandbox's log holds more (``ReplayIncomplete``),
as it refuses any call that meets one in the log: nothing runs twice."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from dsec.local import LocalServer
from libdsec import DSecClient, DSecContainerRunArgs, ReplayDiverged, ReplayIncomplete

pytestmark = [pytest.mark.slow, pytest.mark.root]

ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32)


def dsec(server: LocalServer, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "dsec", *args], env=env, capture_output=True, text=True, timeout=120)


async def recorded_episode(client: DSecClient) -> list:
    sandbox = await client.run_container(ARGS, key="e0")
    seen = [(await sandbox.run_shell("echo a >> /root/log; cat /root/log")).stdout]
    await sandbox.write_file("/root/f", "x1")
    seen.append(await sandbox.read_file("/root/f"))
    seen.append((await sandbox.pause()).sandbox.status.value)
    seen.append((await sandbox.resume()).status.value)
    seen.append((await sandbox.set_ttl(300)).ttl_running_stop)
    seen.append((await sandbox.run_shell("echo b >> /root/log; cat /root/log")).stdout)
    await sandbox.stop()
    return [sandbox.id, *seen]


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_store):
    from conftest import make_state_dir

    srv = LocalServer(make_state_dir(tmp_path_factory, test_store, "dsec-joblog-calls")).start()
    try:
        yield srv
    finally:
        asyncio.run(stop_all(srv))  # (sandboxes outlive their server, by design)
        srv.stop()


async def stop_all(srv: LocalServer) -> None:
    async with DSecClient(srv.endpoint, token=srv.token) as plain:
        for info in await plain.list_sandboxes():
            await (await plain.get_sandbox(info.id)).stop()


async def test_recorded_kinds_fast_forward_and_replay(server):
    async with DSecClient(server.endpoint, token=server.token, job="calls-1") as client:
        first = await recorded_episode(client)
    assert first[1:] == ["a\n", b"x1", "paused", "running", 300, "a\nb\n"]
    async with DSecClient(server.endpoint, token=server.token) as plain:
        logged = await plain.job_log("calls-1")
    ops = [e.op for e in logged.entries]
    assert ops == ["create", "exec", "write_file", "read_file", "pause", "resume", "set_ttl", "exec", "stop"]
    async with DSecClient(server.endpoint, token=server.token, job="calls-1", resume=True) as client:
        again = await recorded_episode(client)  # the sandbox is stopped: only the log can answer
        assert client.replayed == len(ops)
    assert again == first
    async with DSecClient(server.endpoint, token=server.token) as plain:
        assert len((await plain.job_log("calls-1")).entries) == len(ops)  # nothing ran, nothing was added
    replayed = dsec(server, "job", "replay", "calls-1", "--json")
    report = json.loads(replayed.stdout)
    assert replayed.returncode == 0 and report["replayed"] == len(ops) and report["divergences"] == [], replayed


async def test_unrecorded_calls_are_refused_while_the_log_holds_more(server):
    async with DSecClient(server.endpoint, token=server.token, job="calls-2") as client:
        sandbox = await client.run_container(ARGS, key="e0")
        await sandbox.run_shell("echo a >> /root/log")
        process = await sandbox.start_shell("echo b >> /root/log")
        await process.wait()
        await sandbox.run_shell("echo c >> /root/log")
    async with DSecClient(server.endpoint, token=server.token) as plain:
        entries = (await plain.job_log("calls-2")).entries
    assert [e.op for e in entries] == ["create", "exec", "unrecorded", "exec"]
    assert entries[2].request == {"call": f"POST /v1/sandboxes/{sandbox.id}/processes"}
    async with DSecClient(server.endpoint, token=server.token, job="calls-2", resume=True) as client:
        again = await client.run_container(ARGS, key="e0")
        await again.run_shell("echo a >> /root/log")
        with pytest.raises(ReplayIncomplete, match="POST /processes of sandbox .* while the log holds 2 more calls"):
            await again.start_shell("echo b >> /root/log")
        with pytest.raises(ReplayIncomplete):
            await again.run_shell("echo b >> /root/log", on_stdout=print)  # streamed: not recorded
        with pytest.raises(ReplayIncomplete):
            async for _ in again.stream_shell("true"):
                pass
        with pytest.raises(ReplayIncomplete):
            await again.open_session()
        with pytest.raises(ReplayIncomplete):
            await again.files.list("/root")
        with pytest.raises(ReplayIncomplete) as caught:  # the next logged call is the process
            await again.run_shell("echo c >> /root/log")
        assert isinstance(caught.value, ReplayDiverged) and caught.value.code == "replay_incomplete"
        assert "log entry" in str(caught.value) and "POST /v1/sandboxes" in str(caught.value)
    async with DSecClient(server.endpoint, token=server.token) as plain:
        live = await plain.get_sandbox(sandbox.id)
        assert (await live.run_shell("cat /root/log")).stdout == "a\nb\nc\n"  # nothing ran twice
        await live.stop()
    shown = dsec(server, "job", "show", "calls-2")
    assert shown.returncode == 0 and "made (no result logged)" in shown.stdout, shown
    replayed = json.loads(dsec(server, "job", "replay", "calls-2", "--json").stdout)
    assert [d["call"] for d in replayed["divergences"]] == [f"POST /v1/sandboxes/{sandbox.id}/processes"]


async def test_a_log_that_ends_at_an_unrecorded_call_is_incomplete(server):
    """The trainer died right after a call the log holds only as made: did it run? The log
    cannot tell what it did, so the resume stops there, typed, instead of making it again."""
    async with DSecClient(server.endpoint, token=server.token, job="calls-3") as client:
        sandbox = await client.run_container(ARGS, key="e0")
        await sandbox.run_shell("echo a >> /root/log")
        await sandbox.files.make_dir("/root/made")
    async with DSecClient(server.endpoint, token=server.token, job="calls-3", resume=True) as client:
        again = await client.run_container(ARGS, key="e0")
        await again.run_shell("echo a >> /root/log")
        with pytest.raises(ReplayIncomplete, match="POST /v1/sandboxes/.*/fs/mkdir"):
            await again.files.make_dir("/root/made")
        with pytest.raises(ReplayIncomplete):
            await again.stop()
    # A new client on the job without resume goes live; past the log, a resumed one does too.
    async with DSecClient(server.endpoint, token=server.token, job="calls-4") as client:
        fresh = await client.run_container(ARGS, key="e0")
        await fresh.run_shell("true")
    async with DSecClient(server.endpoint, token=server.token, job="calls-4", resume=True) as client:
        fresh = await client.run_container(ARGS, key="e0")
        await fresh.run_shell("true")
        await (await fresh.start_shell("true")).wait()  # the log is used up: live, logged as made
        await fresh.stop()
    async with DSecClient(server.endpoint, token=server.token) as plain:
        assert [e.op for e in (await plain.job_log("calls-4")).entries] == ["create", "exec", "unrecorded", "stop"]
        await (await plain.get_sandbox(sandbox.id)).stop()
