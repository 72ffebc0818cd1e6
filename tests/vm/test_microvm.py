"""MicroVM and full VM sandboxes on real QEMU: the SDK end to end, memory snapshots and clones,
and every way a VM can go wrong (never a hung call, nothing left behind).

Small guests (busybox image, 256 MB); a VM that a test breaks is restored from a snapshot of a
booted one (a fraction of a second) instead of booted afresh."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.backends.base import ExecContext, SandboxSpec
from libdsec import BackendError, CommandTimeout, InvalidRequest, SandboxStateError
from libdsec.protocol import ExecRequest

# One event loop for the module: the shared VM's connections live on it.
pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.asyncio(loop_scope="module")]

ROOT = ExecContext(uid=0, gid=0, workdir="/", env={"PATH": "/bin:/usr/bin"})


def assets_dir(store: Path) -> Path:
    # DSEC_VM_ASSETS: a kernel/initramfs cache of one's own (worktrees with different guest
    # scripts would replace each other's initramfs in the shared one).
    return Path(os.environ.get("DSEC_VM_ASSETS") or Path(store).parent / "vm")


def qemu_processes(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if "qemu-system" in cmdline and marker in cmdline:
            found.append(f"{pid}: {cmdline[:120]}")
    return found


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vm_kit(tmp_path_factory, test_store):
    """A microVM backend, one booted VM and a snapshot of it, for the module's tests."""
    from dsec._sys import set_child_subreaper
    from dsec.backends.vm.microvm import MicroVMBackend
    from dsec.images.store import LayerStore
    from dsec.local import leftovers

    set_child_subreaper()
    state = tmp_path_factory.mktemp("microvm")
    store = LayerStore(test_store)
    # KSM is node-wide: the tests leave the host's settings alone.
    backend = MicroVMBackend(state / "node", store, assets_dir(test_store), boot_timeout_s=90, use_ksm=False)
    image = store.get_image("busybox")
    spec = SandboxSpec(image="busybox", layers=image.layers, env=dict(image.env), limits=None)
    base = await backend.create("cbase000000000000", spec)
    await backend.exec(base, ExecRequest(command="echo saved > /root/state; sleep 3600 >/dev/null 2>&1 &"), ROOT)
    meta = await backend.snapshot(base)
    try:
        yield backend, spec, base, meta
    finally:
        await backend.recover([])
        await backend.close()
        left = leftovers(state) + qemu_processes(str(state))
        shutil.rmtree(state, ignore_errors=True)
        assert not left, left


async def restore(backend, spec, meta, name):
    from dataclasses import replace

    return await backend.create(name, replace(spec, snapshot=meta["id"]))


async def test_snapshot_restores_processes_and_files(vm_kit):
    backend, spec, base, meta = vm_kit
    clones = [await restore(backend, spec, meta, f"cclone00000000{i:03d}") for i in range(2)]
    try:
        for clone in clones:
            result = await backend.exec(clone, ExecRequest(command="cat /root/state; pidof sleep"), ROOT)
            assert result.stdout.startswith("saved\n") and result.stdout.split()[1].isdigit()
        # Clones are independent copies: a write in one is not seen in the other or the source.
        await backend.write_file(clones[0], "/root/state", b"changed", 0o644, 0, 0)
        assert await backend.read_file(clones[1], "/root/state", 100) == b"saved\n"
        assert await backend.read_file(base, "/root/state", 100) == b"saved\n"
        # Layers are pmem with DAX in the guest.
        dmesg = await backend.exec(clones[0], ExecRequest(command="dmesg | grep -c 'DAX enabled'"), ROOT)
        assert int(dmesg.stdout) >= 1
    finally:
        for clone in clones:
            await backend.destroy(clone)


def mapping_kb(pid: int, suffix: str) -> dict[str, int]:
    """The smaps counters (kB) of the mapping of the file whose name ends with ``suffix``."""
    out: dict[str, int] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            inside = len(fields) > 5 and fields[5].endswith(suffix)
        elif inside and line.endswith(" kB"):
            out[fields[0].rstrip(":")] = out.get(fields[0].rstrip(":"), 0) + int(fields[1])
    return out


