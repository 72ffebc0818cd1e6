"""What a sandbox is given, against a real ``dsec serve``: limits the kernel enforces (memory,
pids, CPU), the user it runs as, env, workdir, stdin, and the blocking twin of the SDK."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from libdsec import (
    CommandTimeout,
    DSecContainerRunArgs,
    ImageNotFound,
    SandboxStatus,
    SyncDSecClient,
)
from dsec.resources import cgroups

pytestmark = [pytest.mark.slow, pytest.mark.root]


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(**{"container_image": "busybox", "memory_limit_mb": 64, **kw})


async def host_cgroup(sandbox, controller: str) -> Path:
    """The host directory of the sandbox's cgroup for ``controller`` (its path read inside)."""
    lines = (await sandbox.run_shell("cat /proc/1/cgroup")).stdout.splitlines()
    # v2: "0::/<parent>/<cid>"; v1: "N:<controllers>:/<parent>/<cid>" on the hierarchies DSec uses
    wanted = "" if cgroups.is_v2() else controller
    path = next(line.split(":", 2)[2] for line in lines if wanted in line.split(":", 2)[1].split(","))
    assert path.count("/") == 2 and path.split("/")[1].startswith("dsec"), lines
    if cgroups.is_v2():
        return cgroups.CGROUP_ROOT / path.lstrip("/")
    return cgroups.CGROUP_ROOT / controller / path.lstrip("/")


async def test_memory_limit_is_enforced(client):
    async with await client.run_container(args(memory_limit_mb=32)) as sandbox:
        memory = await host_cgroup(sandbox, "memory")
        limit_file = "memory.max" if cgroups.is_v2() else "memory.limit_in_bytes"
        assert int((memory / limit_file).read_text()) == 32 << 20
        # The OOM killer takes a command before the init, whose death would end the sandbox.
        adj = await sandbox.run_shell("cat /proc/self/oom_score_adj /proc/1/oom_score_adj")
        assert adj.stdout.split() == ["1000", "500"]
        # Under the limit: fine. Over it (tail keeps a 100 MB line in memory): OOM-killed.
        small = await sandbox.run_shell("head -c 8m /dev/zero | tail | wc -c", timeout=30)
        assert (small.exit_code, small.stdout.strip()) == (0, str(8 << 20))
        big = await sandbox.run_shell("head -c 100m /dev/zero | tail | wc -c", timeout=30)
        assert big.exit_code != 0 or big.stdout.strip() != str(100 << 20)
        assert "Killed" in big.stderr or big.exit_code in (137, -9)
        events = memory / ("memory.events" if cgroups.is_v2() else "memory.oom_control")
        counts = dict(line.split() for line in events.read_text().splitlines())
        assert int(counts["oom_kill"]) >= 1, counts
        # The sandbox itself survives its command's OOM.
        assert (await sandbox.run_shell("echo ok")).stdout == "ok\n"
        assert (await sandbox.refresh()).status is SandboxStatus.running


async def _sample_pids(pids: Path, task: asyncio.Task) -> list[int]:
    seen = []
    while not task.done():
        seen.append(int((pids / "pids.current").read_text()))
        await asyncio.sleep(0.05)
    seen.append(int((pids / "pids.current").read_text()))
    return seen


async def _pids_drop_to(pids: Path, most: int, within_s: float = 10) -> None:
    for _ in range(int(within_s * 10)):
        if int((pids / "pids.current").read_text()) <= most:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"still {(pids / 'pids.current').read_text().strip()} processes")


async def test_pids_limit_bounds_a_fork_bomb(client):
    async with await client.run_container(args(pids_limit=32)) as sandbox:
        pids = await host_cgroup(sandbox, "pids")
        assert (pids / "pids.max").read_text().strip() == "32"

        def refused() -> int:  # forks the kernel refused at the limit
            return int((pids / "pids.events").read_text().split()[-1])

        # Fork for ever, then an exponential bomb: the sandbox's pids fill up, no more, and
        # forks past the limit fail. (The shell gives up when a fork fails, or the timeout
        # ends it.)
        for bomb, holds in (("while :; do sleep 5 & done", True), ("f() { f & f & wait; }; f", False)):
            before = refused()
            task = asyncio.create_task(sandbox.run_shell(bomb, timeout=3))
            seen = await _sample_pids(pids, task)
            try:
                await task
            except CommandTimeout:
                pass
            assert max(seen) <= 32, (bomb, seen)
            if holds:  # (the exponential one collapses too fast to be seen from here)
                assert max(seen) >= 16, (bomb, seen)
            assert refused() > before, bomb
            await _pids_drop_to(pids, 3, within_s=20)
            assert (await sandbox.run_shell("echo ok")).stdout == "ok\n"


