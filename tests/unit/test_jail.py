"""dsec-jail on the host: each layer it applies, its errors, and the seccomp program it loads."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dsec.isolation import jail

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the jail drops what root has")


@pytest.fixture(scope="module")
def jail_bin(tmp_path_factory) -> Path:
    return jail.jail_binary(tmp_path_factory.mktemp("jail"))


def run(jail_bin: Path, *args: str, script: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(jail_bin), *args, "--", "/bin/sh", "-c", script],
                          capture_output=True, text=True, timeout=30)


def test_built_once_per_source(jail_bin):
    assert jail.jail_binary(jail_bin.parent) == jail_bin
    assert jail_bin.name == f"dsec-jail-{jail.source_digest()}"
    assert [p.name for p in jail_bin.parent.iterdir()] == [jail_bin.name]  # no temporary left


def test_landlock_paths(jail_bin, tmp_path):
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "secret").write_text("s")
    (tmp_path / "hidden" / "tool").write_text("t")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "f").write_text("r")
    (tmp_path / "free").mkdir()
    r = run(jail_bin, "--hide", f"{tmp_path}/hidden", "--ro", f"{tmp_path}/hidden/tool", "--ro", f"{tmp_path}/ro",
            "--ro", "/proc", script=f"cd {tmp_path}; cat hidden/secret; echo rc=$?; cat hidden/tool; echo; "
                                    "echo x > ro/f; echo rc=$?; cat ro/f; echo; echo y > free/g && cat free/g; "
                                    "ls hidden | wc -l; echo z > /proc/self/comm; echo rc=$?")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["rc=1", "t", "rc=2", "r", "y", "2", "rc=2"], r
    assert "Permission denied" in r.stderr


def test_scope_signal(jail_bin):
    outside = subprocess.Popen(["sleep", "30"])
    try:
        r = run(jail_bin, "--scope", script=f"kill {outside.pid}; echo out=$?; sleep 30 & kill $!; echo own=$?")
        assert r.stdout.split() == ["out=1", "own=0"], r
        assert outside.poll() is None
    finally:
        outside.kill()
        outside.wait()


def test_caps_no_new_privs_fds_and_seccomp(jail_bin, tmp_path):
    bpf = tmp_path / "profile.bpf"
    bpf.write_bytes(jail.seccomp_bpf())
    extra = os.open("/dev/null", os.O_RDONLY)  # inherited, not close-on-exec
    try:
        r = subprocess.run([str(jail_bin), "--caps", jail.caps_argument(), "--seccomp", str(bpf), "--",
                            "/bin/sh", "-c", "grep -E '^(CapEff|CapBnd|CapAmb|NoNewPrivs)' /proc/self/status; "
                            "ls /proc/self/fd | sort -n | tr '\\n' ' '; echo; unshare -U true; echo rc=$?"],
                           capture_output=True, text=True, timeout=30, pass_fds=(extra,))
    finally:
        os.close(extra)
    keep = sum(1 << int(n) for n in jail.caps_argument().split(","))
    fields = dict(line.split(":\t") for line in r.stdout.splitlines() if ":\t" in line)
    assert int(fields["CapEff"], 16) == keep and int(fields["CapBnd"], 16) == keep, r
    assert int(fields["CapAmb"], 16) == 0 and fields["NoNewPrivs"] == "1"
    assert r.stdout.splitlines()[4].split() == ["0", "1", "2", "3"]  # 3: ls's own directory
    assert "rc=1" in r.stdout  # unshare: EPERM from the profile


def test_shared_pid_namespace(jail_bin, tmp_path):
    (tmp_path / "f").write_text("kept")
    init = int(subprocess.run([str(jail_bin), "--ro", str(tmp_path), "--init"], capture_output=True, text=True,
                              check=True).stdout)
    try:
        # --ro with --init: a read-only bind mount in the commands' mount namespace.
        r = run(jail_bin, "--join", str(init), script=f"python3 -c 'import os; os.truncate(\"{tmp_path}/f\", 0)'")
        assert r.returncode == 1 and "Read-only file system" in r.stderr, r
        assert (tmp_path / "f").read_text() == "kept"
        r = run(jail_bin, "--join", str(init), script="echo $$; sleep 30 >/dev/null 2>&1 & echo started")
        assert r.stdout.split()[1] == "started" and int(r.stdout.split()[0]) > 1
        # The next command sees the first one's process, not this test's; pid 1 is the init.
        r = run(jail_bin, "--join", str(init), script="ps -e -o pid=,comm= | tr -s ' ' | tr '\\n' ';'; exit 7")
        assert r.returncode == 7
        procs = dict(p.strip().split(" ", 1) for p in r.stdout.split(";") if p.strip())
        assert procs["1"].startswith("dsec-jail")
        assert "sleep" in procs.values() and "pytest" not in " ".join(procs.values())
    finally:
        os.kill(init, 9)
        if _is_child(init):  # (when this process is a subreaper)
            os.waitpid(init, 0)


def _is_child(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    except OSError:
        return False


@pytest.mark.parametrize("args, message", [
    (["--bogus", "--", "true"], "unknown or incomplete option --bogus"),
    (["--ro", "relative", "--", "true"], "absolute path"),
    (["--ro", "/tmp/"], "absolute path"),
    (["--caps", "1,x", "--", "true"], "capability numbers"),
    (["--seccomp", "/nonexistent", "--", "true"], "cannot open the seccomp program"),
    (["--"], "no command given"),
    (["--rw", "/tmp", "--init"], "--init takes only --ro paths"),
    (["--user", "1000", "--", "true"], "--user wants UID:GID"),
    (["--user", "x:1", "--", "true"], "--user wants UID:GID"),
    (["--user", "1:2:3", "--", "true"], "--user wants UID:GID"),
])
def test_bad_arguments(jail_bin, args, message):
    r = subprocess.run([str(jail_bin), *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 125 and message in r.stderr, r


def test_missing_command(jail_bin):
    r = subprocess.run([str(jail_bin), "--", "/nonexistent"], capture_output=True, text=True)
    assert r.returncode == 127 and "cannot run /nonexistent" in r.stderr


def test_cwd_user_and_environment(jail_bin, tmp_path):
    """--cwd and --user come after the rest (a VM guest's commands get them from the jail): the
    command starts in the directory, as the uid and gid without supplementary groups and, not
    being root, with no capabilities; it has the jail's environment and nothing else."""
    work = tmp_path / "a dir"
    work.mkdir()
    r = subprocess.run([str(jail_bin), "--caps", jail.caps_argument(), "--cwd", str(work), "--user", "1234:99", "--",
                        "/bin/sh", "-c", "pwd; id -u; id -g; id -G; grep CapEff /proc/self/status; env"],
                       capture_output=True, text=True, timeout=30, env={"ONLY": "it's\nhere"})
    assert r.returncode == 0, r
    lines = r.stdout.splitlines()
    assert lines[:4] == [str(work), "1234", "99", "99"], r.stdout
    assert lines[4].split() == ["CapEff:", "0000000000000000"], r.stdout
    names = {line.split("=", 1)[0] for line in lines[5:] if "=" in line}
    assert "ONLY=it's\nhere" in r.stdout and names <= {"ONLY", "PWD", "SHLVL", "OLDPWD", "_"}, r.stdout
    # Root keeps the capability set it was given.
    r = subprocess.run([str(jail_bin), "--caps", jail.caps_argument(), "--user", "0:0", "--",
                        "/bin/sh", "-c", "grep CapEff /proc/self/status"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.split()[1] != "0000000000000000", r


def test_cwd_that_is_not_there(jail_bin, tmp_path):
    r = subprocess.run([str(jail_bin), "--cwd", str(tmp_path / "gone"), "--", "/bin/true"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "cannot change to" in r.stderr, r