async def test_clones_share_the_snapshot_memory_copy_on_write(vm_kit):
    import hashlib

    backend, spec, base, meta = vm_kit
    snap = backend.snapshot_dir(meta["id"])
    ram_files = sorted(snap.glob("*.ram"))
    assert {p.name for p in ram_files} == {"ram0.ram", "ramtail.ram"}
    digests = [hashlib.sha256(p.read_bytes()).hexdigest() for p in ram_files]
    clones = [await restore(backend, spec, meta, f"ccow0000000000{i:03d}") for i in range(3)]
    try:
        for i, clone in enumerate(clones):
            result = await backend.exec(clone, ExecRequest(command="cat /root/state; pidof sleep"), ROOT)
            assert result.stdout.startswith("saved\n") and result.stdout.split()[1].isdigit()
            # Each writes its own files and 8 MiB of fresh memory (the overlay's upper is tmpfs).
            await backend.exec(clone, ExecRequest(
                command=f"echo clone{i} > /root/state; head -c 8388608 /dev/zero | tr '\\0' '{i}' > /root/big{i}"), ROOT)
        for i, clone in enumerate(clones):
            result = await backend.exec(clone, ExecRequest(command="cat /root/state; ls /root; head -c 3 /root/big*"), ROOT)
            assert result.stdout == f"clone{i}\nbig{i}\nstate\n{str(i) * 3}", result.stdout
        assert await backend.read_file(base, "/root/state", 100) == b"saved\n"
        # A clone's QEMU starts without the guest's kernel and initrd (its memory holds them):
        # no copy of them in each clone's own memory.
        assert "-kernel" in Path(f"/proc/{base.pid}/cmdline").read_bytes().decode().split("\0")
        assert not {"-kernel", "-initrd"} & set(Path(f"/proc/{clones[0].pid}/cmdline").read_bytes().decode().split("\0"))
        # The snapshot's memory is mapped by every clone: pages they only read are one copy
        # (shared between processes), pages they wrote are their own.
        for clone in clones:
            ram0, tail = mapping_kb(clone.pid, "/ram0.ram"), mapping_kb(clone.pid, "/ramtail.ram")
            assert ram0["Shared_Clean"] + ram0["Shared_Dirty"] > 8 * 1024, ram0
            # Its copy-on-write pages (the 8 MiB file and more), in whichever block of the
            # guest's RAM the guest put them.
            assert ram0.get("Anonymous", 0) + tail.get("Anonymous", 0) > 8 * 1024, (ram0, tail)
        # Nothing a clone did reached the snapshot: its files are as saved, a new clone starts
        # from the saved state.
        assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in ram_files] == digests
        backend.snapshot_meta(meta["id"])
        fresh = await restore(backend, spec, meta, "ccowfresh00000000")
        clones.append(fresh)
        assert (await backend.exec(fresh, ExecRequest(command="cat /root/state; ls /root"), ROOT)).stdout == "saved\nstate\n"
        # A clone's own snapshot (its RAM a private file mapping) carries its writes on.
        second = await backend.snapshot(clones[1])
        try:
            grandchild = await restore(backend, spec, second, "ccowgrand00000000")
            clones.append(grandchild)
            result = await backend.exec(grandchild, ExecRequest(command="cat /root/state; ls /root; pidof sleep"), ROOT)
            assert result.stdout.startswith("clone1\nbig1\nstate\n"), result.stdout
        finally:
            backend.delete_snapshot(second["id"])
    finally:
        for clone in clones:
            await backend.destroy(clone)


async def test_damaged_snapshot_memory_files(vm_kit):
    """A RAM file that is missing, cut short or rewritten is refused before QEMU starts, with
    nothing left behind; an intact copy of the snapshot restores."""
    from dataclasses import replace

    from dsec.backends.vm.microvm import SnapshotDamaged, SnapshotNotFound

    backend, spec, base, meta = vm_kit
    good = backend.snapshot_dir(meta["id"])
    bad = backend.snapshots_dir / ("s" + "2" * 16)
    shutil.copytree(good, bad)  # keeps the files' times: a faithful copy
    cid = "cdamaged000000000"
    try:
        vm = await backend.create(cid, replace(spec, snapshot=bad.name))
        assert (await backend.exec(vm, ExecRequest(command="cat /root/state"), ROOT)).stdout == "saved\n"
        await backend.destroy(vm)
        cases = [
            (lambda: (bad / "ram0.ram").unlink(), SnapshotNotFound, "lost its memory file ram0.ram"),
            (lambda: os.truncate(bad / "ramtail.ram", 1 << 20), SnapshotDamaged, "ramtail.ram is 1048576 bytes"),
            (lambda: Path(bad / "ram0.ram").write_bytes(os.urandom(4096) + (good / "ram0.ram").read_bytes()[4096:]),
             SnapshotDamaged, "ram0.ram was modified"),
        ]
        for damage, error, message in cases:
            shutil.rmtree(bad)
            shutil.copytree(good, bad)
            os.chmod(bad / "ram0.ram", 0o600)
            damage()
            with pytest.raises(error, match=message):
                await backend.create(cid, replace(spec, snapshot=bad.name))
            assert not backend.vm_dir(cid).exists()
            assert not qemu_processes(cid)
    finally:
        shutil.rmtree(bad, ignore_errors=True)


