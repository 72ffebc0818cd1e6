"""The container init's command channel (dsec.backends.initchan) at its edges: a request over
one packet of the host's socket buffers goes through `crun exec` alone and the channel stays;
a sandbox whose channel is gone (adopted after a restart) runs commands through `crun exec`; a
root filesystem that cannot be mounted fails its create alone; remains whose crun state is lost
are still killed; a command whose init dies fails with a clear error."""

from __future__ import annotations

import shutil
import socket

import pytest

from dsec.backends.base import ExecContext, SandboxSpec
from libdsec import BackendError
from libdsec.protocol import ExecRequest

pytestmark = [pytest.mark.slow, pytest.mark.root]

ROOT = ExecContext(uid=0, gid=0, workdir="/", env={"PATH": "/bin:/usr/bin"})


@pytest.fixture
async def container(tmp_path_factory, test_store):
    from dsec._sys import set_child_subreaper
    from dsec.backends.container import ContainerBackend
    from dsec.images.store import LayerStore
    from dsec.local import leftovers
    from dsec.resources import cgroups

    set_child_subreaper()
    state = tmp_path_factory.mktemp("initchan")
    store = LayerStore(test_store)
    backend = ContainerBackend(state / "node", store, cgroup_parent=cgroups.parent_for(state))
    image = store.get_image("busybox")
    handle = await backend.create("cinitchan0000001", SandboxSpec(image="busybox", layers=image.layers,
                                                                 env=dict(image.env), limits=None))
    try:
        yield backend, handle
    finally:
        await backend.destroy(handle)
        backend.release_unused()
        left = leftovers(state)
        shutil.rmtree(state, ignore_errors=True)
        assert not left, left


async def test_a_request_over_one_packet_goes_through_crun_exec_alone(container):
    backend, handle = container
    channel = backend.channels[handle.cid]
    channel.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # as a host with small buffers
    big = "x" * 20000
    result = await backend.exec(handle, ExecRequest(command=f"echo {big} | wc -c", timeout=30), ROOT)
    assert result.stdout.strip() == "20001", result
    assert not channel.closed and backend.channels[handle.cid] is channel
    assert (await backend.exec(handle, ExecRequest(command="echo small", timeout=30), ROOT)).stdout == "small\n"


async def test_without_a_channel_commands_go_through_crun_exec(container):
    backend, handle = container
    backend.channels.pop(handle.cid).close()  # as after a server restart
    result = await backend.exec(handle, ExecRequest(command="echo via crun; exit 3", timeout=30), ROOT)
    assert (result.exit_code, result.stdout) == (3, "via crun\n")
    # As through the init: the OOM killer takes such a command before the init.
    adj = await backend.exec(handle, ExecRequest(command="cat /proc/self/oom_score_adj /proc/1/oom_score_adj",
                                                 timeout=30), ROOT)
    assert adj.stdout.split() == ["1000", "500"]


async def test_a_root_filesystem_that_cannot_be_mounted_is_a_clear_error_and_leaves_nothing(container, monkeypatch):
    """When the mounts fail, crun is not run, the error names the mount, and the sandbox's
    cgroup, bundle and id range go; the other sandbox goes on."""
    from libdsec import BackendError

    from dsec.resources import cgroups

    backend, handle = container
    image = backend.store.get_image("busybox")

    def refuse(plan, limits):
        raise OSError(28, "No space left on device (test)")

    monkeypatch.setattr(backend, "_mount_rootfs", refuse)
    with pytest.raises(BackendError, match="cannot mount the root filesystem of cnomount00000001: .*No space left"):
        await backend.create("cnomount00000001", SandboxSpec(image="busybox", layers=image.layers,
                                                             env=dict(image.env), limits=None))
    assert not (backend.sandboxes_dir / "cnomount00000001").exists()
    assert not (backend.crun_root / "cnomount00000001").exists()
    assert all(d.name != "cnomount00000001" for d in cgroups.sandbox_cgroup_dirs(backend.cgroup_parent))
    assert backend.id_ranges is None or backend.id_ranges.of("cnomount00000001") is None
    monkeypatch.undo()
    result = await backend.exec(handle, ExecRequest(command="echo still here", timeout=30), ROOT)
    assert result.stdout == "still here\n"


