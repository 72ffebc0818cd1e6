"""What an agent does inside a sandbox, through the SDK against a real ``dsec serve``:
streamed output (callbacks and an iterator), backpressure, leaving a stream early."""

from __future__ import annotations

import asyncio
import time

import pytest

from libdsec import CommandTimeout, DSecContainerRunArgs, SandboxNotFound, SyncDSecClient

pytestmark = [pytest.mark.slow, pytest.mark.root]


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(**{"container_image": "busybox", "memory_limit_mb": 64, **kw})


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def test_run_shell_with_callbacks_and_stream_shell(client):
    async with await client.run_container(args()) as sandbox:
        seen: list[tuple[str, str, float]] = []
        start = time.perf_counter()

        async def on_stderr(text: str) -> None:
            seen.append(("err", text, time.perf_counter() - start))

        result = await sandbox.run_shell(
            "echo first; sleep 1; echo second >&2; echo third", max_output_bytes=8,
            on_stdout=lambda text: seen.append(("out", text, time.perf_counter() - start)), on_stderr=on_stderr)
        assert result.exit_code == 0 and result.stdout == "first\nth" and result.stdout_truncated
        assert "".join(t for k, t, _ in seen if k == "out") == "first\nthird\n"
        assert "".join(t for k, t, _ in seen if k == "err") == "second\n"
        assert seen[0][1] == "first\n" and seen[0][2] < 0.8, seen  # as written, not at the end

        events = [e async for e in sandbox.stream_shell("echo a; echo b >&2; exit 4")]
        assert [(e.event, e.data) for e in events[:-1]] == [("stdout", "a\n"), ("stderr", "b\n")]
        assert events[-1].event == "exit" and events[-1].result.exit_code == 4

        with pytest.raises(CommandTimeout):
            async for _ in sandbox.stream_shell("echo x; sleep 30", timeout=1):
                pass


async def test_a_slow_reader_slows_the_command_not_the_server(client, server):
    async with await client.run_container(args()) as sandbox:
        before = rss_bytes(server.proc.pid)
        got = 0
        began = time.perf_counter()
        async for event in sandbox.stream_shell("yes", timeout=60, max_output_bytes=1024):
            got += len(event.data)
            await asyncio.sleep(0.05)  # ~ a few MB/s at most
            if time.perf_counter() - began > 4:
                break  # leaving the loop kills the command
        grown = rss_bytes(server.proc.pid) - before
        assert got > 0 and grown < 32 << 20, (got, grown)
        # `yes` is gone with the stream; the sandbox serves on.
        for _ in range(50):
            ps = await sandbox.run_shell("ps -o comm | grep -c '^yes' || true")
            if ps.stdout.strip() == "0":
                break
            await asyncio.sleep(0.1)
        assert ps.stdout.strip() == "0", ps


def test_the_sync_twin_streams(server):
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        with client.run_container(args()) as sandbox:
            events = list(sandbox.stream_shell("echo one; echo two"))
            assert "".join(e.data for e in events if e.event == "stdout") == "one\ntwo\n"
            lines: list[str] = []
            assert sandbox.run_shell("echo cb", on_stdout=lines.append).stdout == "cb\n" and lines == ["cb\n"]
            with pytest.raises(SandboxNotFound):
                list(client.get_sandbox(sandbox.id[:-4] + "0000").stream_shell("true"))


