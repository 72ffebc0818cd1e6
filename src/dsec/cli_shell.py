"""``dsec shell ID``: an interactive terminal on a sandbox, as ``docker exec -it`` does. Added to
the main command line by ``register(app)``.

The local terminal is put in raw mode, so every key (Ctrl-C, Ctrl-D, Ctrl-Z, the arrows) goes
to the sandbox's terminal as it is typed and the sandbox's line discipline does the rest: Ctrl-C
interrupts the sandbox's foreground job, not this command. The sandbox's terminal takes the
size of this one and follows it (SIGWINCH). The command's exit code is this command's. With a
stdin that is not a terminal, what it reads goes to the sandbox as typed, then Ctrl-D.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import termios
import tty
from typing import Annotated, Optional

import typer

from libdsec import DSecClient, Sandbox, SandboxStateError

from .cli_common import run_sdk


def _size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
        return max(1, size.columns), max(1, size.lines)
    except OSError:
        return 80, 24


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


async def interactive(sandbox: Sandbox, command: str, *, user: str | None = None, workdir: str | None = None,
                      env: dict[str, str] | None = None, stdin: int = 0, stdout: int = 1) -> int:
    """Connect the local terminal (``stdin``, ``stdout``) to ``command`` on a terminal of the
    sandbox's until it ends; its exit code."""
    loop = asyncio.get_running_loop()
    local_tty = os.isatty(stdin)
    cols, rows = _size(stdout if os.isatty(stdout) else stdin)
    env = dict(env or {})
    if "TERM" not in env and os.environ.get("TERM"):
        env["TERM"] = os.environ["TERM"]
    typed: asyncio.Queue[bytes | None] = asyncio.Queue()

    def on_input() -> None:
        try:
            data = os.read(stdin, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(stdin)
            if not local_tty:
                typed.put_nowait(b"\x04")  # end of input, as Ctrl-D at a terminal
            typed.put_nowait(None)
            return
        typed.put_nowait(data)

    async with await sandbox.open_pty(cols=cols, rows=rows, command=command, user=user, workdir=workdir,
                                      env=env) as pty:

        async def send() -> None:
            while (data := await typed.get()) is not None:
                while not typed.empty() and len(data) < 65536:  # what was typed meanwhile goes along
                    more = typed.get_nowait()
                    if more is None:
                        typed.put_nowait(None)
                        break
                    data += more
                try:
                    await pty.write(data)
                except SandboxStateError:
                    return  # the command has ended: what is typed after goes nowhere, as at a terminal

        resized = asyncio.Event()

        async def follow_size() -> None:
            while True:
                await resized.wait()
                resized.clear()
                new = _size(stdout if os.isatty(stdout) else stdin)
                if new != (pty.info.cols, pty.info.rows):
                    await pty.resize(*new)

        saved = termios.tcgetattr(stdin) if local_tty else None
        tasks: list[asyncio.Task] = []
        try:
            if saved is not None:
                tty.setraw(stdin, termios.TCSANOW)
                loop.add_signal_handler(signal.SIGWINCH, resized.set)
            try:
                loop.add_reader(stdin, on_input)
            except PermissionError:  # a file, /dev/null: epoll takes none, and reading never waits
                for chunk in iter(lambda: os.read(stdin, 65536), b""):
                    typed.put_nowait(chunk)
                typed.put_nowait(b"\x04")
                typed.put_nowait(None)
            tasks = [asyncio.create_task(send()), asyncio.create_task(follow_size())]
            async for data in pty:
                _write_all(stdout, data)
                for task in tasks:
                    if task.done() and not task.cancelled() and task.exception() is not None:
                        raise task.exception()
        finally:
            with contextlib.suppress(Exception):
                loop.remove_reader(stdin)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if saved is not None:
                loop.remove_signal_handler(signal.SIGWINCH)
                termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
    return pty.exit_code if pty.exit_code is not None else 1


def register(app: typer.Typer) -> None:
    @app.command()
    def shell(
        sandbox_id: Annotated[str, typer.Argument(help="Sandbox id.")],
        command: Annotated[str, typer.Option("--command", "-c", help="What to run (sh -c).")] = "/bin/sh",
        user: Annotated[Optional[str], typer.Option("--user", "-u", help="User to run as.")] = None,
        workdir: Annotated[Optional[str], typer.Option("--workdir", "-w")] = None,
        env: Annotated[Optional[list[str]], typer.Option("--env", "-e", help="KEY=VALUE")] = None,
    ) -> None:
        """An interactive terminal on a sandbox, as `docker exec -it` does: keys go to the
        sandbox (Ctrl-C too), its size follows this terminal's, and its exit code is returned."""
        variables = dict(e.split("=", 1) for e in env or [] if "=" in e)

        async def go() -> int:
            async with DSecClient() as client:
                sandbox = await client.get_sandbox(sandbox_id)
                return await interactive(sandbox, command, user=user, workdir=workdir, env=variables)

        raise typer.Exit(run_sdk(go()))
