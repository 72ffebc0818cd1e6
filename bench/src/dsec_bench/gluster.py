"""A GlusterFS volume of its own, mounted through its FUSE client, for the layer store (the
cluster tests, tests/cluster/test_gluster_store.py, and `dsec bench layercache`).

GlusterFS refuses bricks on loopback addresses, so its daemon runs where only this machine
reaches it: in a network namespace of its own, joined to the host by a veth pair with a /30 of
10.251.0.0/16 that no route of the host uses (nothing goes out of an outward interface, and the
namespace has no route out). glusterd runs there in a mount namespace of its own too, its
working, run and log directories in the test's directory (``/var/lib/glusterd``,
``/var/log/glusterfs`` and ``/run/gluster`` of the host are not touched). The volume has one
brick, a ping timeout of ``PING_TIMEOUT_S`` and no metadata cache in its clients (as
docs/CLUSTER.md sets it up). The FUSE client (``glusterfs``, in the
foreground, a child of this process) mounts it on the host.

``close()`` (idempotent) unmounts, ends every process it started (the client, glusterd and the
brick and self-heal daemons glusterd started in the namespace) and removes the namespace, the
veth pair and the directories.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

PING_TIMEOUT_S = 5
INSTALL_HINT = (
    "GlusterFS is not installed (glusterd, gluster, glusterfs): apt-get install glusterfs-server glusterfs-client "
    "(make setup does, through scripts/setup-host.sh)")


def missing() -> str | None:
    """Why a volume cannot be run here, or None."""
    if not (shutil.which("glusterd") and shutil.which("gluster") and shutil.which("glusterfs")):
        return INSTALL_HINT
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse: the GlusterFS client mounts through FUSE (modprobe fuse)"
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 of 10.251.0.0/16 that no route or address of the host overlaps."""
    used = []
    for family in ("route", "addr"):
        out = subprocess.run(["ip", "-j", "-4", family], capture_output=True, text=True, check=True).stdout
        for entry in json.loads(out or "[]"):
            for dst in [entry.get("dst")] + [a.get("local") for a in entry.get("addr_info", [])]:
                if dst and dst != "default":
                    with contextlib.suppress(ValueError):
                        used.append(ipaddress.ip_network(dst, strict=False))
    pool = ipaddress.ip_network("10.251.0.0/16")
    start = os.getpid() % 16384
    for i in range(16384):
        subnet = ipaddress.ip_network((int(pool.network_address) + 4 * ((start + i) % 16384), 30))
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise RuntimeError("no free /30 in 10.251.0.0/16")