async def test_missing_and_corrupt_snapshot(vm_kit):
    from dataclasses import replace

    from dsec.backends.vm import machine

    backend, spec, base, meta = vm_kit
    with pytest.raises(InvalidRequest, match="no snapshot"):
        await backend.create("cmissing000000000", replace(spec, snapshot="s" + "0" * 16))
    bad = backend.snapshots_dir / ("s" + "1" * 16)
    shutil.copytree(backend.snapshot_dir(meta["id"]), bad)
    with open(bad / "state", "r+b") as f:
        f.seek(4096)
        f.write(os.urandom(1 << 16))
    try:
        start = time.monotonic()
        with pytest.raises(BackendError):
            await backend.create("ccorrupt000000000", replace(spec, snapshot=bad.name))
        assert time.monotonic() - start < 60
        assert not backend.vm_dir("ccorrupt000000000").exists()
        (bad / "state").unlink()
        with pytest.raises(InvalidRequest, match="lost its state"):
            await backend.create("ccorrupt000000001", replace(spec, snapshot=bad.name))
    finally:
        shutil.rmtree(bad, ignore_errors=True)
    assert machine.pid_alive(base.pid)


async def test_guest_agent_runs_commands_as_asked(vm_kit):
    """The guest agent (native/agent.c) in a restored VM: the workdir, user and environment the
    request gave (values passed as they are), stdin bigger than a pipe holds, output over the
    cap counted on both streams, a background process that keeps stdout open not holding the
    answer, concurrent commands each with its own whole output, a timeout ending all the
    command started, a missing workdir refused."""
    backend, spec, base, meta = vm_kit
    vm = await restore(backend, spec, meta, "cagentcmds0000000")
    try:
        assert "run" in backend._live[vm.cid].agent.features
        await backend.make_dir(vm, "/tmp/a dir", 0, 0)
        value = "it's \"$HOME\" `x`\nnext"
        ctx = ExecContext(uid=1000, gid=1001, workdir="/tmp/a dir", env={"PATH": "/bin", "V": value})
        r = await backend.exec(vm, ExecRequest(command='pwd; id -u; id -g; grep CapEff /proc/self/status; '
                                                       '[ -z "$HOME" ] && echo no-home; printf %s "$V"'), ctx)
        assert r.exit_code == 0, r
        assert r.stdout.split("\n", 5) == ["/tmp/a dir", "1000", "1001", "CapEff:\t0000000000000000", "no-home",
                                          value], r.stdout
        data = "".join(f"{i:07d}\n" for i in range(40_000))  # 320 kB
        r = await backend.exec(vm, ExecRequest(command="md5sum", stdin=data), ROOT)
        assert r.stdout.split()[0] == hashlib.md5(data.encode()).hexdigest(), r
        r = await backend.exec(vm, ExecRequest(command="yes 0123456789 | head -c 1000000; yes e | head -c 300000 >&2; "
                                                       "kill -9 $$", max_output_bytes=1000), ROOT)
        assert (r.exit_code, r.stdout, r.stdout_bytes, r.stderr_bytes) == (137, "0123456789\n" * 90 + "0123456789", 1_000_000, 300_000)
        assert r.stdout_truncated and r.stderr_truncated and r.stderr == "e\n" * 500
        start = time.monotonic()
        r = await backend.exec(vm, ExecRequest(command="echo started; sleep 30 &"), ROOT)
        assert r.stdout == "started\n" and time.monotonic() - start < 5, r
        results = await asyncio.gather(*(backend.exec(vm, ExecRequest(command=f"yes {i} | head -c 200000",
                                                                      max_output_bytes=1 << 20), ROOT)
                                         for i in range(6)))
        assert [r.stdout == f"{i}\n" * 100_000 for i, r in enumerate(results)] == [True] * 6
        with pytest.raises(CommandTimeout):
            await backend.exec(vm, ExecRequest(command="sleep 300 & sleep 301", timeout=1), ROOT)
        r = await backend.exec(vm, ExecRequest(command="ps -o args | grep -c '^sleep 30[01]$'"), ROOT)
        assert r.stdout == "0\n", r
        with pytest.raises(InvalidRequest, match="not a directory"):
            await backend.exec(vm, ExecRequest(command="true"), ExecContext(uid=0, gid=0, workdir="/nonexistent", env={}))
        assert (await backend.exec(vm, ExecRequest(command="echo alive"), ROOT)).stdout == "alive\n"
    finally:
        await backend.destroy(vm)


async def test_qemu_killed_from_outside(vm_kit):
    backend, spec, base, meta = vm_kit
    vm = await restore(backend, spec, meta, "ckilled0000000000")
    os.kill(vm.pid, signal.SIGKILL)
    with pytest.raises(SandboxStateError):
        await asyncio.wait_for(backend.exec(vm, ExecRequest(command="true"), ROOT), 30)
    assert not await backend.is_alive(vm)
    await backend.destroy(vm)
    assert not backend.vm_dir(vm.cid).exists()