async def test_cpu_weight_and_cap(client):
    """``cpu_cores_limit`` is the sandbox's CPU share; ``cpu_cores_cap`` a hard quota on top."""
    async with await client.run_container(args(cpu_cores_limit=0.5)) as shared:
        cpu = await host_cgroup(shared, "cpu")
        if cgroups.is_v2():
            assert (cpu / "cpu.weight").read_text().strip() == "50"
            assert (cpu / "cpu.max").read_text().split()[0] == "max"
        else:
            assert (cpu / "cpu.shares").read_text().strip() == "512"
            assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "-1"
    async with await client.run_container(args(cpu_cores_limit=0.25, cpu_cores_cap=0.25)) as capped:
        cpu = await host_cgroup(capped, "cpu")
        if cgroups.is_v2():
            assert (cpu / "cpu.max").read_text().split() == ["25000", "100000"]
        else:
            assert int((cpu / "cpu.cfs_quota_us").read_text()) == 25000
            assert int((cpu / "cpu.cfs_period_us").read_text()) == 100000
        # A busy loop for two seconds gets at most a quarter of a core (less on a busy host).
        # The shell's waited-for children's CPU time (utime + stime of /proc/$$/stat, in ticks).
        r = await capped.run_shell("timeout 2 sh -c 'while :; do :; done'; cut -d' ' -f16,17 /proc/$$/stat",
                                   timeout=30)
        usage_ns = sum(int(t) for t in r.stdout.split()) * 1e9 / os.sysconf("SC_CLK_TCK")
        stat = dict(line.split() for line in (cpu / "cpu.stat").read_text().splitlines())
        if cgroups.is_v2():
            usage_ns = max(usage_ns, int(stat["usage_usec"]) * 1000)
        assert 0 < usage_ns < 0.5e9 + 0.1e9, (usage_ns, stat)  # 2 s at 25 %, and start-up slack
        if usage_ns > 0.3e9:  # it got the CPU it could, so the quota had to stop it
            assert int(stat["nr_throttled"]) > 0, stat


async def test_init_user(client):
    async with await client.run_container(args(init_user="agent")) as sandbox:
        assert (await sandbox.run_shell("id -u; id -g; id -un")).stdout.split() == ["1000", "1000", "agent"]
        await sandbox.write_file("/tmp/agent-file", "mine\n")
        await sandbox.write_file("/tmp/new/dir/file", "mine too\n")
        owners = await sandbox.run_shell("stat -c '%u:%g %a' /tmp/agent-file /tmp/new/dir /tmp/new/dir/file")
        assert owners.stdout.split("\n")[:3] == ["1000:1000 644", "1000:1000 755", "1000:1000 644"]
        # Rewriting a file that exists keeps its owner.
        await sandbox.run_shell("echo x > /tmp/roots; chmod 644 /tmp/roots", user="root")
        await sandbox.write_file("/tmp/roots", "hello\n")
        assert (await sandbox.run_shell("stat -c %u:%g /tmp/roots; cat /tmp/roots")).stdout == "0:0\nhello\n"
        # The user cannot do what only root can; a call may still run as root.
        denied = await sandbox.run_shell("echo x > /etc/passwd")
        assert denied.exit_code != 0
        assert (await sandbox.run_shell("id -u", user="root")).stdout == "0\n"
        assert (await sandbox.run_shell("id -u", user="1234:1234")).stdout == "1234\n"
        info = await sandbox.refresh()
        assert info.init_user == "agent"
    async with await client.run_container(args(init_user="1000:1000")) as numeric:
        assert (await numeric.run_shell("id -u")).stdout == "1000\n"


async def test_env_and_workdir(client):
    run_args = args(env={"GREETING": "hello world", "QUOTED": "a'b\"c $HOME"}, workdir="/work/space",
                    init_user="agent")
    async with await client.run_container(run_args) as sandbox:
        assert sandbox.info.workdir == "/work/space"
        result = await sandbox.run_shell('pwd; echo "$GREETING"; echo "$QUOTED"; echo "$PATH"')
        pwd, greeting, quoted, path = result.stdout.splitlines()
        assert (pwd, greeting, quoted) == ("/work/space", "hello world", "a'b\"c $HOME")
        assert "/bin" in path  # the image's env is kept under the sandbox's
        owner = await sandbox.run_shell("stat -c %u /work/space")
        assert owner.stdout == "1000\n"
        # Per call: env on top, another workdir.
        result = await sandbox.run_shell('echo "$GREETING $EXTRA"; pwd', env={"GREETING": "hi", "EXTRA": "1"},
                                         workdir="/tmp")
        assert result.stdout == "hi 1\n/tmp\n"
        # Relative paths in files calls are refused; commands see relative paths from the workdir.
        await sandbox.run_shell("echo rel > here.txt")
        assert await sandbox.read_file("/work/space/here.txt") == b"rel\n"


