"""Forks of microVMs on real QEMU: one memory snapshot of the parent, the children restored from
it (its RAM file mapped privately by each: shared copy-on-write), processes and all; each child
someone new (host name, machine id) with its random number generator reseeded by its agent,
so no two children draw the same random bytes; the parent runs on."""

from __future__ import annotations

import pytest

from libdsec import DSecMicroVMRunArgs, SandboxStateError, SnapshotNotFound

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.asyncio(loop_scope="module")]

IDENTITY = "hostname; cat /etc/machine-id; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo"


async def test_microvm_fork_carries_memory_and_makes_each_child_someone_new(client):
    parent = await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=128,
                                                         protected_paths=["/bin"]), timeout=180)
    async with parent:
        # A process that holds state only in memory: a shell counting in a variable.
        r = await parent.run_shell("echo 0123456789abcdef0123456789abcdef > /etc/machine-id; "
                                   "echo kept > /root/file; (n=41; while :; do echo $n > /root/n; sleep 0.2; done) "
                                   ">/dev/null 2>&1 & echo $! > /root/pid")
        assert r.exit_code == 0, r
        before = await parent.refresh()
        children = await parent.fork(count=2)
        try:
            result = children[0].fork_result
            assert result.kind == "memory" and result.snapshot is not None and result.layer is None
            assert 0 < result.frozen_s <= result.fork_s
            seen = [(await parent.run_shell(IDENTITY)).stdout.split()]
            for child in children:
                assert (await child.read_file("/root/file")) == b"kept\n"
                # The parent's process runs on in the child (restored, not started again).
                alive = await child.run_shell("kill -0 $(cat /root/pid) && echo alive")
                assert alive.stdout == "alive\n", alive
                seen.append((await child.run_shell(IDENTITY)).stdout.split())
                # The parent's protected paths stay protected in the child (its mounts are restored).
                assert (await child.run_shell("touch /bin/x")).exit_code != 0
            for field, what in enumerate(("host name", "machine id", "random bytes")):
                values = [s[field] for s in seen]
                assert len(set(values)) == 3, (what, seen)
            # The snapshot was the fork's own: gone once the children were up (they map its memory).
            with pytest.raises(SnapshotNotFound, match=f"no snapshot '{result.snapshot}'"):
                await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=128,
                                                            snapshot=result.snapshot), timeout=180)
            after = await parent.refresh()
            assert (after.status, after.ttl_running_stop) == (before.status, before.ttl_running_stop)
            await parent.pause()
            with pytest.raises(SandboxStateError, match="cannot fork: sandbox .* is paused"):
                await parent.fork()
            await parent.resume()
        finally:
            for child in children:
                await child.stop()


async def test_full_vm_fork_carries_the_filesystem_and_says_so(client):
    from libdsec import DSecFullVMRunArgs

    parent = await client.run_vm(DSecFullVMRunArgs(container_image="busybox", memory_limit_mb=128), timeout=240)
    async with parent:
        r = await parent.run_shell("echo 0123456789abcdef0123456789abcdef > /etc/machine-id; echo kept > /root/file")
        assert r.exit_code == 0, r
        [child] = await parent.fork()
        try:
            result = child.fork_result
            assert result.kind == "filesystem" and result.layer is not None and result.snapshot is None
            assert (await child.read_file("/root/file")) == b"kept\n"
            seen = [(await vm.run_shell("hostname; cat /etc/machine-id")).stdout.split() for vm in (parent, child)]
            assert seen[0][0] != seen[1][0] and seen[0][1] != seen[1][1], seen
            assert (await parent.run_shell("echo alive")).stdout == "alive\n"
        finally:
            await child.stop()
