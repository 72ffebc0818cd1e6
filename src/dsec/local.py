"""Run ``dsec serve`` as a child process (for the demo, benchmarks and tests), and check that
nothing is left behind afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .images import loopdev
from .resources import cgroups


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalServer:
    """``with LocalServer(state_dir) as server:`` starts ``dsec serve`` and stops it (SIGTERM).
    ``env``: variables set for the server on top of this process's environment."""

    state_dir: Path
    port: int = 0
    extra_args: tuple[str, ...] = ()
    # DSEC_SERVE_START_TIMEOUT_S: a slow machine's (a TCG guest's) first start builds and
    # probes for minutes.
    start_timeout_s: float = field(default_factory=lambda: float(os.environ.get("DSEC_SERVE_START_TIMEOUT_S", "60")))
    env: dict[str, str] | None = None

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir)
        self.port = self.port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.state_dir / "serve.log"
        self._ended = False  # stopped or killed by us, or its exit already reported

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        return (self.state_dir / "token").read_text().strip()

    def start(self) -> LocalServer:
        self._ended = False
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsec", "serve", "--state-dir", str(self.state_dir),
             "--port", str(self.port), *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env} if self.env else None,
        )
        log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._ended = True
                raise RuntimeError(f"dsec serve exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.endpoint}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"dsec serve did not come up in {self.start_timeout_s}s: {self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Stop the server with ``sig``; returns its exit code. A server that had exited on its
        own with an error, or that a SIGTERM did not stop cleanly within
        ``timeout``, raises ``RuntimeError`` with its log's tail, once: a test whose server
        failed fails."""
        if self.proc is None:
            return None
        ended, self._ended = self._ended, True
        if self.proc.poll() is not None:
            code = self.proc.returncode
            if code != 0 and not ended:
                raise RuntimeError(f"dsec serve had exited on its own with {code}: {self.log_tail()}")
            return code
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"dsec serve did not stop within {timeout:g} s of signal {sig}: {self.log_tail()}") from None
        # (uvicorn ends a clean shutdown by raising the signal again: -SIGTERM is clean too, and
        # on uvloop it exits with the signal's number)
        if sig == signal.SIGTERM and code not in (0, -signal.SIGTERM, signal.SIGTERM):
            raise RuntimeError(f"dsec serve exited with {code} on SIGTERM: {self.log_tail()}")
        return code

    def kill(self) -> None:
        """Die without any cleanup, as a crash would."""
        self.stop(signal.SIGKILL)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""

    def stop_sandboxes(self) -> None:
        """Stop every sandbox the server lists (those it cannot stop are left; the caller's
        leftovers check sees them)."""
        asyncio.run(self.stop_sandboxes_async())

    async def stop_sandboxes_async(self) -> None:
        """``stop_sandboxes`` from a running event loop."""
        from libdsec import DSecClient, DSecError

        if self.proc is None or self.proc.poll() is not None:
            return  # not running: nobody to ask (a client would retry its way to giving up)
        try:
            async with DSecClient(self.endpoint, token=self.token) as client:
                for info in await client.list_sandboxes():
                    try:
                        await (await client.get_sandbox(info.id)).stop()
                    except DSecError:
                        pass
        except (DSecError, OSError):
            pass

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serving(state_dir: Path, *extra_args: str, env: dict[str, str] | None = None) -> Iterator[LocalServer]:
    """A ``dsec serve`` on ``state_dir`` for a block (``env``: variables of its own); on the way
    out it is stopped, the state dir removed, and anything the server left behind is an error."""
    server = LocalServer(state_dir, extra_args=extra_args, env=env).start()
    try:
        yield server
    finally:
        server.stop()
        left = leftovers(state_dir)
        shutil.rmtree(state_dir, ignore_errors=True)
    if left:
        raise AssertionError(f"left behind: {left}")


def persisted_record(state_dir: Path, sandbox_id: str) -> dict:
    """A sandbox's record as the edge of ``dsec serve --state-dir state_dir`` keeps it."""
    from .edge import journal

    text = journal.read(Path(state_dir) / "node" / "run" / "records").get(sandbox_id)
    if text is None:
        raise LookupError(f"no record of {sandbox_id} under {state_dir}")
    return json.loads(text)


def _ancestors() -> set[int]:
    """This process's pid and its ancestors' (up to init)."""
    found, pid = set(), os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return found


def leftovers(state_dir: Path, settle_s: float = 5.0) -> list[str]:
    """What a stopped server left on the host: sandbox processes, mounts, cgroups, bundles.

    Killed processes take a moment to exit and be reaped: look again for up to ``settle_s``."""
    deadline = time.monotonic() + settle_s
    while (found := _leftovers(state_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _leftovers(state_dir: Path) -> list[str]:
    state_dir = Path(state_dir).resolve()
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = line.split()[4]
            if target.startswith(str(state_dir) + "/"):
                found.append(f"mount {target}")
    # Loop devices of layers (DSEC_LAYER_ATTACH=loop, or a kernel before 6.12) whose files are
    # under the state dir: a store it only links to may be another's, and is not looked at.
    found += [f"loop device /dev/{name} on {path}" for name, path in loopdev.backed_by(state_dir).items()]
    node = state_dir / "node"
    for sub in ("run", "layers", "records"):
        d = node / sub
        if d.is_dir():
            found += [f"{sub} entry {p}" for p in d.iterdir()]
    parent = cgroups.parent_for(state_dir)
    hierarchies = [cgroups.CGROUP_ROOT] if cgroups.is_v2() else list(cgroups.CGROUP_ROOT.iterdir())
    for p in (parent, f"{parent}-microvm", f"{parent}-fullvm"):  # containers', VMs' (see backends.vm)
        found += [f"cgroup {d}" for d in cgroups.sandbox_cgroup_dirs(p)]
        found += [f"parent cgroup {h / p}" for h in hierarchies if (h / p).is_dir()]
    inside = str(state_dir) + "/"
    ours = _ancestors()  # this process and what started it (a `timeout` or shell naming the state dir)
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) in ours:
            continue
        try:
            cgroup = Path(f"/proc/{pid}/cgroup").read_text()
            state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue
        if state == "Z" and ppid == str(os.getpid()):
            # A sandbox init orphaned by a stopped server, re-parented to us as a subreaper.
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(pid), os.WNOHANG)
            continue
        if state == "Z" and ppid == "1":
            continue  # exited, and the host's init is to reap it (some reap only now and then)
        if f"/{parent}/" in cgroup:
            found.append(f"process {pid} ({state}) in cgroup {parent}")
            continue
        # Sandbox processes outside the cgroups (a failed cgroup set-up), and the server or a
        # crun that runs on this state dir.
        try:
            root = os.readlink(f"/proc/{pid}/root")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if root.startswith(inside) or inside in cmdline or f"{state_dir} " in cmdline:
            found.append(f"process {pid} ({state}) {cmdline.strip()[:200]!r} rooted in {root}")
    return found
