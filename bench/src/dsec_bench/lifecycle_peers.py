"""The peers DSec is measured against, on the same root filesystem: bare ``crun run`` (the floor:
an OCI runtime with nothing around it) and ``podman run --rm`` (a complete container engine).

The root filesystem is the ``busybox`` image's EROFS layer, mounted read-only once under
``<work>/rootfs`` (file-backed or on a loop device, as the edge mounts it on this kernel). crun runs it read-only as its root;
podman puts an overlay on it (``--rootfs DIR:O``), as the edge does for a sandbox.

Everything made here carries a name this module can find again — crun state under
``<work>/crun``, cgroups under one parent named after the work dir, podman containers named
``dsec-bench-<hash of the work dir>-…`` — and ``PeerRig.cleanup()`` removes it all, also the remains of a run that was
killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from dsec import _sys, hostcheck
from dsec.images import loopdev
from dsec.images.store import LayerStore
from dsec.resources import cgroups

CRUN = shutil.which("crun") or "/usr/bin/crun"
PODMAN = shutil.which("podman") or "/usr/bin/podman"
# What podman needs on this host and no more: its default RLIMIT_NOFILE/NPROC (1048576) are over
# what the host lets a process set ("setrlimit RLIMIT_NOFILE: Operation not permitted"). The
# rootfs gets an overlay (":O") because podman writes /etc/mtab into it. "--network none"
# matches a DSec sandbox (no network) and keeps podman from making a host bridge and firewall
# rules per container; it does not change podman's speed here.
PODMAN_FLAGS = ("--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
SLEEP_ARGS = ["/bin/sleep", "2147483647"]
PROC_TIMEOUT_S = 120.0


async def _finish(proc: asyncio.subprocess.Process, what: str, pipes: bool = False) -> tuple[int, bytes, bytes]:
    """Wait for a peer's process (killing it past PROC_TIMEOUT_S); returns (rc, out, err)."""
    try:
        if pipes:
            out, err = await asyncio.wait_for(proc.communicate(), PROC_TIMEOUT_S)
            return proc.returncode or 0, out or b"", err or b""
        return await asyncio.wait_for(proc.wait(), PROC_TIMEOUT_S), b"", b""
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise PeerError(f"{what} took over {PROC_TIMEOUT_S:g}s and was killed") from None


class PeerError(RuntimeError):
    pass


async def podman_detached(argv: list[str], log: Path) -> None:
    """Run ``podman run --detach …`` (``argv``) to its exit; ``PeerError`` with its output if it
    fails. Its output goes to the file ``log`` (removed after), not a pipe: podman's conmon keeps
    a pipe open after podman exits."""
    with open(log, "w+b") as out:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                                                    stderr=asyncio.subprocess.STDOUT)
        rc, _, _ = await _finish(proc, "podman run --detach")
    text = log.read_text(errors="replace")
    log.unlink(missing_ok=True)
    if rc != 0:
        raise PeerError(f"podman run --detach exited {rc}: {text[-300:]}")


def _cgroup_leaf_dirs(parent: str) -> list[Path]:
    return cgroups.sandbox_cgroup_dirs(parent)