async def test_remains_whose_runtime_state_is_lost_are_killed_by_their_cgroup(container):
    """After a crash that took crun's state with it, ``crun kill`` finds nothing: recover
    still kills what is left in the sandbox's cgroup and removes it."""
    from dsec.resources import cgroups

    backend, handle = container
    assert (await backend.exec(handle, ExecRequest(command="sleep 1000 & echo started", timeout=30),
                               ROOT)).stdout == "started\n"
    backend.channels.pop(handle.cid).close()
    shutil.rmtree(backend.crun_root / handle.cid)
    assert await backend.recover([]) == []
    assert all(d.name != handle.cid for d in cgroups.sandbox_cgroup_dirs(backend.cgroup_parent))
    try:  # dead: gone, or a zombie until this test's process (its parent) reaps it
        state = open(f"/proc/{handle.pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("Z", "gone"), state


async def test_a_command_whose_init_dies_says_the_sandbox_is_gone(container):
    """The init killed under a running command (as by the OOM killer): the command fails with a
    clear error naming the sandbox, not a `crun exec` of a dead container."""
    import asyncio
    import os
    import signal

    from libdsec import SandboxStateError

    backend, handle = container
    command = asyncio.create_task(backend.exec(handle, ExecRequest(command="sleep 30", timeout=60), ROOT))
    await asyncio.sleep(0.3)
    os.kill(handle.pid, signal.SIGKILL)
    with pytest.raises(SandboxStateError, match=f"sandbox process of {handle.cid} is gone"):
        await asyncio.wait_for(command, 10)


async def test_a_command_that_cannot_start_says_which_step_failed_and_the_next_runs(container):
    """The command's process is a vfork of its keeper, sharing its memory until it execs: a
    step that fails before the exec (its working directory is missing) is reported by name,
    as the init's channel carries it, the keeper is not left waiting, and the next commands,
    as other users too, start as before. (The working directory is one only root may enter:
    the host finds it, the command, already another user, cannot change into it.)"""
    from dsec.backends.base import ExecContext

    backend, handle = container
    made = await backend.exec(handle, ExecRequest(command="mkdir -m 700 /tmp/private", timeout=30), ROOT)
    assert made.exit_code == 0, made
    shut_out = ExecContext(uid=1000, gid=1000, workdir="/tmp/private", env={"PATH": "/bin:/usr/bin"})
    with pytest.raises(BackendError, match=r"cannot start the command: .*chdir: Permission denied"):
        await backend.exec(handle, ExecRequest(command="echo unreachable", timeout=30), shut_out)
    agent = ExecContext(uid=1000, gid=1000, workdir="/tmp", env={"PATH": "/bin:/usr/bin", "X": "y"})
    result = await backend.exec(handle, ExecRequest(command="echo $(id -u):$(id -g) $PWD $X $HOME", timeout=30), agent)
    assert result.stdout == "1000:1000 /tmp y /home/agent\n", result
    assert (await backend.exec(handle, ExecRequest(command="echo alive", timeout=30), ROOT)).stdout == "alive\n"


async def test_the_init_holds_its_stdio_its_channel_and_its_signalfd_only(container):
    """What the init inherits past its stdio is closed at its start (close_range, three calls
    rather than a close of each fd below 1024): it keeps its channel and its signalfd, and a
    command started through the channel still runs."""
    import os

    backend, handle = container
    fds = {int(fd): os.readlink(f"/proc/{handle.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{handle.pid}/fd")}
    extra = sorted(target.split(":")[0] + (":[signalfd]" if "signalfd" in target else "")
                   for fd, target in fds.items() if fd > 2)
    assert {0, 1, 2} <= set(fds) and extra == ["anon_inode:[signalfd]", "socket"], fds
    assert (await backend.exec(handle, ExecRequest(command="echo alive", timeout=30), ROOT)).stdout == "alive\n"


async def test_a_command_gets_back_the_default_of_what_the_init_inherited_ignored():
    """An ignored disposition outlives exec: a signal the init was started with ignored (SIGPIPE
    here, as a Python parent leaves it) is the default again in its commands. The init reads
    which those are once, at its start, and sets back just them in each command. Run on the
    host, outside a sandbox: the init's channel is all it needs."""
    import asyncio
    import os
    import subprocess

    from dsec import native
    from dsec.backends.initchan import InitChannel, exit_code

    def ignored(status: str) -> int:
        return int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)

    sigpipe = 1 << (13 - 1)
    host_end, init_end = InitChannel.pair()
    init = subprocess.Popen([str(native.binary("init"))], stdin=init_end, restore_signals=False)
    init_end.close()
    channel = InitChannel(host_end)
    r, w = os.pipe()
    try:
        assert ignored(open(f"/proc/{init.pid}/status").read()) & sigpipe  # what it was started with
        job_id, message = channel.encode(["grep", "SigIgn", "/proc/self/status"], {"PATH": "/usr/bin:/bin"}, "/", 0, 0)
        stdin = os.open(os.devnull, os.O_RDONLY)
        try:
            await channel.start(job_id, message, (stdin, w, w))
        finally:
            os.close(stdin)
            os.close(w)
        status = await asyncio.wait_for(channel.wait(job_id), 10)
        out = os.read(r, 4096).decode()
        assert exit_code(status) == 0, out
        assert not ignored(out) & sigpipe, out
    finally:
        os.close(r)
        channel.close()
        init.kill()
        init.wait()
