"""Red team, confinement of what runs beside the platform's own processes: the container's init,
the FnCall zygote, and a VM's guest agent with its channel to the host.

Each test asserts the attempt fails, that the sandbox (and its platform process) still serves,
and that the refusal is recorded where the platform can see it."""

from __future__ import annotations

import pytest

from libdsec import DSecContainerRunArgs, DSecFnCallArgs, DSecMicroVMRunArgs
from redteam import denied_syscalls

pytestmark = [pytest.mark.slow, pytest.mark.root]


async def test_signalling_the_sandbox_init(sclient, python_image):
    """SIGTERM to pid 1 ended the sandbox (catatonit exits on it). No signal, and no pidfd,
    may name the init now: seccomp answers EPERM and records it."""
    async with await sclient.run_container(DSecContainerRunArgs(container_image=python_image,
                                                                memory_limit_mb=128)) as sb:
        r = await sb.run_shell(
            "for s in TERM INT HUP QUIT USR1 USR2 KILL STOP; do kill -$s 1 2>/dev/null && echo SENT $s; done; "
            "python3 -c \"import os, signal\n"
            "for f in (lambda: os.kill(1, 15), lambda: signal.pidfd_send_signal(os.pidfd_open(1), 15)):\n"
            "    try:\n        f(); print('SENT')\n    except Exception as exc:\n        print(type(exc).__name__)\"")
        assert r.stdout.split() == ["PermissionError", "PermissionError"], r
        assert (await sb.run_shell("echo still here")).stdout == "still here\n"
        assert (await sb.refresh()).status.value == "running"
        await denied_syscalls(sb, "kill", "pidfd_open")


async def test_fncall_killing_its_zygote_and_writing_outside(sclient):
    """A call kills its parent (the zygote), every process it can name, writes outside its
    workdir: all refused (the call runs as a uid of its own, under a Landlock domain that
    scopes its signals); the next call runs on a live zygote."""
    code = ("import os, signal\n"
            "for pid in [os.getppid(), 1] + [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    if pid != os.getpid():\n"
            "        try:\n            os.kill(pid, signal.SIGKILL); print('KILLED', pid)\n"
            "        except OSError as exc:\n            print(pid, exc.errno)\n"
            "for path in ('/dev/x', '/x', '/etc/passwd', '/proc/1/oom_score_adj', '/dev/.dsec-zygote.py',\n"
            "             '/dev/.dsec-zygote.so'):\n"
            "    try:\n        open(path, 'a').write('x'); print('WRITTEN', path)\n"
            "    except OSError as exc:\n        print(path, exc.errno)\n"
            "os.kill(-1, signal.SIGKILL)  # every process it may signal: none but its own\n"
            "print('survived')\n")
    r = await sclient.fncall(DSecFnCallArgs(code=code))
    assert r.exit_code == 0 and "KILLED" not in r.stdout and "WRITTEN" not in r.stdout, r
    assert r.stdout.endswith("survived\n")
    again = await sclient.fncall(DSecFnCallArgs(code="print('next')"))
    assert again.stdout == "next\n"


async def test_microvm_command_against_the_agent_and_its_channel(sclient):
    """Inside a microVM, a command (root in the guest) tries to forge answer frames (on an
    inherited channel fd, on the port device, on a device node it makes), read the agent's
    files and other commands' scripts and output, kill the agent and write the guest's cgroups.
    None of it works: the command has no channel fd, its Landlock domain hides the agent's
    directory and every device but the usual few, its pid namespace holds no agent, its
    capabilities have no CAP_MKNOD. The agent keeps answering, with the right results.

    Not recorded: the refusals happen in the guest's kernel, which the host does not read."""
    vm = await sclient.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=192), timeout=180)
    async with vm:
        await vm.run_shell("echo secret-of-another-command > /dev/null; sleep 600 >/dev/null 2>&1 &")
        r = await vm.run_shell(
            "for f in /proc/$$/fd/*; do echo fd $f $(readlink $f); done; "
            "echo '1 done 0 6 6 0 0' >&3 && echo FORGED fd3; echo '1 done 0 6 6 0 0' >&4 && echo FORGED fd4; "
            "for p in /dev/vport* /dev/hvc* /dev/ttyS0 /dev/console /dev/vda /dev/pmem0 /dev/mem; do "
            "  [ -e $p ] || continue; echo '1 done 0 0 0 0 0' > $p && echo FORGED $p; cat $p >/dev/null && echo READ $p; "
            "done; "
            "dev=$(cat /sys/class/virtio-ports/*/dev | head -1); mknod /tmp/port c ${dev%:*} ${dev#*:} && echo MADE; "
            "cat /dev/.dsec/agent /dev/.dsec/pack.sh /dev/.dsec/caps 2>/dev/null && echo READ agent; "
            "echo x > /dev/.dsec/j/x && echo PLANTED; "
            "echo 1 > /sys/fs/cgroup/dsec/cgroup.kill && echo KILLED cgroup; echo 1 > /proc/sys/kernel/sysrq && echo SYSRQ; "
            "ps -o pid,args | grep -c '^ *[0-9][0-9]* /dev/[.]dsec/agent$'; "
            "for p in $(ls /proc | grep '^[0-9]'); do [ $p = $$ ] || kill -9 $p 2>/dev/null; done; kill -9 -1; "
            "echo end", timeout=60)
        assert r.stdout.rstrip().endswith("end"), r
        for word in ("FORGED", "READ", "MADE", "PLANTED", "KILLED", "SYSRQ", "vport", "hvc"):
            assert word not in r.stdout, (word, r.stdout)
        assert "\n0\n" in r.stdout  # no agent among the processes the command sees
        # Its fds: stdin, the job's two output pipes, and the shell's own (a glob's directory,
        # a pipe): no channel.
        targets = [line.split()[2] for line in r.stdout.splitlines() if line.startswith("fd ") and len(line.split()) > 2]
        assert targets and all(t == "/dev/null" or t.startswith(("pipe:", "/proc/")) for t in targets), r.stdout
        # The agent still answers, and its answers are the right ones.
        r = await vm.run_shell("echo alive; exit 4")
        assert (r.exit_code, r.stdout) == (4, "alive\n")
        await vm.write_file("/root/f", "via the agent")
        assert await vm.read_file("/root/f") == b"via the agent"
