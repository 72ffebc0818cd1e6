"""Idempotency keys and the job log against a real ``dsec serve`` (crun sandboxes, the lean
routes and the SDK's own HTTP client): a keyed create and its job's log survive an apiserver
killed with SIGKILL; a resumed job does not append twice; ``dsec job ls | show | replay`` from
the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsec.local import LocalServer, leftovers
from libdsec import DSecClient, DSecContainerRunArgs, JobNotFound, ReplayDiverged, SandboxStatus

pytestmark = [pytest.mark.slow, pytest.mark.root]

ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32)


async def episode(client: DSecClient, n: int) -> tuple[str, str]:
    sandbox = await client.run_container(ARGS, key=f"episode-{n}")
    await sandbox.run_shell("echo one >> /root/log")
    await sandbox.write_file("/root/patch", f"patch {n}\n")
    await sandbox.run_shell("echo two >> /root/log")
    out = await sandbox.run_shell("cat /root/log /root/patch")
    return sandbox.id, out.stdout


def dsec(server: LocalServer, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "dsec", *args], env=env, capture_output=True, text=True, timeout=120)


async def test_keys_and_job_log_over_a_restart(new_state_dir):
    state = new_state_dir("dsec-jobs")
    server = LocalServer(state).start()
    try:
        async with DSecClient(server.endpoint, token=server.token, job="run-42") as client:
            first_id, first_out = await episode(client, 0)
        assert first_out == "one\ntwo\npatch 0\n"
        # A crash (kill -9) right after the answers: every answered call's entry is in the log.
        server.kill()
        server = LocalServer(state).start()  # the apiserver restarts; its edge re-adopts the sandbox
        async with DSecClient(server.endpoint, token=server.token, job="run-42", resume=True) as client:
            again_id, again_out = await episode(client, 0)  # from the log: nothing runs again
            assert client.replayed == 5
            sandbox = await client.get_sandbox(again_id)
            live = await sandbox.run_shell("cat /root/log")  # past the log: live
            with pytest.raises(ReplayDiverged):  # episode 1 is new: live; but a differing call is not
                async with DSecClient(server.endpoint, token=server.token, job="run-42", resume=True) as other:
                    s = await other.run_container(ARGS, key="episode-0")
                    await s.run_shell("echo three >> /root/log")
        assert (again_id, again_out) == (first_id, first_out)
        assert live.stdout == "one\ntwo\n", "a command that appends ran twice"
        async with DSecClient(server.endpoint, token=server.token) as plain:
            # Outside the job, the key is the project's own: a new sandbox.
            other = await plain.run_container(ARGS, key="episode-0")
            assert other.id != first_id
            assert (await plain.run_container(ARGS, key="episode-0")).id == other.id
            await other.stop()

        async with DSecClient(server.endpoint, token=server.token, job="run-42") as client:
            # A command that answers otherwise each time: the replay reports it.
            await (await client.get_sandbox(first_id)).run_shell("cat /proc/sys/kernel/random/uuid")
        listed = dsec(server, "job", "ls")
        assert listed.returncode == 0 and "run-42" in listed.stdout, listed
        shown = json.loads(dsec(server, "job", "show", "run-42", "--json").stdout)
        assert [e["op"] for e in shown["entries"]] == ["create", "exec", "write_file", "exec", "exec", "exec", "exec"]
        replayed = dsec(server, "job", "replay", "run-42", "--json")
        report = json.loads(replayed.stdout)
        assert replayed.returncode == 1 and report["replayed"] == 7, replayed
        [diverged] = report["divergences"]
        assert diverged["call"] == "exec 'cat /proc/sys/kernel/random/uuid'" and diverged["logged"].startswith("exit 0")
        async with DSecClient(server.endpoint, token=server.token) as plain:
            await (await plain.get_sandbox(first_id)).stop()
            left = [s for s in await plain.list_sandboxes() if s.status is not SandboxStatus.stopped]
            assert left == []  # the replay stopped its own
            await plain.remove_job("run-42")
            with pytest.raises(JobNotFound, match="no job log 'run-42'"):
                await plain.job_log("run-42")
    finally:
        server.stop()
    assert not leftovers(state)
