"""An edge restart re-adopts running sandboxes: after SIGTERM and after a crash (SIGKILL).
A sandbox whose init died while the server was down is cleaned up and reported failed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from dsec.edge import journal
from dsec.local import LocalServer, leftovers, persisted_record
from libdsec import DSecClient, DSecContainerRunArgs, SandboxStateError, SandboxStatus

pytestmark = [pytest.mark.slow, pytest.mark.root]

ARGS = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32)
LINKS = "grep -c : /proc/net/dev"  # the network interfaces the sandbox sees


@pytest.fixture
def state_dir(new_state_dir):
    state = new_state_dir("dsec-restart")
    yield state
    # Whatever a failed test left: a last server re-adopts it, is told to stop it all, and goes.
    if leftovers(state, settle_s=0):
        srv = LocalServer(state).start()
        try:
            async def stop_all():
                async with DSecClient(srv.endpoint, token=srv.token) as c:
                    for info in await c.list_sandboxes():
                        await (await c.get_sandbox(info.id)).stop()

            asyncio.run(stop_all())
        finally:
            srv.stop()
    left = leftovers(state)
    assert not left, f"left behind: {left}"


def init_pid(state: Path, sandbox_id: str) -> int:
    """The host pid of a sandbox's init, from the edge's persisted record."""
    return persisted_record(state, sandbox_id)["handle"]["pid"]


def wait_gone(pid: int, within_s: float = 5) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except OSError:
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still alive")


async def _prepare(server: LocalServer) -> tuple[str, str]:
    """Two sandboxes with some state each: a file, and a process running in the background."""
    async with DSecClient(server.endpoint, token=server.token) as client:
        keep = await client.run_container(ARGS)
        lose = await client.run_container(ARGS)
        for s in (keep, lose):
            await s.write_file("/root/note.txt", f"written before the restart by {s.id}\n")
            await s.run_shell("sleep 3600 >/dev/null 2>&1 &")
        return keep.id, lose.id


async def _check_after(server: LocalServer, keep: str, lose: str | None) -> None:
    async with DSecClient(server.endpoint, token=server.token) as client:
        sandbox = await client.get_sandbox(keep)
        assert sandbox.status is SandboxStatus.running
        assert await sandbox.read_file("/root/note.txt") == f"written before the restart by {keep}\n".encode()
        ps = await sandbox.run_shell("ps -o args")
        assert "sleep 3600" in ps.stdout  # the same sandbox, not a new one
        assert (await sandbox.run_shell("echo back")).stdout == "back\n"
        # Its commands now go through `crun exec`, and are born in the sandbox's cgroup (crun
        # does not make it, so it would not put them there).
        own = (await sandbox.run_shell("cat /proc/self/cgroup")).stdout
        assert own == (await sandbox.run_shell("cat /proc/1/cgroup")).stdout
        assert any(line.split(":")[1] in ("", "pids") and "/dsec" in line for line in own.splitlines()), own
        listed = {s.id for s in await client.list_sandboxes()}
        assert keep in listed
        if lose is not None:
            assert lose not in listed
            gone = await client.get_sandbox(lose)
            assert gone.status is SandboxStatus.failed
            assert "gone when the edge restarted" in gone.info.reason
            with pytest.raises(SandboxStateError, match="failed"):
                await gone.run_shell("true")
        await sandbox.stop()
        assert await client.list_sandboxes() == []


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
async def test_restart_readopts_running_sandboxes(state_dir, how):
    server = LocalServer(state_dir, extra_args=("--pool-max", "2")).start()
    try:
        keep, lose = await _prepare(server)
        port = server.port
        if how == "sigterm":
            server.stop()
        else:
            server.kill()
        # The sandboxes outlive the server.
        for sandbox_id in (keep, lose):
            pid = init_pid(state_dir, sandbox_id)
            assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"/dev/.dsec-init")
        server = LocalServer(state_dir, port=port, extra_args=("--pool-max", "2")).start()
        async with DSecClient(server.endpoint, token=server.token) as client:
            assert {s.id for s in await client.list_sandboxes()} == {keep, lose}
            await (await client.get_sandbox(lose)).stop()
        await _check_after(server, keep, None)
    finally:
        server.stop()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
async def test_sandbox_dead_while_server_down_is_cleaned_up(state_dir, how):
    server = LocalServer(state_dir).start()
    try:
        keep, lose = await _prepare(server)
        if how == "sigterm":
            server.stop()
        else:
            server.kill()
        pid = init_pid(state_dir, lose)
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid)
        server = LocalServer(state_dir).start()
        await _check_after(server, keep, lose)
    finally:
        server.stop()


async def test_a_batch_cut_by_a_crash_is_undone_at_restart(state_dir):
    """kill -9 in the middle of a batch: the sandboxes it had made are held for the batch, which
    was never committed, so the restarted server stops them (all or none across a crash), and
    the sandboxes made outside the batch stay."""
    server = LocalServer(state_dir, extra_args=("--pool-max", "0")).start()
    try:
        async with DSecClient(server.endpoint, token=server.token) as client:
            single = await client.run_container(ARGS)
            made: list[str] = []

            def progress(done: int, count: int) -> None:
                made.append(str(done))

            batch = asyncio.create_task(client.run_containers(ARGS, count=200, progress=progress))
            deadline = time.monotonic() + 120
            while len(made) < 20 and not batch.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert not batch.done(), "the batch finished before the crash: make it larger"
            server.kill()
            with pytest.raises(Exception):  # noqa: B017 - the connection breaks, whatever the error
                await batch
        held = [json.loads(r) for r in journal.read(state_dir / "node" / "run" / "records").values()]
        assert sum(r["batch"] is not None for r in held) >= 20  # outlived the server, held for their batch
        server = LocalServer(state_dir, extra_args=("--pool-max", "0")).start()
        async with DSecClient(server.endpoint, token=server.token) as client:
            assert [s.id for s in await client.list_sandboxes()] == [single.id]
            await (await client.get_sandbox(single.id)).stop()
    finally:
        server.stop()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
async def test_background_processes_outlive_an_edge_restart(state_dir, how):
    """They keep running, writing and being listed; their exit is recorded while the edge is down."""
    server = LocalServer(state_dir).start()
    try:
        async with DSecClient(server.endpoint, token=server.token) as client:
            sandbox = await client.run_container(ARGS)
            ticker = await sandbox.start_shell("i=0; while :; do echo $i; i=$((i+1)); sleep 0.1; done")
            brief = await sandbox.start_shell("sleep 1; echo done; exit 5")
            session = await sandbox.open_session()
            await session.run_shell("cd /tmp && export KEPT=yes")
        port = server.port
        server.stop() if how == "sigterm" else server.kill()
        time.sleep(1.5)  # `brief` ends meanwhile
        server = LocalServer(state_dir, port=port).start()
        async with DSecClient(server.endpoint, token=server.token) as client:
            sandbox = await client.get_sandbox(sandbox.id)
            listed = {p.pid: p for p in await sandbox.list_processes()}
            assert listed[ticker.pid].running and listed[ticker.pid].stdout_bytes > 20, listed
            assert (listed[brief.pid].running, listed[brief.pid].exit_code) == (False, 5)
            proc = await sandbox.connect_process(ticker.pid)
            async for event in proc.stream():
                assert event.event == "stdout" and event.data.strip().split("\n")[0].isdigit()
                break
            await proc.kill()
            assert (await proc.wait()).exit_code == 137
            # The session is a background process too: its shell and its state are there.
            again = await sandbox.connect_session(session.id)
            assert (await again.run_shell("pwd; echo $KEPT")).stdout == "/tmp\nyes\n"
            await again.close()
            await sandbox.stop()
    finally:
        server.stop()


async def test_ptys_end_with_an_edge_restart(state_dir):
    """A PTY is the edge's: after a restart (SIGKILL: nothing of it could be closed) its id says
    it ended, and what ran on it is gone."""
    from libdsec import SessionClosed

    server = LocalServer(state_dir).start()
    try:
        async with DSecClient(server.endpoint, token=server.token) as client:
            sandbox = await client.run_container(ARGS)
            pty = await sandbox.open_pty()
            await pty.write(b"exec sleep 1000\n")
            listed = ""
            for _ in range(50):
                listed = (await sandbox.run_shell("ps -o pid,args")).stdout
                if "sleep 1000" in listed:
                    break
                await asyncio.sleep(0.1)
            assert "sleep 1000" in listed, listed
            watch = await sandbox.watch_dir("/tmp")  # (a directory watch is the edge's too)
        port = server.port
        server.kill()
        server = LocalServer(state_dir, port=port).start()
        async with DSecClient(server.endpoint, token=server.token) as client:
            sandbox = await client.get_sandbox(sandbox.id)
            old_watch = type(watch)(sandbox, watch.info)
            with pytest.raises(SessionClosed, match="edge restarted"):
                await old_watch.events()
            async with await sandbox.watch_dir("/tmp") as fresh_watch:
                await sandbox.run_shell("touch /tmp/after")
                assert [(e.type, e.name) for e in await fresh_watch.events()] == [("create", "after")]
            again = type(pty)(sandbox, pty.info)
            with pytest.raises(SessionClosed, match="restart of the node's edge"):
                await again.write(b"echo\n")
            with pytest.raises(SessionClosed):
                async for _ in again:
                    pass
            # Its command got the terminal's hangup: nothing of it is left in the sandbox.
            for _ in range(50):
                listed = (await sandbox.run_shell("ps -o pid,args")).stdout
                if "sleep 1000" not in listed:
                    break
                await asyncio.sleep(0.1)
            assert "sleep 1000" not in listed, listed
            fresh = await sandbox.open_pty(command="echo fresh")
            assert b"fresh" in b"".join([d async for d in fresh]) and fresh.exit_code == 0
            await sandbox.stop()
    finally:
        server.stop()


async def test_a_sandbox_paused_keeping_its_files_outlives_a_crash(state_dir):
    """kill -9 of a server whose sandbox is paused keeping its files only (no process runs in
    it): the restarted server finds it paused so, its files (and user ids) there, and a resume
    starts it over them, with its network link."""
    server = LocalServer(state_dir, extra_args=("--pool-max", "0")).start()
    try:
        async with DSecClient(server.endpoint, token=server.token) as client:
            sandbox = await client.run_container(ARGS.model_copy(update={"network_rules": {"domains": ["127.0.0.1"]}}))
            await sandbox.write_file("/root/note.txt", "kept across the crash\n")
            links = (await sandbox.run_shell(LINKS)).stdout.strip()
            await sandbox.pause("filesystem")
        assert init_pid(state_dir, sandbox.id) == 0
        port = server.port
        server.kill()
        server = LocalServer(state_dir, port=port, extra_args=("--pool-max", "0")).start()
        async with DSecClient(server.endpoint, token=server.token) as client:
            again = await client.get_sandbox(sandbox.id)
            assert (again.info.status, again.info.pause_mode) == (SandboxStatus.paused, "filesystem")
            await again.resume()
            assert await again.read_file("/root/note.txt") == b"kept across the crash\n"
            assert (await again.run_shell("id -u")).stdout.strip() == "0"
            assert (await again.run_shell(LINKS)).stdout.strip() == links  # its network link made when it booted
            await again.stop()
    finally:
        server.stop()
