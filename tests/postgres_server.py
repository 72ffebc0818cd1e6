"""A PostgreSQL server of a test run's own, for the project stores' tests and the apiservers
that share one database.

Debian's ``initdb`` and ``postgres`` (``/usr/lib/postgresql/<version>/bin``) run as the
``postgres`` user when the tests run as root (initdb refuses root), with the data directory and
the unix socket in a temporary directory, listening on 127.0.0.1 on a free port. Durability is
off (no fsync): it is thrown away at the end. ``stop()`` ends every process it started and
removes the directory.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from itertools import count
from pathlib import Path

from dsec.local import free_port

SUPERUSER = "dsec"


def find_postgres() -> Path | None:
    """The directory holding initdb and postgres (the newest Debian version), or None."""
    def version(bin_dir: Path) -> tuple[int, ...]:
        return tuple(int(p) for p in bin_dir.parent.name.split(".") if p.isdigit())

    found = sorted((p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/initdb")), key=version)
    if found:
        return found[-1]
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PostgresServer:
    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.port = 0
        self.dir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self._databases = count()
        self._shared: str | None = None
        # initdb and postgres refuse to run as root.
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            self._as_user = ["setpriv", "--reuid=postgres", "--regid=postgres", "--clear-groups", "--"]

    def _run(self, *args: str) -> None:
        done = subprocess.run([*self._as_user, *args], cwd=self.dir, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({done.returncode}): {done.stdout}{done.stderr}")

    def start(self) -> PostgresServer:
        self.dir = Path(tempfile.mkdtemp(prefix="dsec-test-pg-"))
        try:
            if self._as_user:
                user = pwd.getpwnam("postgres")
                os.chown(self.dir, user.pw_uid, user.pw_gid)
            data = self.dir / "data"
            self._run(str(self.bin_dir / "initdb"), "-D", str(data), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8",
                      "--locale=C", "--no-sync", "--no-instructions")
            self.port = free_port()
            log = open(self.dir / "postgres.log", "ab")  # noqa: SIM115 - handed to the child
            self.proc = subprocess.Popen(
                [*self._as_user, str(self.bin_dir / "postgres"), "-D", str(data), "-k", str(self.dir),
                 "-h", "127.0.0.1", "-p", str(self.port),
                 "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.dir,
                start_new_session=True,  # a Ctrl-C of the tests reaches the tests, which stop it
            )
            log.close()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}: {self.log_tail()}")
            ready = subprocess.run([str(self.bin_dir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)])
            if ready.returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"postgres did not come up in {timeout_s}s: {self.log_tail()}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """The URL of a fresh, empty place for records: a schema of its own (its URL sets the
        ``search_path``) in one shared database; a schema takes milliseconds to make, a
        database a third of a second."""
        name = f"test_{next(self._databases)}"
        if self._shared is None:
            self._psql("postgres", "CREATE DATABASE dsec_test")
            self._shared = "dsec_test"
        self._psql(self._shared, f"CREATE SCHEMA {name}")
        return f"{self.url(self._shared)}?search_path={name}"

    def _psql(self, database: str, command: str) -> None:
        subprocess.run([str(self.bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER,
                        "-d", database, "-qXv", "ON_ERROR_STOP=1", "-c", command],
                       check=True, capture_output=True, timeout=60)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return (self.dir / "postgres.log").read_text()[-n:] if self.dir else ""
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            proc, self.proc = self.proc, None
            # Its children each lead a session of their own (not the server's process group).
            children = _children(proc.pid)
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # fast shutdown: ends the sessions, then the server
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            deadline = time.monotonic() + 10  # a child sees its server gone and exits
            while (alive := [pid for pid in children if _alive(pid)]) and time.monotonic() < deadline:
                time.sleep(0.05)
            for pid in alive:
                os.kill(pid, signal.SIGKILL)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
