"""protected_paths in VMs (issue 17, part 1): the guest agent binds each read-only in the commands'
mount namespace before the first command; root in a command cannot write, remove, rename or link
there, nor remount or unmount it. A path the image lacks is refused at create."""

from __future__ import annotations

import pytest

from libdsec import DSecFullVMRunArgs, DSecMicroVMRunArgs, InvalidRequest

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.asyncio(loop_scope="module")]

PROTECTED = ["/bin", "/etc", "/usr/bin"]
ATTEMPTS = [
    "echo x > /etc/new", "echo x >> /etc/passwd", "rm -f /etc/passwd", "mv /etc/passwd /root/p",
    "mv /etc /etc2", "mv /bin /bin2", "ln /etc/passwd /root/hard", "ln /root/mine /etc/hard",
    "rm -f /bin/sh", "cp /root/mine /bin/sh", "touch /bin/evil", "mkdir /etc/d", "chmod 777 /etc/passwd",
    "mount -o remount,rw /etc", "mount -o remount,rw,bind /etc", "umount /etc", "umount -l /bin",
    "mount -t tmpfs none /etc", "busybox mount --bind /root /etc",
    "mv /usr /usr2", "mv /usr /root/usr2", "echo x > /usr/bin/evil",  # nor the parent of a protected path
]


def script(attempts: list[str]) -> str:
    """Each attempt in a shell of its own; prints the ones that succeeded."""
    return "echo mine > /root/mine; " + "; ".join(
        f"if sh -c {_q(a)} 2>/dev/null; then echo 'DONE: {a}'; fi" for a in attempts)


def _q(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


@pytest.mark.parametrize("kind", ["microvm", "fullvm"])
async def test_vm_protected_paths_hold_for_root(client, kind):
    if kind == "microvm":
        args, run = DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=128, protected_paths=PROTECTED), client.run_microvm
    else:
        args, run = DSecFullVMRunArgs(container_image="busybox", memory_limit_mb=128, protected_paths=PROTECTED), client.run_vm
    async with await run(args, timeout=240) as vm:
        assert (await vm.run_shell("id -u")).stdout == "0\n"
        r = await vm.run_shell(script(ATTEMPTS))
        assert r.stdout == "", r  # not one got through
        r = await vm.run_shell("head -1 /etc/passwd; ls /bin/sh; ls /usr/bin | grep -c .")
        assert r.stdout.startswith("root:") and "/bin/sh" in r.stdout and int(r.stdout.split()[-1]) > 10, r
        assert (await vm.run_shell(script(["echo x > /usr/bin/evil", "touch /bin/evil"]))).stdout == ""
        # The same attempts where nothing is protected do get through (the harness can tell).
        control = await vm.run_shell(script(["echo x > /root/new", "mkdir /root/d", "ln /root/mine /root/hard",
                                             "mv /root/new /root/new2", "rm -f /root/new2"]))
        assert control.stdout.count("DONE:") == 5, control
        async with await vm.clean_copy(keep=["/root"]) as copy:  # a grader copy has the source's run args
            assert (await copy.run_shell(script(["touch /etc/x", "rm -f /bin/sh"]))).stdout == ""
            assert (await copy.run_shell("cat /root/mine")).stdout == "mine\n"


async def test_vm_protected_path_missing_is_refused(client):
    with pytest.raises(InvalidRequest, match="protected path '/nope' cannot be protected in image 'busybox'"):
        await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=128,
                                                    protected_paths=["/etc", "/nope"]), timeout=240)
    too_long = [f"/etc/{'x' * 60}{i}" for i in range(12)]
    with pytest.raises(InvalidRequest, match="at most 640 bytes in all"):
        await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", protected_paths=too_long), timeout=60)
    with pytest.raises(InvalidRequest, match="at most 63 protected paths"):
        await client.run_vm(DSecFullVMRunArgs(container_image="busybox", protected_paths=[f"/p{i}" for i in range(64)]),
                            timeout=60)
