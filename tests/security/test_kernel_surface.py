"""Red team, kernel surface: what an agent tries as root inside its sandbox to get at the kernel,
the host or its neighbours. Each test asserts the attempt fails and, where the platform can see
the refusal (a seccomp denial), that it is recorded against the sandbox."""

from __future__ import annotations

import os

import pytest

from libdsec import DSecContainerRunArgs
from redteam import denied_syscalls

pytestmark = [pytest.mark.slow, pytest.mark.root]


def _args(image: str, **kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image=image, memory_limit_mb=128, **kw)


PY_SYSCALL = ("import ctypes, errno, os, sys\n"
              "libc = ctypes.CDLL(None, use_errno=True)\n"
              "nr = int(sys.argv[1]); args = [int(a, 0) for a in sys.argv[2:]]\n"
              "rc = libc.syscall(nr, *args)\n"
              "print(rc, errno.errorcode.get(ctypes.get_errno()))\n")


async def _syscall(sb, nr: int, *args: int) -> str:
    await sb.write_file("/tmp/sys.py", PY_SYSCALL)
    r = await sb.run_shell("python3 /tmp/sys.py " + " ".join(str(a) for a in (nr, *args)))
    return r.stdout.strip()


async def test_mounting(sclient, python_image):
    async with await sclient.run_container(_args("busybox")) as sb:
        r = await sb.run_shell("mount -t tmpfs none /mnt; mount -o remount,rw /proc/sys; mount -t proc proc /mnt")
        assert r.exit_code != 0, r
        mounts = (await sb.run_shell("cat /proc/mounts")).stdout
        assert " /mnt " not in mounts and "/proc/sys proc rw" not in mounts
        await denied_syscalls(sb, "mount")


async def test_unshare_and_setns(sclient):
    async with await sclient.run_container(_args("busybox")) as sb:
        # pid 1 (the init) is not dumpable: its namespaces cannot even be opened; the shell's own
        # can, and then setns is refused.
        r = await sb.run_shell("unshare -U -r id; unshare -n true; unshare -m true; nsenter -t 1 -m true; "
                               "nsenter -t $$ -m true")
        assert "uid=" not in r.stdout and r.exit_code != 0, r
        assert "Permission denied" in r.stderr, r
        await denied_syscalls(sb, "unshare", "setns")


async def test_device_nodes(sclient):
    async with await sclient.run_container(_args("busybox")) as sb:
        r = await sb.run_shell("mknod /tmp/disk b 254 0; mknod /tmp/mem c 1 1; ls /tmp")
        assert "disk" not in r.stdout and "mem" not in r.stdout, r
        r = await sb.run_shell("ls /dev; head -c 1 /dev/vda 2>&1; head -c 1 /dev/mem 2>&1")
        assert "vda" not in r.stdout.split() and "mem" not in r.stdout.split()


async def test_cgroup_escape(sclient):
    """No cgroup filesystem inside; /sys is read-only; mounting one is refused."""
    async with await sclient.run_container(_args("busybox")) as sb:
        r = await sb.run_shell("ls /sys/fs/cgroup | wc -l; "
                               "for f in /sys/fs/cgroup/release_agent /sys/fs/cgroup/memory/cgroup.procs "
                               "/sys/kernel/uevent_helper; do echo x > $f && echo WROTE $f; done; "
                               "mkdir -p /tmp/cg && mount -t cgroup -o memory cgroup /tmp/cg && echo MOUNTED")
        assert "WROTE" not in r.stdout and "MOUNTED" not in r.stdout, r
        assert r.stdout.split()[0] == "0", r
        await denied_syscalls(sb, "mount")


async def test_writing_proc_sys(sclient):
    async with await sclient.run_container(_args("busybox")) as sb:
        before = open("/proc/sys/kernel/hostname").read()
        r = await sb.run_shell("for f in /proc/sys/kernel/sysrq /proc/sys/kernel/hostname /proc/sysrq-trigger "
                               "/proc/sys/vm/drop_caches /proc/sys/kernel/core_pattern; do "
                               "echo 1 > $f && echo WROTE $f; done; true")
        assert "WROTE" not in r.stdout, r
        assert open("/proc/sys/kernel/hostname").read() == before


async def test_loading_kernel_modules(sclient, python_image):
    async with await sclient.run_container(_args(python_image)) as sb:
        # init_module(NULL, 0, "") and finit_module(0, "", 0): refused before the kernel reads a byte.
        assert (await _syscall(sb, 175, 0, 0, 0)).endswith("EPERM")
        assert (await _syscall(sb, 313, 0, 0, 0)).endswith("EPERM")
        await denied_syscalls(sb, "init_module", "finit_module")