async def test_background_processes(client):
    import signal

    from libdsec import ProcessNotFound, SandboxStateError

    async with await client.run_container(args()) as sandbox:
        proc = await sandbox.start_shell("echo ready; while read line; do echo \"got $line\"; done; echo bye >&2; exit 7",
                                         env={"X": "1"}, workdir="/tmp")
        assert proc.pid > 1 and proc.info.running
        await proc.send_stdin("one\n")
        await proc.send_stdin(b"two\n")
        seen = ""
        async for event in proc.stream():
            seen += event.data
            if "got two" in seen:
                break  # the process runs on
        assert seen == "ready\ngot one\ngot two\n"
        [listed] = await sandbox.list_processes()
        assert listed.pid == proc.pid and listed.running and listed.stdout_bytes == len(seen)
        # Another client finds it and streams what follows.
        other = await sandbox.connect_process(proc.pid)
        await proc.close_stdin()
        rest = [e async for e in other.stream()]
        assert [(e.event, e.data) for e in rest[:-1]] == [("stderr", "bye\n")]
        assert rest[-1].event == "exit" and rest[-1].result.exit_code == 7
        assert (await proc.wait()).exit_code == 7
        with pytest.raises(SandboxStateError, match="has exited"):
            await proc.send_stdin("late\n")
        with pytest.raises(SandboxStateError, match="has exited"):
            await proc.signal(signal.SIGTERM)
        # Not a pid DSec started there (pid 1 is the sandbox's init): refused, named.
        with pytest.raises(ProcessNotFound, match="no background process 1 "):
            await (await sandbox.connect_process(proc.pid))._sandbox.connect_process(1)
        # SIGINT reaches it as Ctrl-C would; kill() ends what ignores it.
        sleeper = await sandbox.start_shell("trap 'echo int; exit 130' INT; while :; do sleep 0.1; done")
        await asyncio.sleep(0.3)
        await sleeper.signal(signal.SIGINT)
        assert (await sleeper.wait(timeout=10)).exit_code == 130
        stubborn = await sandbox.start_shell("trap '' INT TERM; sleep 1000")
        with pytest.raises(CommandTimeout, match="still runs"):
            await stubborn.wait(timeout=0.5)
        async with stubborn:  # killed on the way out
            pass
        assert (await stubborn.wait(timeout=10)).exit_code == 137
        assert {p.pid for p in await sandbox.list_processes()} == {proc.pid, sleeper.pid, stubborn.pid}


def test_the_sync_twin_runs_background_processes(server):
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        with client.run_container(args()) as sandbox:
            with sandbox.start_shell("cat") as proc:
                proc.send_stdin("echoed\n")
                proc.close_stdin()
                assert "".join(e.data for e in proc.stream() if e.event == "stdout") == "echoed\n"
                assert proc.wait().exit_code == 0


async def test_sessions_keep_their_state(client):
    from libdsec import SessionClosed

    async with await client.run_container(args()) as sandbox:
        await sandbox.run_shell("mkdir -p /repo/env/bin && printf 'export VIRTUAL_ENV=/repo/env\\n"
                                "PATH=/repo/env/bin:$PATH\\n' > /repo/env/bin/activate && "
                                "printf '#!/bin/sh\\necho venv' > /repo/env/bin/python && chmod +x /repo/env/bin/python")
        async with await sandbox.open_session(workdir="/tmp", env={"B": "2"}) as session:
            first = await session.run_shell("pwd; cd /repo && export A=1 && . env/bin/activate; echo $B")
            assert (first.exit_code, first.stdout) == (0, "/tmp\n2\n")
            later = await session.run_shell("pwd; echo $A; which python; python; echo oops >&2; false")
            assert (later.exit_code, later.stdout, later.stderr) == (1, "/repo\n1\n/repo/env/bin/python\nvenv\n", "oops\n")
            # Syntax errors and a command's stdin do not break the shell.
            bad = await session.run_shell("if then fi")
            assert bad.exit_code == 2 and "syntax error" in bad.stderr
            assert (await session.run_shell("cat; echo read-nothing")).stdout == "read-nothing\n"
            # Streamed, as run_shell's.
            lines: list[str] = []
            streamed = await session.run_shell("echo a; sleep 0.3; echo b", on_stdout=lines.append)
            assert streamed.stdout == "a\nb\n" and "".join(lines) == "a\nb\n"
            # Past its timeout: interrupted as Ctrl-C would, and the session goes on.
            with pytest.raises(CommandTimeout, match="interrupted"):
                await session.run_shell("sleep 30", timeout=1)
            assert (await session.run_shell("echo $A; pwd")).stdout == "1\n/repo\n"
            with pytest.raises(CommandTimeout, match="killed"):
                await session.run_shell("(trap '' INT; sleep 30)", timeout=1)
            assert (await session.run_shell("echo alive")).stdout == "alive\n"
            # interrupt() from elsewhere while a command runs.
            running = asyncio.ensure_future(session.run_shell("sleep 20; echo late"))
            await asyncio.sleep(0.5)
            await session.interrupt()
            result = await running
            assert result.exit_code == 130 and "late" not in result.stdout, result
            # The shell's exit ends the session: a typed error from then on.
            with pytest.raises(SessionClosed, match=r"its shell exited \(exit code 3\)"):
                await session.run_shell("exit 3")
            with pytest.raises(SessionClosed, match="has ended"):
                await session.run_shell("echo again")
        # An idle session ends by itself.
        idle = await sandbox.open_session(idle_timeout=1)
        for _ in range(100):  # (its watchdog looks every second: gone 2-3 s after its last command)
            if not any(p.running for p in await sandbox.list_processes() if p.pid == idle.id):
                break
            await asyncio.sleep(0.1)
        with pytest.raises(SessionClosed, match="idle"):
            await idle.run_shell("true")
        await idle.close()  # closing a closed one: nothing to do


