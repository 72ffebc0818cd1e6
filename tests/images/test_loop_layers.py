"""Layers on read-only loop devices (the path of kernels before 6.12, forced here): the devices
are read-only and autoclear, one per layer however many users it has, and gone with the mount;
the sweep detaches strays without pulling a device from under a mount; the probes answer."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import pytest

from dsec import _sys, hostcheck
from dsec.images import loopdev
from dsec.images.compose import LayerMount
from dsec.images.mounts import LayerMounts

pytestmark = [pytest.mark.slow, pytest.mark.root]


def _sysfs(name: str, attr: str) -> str:
    return Path(f"/sys/block/{name}/{attr}").read_text().strip()


def _gone(directory: Path, within_s: float = 5.0) -> dict[str, str]:
    deadline = time.monotonic() + within_s
    while (left := loopdev.backed_by(directory)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


@pytest.fixture
def layers(tmp_path) -> Path:
    """Two one-file EROFS layers in a directory of their own."""
    d = tmp_path / "layers"
    d.mkdir()
    for name in ("a", "b"):
        work = tmp_path / f"work-{name}"
        work.mkdir()
        image = hostcheck.tiny_erofs(work)
        image.rename(d / f"sha256-{name}.erofs")
    yield d
    stray = loopdev.detach_backed_by(d)
    assert not stray, f"the test left {stray} attached"


def test_attached_device_is_read_only_autoclear_and_goes_with_its_mount(layers, tmp_path):
    target = tmp_path / "mnt"
    target.mkdir()
    layer = layers / "sha256-a.erofs"
    with loopdev.attached(layer) as device:
        name = Path(device).name
        assert _sysfs(name, "ro") == "1"
        assert _sysfs(name, "loop/autoclear") == "1"
        assert loopdev.backing_file(name) == str(layer)
        _sys.mount(device, str(target), "erofs", _sys.MS_RDONLY)
    try:
        assert (target / "probe").read_bytes() == b"dsec layer probe\n"
        assert loopdev.backed_by(layers) == {name: str(layer)}  # held by the mount alone now
    finally:
        _sys.umount(str(target), _sys.MNT_DETACH)
    assert _gone(layers) == {}


def test_a_device_never_mounted_goes_when_the_block_ends(layers):
    with loopdev.attached(layers / "sha256-a.erofs"):
        assert len(loopdev.backed_by(layers)) == 1
    assert _gone(layers) == {}


def test_sweep_detaches_strays_but_not_what_is_mounted(layers, tmp_path):
    # A stray made the way an older tool would (no autoclear), and a mounted layer.
    stray = subprocess.run(["losetup", "--find", "--show", "--read-only", str(layers / "sha256-b.erofs")],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert _sysfs(Path(stray).name, "loop/autoclear") == "0"
    target = tmp_path / "mnt"
    target.mkdir()
    with loopdev.attached(layers / "sha256-a.erofs") as device:
        _sys.mount(device, str(target), "erofs", _sys.MS_RDONLY)
    try:
        swept = loopdev.detach_backed_by(layers)
        assert sorted(swept) == sorted([Path(stray).name, Path(device).name])
        assert loopdev.backed_by(layers) == {Path(device).name: str(layers / "sha256-a.erofs")}
        assert (target / "probe").read_bytes() == b"dsec layer probe\n"
    finally:
        _sys.umount(str(target), _sys.MNT_DETACH)
    assert _gone(layers) == {}


def test_layer_mounts_on_loop_devices_share_one_device_per_layer(layers, tmp_path):
    mounts = LayerMounts(tmp_path / "node-layers", attach="loop", layers_dir=layers)
    a, b = (LayerMount(d, layers / f"{d}.erofs", mounts.mount_dir / d) for d in ("sha256-a", "sha256-b"))
    mounts.acquire((a, b))
    mounts.acquire((a,))
    try:
        devices = loopdev.backed_by(layers)
        assert sorted(devices.values()) == [str(a.source), str(b.source)]
        assert (a.target / "probe").exists() and (b.target / "probe").exists()
        mounts.release((a, b))
        assert loopdev.backed_by(layers) == {n: p for n, p in devices.items() if p == str(a.source)}
        assert mounts.release_unused() == []  # a is still held: the sweep leaves it
        assert (a.target / "probe").exists()
    finally:
        mounts.release((a,))
    assert _gone(layers) == {}
    assert mounts.mounted() == {}


@pytest.mark.parametrize("attach", ["file", "loop"])
@pytest.mark.parametrize("idmapped", [True, False], ids=["idmapped", "plain"])
def test_the_layer_stack_probe_passes_here(attach, idmapped):
    if attach == "file" and not hostcheck.erofs_mounts_files():
        pytest.skip("this kernel cannot mount EROFS files")
    hostcheck.probe_layer_stack(attach, idmapped)


def test_the_file_backed_probe_matches_the_kernel():
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    assert hostcheck.erofs_mounts_files() is ((major, minor) >= (6, 12))


def test_check_host_passes_on_this_host_both_ways():
    for attach in ("file", "loop"):
        if attach == "file" and not hostcheck.erofs_mounts_files():
            continue
        notes = hostcheck.check_host(attach=attach, idmapped=os.environ.get("DSEC_USERNS", "1") != "0")
        assert any(n.startswith("layers: ") for n in notes), notes
