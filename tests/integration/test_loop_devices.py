"""Container sandboxes with their layers on loop devices (``DSEC_LAYER_ATTACH=loop``: the path
of kernels before 6.12, forced on this one): they read their image, the node holds exactly one
read-only loop device per layer while they run and none once the server has stopped, and after
a crash (``kill -9`` of ``dsec serve``) a restart adopts the devices and ``dsec reset`` leaves
none, strays of other tools included.

Each test has a store of its own, so the loop devices it counts (found by their backing files)
are its own: other runs on this machine may attach the shared test store's layers meanwhile."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsec.images import loopdev
from dsec.images.builders import build_busybox
from dsec.images.store import Image, LayerStore
from dsec.local import LocalServer, leftovers
from libdsec import DSecClient, DSecContainerRunArgs

pytestmark = [pytest.mark.slow, pytest.mark.root]

LOOP = {"DSEC_LAYER_ATTACH": "loop", "DSEC_VMS": "0"}
TASK = DSecContainerRunArgs(container_image="task", memory_limit_mb=32)
BUSYBOX = DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32)


@pytest.fixture
def state_dir(tmp_path_factory):
    """A state dir with a store of its own: busybox, and ``task`` (busybox + a workspace layer)."""
    state = tmp_path_factory.mktemp("dsec-loop")
    store = LayerStore(state / "store")
    base = build_busybox(store)
    work = tmp_path_factory.mktemp("task-layer")
    (work / "task").mkdir()
    (work / "task" / "hello.txt").write_text("hello from the task layer\n")
    store.put_image(Image(name="task", layers=base.layers + (store.add_dir(work),), env=base.env,
                          roles=("base", "workspace")))
    yield state
    if leftovers(state, settle_s=0):
        _reset(state)
    left = leftovers(state)
    assert not left, f"left behind: {left}"


def _reset(state: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "dsec", "reset", "--state-dir", str(state), "--yes"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _layer_files(state: Path) -> list[str]:
    store = LayerStore(state / "store")
    digests = set(store.get_image("task").layers) | set(store.get_image("busybox").layers)
    return sorted(str(store.layer_path(d).resolve()) for d in digests)


def _devices(state: Path) -> dict[str, str]:
    return loopdev.backed_by(state / "store")


def _no_devices(state: Path, within_s: float = 10.0) -> dict[str, str]:
    deadline = time.monotonic() + within_s
    while (left := _devices(state)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _layer_mount_sources(state: Path) -> dict[str, str]:
    """The node's layer mounts: target -> source device. Not the idmapped clones a create
    attaches under ``.idmapped/`` for a moment on kernels before 6.15 (the warm pool may be
    refilling while this looks): they are the same devices, and gone once its overlay is up."""
    layers = str((state / "node" / "layers").resolve()) + "/"
    clones = layers + ".idmapped/"
    found = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4].startswith(layers) and not fields[4].startswith(clones):
                found[fields[4]] = fields[fields.index("-") + 2]
    return found


def _assert_one_device_per_layer(state: Path) -> dict[str, str]:
    devices = _devices(state)
    assert sorted(devices.values()) == _layer_files(state), devices
    for name in devices:
        assert Path(f"/sys/block/{name}/ro").read_text().strip() == "1"
    assert sorted(_layer_mount_sources(state).values()) == sorted(f"/dev/{n}" for n in devices)
    return devices


async def test_sandboxes_run_on_one_loop_device_per_layer(state_dir):
    server = LocalServer(state_dir, extra_args=("--pool-max", "2"), env=LOOP).start()
    try:
        async with DSecClient(server.endpoint, token=server.token) as client:
            [node] = await client.node_info()
            assert node.layer_attach == "loop"
            assert "EROFS layers on read-only loop devices" in node.runtime
            tasks = [await client.run_container(TASK) for _ in range(3)]
            plain = await client.run_container(BUSYBOX)
            for s in tasks:
                result = await s.run_shell("cat /task/hello.txt")
                assert (result.exit_code, result.stdout) == (0, "hello from the task layer\n")
            assert (await plain.run_shell("ls /task 2>&1; echo $?")).stdout.endswith("1\n")
            _assert_one_device_per_layer(state_dir)
            info = subprocess.run(
                [sys.executable, "-m", "dsec", "info"], capture_output=True, text=True, timeout=60,
                env={**os.environ, "DSEC_ENDPOINT": server.endpoint, "DSEC_TOKEN": server.token, "COLUMNS": "400"})
            assert "layers on read-only loop devices" in info.stdout, info.stdout + info.stderr
            for s in (*tasks, plain):
                await s.stop()
            # The warm pool still holds busybox and task sandboxes, and with them the layers.
            _assert_one_device_per_layer(state_dir)
    finally:
        server.stop()
    assert _no_devices(state_dir) == {}
    assert "Traceback" not in server.log_tail(20000)


async def test_crash_then_restart_adopts_the_devices_and_reset_leaves_none(state_dir):
    server = LocalServer(state_dir, extra_args=("--pool-max", "0"), env=LOOP).start()
    try:
        async with DSecClient(server.endpoint, token=server.token) as client:
            keep = await client.run_container(TASK)
            await client.run_container(TASK)
            assert (await keep.run_shell("cat /task/hello.txt")).exit_code == 0
        before = _assert_one_device_per_layer(state_dir)
        server.kill()
        assert _devices(state_dir) == before  # the sandboxes still run on them

        server = LocalServer(state_dir, port=server.port, extra_args=("--pool-max", "0"), env=LOOP).start()
        async with DSecClient(server.endpoint, token=server.token) as client:
            adopted = await client.get_sandbox(keep.id)
            result = await adopted.run_shell("cat /task/hello.txt")
            assert (result.exit_code, result.stdout) == (0, "hello from the task layer\n")
            assert _devices(state_dir) == before  # adopted as they were, none attached again
            assert len(await client.list_sandboxes()) == 2
        server.kill()
    finally:
        server.stop()
    # A stray of another tool (no autoclear) on one of the store's layers, as an older run might leave.
    stray = subprocess.run(["losetup", "--find", "--show", "--read-only", _layer_files(state_dir)[0]],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(stray).name in _devices(state_dir)
    # reset on its own: this process would attach files (auto), the earlier ones used loop devices.
    out = _reset(state_dir)
    assert "2 sandbox(es) removed" in out
    assert _no_devices(state_dir) == {}
    assert leftovers(state_dir) == []
