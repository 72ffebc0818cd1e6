"""Clean copies of VMs (issue 17, part 1): the guest's writable layer, streamed out by its agent,
gives a layer of only the kept paths, and a new VM boots from the image's layers and it. The
agent's forged /bin/sh and the rest of what it did elsewhere stay behind; tampering is seen."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from libdsec import DSecFullVMRunArgs, DSecMicroVMRunArgs, InvalidRequest, SandboxStateError

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.asyncio(loop_scope="module")]

WORK = (
    "set -e; mkdir -p /root/work/sub; echo 'def test(): assert 1 == 2' > /root/work/test_x.py;"
    " echo work > /root/work/sub/data; ln -s /etc/shadow /root/work/link; echo hist > /root/.ash_history;"
    " rm -rf /usr/sbin; mkdir /usr/sbin; echo new > /usr/sbin/only; rm /bin/vi;"
    " echo /x.so > /etc/ld.so.preload"
)
FORGE = ("rm -f /bin/sh && printf '%s\\n' '#!/bin/busybox ash' \"echo '1 passed'\" 'exit 0' > /bin/sh"
         " && chmod +x /bin/sh")
GRADE = "grep -q 'assert 1 == 2' /root/work/test_x.py && echo '1 failed' && exit 1"


@pytest.mark.parametrize("kind", ["microvm", "fullvm"])
async def test_vm_clean_copy(client, kind):
    if kind == "microvm":
        vm = await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=128), timeout=180)
    else:
        vm = await client.run_vm(DSecFullVMRunArgs(container_image="busybox", memory_limit_mb=128), timeout=240)
    async with vm:
        r = await vm.run_shell(WORK)
        assert r.exit_code == 0, r
        with pytest.raises(InvalidRequest, match="keep path '/root/nope' does not exist"):
            await vm.clean_copy(keep=["/root/nope"])
        with pytest.raises(InvalidRequest, match="passes through the symbolic link /root/work/link"):
            await vm.clean_copy(keep=["/root/work/link/x"])
        assert (await vm.run_shell(FORGE)).exit_code == 0
        assert (await vm.run_shell(GRADE)).stdout == "1 passed\n"  # the hole, in a VM too
        async with await vm.clean_copy(keep=["/root/work", "/usr/sbin", "/root/.ash_history"]) as grader:
            result = grader.clean_copy_result
            assert grader.info.kind.value == kind
            assert {"/bin/sh", "/etc/ld.so.preload"} <= set(result.tampered)
            assert result.scrubbed == ["/root/.ash_history"]
            graded = await grader.run_shell(GRADE)
            assert (graded.exit_code, graded.stdout) == (1, "1 failed\n")
            check = await grader.run_shell(
                "cat /root/work/sub/data; readlink /root/work/link; ls /usr/sbin; test -e /bin/vi && echo vi-kept;"
                " test -e /etc/ld.so.preload || echo no-preload; test -e /root/.ash_history || echo no-history")
            assert check.stdout.split() == ["work", "/etc/shadow", "only", "vi-kept", "no-preload", "no-history"], check
        events = [e for e in await vm.security_events() if e.kind == "file.tampered"]
        assert events and "/bin/sh" in events[0].detail


@pytest.mark.parametrize("kind", ["microvm", "fullvm"])
async def test_vm_tampering_seen_at_stop(client, kind):
    """No clean copy: a pack_diff, reading the events of a running VM and its stop ask the guest's
    agent what its writable layer holds in the system paths, and record what is new (a paused VM
    is let run for that at stop)."""
    if kind == "microvm":
        vm = await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=128), timeout=180)
    else:
        vm = await client.run_vm(DSecFullVMRunArgs(container_image="busybox", memory_limit_mb=128), timeout=240)
    async with vm:
        r = await vm.run_shell(
            "set -e; echo x > /usr/bin/evil; echo /x.so > /etc/ld.so.preload; rm /bin/vi; echo x > /root/.profile;"
            " mkdir -p /root/.local/lib/site-packages /root/work /home/u/.local /usr/share/doc;"
            " echo x > /root/.local/lib/site-packages/hook.pth; echo x > /root/work/sitecustomize.py;"
            " echo x > /home/u/.bashrc; echo x > /home/u/notes; echo x > /usr/share/doc/readme")
        assert r.exit_code == 0, r
        packed = await vm.pack_diff()
        after_pack = datetime.now(timezone.utc)
        await client.remove_image(packed.image)
        seen = [e for e in await vm.security_events() if e.kind == "file.tampered"]
        assert len(seen) == 1 and seen[0].count == 5 and seen[0].at <= after_pack, seen  # seen by the pack
        await vm.run_shell("echo y > /usr/bin/evil2")
        await vm.pause()
        with pytest.raises(SandboxStateError, match=f"cannot make a clean copy of: sandbox {vm.id} is paused"):
            await vm.clean_copy(keep=["/root/work"])
    with pytest.raises(SandboxStateError, match=f"cannot make a clean copy of: sandbox {vm.id} is stopped"):
        await vm.clean_copy(keep=["/root/work"])
    events = [e for e in await vm.security_events() if e.kind == "file.tampered"]
    assert len(events) == 2, events  # each path once: the stop found only what was new
    assert events[0].detail == ("system files replaced or added: /etc/ld.so.preload, /home/u/.bashrc, "
                                "/root/.local/lib/site-packages/hook.pth, /root/.profile, /usr/bin/evil")
    assert (events[1].detail, events[1].count) == ("system files replaced or added: /usr/bin/evil2", 1)
