"""A container create that fails at any of its steps leaves nothing. Each step in turn is made
to fail before it acts, so that all before it has been done (a step that fails undoes its own
part: the layer mounts' acquire, the cgroup's making); ``crun run`` and the move of the init
into its cgroup fail once they have acted too, since what they did is outside this process.
Then no mount, cgroup, crun container, bundle directory, id range or process of the sandbox is
left, the backend's tables do not name it, and the backend still makes and removes a sandbox
(whose layers are then unused, every count given back)."""

from __future__ import annotations

import asyncio
import errno
import shutil
import subprocess

import pytest

from dsec.backends.base import SandboxSpec

pytestmark = [pytest.mark.slow, pytest.mark.root]

CID = "cundo00000000001"


class Injected(OSError):
    def __init__(self, step: str) -> None:
        super().__init__(errno.EIO, f"injected failure: {step}")


def failing(step: str, done=None):
    """A stand-in that raises; after doing ``done`` first when given (the step has acted)."""

    def stand_in(*args, **kwargs):
        if done is not None:
            done(*args, **kwargs)
        raise Injected(step)

    return stand_in


def _id_range(backend, mp):
    if backend.id_ranges is None:
        pytest.skip("no user namespaces here (DSEC_USERNS=0)")
    mp.setattr(backend.id_ranges, "take", failing("take an id range"))


def _overlay(backend, mp):
    from dsec import _sys

    real = _sys.mount

    def mount(source, target, fstype, *args):
        if fstype == "overlay":
            raise Injected("mount the overlay")
        return real(source, target, fstype, *args)

    mp.setattr(_sys, "mount", mount)


def _crun_run(after: bool):
    def install(backend, mp):
        real = backend._run_crun

        async def run(*args, **kwargs):
            if args[0] != "run":
                return await real(*args, **kwargs)
            if after:
                await real(*args, **kwargs)
            raise Injected("crun run" + (" (the container made)" if after else ""))

        mp.setattr(backend, "_run_crun", run)

    return install


def _cancelled(backend, mp):
    from dsec.backends.container import lifecycle

    def runs_init(pid):
        raise asyncio.CancelledError

    mp.setattr(lifecycle, "_runs_init", runs_init)


def _patch(target: str, attr: str, step: str, after: bool = False):
    def install(backend, mp):
        from dsec.backends.container import lifecycle
        from dsec.backends.initchan import InitChannel
        from dsec.isolation import disk
        from dsec.resources import cgroups

        obj = {"backend": backend, "oci": backend.oci, "layers": backend.layer_mounts, "cgroups": cgroups,
               "disk": disk, "lifecycle": lifecycle, "InitChannel": InitChannel}[target]
        stand_in = failing(step, getattr(obj, attr) if after else None)
        mp.setattr(obj, attr, staticmethod(stand_in) if obj is InitChannel else stand_in)

    return install


# Create's steps in their order.
STEPS = {
    "id-range": _id_range,
    "cgroup": _patch("cgroups", "make_sandbox_cgroup", "make the cgroup"),
    "bundle-tmpfs": _patch("disk", "mount_bundle", "mount the bundle's tmpfs"),
    "layers": _patch("layers", "acquire", "acquire the layers"),
    "overlay": _overlay,
    "rootfs": _patch("backend", "_mount_rootfs", "mount the root filesystem"),
    "channel": _patch("InitChannel", "pair", "open the init's channel"),
    "config": _patch("oci", "json", "write the config"),
    "crun-run": _crun_run(after=False),
    "crun-run-done": _crun_run(after=True),
    "seccomp": _patch("oci", "learn_compiled", "keep crun's seccomp program"),
    "cgroup-enter": _patch("cgroups", "enter", "move the init into its cgroup"),
    "cgroup-enter-done": _patch("cgroups", "enter", "move the init into its cgroup (moved)", after=True),
    "init-wait": _patch("lifecycle", "_runs_init", "wait for the init"),
    "cancelled": _cancelled,
}


@pytest.fixture
async def backend(tmp_path_factory, test_store):
    from dsec._sys import set_child_subreaper
    from dsec.backends.container import ContainerBackend
    from dsec.images.store import LayerStore
    from dsec.local import leftovers
    from dsec.resources import cgroups

    set_child_subreaper()
    state = tmp_path_factory.mktemp("createundo")
    backend = ContainerBackend(state / "node", LayerStore(test_store), cgroup_parent=cgroups.parent_for(state))
    try:
        yield backend
    finally:
        backend.release_unused()
        left = leftovers(state)
        shutil.rmtree(state, ignore_errors=True)
        assert not left, left


def _spec(backend) -> SandboxSpec:
    image = backend.store.get_image("busybox")
    return SandboxSpec(image="busybox", layers=image.layers, env=dict(image.env), limits=None,
                       protected_paths=["/etc"])


@pytest.mark.parametrize("step", list(STEPS))
async def test_a_create_that_fails_at_any_step_leaves_nothing(backend, monkeypatch, step):
    from libdsec import BackendError

    from dsec.resources import cgroups

    STEPS[step](backend, monkeypatch)
    with pytest.raises((Injected, BackendError, asyncio.CancelledError)) as failure:
        await backend.create(CID, _spec(backend))
    if failure.type is BackendError:
        assert isinstance(failure.value.__cause__, Injected), failure.value
    monkeypatch.undo()

    bundle = backend.sandboxes_dir / CID
    with open("/proc/self/mountinfo") as f:
        mounts = [t for line in f if (t := line.split()[4]) == str(bundle) or t.startswith(f"{bundle}/")]
    assert mounts == []
    assert not bundle.exists()
    assert all(d.name != CID for d in cgroups.sandbox_cgroup_dirs(backend.cgroup_parent))
    assert not (backend.crun_root / CID).exists()
    listed = subprocess.run(backend._crun("list"), capture_output=True, text=True, check=True).stdout
    assert CID not in listed
    assert backend.id_ranges is None or backend.id_ranges.of(CID) is None
    assert CID not in backend.channels and CID not in backend.rootfs.plans

    # The layers' counts and the id ranges are as they were: a sandbox comes and goes, and then
    # release_unused (in the fixture) finds every layer unused.
    handle = await backend.create("cundo00000000002", _spec(backend))
    await backend.destroy(handle)
