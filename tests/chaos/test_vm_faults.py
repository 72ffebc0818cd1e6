"""Chaos under a microVM: its QEMU killed (SIGKILL) while it runs, its guest agent killed alone (by
the guest's OOM killer), and ``kill -9`` of the server in the middle of a snapshot. A dead VM's
next call fails with a clear error naming what happened and it is ``failed``; the sandboxes
beside it are not affected; a VM whose server died while its vCPUs were stopped for a snapshot
is re-adopted and runs, the snapshot absent from the catalogue and the disk; one killed in the
middle of a fork leaves the parent running, its children stopped and the fork's memory snapshot
removed; a snapshot saved by another QEMU or of another guest kernel is refused, naming both;
nothing is left once they are stopped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
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
            # No half-made snapshot, and none whose record the kill cut short: nothing in the
            # catalogue, no memory on the node.
            assert left == [], left
            assert [s for s in await client.list_snapshots() if s.sandbox_id == vm.id] == []
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


async def test_a_kill_during_a_microvm_fork_leaves_the_parent_running_and_no_snapshot_behind(new_state_dir):
    async with vm_server(new_state_dir, "dsec-vmforkkill") as (state, srv):
        snapshots, vms = Path(state) / "node" / "snapshots", Path(state) / "node" / "vms" / "microvm"
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            parent = await busybox_vm(client)
            await parent.write_file("/root/note", "the parent's\n")
            forking = asyncio.create_task(parent.fork(count=2))
            # The kill comes once the fork's memory snapshot is saved and its children are being
            # restored from it (a VM directory beside the parent's).
            deadline = time.monotonic() + 180
            while not ([d for d in snapshots.glob("s*")] and len(list(vms.iterdir())) > 1):
                assert time.monotonic() < deadline and not forking.done(), forking
                await asyncio.sleep(0.005)
            srv.kill()
            with pytest.raises(Exception):  # noqa: B017 - the server is gone: how the client says so does not matter
                await forking
        assert [d.name for d in snapshots.iterdir()], "the kill came after the fork's snapshot was saved"
        srv.start()
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            again = await client.get_sandbox(parent.id)
            assert again.status is SandboxStatus.running, again.info
            assert (await again.run_shell("cat /root/note", timeout=60)).stdout == "the parent's\n"
            # Its children were never handed to anyone: stopped at the restart.
            deadline = time.monotonic() + 60
            while [s.id for s in await client.list_sandboxes()] != [parent.id] and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            assert [s.id for s in await client.list_sandboxes()] == [parent.id]
            assert sorted(d.name for d in snapshots.iterdir()) == []  # the fork's memory snapshot is gone
            await again.stop()


async def test_a_snapshot_of_another_qemu_or_kernel_is_refused_naming_both(new_state_dir):
    import json

    from dsec.backends.vm import machine
    from libdsec import InvalidRequest

    async with vm_server(new_state_dir, "dsec-vmsnapver") as (state, srv):
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            vm = await busybox_vm(client)
            await vm.write_file("/root/note", "saved\n")
            snap = await vm.snapshot("full")
            await vm.stop()
            [memory] = (Path(state) / "node" / "snapshots").iterdir()
            meta_path = memory / "meta.json"
            saved = json.loads(meta_path.read_text())
            assert saved["qemu"] == machine.qemu_version() and saved["kernel"], saved
            from_it = DSecMicroVMRunArgs(snapshot=snap.id, memory_limit_mb=128)
            try:
                meta_path.write_text(json.dumps({**saved, "qemu": "6.2.0 (Debian 1:6.2+dfsg-2)"}))
                with pytest.raises(InvalidRequest, match=r"made by QEMU 6\.2\.0 \(Debian 1:6\.2\+dfsg-2\); this node has "
                                                         rf"QEMU {re.escape(machine.qemu_version())}"):
                    await client.run_microvm(from_it, timeout=120)
                meta_path.write_text(json.dumps({**saved, "kernel": "5.10.0-99-cloud-amd64"}))
                with pytest.raises(InvalidRequest, match=r"running kernel 5\.10\.0-99-cloud-amd64; this node boots "
                                                         rf"kernel {re.escape(saved['kernel'])}"):
                    await client.run_microvm(from_it, timeout=120)
                assert await client.list_sandboxes() == []  # (nothing was made of either)
                meta_path.write_text(json.dumps(saved))
                async with await client.run_microvm(from_it, timeout=180) as restored:
                    assert (await restored.read_file("/root/note")) == b"saved\n"
            finally:
                await client.remove_snapshot(snap.id)