class GlusterVolume:
    def __init__(self, base: Path, volume: str = "dsec") -> None:
        self.base = Path(base)
        self.volume = volume
        tag = f"{os.getpid() % 100000}"
        self.netns = f"dsec-gluster-{tag}"
        self.host_if, self.ns_if = f"dglh{tag}", f"dgln{tag}"
        subnet = _free_subnet()
        self.host_ip, self.server_ip = (str(a) for a in list(subnet.hosts())[:2])
        self.prefix = subnet.prefixlen
        self.brick = self.base / "brick"
        self.mountpoint = self.base / "mnt"
        self.glusterd: subprocess.Popen | None = None
        self.client: subprocess.Popen | None = None
        self.other_clients: list[tuple[Path, subprocess.Popen]] = []
        self._netns_made = self._veth_made = False
        self._closed = False

    # -- start and stop --------------------------------------------------------------------

    def start(self) -> GlusterVolume:
        try:
            for d in ("work", "run", "log", "brick", "mnt"):
                (self.base / d).mkdir(parents=True, exist_ok=True)
            self._network()
            self._glusterd()
            self.gluster("volume", "create", self.volume, f"{self.server_ip}:{self.brick}", "force")
            self.gluster("volume", "set", self.volume, "network.ping-timeout", str(PING_TIMEOUT_S))
            # Without it a client answers stats from its metadata cache for a second: a manifest
            # replaced on one machine is read as it was on the others (docs/CLUSTER.md).
            self.gluster("volume", "set", self.volume, "performance.stat-prefetch", "off")
            # Nor a stat answered through another process's file not yet opened on the brick
            # (EBADFD, seen on a manifest in the three-node burst): docs/CLUSTER.md.
            self.gluster("volume", "set", self.volume, "performance.open-behind", "off")
            self.start_volume()
            self.mount()
        except BaseException:
            self.close()
            raise
        return self

    def _network(self) -> None:
        _run("ip", "netns", "add", self.netns)
        self._netns_made = True
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self._veth_made = True
        _run("ip", "link", "set", self.ns_if, "netns", self.netns)
        _run("ip", "addr", "add", f"{self.host_ip}/{self.prefix}", "dev", self.host_if)
        _run("ip", "link", "set", self.host_if, "up")
        for cmd in (("addr", "add", f"{self.server_ip}/{self.prefix}", "dev", self.ns_if),
                    ("link", "set", self.ns_if, "up"), ("link", "set", "lo", "up")):
            _run("ip", "-n", self.netns, *cmd)

    def _glusterd(self) -> None:
        run, log, work = self.base / "run", self.base / "log", self.base / "work"
        volfile = self.base / "glusterd.vol"
        volfile.write_text(
            "volume management\n    type mgmt/glusterd\n"
            f"    option working-directory {work}\n    option run-directory {run}\n"
            f"    option glusterd-sockfile {run}/glusterd.socket\n"
            "    option transport-type socket\n    option transport.socket.listen-port 24007\n"
            "    option ping-timeout 0\n    option event-threads 1\nend-volume\n")
        # Bricks and daemons glusterd starts write under /var/lib/glusterd, /var/log/glusterfs
        # and /run/gluster whatever it is told: those are this volume's own directories in its
        # mount namespace.
        script = (f"mount -t tmpfs dsec-gluster /var/lib/glusterd && mount --bind {log} /var/log/glusterfs"
                  f" && mkdir -p /run/gluster && mount --bind {run} /run/gluster"
                  f" && exec glusterd -N -f {volfile} -l {log}/glusterd.log")
        self.glusterd = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "-m", "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.DEVNULL, stderr=open(log / "glusterd.stderr", "wb"))
        deadline = time.monotonic() + 30
        while not (run / "glusterd.socket").exists():
            if self.glusterd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"glusterd did not start: {self._log_tail('glusterd.log')}")
            time.sleep(0.1)

    def gluster(self, *args: str, timeout: float = 60) -> str:
        done = subprocess.run(
            ["ip", "netns", "exec", self.netns, "gluster", f"--glusterd-sock={self.base}/run/glusterd.socket",
             "--mode=script", f"--log-file={self.base}/log/cli.log", *args], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"gluster {' '.join(args)}: {done.stdout}{done.stderr}")
        return done.stdout

    def start_profile(self) -> None:
        """Have the brick count what it serves (``data_read``); again: nothing changes."""
        try:
            self.gluster("volume", "profile", self.volume, "start")
        except RuntimeError as exc:
            if "already started" not in str(exc):
                raise

    def data_read(self) -> int:
        """Bytes the brick has served to reads since ``start_profile``: gluster's own count."""
        out = self.gluster("volume", "profile", self.volume, "info", "cumulative")
        match = re.search(r"Cumulative Stats:.*?Data Read: (\d+) bytes", out, re.S)
        if match is None:
            raise RuntimeError(f"no 'Data Read' in gluster's profile: {out[:300]}")
        return int(match.group(1))

    def stop_volume(self) -> None:
        """The volume stopped: its brick process ends, the client answers ENOTCONN."""
        self.gluster("volume", "stop", self.volume, "force")

    def start_volume(self) -> None:
        self.gluster("volume", "start", self.volume, "force")

    def slow_reads(self, delay_ms: int) -> None:
        """Every read the brick serves delayed by ``delay_ms`` (GlusterFS's own ``delay-gen``
        translator, put above the brick's storage); 0 takes it out. It is in the brick's graph,
        which glusterd does not change under a running brick, so the volume is restarted: its
        clients answer ENOTCONN for the moment that takes."""
        if delay_ms:
            for option, value in (("debug.delay-gen", "posix"), ("delay-gen.enable", "READ"),
                                  ("delay-gen.delay-duration", str(delay_ms * 1000)),
                                  ("delay-gen.delay-percentage", "100")):
                self.gluster("volume", "set", self.volume, option, value)
        else:
            self.gluster("volume", "reset", self.volume, "debug.delay-gen")
        self.stop_volume()
        self.start_volume()

    def fill(self) -> None:
        """The volume full: the brick keeps 99% of its disk in reserve (``storage.reserve``),
        so every write that needs room answers ENOSPC, at once."""
        self.gluster("volume", "set", self.volume, "storage.reserve", "99")

    def unfill(self) -> None:
        """Room again. (1%, not 0: 0 stops the brick's check of its free space, and the brick
        then answers ENOSPC for good.)"""
        self.gluster("volume", "set", self.volume, "storage.reserve", "1")

    def freeze_brick(self) -> None:
        """The brick process stopped (SIGSTOP): a server gone silent, its connection still up.
        The client waits for it up to the ping timeout, then answers ENOTCONN."""
        for pid in self._brick_pids():
            os.kill(pid, signal.SIGSTOP)

    def thaw_brick(self) -> None:
        for pid in self._brick_pids():
            os.kill(pid, signal.SIGCONT)

    def _brick_pids(self) -> list[int]:
        pids = []
        for pid in self._netns_pids():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() == "glusterfsd":
                    pids.append(pid)
        assert pids, "no brick process"
        return pids

    def mount(self) -> None:
        self.client = self._client(self.mountpoint, "client")

    def mount_another(self) -> Path:
        """A second client's mount of the volume (as on another machine), unmounted by ``close``."""
        path = self.base / f"mnt{len(self.other_clients) + 2}"
        path.mkdir()
        self.other_clients.append((path, self._client(path, path.name)))
        return path

    def _client(self, path: Path, name: str) -> subprocess.Popen:
        log = self.base / "log"
        client = subprocess.Popen(
            ["glusterfs", "-N", f"--volfile-server={self.server_ip}", f"--volfile-id={self.volume}",
             "-l", f"{log}/{name}.log", str(path)],
            stdout=subprocess.DEVNULL, stderr=open(log / f"{name}.stderr", "ab"))
        deadline = time.monotonic() + 30
        while True:
            if _mounted(path):
                try:
                    os.statvfs(path)
                    return client
                except OSError:
                    pass
            if client.poll() is not None or time.monotonic() > deadline:
                _end(client)
                raise RuntimeError(f"the GlusterFS client did not mount {path}: {self._log_tail(f'{name}.log')}")
            time.sleep(0.1)

    def kill_mount(self) -> None:
        """The FUSE client killed (SIGKILL): its mount stays, every call on it answers ENOTCONN."""
        if self.client is not None and self.client.poll() is None:
            self.client.kill()
            self.client.wait(10)

    def remount(self) -> None:
        """What an operator does after the client died: unmount the dead mount, mount again."""
        self.unmount()
        self.mount()

    def unmount(self) -> None:
        _unmount(self.mountpoint)
        if self.client is not None:
            _end(self.client)
            self.client = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.unmount()
        for path, client in self.other_clients:
            _unmount(path)
            _end(client)
        if self._netns_made:
            # glusterd and every daemon it started (bricks, self-heal) live in the namespace.
            pids = self._netns_pids()
            for pid in pids:  # (a frozen brick, if a test failed with it frozen)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                deadline = time.monotonic() + 5
                while (pids := self._netns_pids()) and time.monotonic() < deadline:
                    time.sleep(0.1)
            if self.glusterd is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.glusterd.wait(5)
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)
        if self._veth_made:
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)
        shutil.rmtree(self.base, ignore_errors=True)

    def _netns_pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True, timeout=30).stdout
        return [int(p) for p in out.split()]

    def mounted(self) -> bool:
        return _mounted(self.mountpoint)

    def leftovers(self) -> list[str]:
        """What of the volume is still there (after ``close``)."""
        left = []
        left += [f"mount {p}" for p in (self.mountpoint, *(p for p, _ in self.other_clients)) if _mounted(p)]
        if Path(f"/run/netns/{self.netns}").exists():
            left.append(f"netns {self.netns}")
        if Path(f"/sys/class/net/{self.host_if}").exists():
            left.append(f"link {self.host_if}")
        for pid in os.listdir("/proc"):
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if cmdline.startswith(("glusterd", "/usr/sbin/gluster", "glusterfs")) and str(self.base) in cmdline:
                    left.append(f"process {pid} {cmdline[:120]!r}")
        return left

    def client_errors(self, most: int = 40) -> list[str]:
        """The client's logged errors and warnings (`` E `` / `` W `` lines), the last ``most``:
        what a call on the mount that failed was answered from, kept before ``close`` removes
        the logs."""
        try:
            lines = (self.base / "log" / "client.log").read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [line for line in lines if "] E [" in line or "] W [" in line][-most:]

    def _log_tail(self, name: str) -> str:
        try:
            return "\n".join((self.base / "log" / name).read_text(errors="replace").splitlines()[-15:])
        except OSError:
            return f"(no {name})"


def _run(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")


def _mounted(path: Path) -> bool:
    """From the mount table: a dead FUSE mount answers no stat (os.path.ismount says False)."""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


def _unmount(path: Path) -> None:
    while _mounted(path):  # (a mount made over a dead one: both go)
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30, check=True)


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