async def test_file_trees(client, tmp_path):
    import io
    import os
    import tarfile

    from libdsec import InvalidRequest, SandboxFileNotFound

    async with await client.run_container(args(init_user="1000")) as sandbox:
        src = tmp_path / "src"
        (src / "pkg" / "deep").mkdir(parents=True)
        (src / "pkg" / "mod.py").write_text("x = 1\n")
        (src / "run.sh").write_text("#!/bin/sh\necho run\n")
        os.chmod(src / "run.sh", 0o750)
        (src / "big.bin").write_bytes(os.urandom(5 << 20))  # over one upload piece
        os.symlink("pkg/mod.py", src / "link")
        await sandbox.files.upload_dir(src, "/tmp/up")
        listed = {e.name: e for e in await sandbox.files.list("/tmp/up")}
        assert set(listed) == {"big.bin", "link", "pkg", "run.sh"}
        assert listed["run.sh"].mode == 0o750 and listed["run.sh"].uid == 1000 and listed["run.sh"].type == "file"
        assert (listed["link"].type, listed["link"].target) == ("symlink", "pkg/mod.py")
        assert listed["pkg"].type == "dir" and listed["big.bin"].size == 5 << 20
        assert (await sandbox.run_shell("/tmp/up/run.sh; cat /tmp/up/link")).stdout == "run\nx = 1\n"
        assert (await sandbox.files.stat("/tmp/up/pkg/mod.py")).size == 6
        await sandbox.files.rename("/tmp/up/pkg/mod.py", "/tmp/up/pkg/renamed.py")
        await sandbox.files.make_dir("/tmp/up/a/b/c")
        assert [e.name for e in await sandbox.files.list("/tmp/up/a/b")] == ["c"]
        with pytest.raises(InvalidRequest, match="not empty"):
            await sandbox.files.remove("/tmp/up/a")
        await sandbox.files.remove("/tmp/up/a", recursive=True)
        with pytest.raises(SandboxFileNotFound):
            await sandbox.files.stat("/tmp/up/a")
        out = tmp_path / "out"
        await sandbox.files.download_dir("/tmp/up", out)
        assert (out / "pkg" / "renamed.py").read_text() == "x = 1\n"
        assert (out / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
        assert os.readlink(out / "link") == "pkg/mod.py" and (out / "run.sh").stat().st_mode & 0o777 == 0o750
        # Bad paths and hostile tars: refused, naming the problem; the server serves on.
        for bad, message in (("relative", "must be absolute"), ("/tmp/../etc", "'..' component"), ("/a\nb", "newline")):
            with pytest.raises(InvalidRequest, match=message):
                await sandbox.files.list(bad)
        with pytest.raises(SandboxFileNotFound):
            await sandbox.files.list("/no/such")
        with pytest.raises(InvalidRequest, match="not a directory"):
            await sandbox.files.list("/tmp/up/run.sh")
        with pytest.raises(InvalidRequest, match="cannot remove /"):
            await sandbox.files.remove("/", recursive=True)

        def tar_of(*members: tarfile.TarInfo) -> bytes:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                for m in members:
                    tar.addfile(m, io.BytesIO(b"x" * m.size) if m.isreg() else None)
            return buf.getvalue()

        def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
            m = tarfile.TarInfo(name)
            m.type, m.linkname, m.size = kind, link, 1 if kind == tarfile.REGTYPE else 0
            return m

        for hostile, message in ((member("/etc/evil"), "AbsolutePath"), (member("../evil"), "OutsideDestination"),
                                 (member("dev", tarfile.CHRTYPE), "SpecialFile"),
                                 (member("out", tarfile.SYMTYPE, "/etc/passwd"), "AbsoluteLink"),
                                 (member("up", tarfile.SYMTYPE, "../../x"), "LinkOutsideDestination")):
            with pytest.raises(InvalidRequest, match=message):
                await sandbox._client._request("PUT", f"/v1/sandboxes/{sandbox.id}/fs/tree",
                                               params={"path": "/tmp/hostile"}, content=tar_of(hostile))
        with pytest.raises(InvalidRequest, match="not a tar"):
            await sandbox._client._request("PUT", f"/v1/sandboxes/{sandbox.id}/fs/tree",
                                           params={"path": "/tmp/hostile"}, content=b"garbage" * 100)
        assert (await sandbox.run_shell("ls /tmp/hostile 2>&1; echo still")).stdout.endswith("still\n")


async def test_abandoned_sessions_are_cleaned_up(server):
    """Sessions opened by a client that then vanished end by themselves once idle."""
    from libdsec import DSecClient

    async with DSecClient(server.endpoint, token=server.token) as client:
        sandbox = await client.run_container(args(memory_limit_mb=256))
        try:
            async with DSecClient(server.endpoint, token=server.token) as vanishing:
                mine = await vanishing.get_sandbox(sandbox.id)
                opened = await asyncio.gather(*(mine.open_session(idle_timeout=2) for _ in range(50)))
                assert len({s.id for s in opened}) == 50
            # (that client is gone, its sessions never closed)
            for _ in range(100):
                listed = await sandbox.list_processes()
                if listed and not any(p.running for p in listed):
                    break
                await asyncio.sleep(0.2)
            assert len(listed) == 50 and not any(p.running for p in listed), [p for p in listed if p.running]
            # Left: the init and its keepers (one a running command), and this command itself.
            # (ps into a file first: a grep reading the pipe can be listed as busybox's "exe" mid-start)
            ps = await sandbox.run_shell("ps -o comm,pid,ppid,stat,args > /tmp/ps.txt; grep -v -e '^COMMAND' "
                                         "-e '^.dsec-init ' -e '^ps ' -e '^sh ' /tmp/ps.txt || true")
            assert ps.stdout == "", ps.stdout
            assert (await sandbox.run_shell("echo serving")).stdout == "serving\n"
        finally:
            await sandbox.stop()


async def test_ports(client, server):
    import httpx

    async with await client.run_container(args()) as sandbox:
        await sandbox.run_shell("mkdir -p /tmp/www && echo hello > /tmp/www/index.html")
        httpd = await sandbox.start_shell("httpd -f -p 127.0.0.1:8000 -h /tmp/www")
        url = sandbox.port_url(8000)
        assert url.endswith(f"/v1/sandboxes/{sandbox.id}/ports/8000/")
        auth = {"authorization": f"Bearer {server.token}"}
        async with httpx.AsyncClient(timeout=30) as http:
            for _ in range(50):
                answer = await http.get(url + "index.html?x=1", headers=auth)
                if answer.status_code != 502:
                    break
                await asyncio.sleep(0.1)  # (httpd starting)
            assert (answer.status_code, answer.text) == (200, "hello\n")
            assert (await http.get(url + "missing.html", headers=auth)).status_code == 404
            # Nothing there: a clear 502, at once; a bad port or no token: refused.
            gone = await http.get(sandbox.port_url(8001), headers=auth)
            assert gone.status_code == 502 and gone.json()["error"]["code"] == "port_unreachable"
            assert "port 8001" in gone.json()["error"]["message"]
            bad = await http.get(url.replace("/8000/", "/70000/"), headers=auth)
            assert bad.status_code == 422
            assert (await http.get(url + "index.html")).status_code == 401
            # An upgrade that is no WebSocket handshake (no Sec-WebSocket-Key): refused as such.
            # (WebSocket itself goes through: tests/integration/test_pty.py.)
            ws = await http.get(url, headers={**auth, "upgrade": "websocket", "connection": "upgrade"})
            assert ws.status_code == 400, ws.text
        with pytest.raises(libdsec_invalid()):
            sandbox.port_url(0)
        await httpd.kill()


def libdsec_invalid():
    from libdsec import InvalidRequest

    return InvalidRequest


async def test_files_larger_than_memory_stream_both_ways(client, server, tmp_path):
    """A 300 MB file in and out, and a tree with a link out of it: the server holds neither."""
    import hashlib
    import os

    from libdsec import InvalidRequest, SandboxFileNotFound

    async with await client.run_container(args(memory_limit_mb=1024)) as sandbox:
        big = tmp_path / "big.bin"
        digest = hashlib.sha256()
        with open(big, "wb") as f:
            for _ in range(300):
                piece = os.urandom(1 << 20)
                digest.update(piece)
                f.write(piece)
        before = rss_bytes(server.proc.pid)
        peak = 0

        async def watch():
            nonlocal peak
            while True:
                peak = max(peak, rss_bytes(server.proc.pid))
                await asyncio.sleep(0.05)

        watcher = asyncio.ensure_future(watch())
        try:
            await sandbox.files.upload_file(big, "/tmp/in/big.bin", mode=0o600)
            listed = await sandbox.files.stat("/tmp/in/big.bin")
            assert (listed.size, listed.mode) == (300 << 20, 0o600)
            back = tmp_path / "back.bin"
            await sandbox.files.download_file("/tmp/in/big.bin", back)
        finally:
            watcher.cancel()
        assert back.stat().st_size == 300 << 20
        with open(back, "rb") as f:
            assert hashlib.file_digest(f, "sha256").hexdigest() == digest.hexdigest()
        grown = (peak - before) >> 20
        assert grown < 64, f"the server's RSS grew by {grown} MiB for a 300 MiB file"
        with pytest.raises(SandboxFileNotFound):
            await sandbox.files.download_file("/tmp/in/none", tmp_path / "none")
        assert not (tmp_path / "none").exists()
        with pytest.raises(InvalidRequest, match="is a directory"):
            await sandbox.files.download_file("/tmp/in", tmp_path / "dir")
        # A tree streamed up with a link out of it: refused naming the member, as a whole tar is.
        tree = tmp_path / "tree"
        tree.mkdir()
        (tree / "ok.txt").write_text("fine\n")
        os.symlink("/etc/passwd", tree / "out")
        with pytest.raises(InvalidRequest, match="refused tar member './out': AbsoluteLink"):
            await sandbox.files.upload_dir(tree, "/tmp/tree")
        assert (await sandbox.run_shell("echo serving")).stdout == "serving\n"


async def test_a_session_whose_files_were_replaced_is_refused_not_followed(client):
    """The node opens a session's files itself: a link or a file where a FIFO was is refused."""
    from libdsec import SandboxStateError

    async with await client.run_container(args()) as sandbox:
        async with await sandbox.open_session() as session:
            assert (await session.run_shell("echo $DSEC_PROC_DIR")).stdout.startswith("/tmp/.dsec-proc/")
            await session.run_shell('rm "$DSEC_PROC_DIR/done"; ln -s /etc/passwd "$DSEC_PROC_DIR/done"')
            with pytest.raises(SandboxStateError, match="not as the session keeps them"):
                await session.run_shell("echo hi")
        async with await sandbox.open_session() as other:
            await other.run_shell('rm "$DSEC_PROC_DIR/done"; : > "$DSEC_PROC_DIR/done"')
            with pytest.raises(SandboxStateError, match="not what a session keeps there"):
                await other.run_shell("echo hi")
        assert (await sandbox.run_shell("echo serving; head -c 4 /etc/passwd")).stdout == "serving\nroot"
