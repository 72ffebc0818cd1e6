"""``dsec shell``'s terminal loop with a PTY whose command ends before all its input is sent:
the command's exit code is the shell's, not an error about the input that came too late."""

from __future__ import annotations

import asyncio
import os

from libdsec import SandboxStateError

from dsec.cli_shell import interactive


class EndedPty:
    """A PTY whose command has exited with 5: its output comes, and every write is refused as
    the node refuses input to an exited command."""

    def __init__(self) -> None:
        self.exit_code: int | None = None
        self.writes = 0

    async def __aenter__(self) -> EndedPty:
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def write(self, data: bytes) -> None:
        self.writes += 1
        raise SandboxStateError("cannot write to the PTY: the PTY's command has exited (exit code 5)")

    def __aiter__(self):
        return self._output()

    async def _output(self):
        yield b"started\r\n"
        while not self.writes:  # the refused write comes before the output ends
            await asyncio.sleep(0.01)
        yield b"bye\r\n"
        self.exit_code = 5


class Sandbox:
    def __init__(self, pty: EndedPty) -> None:
        self.pty = pty

    async def open_pty(self, **_) -> EndedPty:
        return self.pty


def test_input_after_the_command_ended_goes_nowhere_and_the_exit_code_is_the_commands():
    stdin_r, stdin_w = os.pipe()
    out_r, out_w = os.pipe()
    os.write(stdin_w, b"exit 5\nmore typed\n")
    os.close(stdin_w)
    pty = EndedPty()
    try:
        code = asyncio.run(interactive(Sandbox(pty), "/bin/sh", stdin=stdin_r, stdout=out_w))
        os.close(out_w)
        out_w = -1
        assert code == 5
        assert pty.writes == 1
        assert os.read(out_r, 100) == b"started\r\nbye\r\n"
    finally:
        for fd in (stdin_r, out_r, out_w):
            if fd >= 0:
                os.close(fd)
