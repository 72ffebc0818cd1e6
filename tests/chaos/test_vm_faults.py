"""Chaos under a microVM: its QEMU killed (SIGKILL) while it runs, its guest agent killed alone (by
the guest's OOM killer), and ``kill -9`` of the server in the middle of a snapshot. A dead VM's
next call fails with a clear error naming what happened and it is ``failed``; the sandboxes
beside it are not affected; a VM whose server died while its vCPUs were stopped for a snapshot
is re-adopted and runs, the snapshot whole or absent; nothing is left once they are stopped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.local import LocalServer, leftovers, persisted_record
from libdsec import DSecClient, DSecContainerRunArgs, DSecMicroVMRunArgs, Sandbox, SandboxStateError, SandboxStatus

pytestmark = [pytest.mark.slow, pytest.mark.root]


@contextlib.asynccontextmanager
async def vm_server(new_state_dir, name: str) -> AsyncIterator[tuple[Path, LocalServer]]:
    """A server of the test's own (no warm pool): once the test is done and has stopped its
    sandboxes, it is stopped and nothing may be left; a test that failed midway has its
    sandboxes stopped first."""
    state = new_state_dir(name)
    srv = LocalServer(state, extra_args=("--pool-max", "0")).start()
    try:
        yield state, srv
        srv.stop()
        assert not leftovers(state, settle_s=10)
    finally:
        await srv.stop_sandboxes_async()
        srv.stop()


async def busybox_vm(client: DSecClient, timeout: float = 300) -> Sandbox:
    return await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=128),
                                    timeout=timeout)


async def until_not_running(sandbox: Sandbox, within_s: float, every_s: float) -> None:
    deadline = time.monotonic() + within_s
    while (await sandbox.refresh()).status is SandboxStatus.running and time.monotonic() < deadline:
        await asyncio.sleep(every_s)


async def test_a_killed_qemu_fails_its_microvm_only(new_state_dir):
    async with vm_server(new_state_dir, "dsec-vmchaos") as (state, srv):
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            victim, other = await asyncio.gather(busybox_vm(client, 180), busybox_vm(client, 180))
            container = await client.run_container(DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32))
            assert (await victim.run_shell("echo up")).stdout == "up\n"
            os.kill(persisted_record(state, victim.id)["handle"]["pid"], signal.SIGKILL)
            with pytest.raises(SandboxStateError, match="(?i)qemu|gone|died|exited|closed"):
                await victim.run_shell("echo hi", timeout=20)
            await until_not_running(victim, 10, 0.1)
            assert victim.status is SandboxStatus.failed, victim.info
            assert (await other.run_shell("echo fine")).stdout == "fine\n"
            assert (await container.run_shell("echo fine")).stdout == "fine\n"
            for sandbox in (victim, other, container):
                await sandbox.stop()


async def test_a_microvm_that_dies_with_no_call_is_seen_failed(new_state_dir):
    """Nobody calls it: the edge's sweep (each reaper round, 1 s) finds its QEMU gone."""
    async with vm_server(new_state_dir, "dsec-vmsweep") as (state, srv):
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            vm = await busybox_vm(client)
            os.kill(persisted_record(state, vm.id)["handle"]["pid"], signal.SIGKILL)
            await until_not_running(vm, 10, 0.2)
            assert vm.status is SandboxStatus.failed and "its QEMU exited" in vm.info.reason, vm.info
            await vm.stop()


async def test_an_oom_killed_guest_agent_fails_its_microvm_with_the_reason(new_state_dir):
    """The guest agent killed alone, by the guest's own OOM killer: a command's output is kept by
    the agent up to ``max_output_bytes`` (64 MiB a stream), more than a 128 MB guest can hold. The
    guest's init powers the VM off when its agent is gone; the host sees the channel close, the
    call fails, and the sandbox is ``failed`` with the console's account of it. The container
    beside it is not affected, and nothing is left."""
    async with vm_server(new_state_dir, "dsec-vmagent") as (_, srv):
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            victim = await busybox_vm(client)
            container = await client.run_container(DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32))
            assert (await victim.run_shell("echo up")).stdout == "up\n"
            with pytest.raises(SandboxStateError, match=r"(?i)OOM killer killed its agent \(Out of memory: Killed process \d+ \(agent\)"):
                await victim.run_shell("head -c 62914560 /dev/zero; head -c 62914560 /dev/zero >&2", timeout=120,
                                       max_output_bytes=64 << 20)
            info = await victim.refresh()
            assert info.status is SandboxStatus.failed, info
            assert "OOM killer killed its agent" in info.reason and "channel" in info.reason, info.reason
            with pytest.raises(SandboxStateError, match="OOM killer killed its agent"):  # later calls say why too
                await victim.run_shell("echo again")
            assert (await container.run_shell("echo fine")).stdout == "fine\n"
            for sandbox in (victim, container):
                await sandbox.stop()


async def test_a_kill_during_a_microvm_snapshot_leaves_it_running_and_the_snapshot_whole_or_absent(new_state_dir):
    async with vm_server(new_state_dir, "dsec-vmsnap") as (state, srv):
        snapshots = Path(state) / "node" / "snapshots"
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            vm = await busybox_vm(client)
            await vm.write_file("/root/note", "before the crash\n")
            saving = asyncio.create_task(vm.snapshot())
            # The kill comes once QEMU writes the migration stream: its vCPUs are stopped then.
            deadline = time.monotonic() + 120
            while not any((d / "stream").exists() for d in snapshots.glob(".s*")):
                assert time.monotonic() < deadline and not saving.done(), saving
                await asyncio.sleep(0.002)
            srv.kill()
            with pytest.raises(Exception):  # noqa: B017 - the server is gone: how the client says so does not matter
                await saving
        srv.start()
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            again = await client.get_sandbox(vm.id)
            assert again.status is SandboxStatus.running, again.info
            assert (await again.run_shell("cat /root/note", timeout=60)).stdout == "before the crash\n"
            assert (await again.run_shell("echo runs")).stdout == "runs\n"
            left = sorted(d.name for d in snapshots.iterdir()) if snapshots.is_dir() else []
            assert not [n for n in left if n.startswith(".")], left  # no half-made snapshot
            for name in left:  # one that finished before the kill is whole
                assert (snapshots / name / "meta.json").is_file() and (snapshots / name / "state").is_file(), name
            await again.stop()
    log = srv.log_path.read_text()
    assert "with its vCPUs stopped" in log, log[-2000:]  # the kill came while they were


async def test_a_paused_microvm_is_re_adopted_paused_and_resumes(new_state_dir):
    """``kill -9`` of the server while a microVM is paused (its vCPUs stopped): after the restart
    it is still paused, and its next call resumes it and answers."""
    async with vm_server(new_state_dir, "dsec-vmpause") as (_, srv):
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            vm = await busybox_vm(client)
            await vm.write_file("/root/note", "paused\n")
            await vm.pause()
        srv.kill()
        srv.start()
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            again = await client.get_sandbox(vm.id)
            assert again.status is SandboxStatus.paused, again.info
            assert (await again.run_shell("cat /root/note", timeout=60)).stdout == "paused\n"
            assert (await again.refresh()).status is SandboxStatus.running
            await again.stop()
