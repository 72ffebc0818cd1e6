"""The e2b SDK's sync ``Sandbox`` against DSec: every call of the compatibility list, errors too."""

from __future__ import annotations

import os
import time
import uuid

import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)
from e2b.sandbox.filesystem.filesystem import FileType
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

from conftest import TEMPLATE


def test_create_with_template_timeout_envs_metadata_then_list_get_and_kill():
    tag = uuid.uuid4().hex
    sb = Sandbox.create(template=TEMPLATE, timeout=120, envs={"GREETING": "hi there"},
                        metadata={"run": tag, "team": "a"})
    try:
        assert sb.commands.run("echo $GREETING").stdout == "hi there\n"
        info = sb.get_info()
        assert info.sandbox_id == sb.sandbox_id and info.template_id == TEMPLATE
        assert info.metadata == {"run": tag, "team": "a"}
        # E2B's timeout is DSec's idle TTL: it ends 120 s after the last call
        assert 100 < (info.end_at - info.started_at).total_seconds() < 200
        found = Sandbox.list(query=SandboxQuery(metadata={"run": tag})).next_items()
        assert [s.sandbox_id for s in found] == [sb.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"run": "other"})).next_items() == []
        assert sb.is_running()
    finally:
        assert sb.kill() is True
    assert not Sandbox.list(query=SandboxQuery(metadata={"run": tag})).next_items()
    assert Sandbox.kill(sb.sandbox_id) is False  # gone: E2B's not found
    with pytest.raises(NotFoundException):
        Sandbox.connect(sb.sandbox_id)


def test_create_with_no_arguments_uses_the_base_template():
    with Sandbox.create() as sb:
        assert sb.get_info().template_id == "base"
        assert sb.commands.run("python3 -c 'print(6 * 7)'").stdout == "42\n"


def test_set_timeout_pause_and_connect_resumes():
    sb = Sandbox.create(template=TEMPLATE, timeout=60)
    try:
        sb.files.write("/root/kept.txt", "before the pause")
        before = sb.get_info().end_at
        sb.set_timeout(600)
        assert (sb.get_info().end_at - before).total_seconds() > 500
        sb.pause()
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert sb.sandbox_id in [s.sandbox_id for s in paused]
        assert Sandbox.get_info(sb.sandbox_id).state == SandboxState.PAUSED
        again = Sandbox.connect(sb.sandbox_id)  # resumes it
        assert again.get_info().state == SandboxState.RUNNING
        assert again.files.read("/root/kept.txt") == "before the pause"
        assert again.commands.run("echo back").stdout == "back\n"
    finally:
        sb.kill()


def test_run_in_the_foreground_with_streamed_output(sandbox):
    seen: list[tuple[str, str, float]] = []
    start = time.monotonic()
    result = sandbox.commands.run(
        "echo first; sleep 0.6; echo second >&2; echo third",
        on_stdout=lambda s: seen.append(("out", s, time.monotonic() - start)),
        on_stderr=lambda s: seen.append(("err", s, time.monotonic() - start)))
    assert (result.exit_code, result.stdout, result.stderr) == (0, "first\nthird\n", "second\n")
    assert "".join(s for k, s, _ in seen if k == "out") == "first\nthird\n"
    assert [s for k, s, _ in seen if k == "err"] == ["second\n"]
    assert seen[0][1] == "first\n" and seen[0][2] < 0.5, seen  # as it was written


def test_envs_cwd_user_and_exit_codes(sandbox):
    result = sandbox.commands.run("pwd; echo $ONE; whoami", envs={"ONE": "1"}, cwd="/tmp", user="root")
    assert result.stdout == "/tmp\n1\nroot\n"
    with pytest.raises(CommandExitException) as e:
        sandbox.commands.run("echo out; echo err >&2; exit 3")
    assert (e.value.exit_code, e.value.stdout, e.value.stderr) == (3, "out\n", "err\n")
    # stdin is /dev/null unless asked for
    assert sandbox.commands.run("cat; echo done", timeout=10).stdout == "done\n"


def test_a_command_past_its_timeout_is_killed(sandbox):
    start = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 30; echo never", timeout=1)
    assert time.monotonic() - start < 10
    deadline = time.monotonic() + 5
    while any("sleep 30" in " ".join(p.args) for p in sandbox.commands.list()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any("sleep 30" in " ".join(p.args) for p in sandbox.commands.list())


def test_background_list_send_stdin_connect_and_kill(sandbox):
    reader = sandbox.commands.run("read line; echo got $line", background=True, stdin=True)
    listed = {p.pid: p for p in sandbox.commands.list()}
    assert reader.pid in listed and listed[reader.pid].cmd == "/bin/bash"
    assert listed[reader.pid].args[-1] == "read line; echo got $line"
    sandbox.commands.send_stdin(reader.pid, "hello\n")
    assert reader.wait().stdout == "got hello\n"

    later = sandbox.commands.run("sleep 1; echo late", background=True)
    assert sandbox.commands.connect(later.pid).wait().stdout == "late\n"

    sleeper = sandbox.commands.run("sleep 60", background=True)
    assert sandbox.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException):
        sleeper.wait()
    assert sleeper.pid not in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(sleeper.pid) is False  # gone
    with pytest.raises(NotFoundException):
        sandbox.commands.connect(999_999)