class PeerRig:
    """The peers' shared set-up. ``with PeerRig(work, layer_file) as rig:`` mounts the rootfs and
    cleans up everything on exit."""

    def __init__(self, work: Path, layer_file: Path, run_id: str) -> None:
        self.work = Path(work).resolve()
        self.layer_file = Path(layer_file)
        self.run_id = run_id
        self.rootfs = self.work / "rootfs"
        self.crun_root = self.work / "crun"
        self.bundles = self.work / "bundles"
        tag = hashlib.sha1(str(self.work).encode()).hexdigest()[:10]
        self.cgroup_parent = f"dsecbench-{tag}"
        self.podman_prefix = f"dsec-bench-{tag}-"
        self._spec: dict | None = None
        self._counter = 0

    # -- set-up and clean-up -----------------------------------------------------------------

    def __enter__(self) -> PeerRig:
        self.cleanup()
        for d in (self.rootfs, self.crun_root, self.bundles):
            d.mkdir(parents=True, exist_ok=True)
        flags = _sys.MS_RDONLY | _sys.MS_NODEV | _sys.MS_NOSUID
        if hostcheck.layer_attach() == "file":
            _sys.mount(str(self.layer_file), str(self.rootfs), "erofs", flags)
        else:  # a kernel before 6.12: through a loop device, as the edge attaches it there
            with loopdev.attached(self.layer_file) as device:
                _sys.mount(device, str(self.rootfs), "erofs", flags)
        spec_dir = self.work / "spec"
        spec_dir.mkdir(exist_ok=True)
        subprocess.run([CRUN, "spec"], cwd=spec_dir, check=True, capture_output=True)
        self._spec = json.loads((spec_dir / "config.json").read_text())
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def podman_names(self) -> list[str]:
        if not os.path.exists(PODMAN):
            return []
        proc = subprocess.run(
            [PODMAN, "ps", "-a", "--format", "{{.Names}}", "--filter", f"name=^{self.podman_prefix}"],
            capture_output=True, text=True, timeout=120,
        )
        return [n for n in proc.stdout.split() if n.startswith(self.podman_prefix)]

    def crun_ids(self) -> list[str]:
        if not self.crun_root.is_dir():
            return []
        proc = subprocess.run([CRUN, "--root", str(self.crun_root), "list", "-q"], capture_output=True, text=True)
        return proc.stdout.split()

    def cleanup(self) -> None:
        """Remove every container, cgroup, mount and file this rig (or an earlier killed run of
        it) made. Idempotent."""
        names = self.podman_names()
        for i in range(0, len(names), 64):
            subprocess.run([PODMAN, "rm", "-f", "-t", "0", *names[i:i + 64]], capture_output=True, timeout=300)
        for cid in self.crun_ids():
            subprocess.run([CRUN, "--root", str(self.crun_root), "delete", "-f", cid], capture_output=True)
        deadline = time.monotonic() + 10
        while True:
            for d in _cgroup_leaf_dirs(self.cgroup_parent):
                with contextlib.suppress(OSError):
                    d.rmdir()
            cgroups.remove_parent(self.cgroup_parent)
            if not self._cgroup_left() or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if os.path.ismount(self.rootfs):
            try:
                _sys.umount(str(self.rootfs))
            except OSError:
                _sys.umount(str(self.rootfs), _sys.MNT_DETACH)
        shutil.rmtree(self.work, ignore_errors=True)

    def _cgroup_left(self) -> list[str]:
        return [str(p / self.cgroup_parent) for p in cgroups.CGROUP_ROOT.iterdir()
                if (p / self.cgroup_parent).exists()] if not cgroups.is_v2() else (
            [str(cgroups.CGROUP_ROOT / self.cgroup_parent)] if (cgroups.CGROUP_ROOT / self.cgroup_parent).exists() else [])

    def leftovers(self) -> list[str]:
        found = [f"podman container {n}" for n in self.podman_names()]
        found += [f"crun container {c}" for c in self.crun_ids()]
        found += [f"cgroup {d}" for d in self._cgroup_left()]
        if os.path.ismount(self.rootfs):
            found.append(f"mount {self.rootfs}")
        if self.work.exists():
            found.append(f"directory {self.work}")
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if f"/{self.cgroup_parent}/" in Path(f"/proc/{pid}/cgroup").read_text():
                    found.append(f"process {pid} in cgroup {self.cgroup_parent}")
            except OSError:
                continue
        return found

    # -- crun --------------------------------------------------------------------------------

    def _new_cid(self, tag: str) -> str:
        self._counter += 1
        return f"{tag}-{self.run_id}-{self._counter}"

    def _bundle(self, cid: str, args: list[str]) -> Path:
        assert self._spec is not None
        config = copy.deepcopy(self._spec)
        config["process"]["terminal"] = False
        config["process"]["args"] = args
        config["root"] = {"path": str(self.rootfs), "readonly": True}
        config["hostname"] = "peer"
        config["linux"]["cgroupsPath"] = f"/{self.cgroup_parent}/{cid}"
        bundle = self.bundles / cid
        bundle.mkdir()
        (bundle / "config.json").write_text(json.dumps(config))
        return bundle

    def _crun(self, *args: str) -> list[str]:
        return [CRUN, "--root", str(self.crun_root), *args]

    async def crun_echo(self) -> tuple[bool, str]:
        """One whole lifecycle: ``crun run`` of ``/bin/echo hi`` (it deletes the container when
        the process ends)."""
        cid = self._new_cid("echo")
        bundle = self._bundle(cid, ["/bin/echo", "hi"])
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._crun("run", "--bundle", str(bundle), cid),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            rc, out, err = await _finish(proc, "crun run", pipes=True)
        finally:
            shutil.rmtree(bundle, ignore_errors=True)
        if rc != 0 or out != b"hi\n":
            return False, f"crun run exited {rc}: {(out + err).decode(errors='replace')[-300:]}"
        return True, ""

    async def crun_start_idle(self) -> str:
        """``crun run --detach`` of an idle process (``sleep``); returns its id once it runs."""
        cid = self._new_cid("idle")
        bundle = self._bundle(cid, SLEEP_ARGS)
        log = bundle / "crun.log"
        with open(log, "w+b") as out:
            proc = await asyncio.create_subprocess_exec(
                *self._crun("run", "--detach", "--bundle", str(bundle), cid),
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT)
            try:
                rc, _, _ = await _finish(proc, "crun run --detach")
            except PeerError:
                await self.crun_delete(cid)
                raise
        if rc != 0:
            text = log.read_text(errors="replace")[-300:]
            await self.crun_delete(cid)
            raise PeerError(f"crun run --detach exited {rc}: {text}")
        return cid

    async def crun_delete(self, cid: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            *self._crun("delete", "--force", cid),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        await _finish(proc, "crun delete")
        shutil.rmtree(self.bundles / cid, ignore_errors=True)

    # -- podman ------------------------------------------------------------------------------

    def podman_argv(self, name: str, *args: str, detach: bool = False) -> list[str]:
        return [PODMAN, "run", "--rm", *(["--detach"] if detach else []), "--name", name, *PODMAN_FLAGS,
                "--rootfs", f"{self.rootfs}:O", *args]

    async def podman_echo(self) -> tuple[bool, str]:
        """One whole lifecycle: ``podman run --rm`` of ``/bin/echo hi``."""
        name = self.podman_prefix + self._new_cid("echo")
        proc = await asyncio.create_subprocess_exec(
            *self.podman_argv(name, "/bin/echo", "hi"),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        rc, out, err = await _finish(proc, "podman run", pipes=True)
        if rc != 0 or out != b"hi\n":
            return False, f"podman run exited {rc}: {(out + err).decode(errors='replace')[-300:]}"
        return True, ""

    async def podman_start_idle(self) -> str:
        """``podman run --rm --detach`` of ``sleep``; returns the container's name once it runs."""
        name = self.podman_prefix + self._new_cid("idle")
        await podman_detached(self.podman_argv(name, *SLEEP_ARGS, detach=True), self.bundles / f"{name}.log")
        return name

    def podman_pids(self, names: list[str]) -> list[int]:
        """The containers' processes and their conmons."""
        if not names:
            return []
        proc = subprocess.run([PODMAN, "inspect", "--format", "{{.State.Pid}} {{.State.ConmonPid}}", *names],
                              capture_output=True, text=True, timeout=120)
        return [int(x) for x in proc.stdout.split() if x.isdigit() and int(x) > 0]

    async def podman_remove(self, names: list[str]) -> None:
        for i in range(0, len(names), 64):
            proc = await asyncio.create_subprocess_exec(
                PODMAN, "rm", "-f", "-t", "0", *names[i:i + 64],
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            await _finish(proc, "podman rm")


@contextlib.contextmanager
def image_root(store: LayerStore, name: str, work: Path):
    """The image's root filesystem, read-only: its layers mounted and overlaid (the lowest last)."""
    image = store.get_image(name)
    mounted: list[Path] = []
    try:
        for n, digest in enumerate(image.layers):
            target = work / f"layer{n}"
            target.mkdir(parents=True)
            subprocess.run(["mount", "-t", "erofs", "-o", "ro", str(store.layer_path(digest)), str(target)],
                           check=True, capture_output=True)
            mounted.append(target)
        if len(mounted) == 1:  # (overlayfs wants two lower layers when it has no upper one)
            yield mounted[0]
            return
        merged = work / "merged"
        merged.mkdir()
        lower = ":".join(str(p) for p in reversed(mounted))
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"ro,lowerdir={lower}", str(merged)],
                       check=True, capture_output=True)
        mounted.append(merged)
        yield merged
    finally:
        for path in reversed(mounted):
            subprocess.run(["umount", str(path)], capture_output=True)
