"""The e2b SDK's ``AsyncSandbox`` against DSec."""

from __future__ import annotations

import asyncio

import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    InvalidArgumentException,
    NotFoundException,
    SandboxQuery,
    TimeoutException,
)
from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

from conftest import TEMPLATE


async def test_async_sandbox_lifecycle_commands_and_files():
    sb = await AsyncSandbox.create(template=TEMPLATE, timeout=120, envs={"X": "1"}, metadata={"async": "yes"})
    try:
        out: list[str] = []
        result = await sb.commands.run("echo $X; echo e >&2", on_stdout=out.append)
        assert (result.stdout, result.stderr, out) == ("1\n", "e\n", ["1\n"])
        with pytest.raises(CommandExitException):
            await sb.commands.run("exit 7")
        with pytest.raises(TimeoutException):
            await sb.commands.run("sleep 20", timeout=1)

        background = await sb.commands.run("sleep 60", background=True)
        assert background.pid in [p.pid for p in await sb.commands.list()]
        assert await sb.commands.kill(background.pid)

        reader = await sb.commands.run("read a; echo [$a]", background=True, stdin=True)
        await sb.commands.send_stdin(reader.pid, "typed\n")
        assert (await reader.wait()).stdout == "[typed]\n"

        first: list[bytes] = []
        second: list[bytes] = []
        terminal = await sb.pty.create(PtySize(rows=24, cols=80), on_data=first.append, envs={"Y": "2"})
        watcher = await sb.pty.connect(terminal.pid, on_data=second.append)  # both see what follows
        await sb.pty.resize(terminal.pid, PtySize(rows=24, cols=120))
        await sb.pty.send_stdin(terminal.pid, b"echo y=$Y; tput cols; seq 1 50000 | tail -c 2000000; exit\n")
        assert (await terminal.wait()).exit_code == 0 and (await watcher.wait()).exit_code == 0
        for seen in (first, second):  # (more than the relay queues for a stream: read at their pace)
            text = b"".join(seen).decode()
            assert "y=2" in text and "\n120\r" in text and "\n49999\r\n50000\r" in text, text[-500:]
        terminal = await sb.pty.create(PtySize(rows=24, cols=80), on_data=first.append)
        assert await sb.pty.kill(terminal.pid)
        with pytest.raises(CommandExitException):
            await terminal.wait()
        with pytest.raises(NotFoundException):
            await sb.pty.send_stdin(terminal.pid, b"exit\n")
        with pytest.raises(InvalidArgumentException):
            await sb.pty.create(PtySize(rows=24, cols=0), on_data=first.append)

        await sb.files.write("/root/async.txt", "written")
        assert await sb.files.read("/root/async.txt") == "written"
        assert "async.txt" in [e.name for e in await sb.files.list("/root")]
        assert await sb.files.exists("/root/async.txt")
        await sb.files.remove("/root/async.txt")
        assert not await sb.files.exists("/root/async.txt")
        with pytest.raises(NotFoundException):
            await sb.files.read("/root/async.txt")

        found = await AsyncSandbox.list(query=SandboxQuery(metadata={"async": "yes"})).next_items()
        assert [s.sandbox_id for s in found] == [sb.sandbox_id]
        assert (await sb.get_metrics())[-1].cpu_count >= 1
    finally:
        await sb.kill()


async def test_async_watch_dir_streams_events():
    async with await AsyncSandbox.create(template=TEMPLATE, timeout=120) as sb:
        await sb.files.make_dir("/root/w")
        seen = []
        handle = await sb.files.watch_dir("/root/w", on_event=seen.append, recursive=True)
        try:
            await sb.files.write("/root/w/one.txt", "1")
            for _ in range(50):
                if any(e.name == "one.txt" and e.type == FilesystemEventType.CREATE for e in seen):
                    break
                await asyncio.sleep(0.1)
            assert any(e.name == "one.txt" and e.type == FilesystemEventType.CREATE for e in seen), seen
        finally:
            await handle.stop()


async def test_async_pause_and_connect():
    sb = await AsyncSandbox.create(template=TEMPLATE, timeout=120)
    try:
        await sb.commands.run("echo state > /root/s")
        await sb.pause()
        again = await AsyncSandbox.connect(sb.sandbox_id, timeout=300)
        assert (await again.commands.run("cat /root/s")).stdout == "state\n"
        await again.set_timeout(200)
    finally:
        await sb.kill()