def test_a_disconnected_command_runs_on_and_can_be_killed(sandbox):
    # As under envd (E2B Desktop starts Xvfb and xfce4 so): the client goes, the command stays,
    # and what it writes after is taken (xfce4-session, its output's reader gone, ended on SIGPIPE).
    writer = sandbox.commands.run("sleep 1; seq 100000; echo done > /tmp/after; exec sleep 60", background=True)
    writer.disconnect()
    for _ in range(100):
        if sandbox.files.exists("/tmp/after"):
            break
        time.sleep(0.1)
    assert sandbox.files.read("/tmp/after") == "done\n"
    assert writer.pid in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(writer.pid) is True
    for _ in range(50):
        if writer.pid not in [p.pid for p in sandbox.commands.list()]:
            break
        time.sleep(0.1)
    assert writer.pid not in [p.pid for p in sandbox.commands.list()]


def test_files(sandbox):
    sandbox.files.write("/root/f/a.txt", "alpha")  # the parents are made
    sandbox.files.write("/root/f/b.bin", b"\x00\x01\xff")
    assert sandbox.files.read("/root/f/a.txt") == "alpha"
    assert sandbox.files.read("/root/f/b.bin", format="bytes") == b"\x00\x01\xff"
    assert sandbox.files.read("f/a.txt") == "alpha"  # relative: from the user's home
    entries = {e.name: e for e in sandbox.files.list("/root/f")}
    assert set(entries) == {"a.txt", "b.bin"} and entries["a.txt"].type == FileType.FILE
    assert entries["a.txt"].size == 5 and entries["a.txt"].path == "/root/f/a.txt"
    info = sandbox.files.get_info("/root/f")
    assert info.type == FileType.DIR and info.permissions.startswith("d")
    assert sandbox.files.exists("/root/f/a.txt") and not sandbox.files.exists("/root/f/none")
    assert sandbox.files.make_dir("/root/f/sub/deeper") is True
    assert sandbox.files.make_dir("/root/f/sub/deeper") is False  # there already
    moved = sandbox.files.rename("/root/f/a.txt", "/root/f/sub/a2.txt")
    assert moved.path == "/root/f/sub/a2.txt" and not sandbox.files.exists("/root/f/a.txt")
    deep = {e.path for e in sandbox.files.list("/root/f", depth=3)}
    assert {"/root/f/sub", "/root/f/sub/a2.txt", "/root/f/sub/deeper"} <= deep
    sandbox.files.remove("/root/f")
    assert not sandbox.files.exists("/root/f")
    with pytest.raises(NotFoundException):
        sandbox.files.read("/root/f/sub/a2.txt")
    with pytest.raises(NotFoundException):
        sandbox.files.get_info("/no/such/file")


def test_watch_dir(sandbox):
    sandbox.files.make_dir("/root/watched")
    handle = sandbox.files.watch_dir("/root/watched")
    try:
        sandbox.files.write("/root/watched/new.txt", "x")
        events = handle.get_new_events()  # as envd's inotify tells a new file written: three
        assert [(e.type, e.name) for e in events] == [
            (FilesystemEventType.CREATE, "new.txt"), (FilesystemEventType.CHMOD, "new.txt"),
            (FilesystemEventType.WRITE, "new.txt")]
        sandbox.files.rename("/root/watched/new.txt", "/root/watched/old.txt")
        sandbox.files.remove("/root/watched/old.txt")
        assert [(e.type, e.name) for e in handle.get_new_events()] == [
            (FilesystemEventType.RENAME, "new.txt"), (FilesystemEventType.CREATE, "old.txt"),
            (FilesystemEventType.REMOVE, "old.txt")]
    finally:
        handle.stop()
    # Recursive: a folder made after the watch is watched too.
    handle = sandbox.files.watch_dir("/root/watched", recursive=True)
    try:
        sandbox.files.make_dir("/root/watched/nested")
        sandbox.files.write("/root/watched/nested/f.txt", "y")
        assert (FilesystemEventType.WRITE, "nested/f.txt") in [(e.type, e.name) for e in handle.get_new_events()]
    finally:
        handle.stop()
    with pytest.raises(NotFoundException):
        sandbox.files.watch_dir("/root/not-there")


