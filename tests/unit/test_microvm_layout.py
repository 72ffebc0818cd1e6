"""A pmem microVM's guest-physical layout: RAM, the layers, then the tail RAM, with the initrd
(QEMU puts it at the top of the RAM below 2 GiB) in RAM, never inside a layer."""

from __future__ import annotations

import pytest

from dsec.backends.vm.microvm import INITRD_MAX_MB, TAIL_RAM_MB, MicroVMBackend
from libdsec import LimitOutOfRange


@pytest.fixture
def backend(tmp_path):
    return MicroVMBackend(tmp_path / "node", None, tmp_path / "assets", use_ksm=False)


def _tail_covers_the_initrd(blocks, layers_mb):
    (_, head), (_, tail) = blocks
    tail_start, end = head + layers_mb, head + layers_mb + tail
    top = min(end, INITRD_MAX_MB)  # where the initrd ends (it is a few MB, below this)
    return tail_start <= top - TAIL_RAM_MB // 2 and top <= end


@pytest.mark.parametrize("ram_mb, layers_mb", [(512, 20), (512, 1296), (768, 1296), (1024, 1296), (2048, 200)])
def test_the_initrd_lands_in_the_tail(backend, ram_mb, layers_mb):
    blocks = backend._ram_blocks(ram_mb, layers_mb)
    assert [b for b, _ in blocks] == ["ram0", "ramtail"]  # (the snapshot's block names)
    assert sum(mb for _, mb in blocks) == ram_mb
    assert _tail_covers_the_initrd(blocks, layers_mb), blocks


def test_small_spans_keep_the_usual_tail(backend):
    assert backend._ram_blocks(512, 20) == [("ram0", 480), ("ramtail", 32)]


def test_layers_that_leave_no_room_to_boot_are_refused(backend):
    with pytest.raises(LimitOutOfRange, match="too little memory below 2048 MB to boot from"):
        backend._ram_blocks(1024, 1950)


async def test_a_node_dir_too_long_for_the_vms_sockets_is_a_clear_error(tmp_path):
    """A VM's QMP and agent sockets live in its directory under the node's: past the 107 bytes
    a socket's path may hold, create says so and what to do, before anything is made."""
    from dsec.backends.base import SandboxSpec
    from libdsec import BackendError

    node = tmp_path / ("n" * 60)
    backend = MicroVMBackend(node, None, tmp_path / "assets", use_ksm=False)
    with pytest.raises(BackendError, match=r"over the 107 a UNIX socket's path may hold: give the node a shorter "
                                           r"state dir"):
        await backend.create("c0123456789abcdef", SandboxSpec(image="busybox", layers=(), env={}, limits=None))
    assert not backend.vm_dir("c0123456789abcdef").exists()
