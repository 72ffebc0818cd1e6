"""Two real ``dsec serve`` apiservers over one PostgreSQL (``--db``): a project, a quota and a
token made through one work through the other, and the SDK given both endpoints keeps working
when one of them stops. Each server runs its own edge on its own state dir (nodes n0 and n1);
what they share is the projects, quotas and tokens."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from dsec.local import free_port, serving
from libdsec import DSecClient, DSecContainerRunArgs, QuotaExceeded, ServerUnavailable, Unauthenticated

pytestmark = [pytest.mark.slow, pytest.mark.root]

ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32)


@pytest.fixture(autouse=True)
def containers_only(monkeypatch):
    monkeypatch.setenv("DSEC_VMS", "0")  # no guest kernel, no accelerator probe at start


async def eventually(call, within_s: float = 3.0):
    """``await call()`` until it stops raising (another apiserver's change shows within ~1 s)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await call()
        except (Unauthenticated, AssertionError, LookupError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_two_apiservers_share_projects_and_the_sdk_moves_on_when_one_stops(new_state_dir, postgres):
    db = postgres.new_database()
    args = ("--db", db, "--pool-max", "0", "--fncall-max", "0")
    with serving(new_state_dir("dsec-api-a"), "--node", "n0", *args) as a, \
         serving(new_state_dir("dsec-api-b"), "--node", "n1", *args) as b:
        async with DSecClient(a.endpoint, token=a.token) as root_a, DSecClient(b.endpoint, token=b.token) as root_b:
            await root_a.create_project("team", sandboxes=2)
            token = await root_a.create_project_token("team")

            async def seen_by_b():
                assert (await root_b.get_project("team")).quota.sandboxes == 2

            await eventually(seen_by_b)
            async with DSecClient(b.endpoint, token=token) as team_b:
                first = await eventually(lambda: team_b.run_container(ARGS))
                assert first.info.project == "team" and first.info.node == "n1"
                assert (await first.run_shell("echo via b")).stdout == "via b\n"
                # A quota lowered through A holds on B.
                await root_a.set_project_quota("team", sandboxes=1)

                async def refused_by_b():
                    try:
                        extra = await team_b.run_container(ARGS)
                    except QuotaExceeded as exc:
                        assert "'team'" in str(exc)
                        return
                    await extra.stop()  # B had not seen the lower quota yet
                    raise AssertionError("B admitted a sandbox past the lowered quota")

                await eventually(refused_by_b)
                await first.stop()

        # The SDK with both endpoints, holding the project's token.
        async with DSecClient(f"{a.endpoint},{b.endpoint}", token=token) as team:
            on_a = await team.run_container(ARGS)
            assert on_a.info.node == "n0" and team.endpoint == a.endpoint
            await on_a.stop()
            a.stop()
            assert (await team.get_project("team")).name == "team"  # a read moves on to B
            assert team.endpoint == b.endpoint
            on_b = await team.run_container(ARGS)
            assert on_b.info.node == "n1"
            assert (await on_b.run_shell("echo still here")).stdout == "still here\n"
            await on_b.stop()
            b.stop()
            with pytest.raises(ServerUnavailable, match=f"{b.endpoint}, {a.endpoint}"):
                await team.list_sandboxes()


def test_dsec_serve_with_a_database_it_cannot_reach_exits_at_once_naming_it(tmp_path):
    url = f"postgresql://dsec:secret@127.0.0.1:{free_port()}/dsec"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dsec", "serve", "--state-dir", str(tmp_path), "--db", url],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 1
    assert "cannot open the project database postgresql://dsec:***@127.0.0.1" in done.stderr
    assert "secret" not in done.stderr + done.stdout
    assert time.monotonic() - started < 30
