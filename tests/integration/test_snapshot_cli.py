"""``dsec snapshot create|ls|inspect|rm`` against a real ``dsec serve`` (crun): a container's
snapshot taken by name, listed and inspected (as a table and as JSON), its removal refused while
a sandbox started from it runs, then removed; bad references and modes are clear errors."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

from libdsec import DSecContainerRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.usefixtures("no_sandbox_outlives_the_test")]


def dsec(server, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token, "COLUMNS": "250"}
    return subprocess.run([sys.executable, "-m", "dsec", *args], capture_output=True, text=True, timeout=180, env=env)


async def test_snapshot_commands_create_list_inspect_and_remove(server, client):
    # (The catalogue lives in the layer store the test modules share: a name of this run's own.)
    name = f"cli-step-3-{secrets.token_hex(3)}"
    try:
        await _commands(server, client, name)
    finally:
        if name in {s.name for s in await client.list_snapshots()}:
            await client.remove_snapshot(name)


async def _commands(server, client, name: str) -> None:
    args = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=64)
    async with await client.run_container(args) as source:
        assert (await source.run_shell("echo step-3 > /root/state")).exit_code == 0
        made = dsec(server, "snapshot", "create", source.id, "--name", name, "--mode", "filesystem", "--json")
        assert made.returncode == 0, made.stderr
        snap = json.loads(made.stdout)
        assert (snap["name"], snap["mode"], snap["kind"], snap["sandbox_id"]) == (
            name, "filesystem", "container", source.id)
        clash = dsec(server, "snapshot", "create", source.id, "--name", name)
        assert clash.returncode == 1 and f"is taken by snapshot {snap['id']}" in clash.stderr, clash.stderr
        full = dsec(server, "snapshot", "create", source.id, "--mode", "full")
        assert full.returncode == 1 and "a container sandbox takes no full snapshots" in full.stderr, full.stderr
        odd = dsec(server, "snapshot", "create", source.id, "--mode", "half")
        assert odd.returncode == 1 and "'half'" in odd.stderr, odd.stderr
    listed = dsec(server, "snapshot", "ls")
    assert listed.returncode == 0 and snap["id"] in listed.stdout and name in listed.stdout, listed.stdout
    assert "filesystem" in listed.stdout and "container" in listed.stdout
    as_json = json.loads(dsec(server, "snapshot", "ls", "--json").stdout)
    assert [s["id"] for s in as_json if s["name"] == name] == [snap["id"]]
    for ref in (snap["id"], name):
        shown = dsec(server, "snapshot", "inspect", ref)
        assert shown.returncode == 0 and snap["id"] in shown.stdout and source.id in shown.stdout, shown.stdout
    assert json.loads(dsec(server, "snapshot", "inspect", name, "--json").stdout) == snap

    # In use by a sandbox started from it: refused, naming it; removed once it stopped.
    started = await client.run_container(DSecContainerRunArgs(snapshot=name, memory_limit_mb=64))
    try:
        assert (await started.read_file("/root/state")) == b"step-3\n"
        refused = dsec(server, "snapshot", "rm", name)
        assert refused.returncode == 1, refused.stdout
        assert "in use by the sandboxes started from it" in refused.stderr and started.id in refused.stderr
    finally:
        await started.stop()
    removed = dsec(server, "snapshot", "rm", name)
    assert removed.returncode == 0 and f"removed snapshot {snap['id']} ({name})" in removed.stdout, removed.stdout
    gone = dsec(server, "snapshot", "inspect", snap["id"])
    assert gone.returncode == 1 and snap["id"] in gone.stderr and "no snapshot" in gone.stderr, gone.stderr
    assert dsec(server, "snapshot", "rm", name).returncode == 1
    missing = dsec(server, "snapshot", "create", "s-no-such-sandbox")
    assert missing.returncode == 1 and "s-no-such-sandbox" in missing.stderr, missing.stderr