async def test_ptrace_outside(sclient, python_image):
    async with await sclient.run_container(_args(python_image)) as sb:
        # PTRACE_ATTACH to the sandbox's own init (the only "outside" process it can name: the
        # pid namespace hides the host's), and process_vm_readv of it.
        assert (await _syscall(sb, 101, 16, 1, 0, 0)).endswith("EPERM")
        assert (await _syscall(sb, 310, 1, 0, 0, 0, 0, 0)).endswith("EPERM")
        r = await sb.run_shell("ls /proc | grep -c '^[0-9]'")
        assert int(r.stdout) <= 5, r  # init, the command's keeper, the shell, grep, ls: no host process
        await denied_syscalls(sb, "ptrace", "process_vm_readv")


async def test_raw_sockets(sclient, python_image):
    async with await sclient.run_container(_args(python_image)) as sb:
        r = await sb.run_shell("python3 -c \"import socket\n"
                               "for fam, kind, proto in ((socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),"
                               " (socket.AF_PACKET, socket.SOCK_RAW, 0)):\n"
                               "    try: socket.socket(fam, kind, proto); print('OPENED')\n"
                               "    except PermissionError as e: print('DENIED', e)\"")
        assert "OPENED" not in r.stdout and r.stdout.count("DENIED") == 2, r


async def test_bpf_perf_keyctl_io_uring(sclient, python_image):
    async with await sclient.run_container(_args(python_image)) as sb:
        for nr in (321, 298, 250, 425):  # bpf, perf_event_open, keyctl, io_uring_setup
            assert (await _syscall(sb, nr, 0, 0, 0)).endswith("EPERM"), nr
        await denied_syscalls(sb, "bpf", "perf_event_open", "keyctl", "io_uring_setup")


SWAPEXT = ("import fcntl, os, errno\n"
           "a = os.open('/tmp/a', os.O_RDWR | os.O_CREAT); b = os.open('/etc/passwd', os.O_RDONLY)\n"
           "for cmd in (0xC0C0586D, 0x1C0C0586D, 0xC0C8586D, 0xC028660F):\n"
           "    try:\n"
           "        fcntl.ioctl(a, cmd, bytearray(256)); print(hex(cmd), 'OK')\n"
           "    except OSError as e: print(hex(cmd), errno.errorcode[e.errno])\n")


async def test_extent_swap_ioctls(sclient, python_image):
    """XFS_IOC_SWAPEXT (the report's file-access bypass that corrupted XFS), the same with a
    64-bit command (the kernel reads 32) or another struct size, and ext4's MOVE_EXT."""
    async with await sclient.run_container(_args(python_image)) as sb:
        await sb.write_file("/tmp/swap.py", SWAPEXT)
        r = await sb.run_shell("python3 /tmp/swap.py")
        lines = r.stdout.split()
        assert r.stdout.count("EPERM") == 4, r
        assert "OK" not in lines
        await denied_syscalls(sb, "ioctl")


async def test_kpagecgroup_and_kernel_memory(sclient):
    """A recursive grep from / read /proc/kpagecgroup and crashed the report's kernel."""
    async with await sclient.run_container(_args("busybox")) as sb:
        r = await sb.run_shell("for f in kpagecgroup kpagecount kpageflags kcore kallsyms kmsg; do "
                               "printf '%s ' $f; head -c 64 /proc/$f 2>/dev/null | wc -c; done")
        assert all(line.split()[1] == "0" for line in r.stdout.strip().splitlines()), r
        r = await sb.run_shell("timeout 20 grep -r -l -s dsec-token-canary / 2>/dev/null; echo done", timeout=40)
        assert r.stdout.strip().endswith("done")
        assert (await sb.run_shell("echo alive")).stdout == "alive\n"


async def test_masked_directories_and_dev_shm(sclient):
    """The /proc and /sys directories that show the kernel (ACPI, firmware, debugfs, tracing,
    bpf) are bound over, read-only, with one empty directory of the sandbox's own tmpfs, which
    also holds its /dev/shm: no filesystem of their own (each would be a superblock every
    memory cgroup on the node pays for). Empty, unwritable, the mask cannot be lifted; /dev/shm
    takes files."""
    masked = [p for p in ("/proc/acpi", "/sys/firmware", "/sys/kernel/debug", "/sys/kernel/tracing", "/sys/fs/bpf")
              if os.path.isdir(p)]
    assert masked
    async with await sclient.run_container(_args("busybox")) as sb:
        for d in masked:
            r = await sb.run_shell(f"ls -A {d}; touch {d}/x; mkdir {d}/y; umount {d}")
            assert r.stdout == "" and r.exit_code != 0 and "Read-only file system" in r.stderr, (d, r)
        r = await sb.run_shell("echo held > /dev/shm/f && cat /dev/shm/f")
        assert r.stdout.strip() == "held", r
        info = (await sb.run_shell("cat /proc/self/mountinfo")).stdout.splitlines()
        by_point = {line.split()[4]: line.split() for line in info}
        shm_dev = by_point["/dev/shm"][2]
        for d in masked:
            fields = by_point[d]
            assert fields[2] == shm_dev and "ro" in fields[5].split(","), fields
        # One filesystem of the sandbox's own backs them all: not one a directory.
        assert len({by_point[d][2] for d in masked}) == 1