def test_metrics(sandbox):
    metrics = sandbox.get_metrics()
    assert len(metrics) >= 1
    last = metrics[-1]
    assert last.cpu_count >= 1 and last.mem_total == 512 * 1024 * 1024
    assert last.disk_total > 0 and 0 <= last.cpu_used_pct <= 100


def test_network_options():
    with Sandbox.create(template=TEMPLATE, allow_internet_access=False) as sb:
        assert sb.commands.run("echo offline").stdout == "offline\n"
    # (the SDK raises a create's 400 as a plain SandboxException)
    with pytest.raises(SandboxException, match="^400: .*not address ranges"):
        Sandbox.create(template=TEMPLATE, network={"allow_out": ["10.0.0.0/8"]})
    with pytest.raises(SandboxException, match="^400: .*unknown service 'nosuchmirror'"):
        Sandbox.create(template=TEMPLATE, network={"allow_out": ["nosuchmirror"]})
    with Sandbox.create(template=TEMPLATE) as sb:
        sb.update_network({"deny_out": ["0.0.0.0/0"]})  # what DSec denies anyway
        with pytest.raises(SandboxException, match="not address ranges"):
            sb.update_network({"allow_out": ["192.168.0.0/16"]})


def test_errors():
    with pytest.raises(SandboxException, match="template 'no-such-template' not found"):
        Sandbox.create(template="no-such-template")
    with pytest.raises(NotFoundException):
        Sandbox.connect("n0-0000000000000000")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="e2b_" + "0" * 40).next_items()
    assert os.environ["E2B_API_KEY"].startswith("e2b_")


def test_pty_create_type_resize_connect_and_kill(sandbox):
    from e2b import CommandExitException, InvalidArgumentException, SandboxException
    from e2b.sandbox.commands.command_handle import PtySize

    terminal = sandbox.pty.create(PtySize(rows=30, cols=100), envs={"ABC": "123"}, cwd="/tmp")
    sandbox.pty.send_stdin(terminal.pid, b"tty; echo $ABC-$PWD; stty size; exit 3\n")
    output: list[bytes] = []
    with pytest.raises(CommandExitException) as exited:
        terminal.wait(on_pty=output.append)
    text = b"".join(output).decode()
    assert exited.value.exit_code == 3
    assert "/dev/pts/" in text and "123-/tmp" in text and "\n30 100\r" in text, text

    terminal = sandbox.pty.create(PtySize(rows=24, cols=80))
    sandbox.pty.send_stdin(terminal.pid, b"echo one-$((40 + 1))\n")
    terminal.disconnect()  # the PTY stays open
    again = sandbox.pty.connect(terminal.pid)
    assert again.pid == terminal.pid
    sandbox.pty.resize(terminal.pid, PtySize(rows=40, cols=120))
    sandbox.pty.send_stdin(terminal.pid, b"echo two-$((40 + 2)); stty size; exit\n")
    output = []
    assert again.wait(on_pty=output.append).exit_code == 0
    text = b"".join(output).decode()  # (one-41 may have been read by the first stream)
    assert "two-42" in text and "\n40 120\r" in text, text

    terminal = sandbox.pty.create(PtySize(rows=24, cols=80))
    with pytest.raises(InvalidArgumentException, match="bad PTY size 0x0"):
        sandbox.pty.resize(terminal.pid, PtySize(rows=0, cols=0))
    with pytest.raises(SandboxException, match="not a PTY"):
        sandbox.pty.resize(1, PtySize(rows=24, cols=80))
    assert sandbox.pty.kill(terminal.pid)
    with pytest.raises(CommandExitException) as killed:
        terminal.wait()
    assert killed.value.exit_code == 137  # SIGKILL
    with pytest.raises(NotFoundException):
        sandbox.pty.send_stdin(terminal.pid, b"echo too late\n")
    with pytest.raises(NotFoundException):
        sandbox.pty.resize(terminal.pid, PtySize(rows=24, cols=80))
    assert not sandbox.pty.kill(terminal.pid)
    with pytest.raises(InvalidArgumentException, match="bad PTY size"):
        sandbox.pty.create(PtySize(rows=0, cols=80))

    terminal = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=1)  # the PTY's timeout: killed past it
    with pytest.raises(TimeoutException):
        terminal.wait()
    deadline = time.monotonic() + 5  # (killed as the stream ends: the SDK may have hung up first)
    while time.monotonic() < deadline:
        try:
            sandbox.pty.send_stdin(terminal.pid, b"")
        except NotFoundException:
            break
        time.sleep(0.2)
    assert not sandbox.pty.kill(terminal.pid)


