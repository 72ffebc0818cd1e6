"""Pausing many sandboxes in one call on a real ``dsec serve`` (crun): a job's 20 sandboxes paused
by ``dsec pause --job`` and resumed by ``dsec resume --job``, a call that resumes one on its own,
``auto_resume=False`` refusing calls while paused, ``on_ttl="pause"``; and a ``kill -9`` of the
server in the middle of a job's pause, after which each sandbox is running or paused as its
record says and nothing is left behind."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from dsec.local import LocalServer, leftovers
from libdsec import DSecClient, DSecContainerRunArgs, SandboxStateError, SandboxStatus

pytestmark = [pytest.mark.slow, pytest.mark.root]

ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=64)


def dsec(server, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token, "COLUMNS": "250"}
    return subprocess.run([sys.executable, "-m", "dsec", *args], capture_output=True, text=True, timeout=180, env=env)


async def statuses(client: DSecClient, ids) -> dict[str, SandboxStatus]:
    listed = {s.id: s.status for s in await client.list_sandboxes()}
    return {i: listed.get(i) for i in ids}


async def test_a_jobs_20_sandboxes_pause_and_resume_in_one_call(server, client, no_sandbox_outlives_the_test):
    async with DSecClient(server.endpoint, token=server.token, job="pause-many-20") as job:
        made = await job.run_containers(ARGS, count=20)
    sandboxes = [await client.get_sandbox(s.id) for s in made]
    other = await client.run_container(ARGS)  # not the job's: left running
    try:
        ids = [s.id for s in sandboxes]
        # Memory of their own to push out: 4 MiB of random bytes in a tmpfs file each.
        await asyncio.gather(*(s.run_shell("head -c 4194304 /dev/urandom > /dev/shm/held") for s in sandboxes))

        out = dsec(server, "pause", "--job", "pause-many-20")
        assert out.returncode == 0, out.stderr + out.stdout
        assert "20 paused, 0 already so, 0 failed" in out.stdout, out.stdout
        assert all(sid in out.stdout for sid in ids)
        assert set((await statuses(client, ids)).values()) == {SandboxStatus.paused}
        assert (await statuses(client, [other.id]))[other.id] is SandboxStatus.running

        # Again: each is found paused already (the SDK's answer, this time).
        again = await client.pause_sandboxes(job="pause-many-20")
        assert again.already == 20 and again.done == 0

        # A call to one resumes it first, and its memory is all there.
        back = await client.get_sandbox(ids[0])
        assert (await back.run_shell("wc -c < /dev/shm/held")).stdout.strip() == "4194304"
        assert (await statuses(client, ids[:1]))[ids[0]] is SandboxStatus.running

        out = dsec(server, "resume", "--job", "pause-many-20")
        assert out.returncode == 0, out.stderr + out.stdout
        assert "19 resumed, 1 already so, 0 failed" in out.stdout, out.stdout
        assert set((await statuses(client, ids)).values()) == {SandboxStatus.running}
        results = await asyncio.gather(*(s.run_shell("echo up") for s in sandboxes))
        assert all(r.stdout == "up\n" for r in results)
    finally:
        await asyncio.gather(*(s.stop() for s in [*sandboxes, other]))


async def test_pause_by_ids_and_bad_selectors(server, client, no_sandbox_outlives_the_test):
    a, b = await client.run_container(ARGS), await client.run_container(ARGS)
    try:
        out = dsec(server, "pause", "--id", a.id, "--id", "n0-0123456789abcdef")
        assert out.returncode == 1, out.stdout  # one failed: the command says so
        assert "1 paused, 0 already so, 1 failed" in out.stdout and "sandbox_not_found" in out.stdout, out.stdout
        assert (await statuses(client, [a.id, b.id])) == {a.id: SandboxStatus.paused, b.id: SandboxStatus.running}
        out = dsec(server, "pause", "--job", "j", "--project", "root")
        assert out.returncode != 0 and "give exactly one of job, project or ids" in out.stdout + out.stderr
        out = dsec(server, "resume")
        assert out.returncode != 0 and "exactly one of job, project or ids to select the sandboxes (got none)" in out.stdout + out.stderr
    finally:
        await a.stop()
        await b.stop()


async def test_auto_resume_false_refuses_until_resumed(client, no_sandbox_outlives_the_test):
    s = await client.run_container(ARGS.model_copy(update={"auto_resume": False}))
    try:
        assert (await client.pause_sandboxes(ids=[s.id])).done == 1
        with pytest.raises(SandboxStateError, match="auto_resume=False") as refused:
            await s.run_shell("true")
        assert refused.value.status == 409
        assert (await client.resume_sandboxes(ids=[s.id])).done == 1
        assert (await s.run_shell("echo ok")).stdout == "ok\n"
    finally:
        await s.stop()


async def test_on_ttl_pause_pauses_instead_of_stopping(client, no_sandbox_outlives_the_test):
    s = await client.run_container(ARGS.model_copy(update={"ttl_running_stop": 1, "on_ttl": "pause"}))
    try:
        deadline = time.monotonic() + 15
        while (await client.get_sandbox(s.id)).status is not SandboxStatus.paused and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert (await client.get_sandbox(s.id)).status is SandboxStatus.paused
        assert (await s.run_shell("echo woke")).stdout == "woke\n"  # auto-resumed
    finally:
        await s.stop()


@pytest.fixture
def state_dir(new_state_dir):
    state = new_state_dir("dsec-pausekill")
    yield state
    if leftovers(state, settle_s=0):  # whatever a failed test left: a last server stops it all
        srv = LocalServer(state).start()
        try:
            srv.stop_sandboxes()
        finally:
            srv.stop()
    left = leftovers(state)
    assert not left, f"left behind: {left}"


async def test_a_kill_9_during_a_jobs_pause_leaves_each_running_or_paused(state_dir):
    server = LocalServer(state_dir, extra_args=("--pool-max", "0")).start()
    try:
        async with DSecClient(server.endpoint, token=server.token, job="cut") as job:
            ids = [s.id for s in await job.run_containers(ARGS, count=12)]
        async with DSecClient(server.endpoint, token=server.token) as client:
            sandboxes = [await client.get_sandbox(i) for i in ids]
            await asyncio.gather(*(s.run_shell("head -c 8388608 /dev/urandom > /dev/shm/held") for s in sandboxes))
            # One at a time, so the kill lands in the middle of the job's pause.
            pausing = asyncio.create_task(client.pause_sandboxes(job="cut", per_node=1))
            async with DSecClient(server.endpoint, token=server.token) as watcher:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    # (a sandbox shows paused from the start of its pause; with one at a time,
                    # a second one seen so means the first one's pause was done and recorded)
                    if list((await statuses(watcher, ids)).values()).count(SandboxStatus.paused) >= 2:
                        break
                    await asyncio.sleep(0.02)
            server.kill()
            pausing.cancel()  # (its client would retry the vanished server for a while)
            await asyncio.gather(pausing, return_exceptions=True)
        port = server.port
        server = LocalServer(state_dir, port=port, extra_args=("--pool-max", "0")).start()
        async with DSecClient(server.endpoint, token=server.token) as client:
            after = await statuses(client, ids)
            assert set(after.values()) <= {SandboxStatus.running, SandboxStatus.paused}, after
            assert SandboxStatus.paused in after.values()
            # A running one answers at once (it was thawed if the crash froze it mid-pause); a
            # paused one answers after resuming; each has its memory.
            for sid, status in after.items():
                s = await client.get_sandbox(sid)
                r = await asyncio.wait_for(s.run_shell("wc -c < /dev/shm/held"), 30)
                assert r.stdout.strip() == "8388608", (sid, status, r)
            # The job's pause again, then its resume, now complete.
            assert (await client.pause_sandboxes(job="cut")).failed == 0
            resumed = await client.resume_sandboxes(job="cut")
            assert resumed.failed == 0 and resumed.done + resumed.already == 12
            await asyncio.gather(*(s.stop() for s in [await client.get_sandbox(i) for i in ids]))
    finally:
        server.stop()


async def test_a_group_pause_and_resume_are_written_to_the_job_log_and_replayed(server, client,
                                                                                no_sandbox_outlives_the_test):
    from dsec.jobreplay import replay

    async with DSecClient(server.endpoint, token=server.token, job="pause-logged") as job:
        made = await job.run_containers(ARGS, count=2)
        [child] = await made[0].fork()  # a fork's child is the job's too
    made = [await client.get_sandbox(s.id) for s in made]
    child = await client.get_sandbox(child.id)
    try:
        paused = await client.pause_sandboxes(job="pause-logged")
        assert paused.done == 3 and {o.id for o in paused.sandboxes} == {made[0].id, made[1].id, child.id}
        # Called from inside the job (its own header) as well: written once to its log.
        async with DSecClient(server.endpoint, token=server.token, job="pause-logged") as job:
            resumed = await job.resume_sandboxes(job="pause-logged")
        assert resumed.done == 3
        log = await client.job_log("pause-logged")
        assert [e.op for e in log.entries] == ["create_batch", "fork", "pause_sandboxes", "resume_sandboxes"]
        entry = log.entries[2]
        assert entry.sandbox is None and entry.request["job"] == "pause-logged"
        assert sorted(o["outcome"] for o in entry.result["sandboxes"]) == ["paused"] * 3
        shown = dsec(server, "job", "show", "pause-logged")
        assert shown.returncode == 0, shown.stderr
        assert "pause_sandboxes" in shown.stdout and "3 paused, 0 already, 0 failed" in shown.stdout, shown.stdout
        assert "resume_sandboxes" in shown.stdout and "3 resumed" in shown.stdout, shown.stdout

        # Replayed: the replay's own three paused and resumed in one call each, no divergence.
        report = await replay(client, log)
        assert report.replayed == 4 and report.divergences == [], report
        # A bad selector is an error of the call, and nothing is written.
        with pytest.raises(Exception, match="no job log 'no-such-job'"):
            await client.pause_sandboxes(job="no-such-job")
        assert len((await client.job_log("pause-logged")).entries) == 4
    finally:
        await asyncio.gather(*(s.stop() for s in [*made, child]))
