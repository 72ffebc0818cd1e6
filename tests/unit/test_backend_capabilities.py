"""Backends declare what they can do (``Capability``); the edge asks, and refuses a backend that
declares an ability without its hook."""

from __future__ import annotations

import pytest

from dsec.backends import base
from dsec.backends.base import Capability, check_backend
from dsec.backends.container import ContainerBackend
from dsec.backends.fake import FakeBackend
from dsec.backends.vm.fullvm import FullVMBackend
from dsec.backends.vm.microvm import MicroVMBackend
from dsec.edge.edge import Edge, EdgeConfig
from dsec.fncall.backend import FnCallBackend

BACKENDS = [ContainerBackend, FnCallBackend, MicroVMBackend, FullVMBackend, FakeBackend]


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_each_backend_has_the_hooks_of_what_it_declares(cls):
    for capability in cls.capabilities:
        hook = base._HOOKS.get(capability)
        assert hook is None or issubclass(cls, hook), (cls.__name__, capability)
    for name in ("describe", "host_view", "warm_up", "close"):
        assert callable(getattr(cls, name)), name


def test_what_each_kind_can_do():
    assert ContainerBackend.capabilities == {Capability.WARM_POOL, Capability.PROTECTED_PATHS, Capability.CARRY,
                                             Capability.HOST_PATHS, Capability.PIPED_STDIN, Capability.PORTS,
                                             Capability.NEW_IDENTITY, Capability.REBOOT, Capability.DESKTOP}
    assert MicroVMBackend.capabilities == {Capability.KEPT_LAYER, Capability.SNAPSHOT, Capability.PIPED_STDIN,
                                           Capability.WATCHED, Capability.PROTECTED_PATHS, Capability.PORTS,
                                           Capability.NEW_IDENTITY, Capability.DESKTOP}
    # no memory snapshots, no warm pool
    assert FullVMBackend.capabilities == {Capability.KEPT_LAYER, Capability.PIPED_STDIN, Capability.WATCHED,
                                          Capability.PROTECTED_PATHS, Capability.PORTS, Capability.NEW_IDENTITY,
                                          Capability.DESKTOP}


class _Claims(FakeBackend):
    capabilities = frozenset({Capability.SNAPSHOT})  # but no snapshot()


def test_a_backend_that_claims_a_hook_it_lacks_is_refused(tmp_path, store):
    with pytest.raises(TypeError, match="declares snapshot but does not implement Snapshots"):
        check_backend(_Claims())
    with pytest.raises(TypeError, match="declares snapshot"):
        Edge(EdgeConfig(node_dir=tmp_path / "node"), _Claims(), store)


class _DesktopNoPorts(FakeBackend):
    capabilities = frozenset({Capability.DESKTOP})


class _DesktopVM(FakeBackend):
    capabilities = frozenset({Capability.PORTS, Capability.DESKTOP})


def test_a_desktop_needs_ports():
    with pytest.raises(TypeError, match="declares desktop but not ports"):
        check_backend(_DesktopNoPorts())


async def test_a_desktop_is_asked_of_the_kinds_that_declare_it(tmp_path, store):
    from libdsec import DesktopSpec, InvalidRequest, LimitOutOfRange
    from libdsec.protocol import DSecContainerRunArgs, DSecMicroVMRunArgs, SandboxKind

    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=0, pool_max=0),
                [FakeBackend(), _DesktopVM("microvm")], store)
    await edge.start()
    try:
        with pytest.raises(InvalidRequest, match=r"a container sandbox on node \S+ cannot have a desktop "
                                                 r"\(desktops here: microvm\)"):
            await edge.create(DSecContainerRunArgs(container_image="tiny", desktop=DesktopSpec()))
        # A VM's memory is all its guest has: a desktop needs a floor of it, named.
        with pytest.raises(LimitOutOfRange, match="memory_limit_mb=256 is too small for a microvm with a desktop: "
                                                  "at least 384 MB"):
            await edge.create(DSecMicroVMRunArgs(container_image="tiny", memory_limit_mb=256, desktop=DesktopSpec()),
                              SandboxKind.microvm)
        assert await edge.list() == []
    finally:
        await edge.close()


async def test_the_edge_asks_the_capabilities(edge):
    from libdsec import InvalidRequest
    from libdsec.protocol import DSecContainerRunArgs

    info = await edge.create(DSecContainerRunArgs(container_image="tiny"))
    with pytest.raises(InvalidRequest, match="a container sandbox takes no full snapshots"):
        await edge.snapshot(info.id, mode="full")
    await edge.stop(info.id)