async def test_stdin(client):
    async with await client.run_container(args()) as sandbox:
        result = await sandbox.run_shell("cat", stdin="line one\nline two\n")
        assert result.stdout == "line one\nline two\n"
        result = await sandbox.run_shell("read a; read b; echo \"$b-$a\"", stdin="first\nsecond\n")
        assert result.stdout == "second-first\n"
        # No stdin: reading gets EOF at once, it does not hang.
        result = await sandbox.run_shell("cat; echo done", timeout=10)
        assert result.stdout == "done\n"
        # A command that ignores a large stdin does not hang either.
        result = await sandbox.run_shell("echo ignored", stdin="z" * 2_000_000, timeout=10)
        assert result.stdout == "ignored\n"
        text = "ünïcödé ✓\n"
        assert (await sandbox.run_shell("cat", stdin=text)).stdout == text


async def test_background_process_does_not_hold_the_call(client):
    """A command that leaves a process in the background returns when the command ends, even
    though that process still holds its stdout; the process lives on."""
    async with await client.run_container(args()) as sandbox:
        start = asyncio.get_running_loop().time()
        result = await sandbox.run_shell("sleep 1234 & echo started", timeout=20)
        assert (result.exit_code, result.stdout) == (0, "started\n")
        assert asyncio.get_running_loop().time() - start < 10
        assert "sleep 1234" in (await sandbox.run_shell("ps -o args")).stdout


async def test_timeout_kills_what_left_the_session(client):
    """A timed-out command dies with everything it started: also what left its session
    (setsid) or its process tree (a double fork). What another command started lives on."""
    async with await client.run_container(args()) as sandbox:
        await sandbox.run_shell("sleep 4321 >/dev/null 2>&1 &")
        with pytest.raises(CommandTimeout):
            await sandbox.run_shell("setsid sleep 1111 & (sleep 2222 &) ; sleep 3333", timeout=1)
        ps = (await sandbox.run_shell("ps -o args")).stdout
        assert not any(f"sleep {n}" in ps for n in (1111, 2222, 3333)), ps
        assert "sleep 4321" in ps, ps


async def test_files_round_trip_modes(client):
    async with await client.run_container(args()) as sandbox:
        await sandbox.write_file("/tmp/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
        assert (await sandbox.run_shell("/tmp/run.sh")).stdout == "ran\n"
        assert (await sandbox.run_shell("stat -c %a /tmp/run.sh")).stdout == "755\n"
        await sandbox.write_file("/tmp/run.sh", b"\x00\x01\xff")  # overwrite, binary
        assert await sandbox.read_file("/tmp/run.sh") == b"\x00\x01\xff"
        await sandbox.write_file("/tmp/empty", b"")
        assert await sandbox.read_file("/tmp/empty") == b""


def test_sync_client(server):
    """The blocking twin, in a plain synchronous test."""
    progress = []
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        with client.run_container(args()) as sandbox:
            sandbox.write_file("/tmp/sync.txt", "sync\n")
            assert sandbox.read_file("/tmp/sync.txt") == b"sync\n"
            assert sandbox.run_shell("cat /tmp/sync.txt").stdout == "sync\n"
            assert client.get_sandbox(sandbox.id).info.status is SandboxStatus.running
            assert sandbox.id in {s.id for s in client.list_sandboxes()}
            with pytest.raises(CommandTimeout):
                sandbox.run_shell("sleep 10", timeout=0.5)
        assert sandbox.refresh().status is SandboxStatus.stopped
        batch = client.run_containers(args(), count=3, progress=lambda d, n: progress.append(d))
        try:
            assert [s.run_shell("echo b").stdout for s in batch] == ["b\n"] * 3
        finally:
            for s in batch:
                s.stop()
        with pytest.raises(ImageNotFound):
            client.run_container(args(container_image="nope"))
        assert "busybox" in {i.name for i in client.list_images().images}
    assert progress == [1, 2, 3]


async def test_sync_client_from_a_thread(server):
    """The sync twin runs its own loop, so it also works from a thread of an async program."""

    def work() -> str:
        with SyncDSecClient(server.endpoint, token=server.token) as client:
            with client.run_container(args()) as sandbox:
                return sandbox.run_shell("echo threaded").stdout

    results = await asyncio.gather(asyncio.to_thread(work), asyncio.to_thread(work))
    assert results == ["threaded\n", "threaded\n"]
