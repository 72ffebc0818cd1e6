"""Chaos under a microVM: its QEMU killed (SIGKILL) while it runs. Its next call fails with a clear
error naming what happened and it is ``failed``; a container sandbox and another microVM on the
node are not affected; nothing is left once they are stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from dsec.local import LocalServer, leftovers, persisted_record
from libdsec import DSecClient, DSecContainerRunArgs, DSecMicroVMRunArgs, SandboxStateError, SandboxStatus

pytestmark = [pytest.mark.slow, pytest.mark.root]


async def test_a_killed_qemu_fails_its_microvm_only(new_state_dir):
    state = new_state_dir("dsec-vmchaos")
    srv = LocalServer(state, extra_args=("--pool-max", "0")).start()
    try:
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            vm_args = DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=128)
            victim, other = await asyncio.gather(client.run_microvm(vm_args, timeout=180),
                                                 client.run_microvm(vm_args, timeout=180))
            container = await client.run_container(DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32))
            assert (await victim.run_shell("echo up")).stdout == "up\n"
            os.kill(persisted_record(state, victim.id)["handle"]["pid"], signal.SIGKILL)
            with pytest.raises(SandboxStateError, match="(?i)qemu|gone|died|exited|closed"):
                await victim.run_shell("echo hi", timeout=20)
            deadline = time.monotonic() + 10
            while (await victim.refresh()).status is SandboxStatus.running and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert victim.status is SandboxStatus.failed, victim.info
            assert (await other.run_shell("echo fine")).stdout == "fine\n"
            assert (await container.run_shell("echo fine")).stdout == "fine\n"
            for sandbox in (victim, other, container):
                await sandbox.stop()
        srv.stop()
        assert not leftovers(state, settle_s=10)
    finally:
        srv.stop()