def test_signed_file_urls_need_no_key_and_expire(sandbox):
    """download_url / upload_url as E2B's own tests use them: fetched with no key, the
    signature checked against the sandbox's envd token; expired or altered, a 401."""
    import json
    import urllib.error
    import urllib.request

    import httpx

    sandbox.files.write("/root/signed.txt", "This file will be fetched.")
    for url in (sandbox.download_url("/root/signed.txt"), sandbox.download_url("/root/signed.txt", None, 120)):
        with urllib.request.urlopen(url) as answer:
            assert answer.status == 200 and answer.read() == b"This file will be fetched."
    expired = sandbox.download_url("/root/signed.txt", use_signature_expiration=-120)
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(expired)
    assert caught.value.code == 401
    assert json.loads(caught.value.read()) == {"code": 401, "message": "signature is already expired"}
    altered = sandbox.download_url("/root/signed.txt").replace("signed.txt", "other.txt")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(altered)
    assert caught.value.code == 401 and json.loads(caught.value.read())["message"] == "invalid signature"
    # An upload link: a multipart POST, no key.
    answer = httpx.post(sandbox.upload_url("/root/uploaded.txt"), files={"file": ("uploaded.txt", b"up it goes")})
    assert answer.status_code == 200, answer.text
    assert sandbox.files.read("/root/uploaded.txt") == "up it goes"
    # A read link does not write.
    answer = httpx.post(sandbox.download_url("/root/uploaded.txt"), files={"file": ("x", b"no")})
    assert answer.status_code == 401
    # No signature at all: refused, naming what is missing.
    bare = sandbox.download_url("/root/uploaded.txt").split("&signature=")[0]
    answer = httpx.get(bare)
    assert answer.status_code == 401 and "signature" in answer.json()["message"]


def test_a_command_killed_with_its_sandbox_says_the_sandbox_went():
    """envd's stream breaks off when its sandbox is killed, and the SDK's health probe then says
    the sandbox is gone (not a command that exited with code 1)."""
    sb = Sandbox.create(template=TEMPLATE, timeout=60)
    cmd = sb.commands.run("sleep 60", background=True)
    sb.kill()
    with pytest.raises(TimeoutException) as caught:
        cmd.wait()
    # (the newer SDKs ask the sandbox's health and say it was killed; 2.45 reads any broken
    # stream as the sandbox's timeout)
    assert "killed" in str(caught.value) or "likely due to sandbox timeout" in str(caught.value)


def test_file_metadata_and_watch_entries(sandbox):
    """envd 0.6.x's file metadata (``user.e2b.*`` attributes: written with a file, shown by
    get_info, list and rename, cleared by a write without it, set by hand inside) and the entry
    a watch event carries with ``include_entry``. e2b 2.45 has neither: nothing to try there."""
    import inspect

    if "metadata" not in inspect.signature(sandbox.files.write).parameters:
        return  # (the older SDK: DSec's envd version makes it refuse these itself)
    from e2b.exceptions import InvalidArgumentException

    info = sandbox.files.write("/root/meta.txt", "m", metadata={"author": "mish", "purpose": "upload"})
    assert info.metadata == {"author": "mish", "purpose": "upload"}
    assert sandbox.files.get_info("/root/meta.txt").metadata == {"author": "mish", "purpose": "upload"}
    listed = {e.name: e.metadata for e in sandbox.files.list("/root")}
    assert listed["meta.txt"] == {"author": "mish", "purpose": "upload"}
    assert sandbox.files.rename("/root/meta.txt", "/root/moved.txt").metadata == {"author": "mish", "purpose": "upload"}
    octet = sandbox.files.write("/root/octet.txt", "o", metadata={"k": "v"}, use_octet_stream=True)
    assert octet.metadata == {"k": "v"} and sandbox.files.get_info("/root/octet.txt").metadata == {"k": "v"}
    assert sandbox.files.write("/root/moved.txt", "again").metadata is None  # a write without it clears it
    assert sandbox.files.get_info("/root/moved.txt").metadata is None
    sandbox.commands.run("python3 -c \"import os; os.setxattr('/root/moved.txt', 'user.e2b.by', b'hand')\"")
    assert sandbox.files.get_info("/root/moved.txt").metadata == {"by": "hand"}
    with pytest.raises(InvalidArgumentException):
        sandbox.files.write("/root/bad.txt", "x", metadata={"bad key": "v"})  # (the SDK's own check)
    assert not sandbox.files.exists("/root/bad.txt")
    sandbox.files.make_dir("/root/w2")
    handle = sandbox.files.watch_dir("/root/w2", include_entry=True)
    try:
        sandbox.files.write("/root/w2/f.txt", "x", metadata={"t": "1"})
        writes = [e for e in handle.get_new_events() if e.type == FilesystemEventType.WRITE and e.name == "f.txt"]
        assert writes and writes[0].entry is not None
        assert (writes[0].entry.path, writes[0].entry.type, writes[0].entry.metadata) == (
            "/root/w2/f.txt", FileType.FILE, {"t": "1"})
    finally:
        handle.stop()