async def test_agent_dies(vm_kit):
    backend, spec, base, meta = vm_kit
    vm = await restore(backend, spec, meta, "cagentdies0000000")
    # Without the agent the guest powers off and its QEMU ends. No command can reach the agent
    # any more (tests/security/test_vm_guest.py); its `shutdown` ends it the same way.
    await backend._live[vm.cid].agent.request("shutdown", timeout=10)
    deadline = time.monotonic() + 60
    while await backend.is_alive(vm) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not await backend.is_alive(vm)
    with pytest.raises(SandboxStateError):
        await backend.exec(vm, ExecRequest(command="true"), ROOT)
    await backend.destroy(vm)


async def test_hung_guest_and_hanging_command(vm_kit):
    backend, spec, base, meta = vm_kit
    vm = await restore(backend, spec, meta, "chung000000000000")
    try:
        with pytest.raises(CommandTimeout):
            await backend.exec(vm, ExecRequest(command="while :; do :; done", timeout=0.5), ROOT)
        assert (await backend.exec(vm, ExecRequest(command="echo alive"), ROOT)).stdout == "alive\n"
        # A guest that stops answering altogether (frozen behind the agent's back): the call
        # ends within its timeout plus the kill grace, and the VM counts as dead.
        await backend._live[vm.cid].qmp.execute("stop")
        start = time.monotonic()
        with pytest.raises(SandboxStateError):
            await backend.exec(vm, ExecRequest(command="true", timeout=1), ROOT)
        assert time.monotonic() - start < 15
        assert not await backend.is_alive(vm)
    finally:
        await backend.destroy(vm)


async def test_boot_timeout_leaves_nothing(tmp_path_factory, test_store):
    from dsec.backends.vm.microvm import MicroVMBackend
    from dsec.images.store import LayerStore

    state = tmp_path_factory.mktemp("microvm-timeout")
    store = LayerStore(test_store)
    backend = MicroVMBackend(state / "node", store, assets_dir(test_store), boot_timeout_s=0.3, use_ksm=False)
    image = store.get_image("busybox")
    with pytest.raises(BackendError, match="did not come up"):
        await backend.create("ctimeout000000000", SandboxSpec(image="busybox", layers=image.layers, env={}, limits=None))
    assert not list(backend.vms_dir.iterdir())
    assert not qemu_processes(str(state))
    shutil.rmtree(state, ignore_errors=True)


async def test_sdk_microvm_and_fullvm(tmp_path_factory, test_store, monkeypatch):
    """run_microvm / run_vm / snapshot through the server, as a trainer would."""
    from dsec.local import LocalServer, leftovers
    from libdsec import DSecClient, DSecFullVMRunArgs, DSecMicroVMRunArgs, SnapshotNotFound

    from conftest import make_state_dir

    monkeypatch.setenv("DSEC_VM_ASSETS", str(assets_dir(test_store)))
    monkeypatch.setenv("DSEC_VM_KSM", "0")
    state = make_state_dir(tmp_path_factory, test_store, "dsec-vm")
    with LocalServer(state, extra_args=("--pool-max", "0")) as srv:
        async with DSecClient(srv.endpoint, token=srv.token) as client:
            nodes = await client.node_info()
            assert "microvm: QEMU" in nodes[0].runtime
            args = DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=192, init_user="agent", workdir="/home/agent")
            vm = await client.run_microvm(args, timeout=120)
            try:
                assert vm.info.kind.value == "microvm"
                await vm.write_file("/home/agent/a.txt", "hello")
                result = await vm.run_shell("cat a.txt; id -u; sleep 3600 >/dev/null 2>&1 &")
                assert result.stdout == "hello1000\n"
                snap = await vm.snapshot()
                assert snap.memory_mb == 192
                clone = await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", snapshot=snap.id))
                async with clone:
                    again = await clone.run_shell("cat /home/agent/a.txt; pidof sleep >/dev/null && echo running")
                    assert again.stdout == "hellorunning\n"
                with pytest.raises(SnapshotNotFound, match="no snapshot 'sffffffffffffffff'"):
                    await client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", snapshot="s" + "f" * 16))
                await client.remove_snapshot(snap.id)
            finally:
                await vm.stop()
            full = await client.run_vm(DSecFullVMRunArgs(container_image="busybox"), timeout=180)
            async with full:
                assert full.info.kind.value == "fullvm"
                # The image's own init is PID 1 (commands, in the sandbox's pid namespace, do
                # not see it; the agent reads the file).
                assert await full.read_file("/proc/1/comm") == b"init\n"
                result = await full.run_shell("echo x > /root/f; cat /root/f")
                assert result.stdout == "x\n"
    left = leftovers(state) + qemu_processes(str(state))
    shutil.rmtree(state, ignore_errors=True)
    assert not left, left
