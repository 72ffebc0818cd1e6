"""MicroVM boot templates on real QEMU: the first VM of an image and shape boots its kernel and
its memory, taken before anything ran in it, is kept; the next VMs of that shape restore it (a
fraction of a boot), each with the host's clock, a random number generator of its own and the
host name asked. A template that cannot be restored is removed and the VM boots; a VM with
protected paths always boots. A memory snapshot restored later gets the host's clock too."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.backends.base import ExecContext, SandboxSpec
from libdsec.protocol import ExecRequest

pytestmark = [pytest.mark.slow, pytest.mark.root]
on_the_modules_loop = pytest.mark.asyncio(loop_scope="module")  # (the kit's VMs live on it)

ROOT = ExecContext(uid=0, gid=0, workdir="/", env={"PATH": "/bin:/usr/bin"})
PROBE = "date +%s; hostname; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; cat /root/mark 2>/dev/null; true"


def qemu_argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def templates(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def kit(tmp_path_factory, test_store):
    """Two microVM backends (two nodes' dirs) sharing one templates dir, as a run's servers do."""
    from dsec._sys import set_child_subreaper
    from dsec.backends.vm.microvm import MicroVMBackend
    from dsec.images.store import LayerStore
    from dsec.local import leftovers

    from test_microvm import assets_dir, qemu_processes

    set_child_subreaper()
    state = tmp_path_factory.mktemp("vmtpl")
    store = LayerStore(test_store)
    tdir = state / "templates"
    made = [MicroVMBackend(state / f"node{i}", store, assets_dir(test_store), boot_timeout_s=120, use_ksm=False,
                           templates_dir=tdir) for i in (1, 2)]
    image = store.get_image("busybox")
    spec = SandboxSpec(image="busybox", layers=image.layers, env=dict(image.env), limits=None)
    try:
        yield made, spec, tdir
    finally:
        for backend in made:
            await backend.recover([])
            await backend.close()
        left = leftovers(state) + qemu_processes(str(state))
        shutil.rmtree(state, ignore_errors=True)
        assert not left, left


async def probe(backend, handle) -> tuple[float, str, str, str]:
    result = await backend.exec(handle, ExecRequest(command=PROBE), ROOT)
    assert result.exit_code == 0, result
    lines = (result.stdout + "\n\n").split("\n")
    return float(lines[0]) - time.time(), lines[1], lines[2], lines[3]


@on_the_modules_loop
async def test_the_first_vm_boots_and_keeps_its_template_the_next_restore_it(kit):
    (first_node, second_node), spec, tdir = kit
    tid = await first_node.template_id(spec)
    assert tid == await second_node.template_id(spec)  # (the node's own paths are not part of it)
    booted = await first_node.create("ctplboot00000000", spec)
    try:
        assert "-kernel" in qemu_argv(booted.pid) and "-incoming" not in qemu_argv(booted.pid)
        assert templates(tdir) == [tid]  # kept once booted, before anything ran in it
        await first_node.exec(booted, ExecRequest(command="echo after > /root/mark"), ROOT)
        await asyncio.sleep(3)  # (the template's clock falls behind the host's)
        named = replace(spec, hostname="tpl-two")
        clones = [await first_node.create("ctplclone0000001", spec), await second_node.create("ctplclone0000002", named)]
        try:
            seen = []
            for backend, clone in zip((first_node, second_node), clones, strict=True):
                argv = qemu_argv(clone.pid)
                assert "-incoming" in argv and "-kernel" not in argv, argv
                assert any(f"{tdir}/{tid}/" in a for a in argv), argv  # its RAM mapped from the template's
                seen.append(await probe(backend, clone))
            (skew1, host1, rand1, mark1), (skew2, host2, rand2, mark2) = seen
            assert abs(skew1) <= 2 and abs(skew2) <= 2, seen  # the host's clock, not the template's
            assert (host1, host2) == ("sandbox", "tpl-two")
            assert len(rand1) == 32 and rand1 != rand2  # each its own random stream
            assert mark1 == mark2 == ""  # what the booted VM did after its template was taken: not theirs
        finally:
            for backend, clone in zip((first_node, second_node), clones, strict=True):
                await backend.destroy(clone)
    finally:
        await first_node.destroy(booted)
    assert templates(tdir) == [tid]


@on_the_modules_loop
async def test_a_damaged_template_is_removed_and_the_vm_boots(kit):
    (backend, _), spec, tdir = kit
    tid = await backend.template_id(spec)
    if tid not in templates(tdir):
        await backend.destroy(await backend.create("ctplmake00000000", spec))
    ram = next((tdir / tid).glob("*.ram"))
    os.chmod(ram, 0o600)
    with open(ram, "r+b") as f:
        f.truncate(4096)
    vm = await backend.create("ctpldamaged00000", spec)
    try:
        assert "-kernel" in qemu_argv(vm.pid)  # booted
        assert (await backend.exec(vm, ExecRequest(command="echo up"), ROOT)).stdout == "up\n"
        assert templates(tdir) == [tid] and (tdir / tid / ram.name).stat().st_size > 4096  # kept anew
    finally:
        await backend.destroy(vm)


@on_the_modules_loop
async def test_other_shapes_have_templates_of_their_own_and_protected_paths_boot(kit):
    (backend, _), spec, tdir = kit
    from dsec.resources.cgroups import Limits

    smaller = replace(spec, limits=Limits(memory_mb=192, cpu_cores=1.0, pids=1024))
    assert await backend.template_id(smaller) != await backend.template_id(spec)
    protected = replace(spec, protected_paths=("/etc",))
    before = templates(tdir)
    vm = await backend.create("ctplprotect00000", protected)
    try:
        argv = qemu_argv(vm.pid)
        assert "-kernel" in argv and any("dsec.protect=" in a for a in argv), argv
        assert templates(tdir) == before  # a VM with paths of its own read-only is no template
    finally:
        await backend.destroy(vm)


@on_the_modules_loop
async def test_a_memory_snapshot_restored_later_has_the_hosts_clock(kit):
    (backend, _), spec, _ = kit
    base = await backend.create("ctplsnapbase0000", spec)
    try:
        meta = await backend.snapshot(base)
    finally:
        await backend.destroy(base)
    try:
        await asyncio.sleep(3)
        clone = await backend.create("ctplsnapclone000", replace(spec, snapshot=meta["id"]))
        try:
            skew, *_ = await probe(backend, clone)
            assert abs(skew) <= 2, skew
        finally:
            await backend.destroy(clone)
    finally:
        backend.delete_snapshot(meta["id"])


def test_the_setting_turns_templates_off(tmp_path, monkeypatch):
    from dsec import settings
    from dsec.backends.vm import vm_backends

    monkeypatch.setattr(settings, "_loaded", None)  # (the environment's settings, as it is now)
    monkeypatch.setenv("DSEC_VM_TEMPLATES_DIR", str(tmp_path / "shared"))
    assert vm_backends(tmp_path / "node", None, tmp_path / "vm")[0].templates_dir == tmp_path / "shared"
    monkeypatch.setenv("DSEC_VM_BOOT_TEMPLATES", "0")
    assert vm_backends(tmp_path / "node", None, tmp_path / "vm")[0].templates_dir is None
    monkeypatch.delenv("DSEC_VM_BOOT_TEMPLATES")
    monkeypatch.delenv("DSEC_VM_TEMPLATES_DIR")
    assert vm_backends(tmp_path / "node", None, tmp_path / "vm")[0].templates_dir == tmp_path / "node" / "vm-templates"
