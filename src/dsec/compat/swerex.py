"""SWE-ReX's runtime protocol on a DSec sandbox: ``RemoteRuntime(host="<endpoint>/v1/sandboxes/
<id>/swerex", port=None, auth_token=<token>)`` (and so SWE-agent's ``remote`` deployment) works
against it unmodified.

Every call is one or a few of DSec's own calls on the sandbox's node (``EdgeAPI``):

- a SWE-ReX bash session is a DSec session with ``shell="bash"`` (``cd``, ``export``, functions
  persist); a command runs in it as one group with its stderr merged into its stdout (SWE-ReX
  reads a terminal), so bash parses it whole before any of it runs and what comes on stderr is
  bash's syntax error (``BashIncorrectSyntaxError``); past its timeout DSec interrupts it as
  Ctrl-C would and the session goes on (``CommandTimeoutError``);
- an interactive command (``is_interactive_command``: a REPL, gdb) is a DSec background process
  started in the session's directory and exported environment, under ``script`` (a terminal, as
  SWE-ReX's pexpect gives) when the image has it; what follows goes to its stdin and its output
  is read until one of ``expect`` appears, or it ends; ``BashInterruptAction`` sends it Ctrl-C;
- ``execute`` is one exec, ``read_file``/``write_file`` DSec's file calls (a relative path taken
  from the sandbox's working directory; failures raised as Python's own file calls raise them),
  ``upload`` a file write or, for the zip a directory goes as, DSec's tree upload (the zip turned
  into a tar here).

The apiserver keeps only the answers for retries: a session's name, its DSec session and
interactive program live in a small JSON file in the sandbox (``/tmp/.dsec-swerex/``). A call
sent again with the same ``X-Request-ID`` (``RemoteRuntime`` sends one per call, and the same on
each of its retries) gets the first one's answer, awaited if it still runs, and runs nothing
again (``Replays``: the answers are kept in this apiserver's memory, the last ones up to a
count and a size; SWE-ReX's own server keeps only its last one).

Errors reach the client as SWE-ReX's server sends them: its own exceptions (and builtins such
as ``FileNotFoundError``) as status 511 with ``{"swerexception": …}``, which ``RemoteRuntime``
raises again; a bad token (401) and an unknown sandbox (404) as HTTP errors with ``detail``
(``is_alive`` then answers False).
"""

from __future__ import annotations

import asyncio
import errno
import io
import json
import os
import posixpath
import re
import shlex
import stat
import tarfile
import zipfile
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from libdsec import (
    CommandTimeout,
    DSecError,
    InvalidRequest,
    Overloaded,
    SandboxFileNotFound,
    SandboxNotFound,
    SandboxStateError,
    SessionClosed,
    Unauthenticated,
)
from libdsec._errors import ProcessNotFound, error_from_wire
from libdsec.protocol import (
    MAX_OUTPUT_BYTES_LIMIT,
    ExecRequest,
    OpenSessionRequest,
    ProcessStreamRequest,
    SandboxStatus,
    StartProcessRequest,
)

from ..edge.api import EdgeAPI

PREFIX = "/v1/sandboxes/{sandbox_id}/swerex"
STATE_DIR = "/tmp/.dsec-swerex"
# What SWE-ReX's bash session uses as its prompt: the expect string of a command that ran to its end.
PS1 = "SHELLPS1PREFIX"
NO_TIMEOUT_S = 24 * 3600.0  # SWE-ReX's None ("no timeout"): DSec's longest
SESSION_IDLE_S = 24 * 3600.0  # a SWE-ReX session is never idle-closed by the client's side
_ANSI = re.compile(r"\x1B[@-_][0-?]*[ -/]*[@-~]")


# -- SWE-ReX's models (swerex.runtime.abstract), as its client sends and reads them ----------------

class CreateBashSessionRequest(BaseModel):
    startup_source: list[str] = []
    session: str = "default"
    session_type: Literal["bash"] = "bash"
    startup_timeout: float = 1.0


class BashAction(BaseModel):
    command: str
    session: str = "default"
    timeout: float | None = None
    is_interactive_command: bool = False
    is_interactive_quit: bool = False
    check: Literal["silent", "raise", "ignore"] = "raise"
    error_msg: str = ""
    expect: list[str] = []
    action_type: Literal["bash"] = "bash"


class BashInterruptAction(BaseModel):
    session: str = "default"
    timeout: float = 0.2
    n_retry: int = 3
    expect: list[str] = []
    action_type: Literal["bash_interrupt"] = "bash_interrupt"


Action = TypeAdapter(Annotated[BashAction | BashInterruptAction, Field(discriminator="action_type")])


class BashObservation(BaseModel):
    output: str = ""
    exit_code: int | None = None
    failure_reason: str = ""
    expect_string: str = ""
    session_type: Literal["bash"] = "bash"


class CloseBashSessionRequest(BaseModel):
    session: str = "default"
    session_type: Literal["bash"] = "bash"


class Command(BaseModel):
    command: str | list[str]
    timeout: float | None = None
    shell: bool = False
    check: bool = False
    error_msg: str = ""
    env: dict[str, str] | None = None
    cwd: str | None = None
    merge_output_streams: bool = False


class CommandResponse(BaseModel):
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None


class ReadFileRequest(BaseModel):
    path: str
    encoding: str | None = None
    errors: str | None = None


class WriteFileRequest(BaseModel):
    content: str
    path: str


class SwerexError(Exception):
    """An error SWE-ReX's client raises again as ``class_path`` (transferred with status 511)."""

    def __init__(self, class_path: str, message: str, extra_info: dict | None = None) -> None:
        super().__init__(message)
        self.class_path, self.message, self.extra_info = class_path, message, extra_info or {}


def _swerex(name: str, message: str, extra_info: dict | None = None) -> SwerexError:
    return SwerexError(f"swerex.exceptions.{name}", message, extra_info)


# DSec's errors inside a call, as the builtin SWE-ReX's local runtime would have raised.
_BUILTIN_OF: list[tuple[type[DSecError], str]] = [
    (SandboxFileNotFound, "builtins.FileNotFoundError"),
    (InvalidRequest, "builtins.ValueError"),
    (SandboxStateError, "builtins.RuntimeError"),
    (ConnectionError, "builtins.ConnectionError"),
]


def error_answer(exc: Exception) -> JSONResponse:
    """``exc`` as SWE-ReX's server answers it."""
    if isinstance(exc, (Unauthenticated, SandboxNotFound)):
        return JSONResponse({"detail": exc.message, **exc.to_wire()}, status_code=exc.status)
    if isinstance(exc, DSecError):
        path = next((p for cls, p in _BUILTIN_OF if isinstance(exc, cls)), "builtins.RuntimeError")
        exc = SwerexError(path, exc.message or type(exc).__name__)
    if not isinstance(exc, SwerexError):
        raise exc
    body = {"message": exc.message, "class_path": exc.class_path, "traceback": "", "extra_info": exc.extra_info}
    return JSONResponse({"swerexception": body}, status_code=511)


def _clean(text: str) -> str:
    """As SWE-ReX's session cleans terminal output."""
    return _ANSI.sub("", text).replace("\r\n", "\n")


def _timeout(value: float | None) -> float:
    return NO_TIMEOUT_S if value is None else min(max(value, 0.001), NO_TIMEOUT_S)


def _merged(command: str) -> str:
    """``command`` in the current shell with its stderr into its stdout (``:`` first: a command
    of only blanks and comments is none, and bash refuses an empty group)."""
    return "{ :; " + command + "\n} 2>&1"


# What Python's own file calls raise for the errno a DSec file call's message names.
_OS_ERRORS = {errno.EEXIST: "FileExistsError", errno.EISDIR: "IsADirectoryError",
              errno.ENOTDIR: "NotADirectoryError", errno.EACCES: "PermissionError",
              errno.ENOENT: "FileNotFoundError"}


def _os_error(exc: DSecError, path: str) -> SwerexError | DSecError:
    """``exc`` of a file call on ``path`` as the ``OSError`` SWE-ReX's local runtime raises
    (others as they are). The last errno text in the message is the cause: ``not a directory (or
    cannot be made one) (mkdir: …: Permission denied)``."""
    if isinstance(exc, SandboxFileNotFound):
        return SwerexError("builtins.FileNotFoundError", f"[Errno 2] No such file or directory: {path!r}")
    at, code = max((exc.message.lower().rfind(os.strerror(code).lower()), code) for code in _OS_ERRORS)
    if at < 0:
        return exc
    return SwerexError(f"builtins.{_OS_ERRORS[code]}", f"[Errno {code}] {os.strerror(code)}: {path!r}")


class SwerexRuntime:
    """SWE-ReX's runtime calls on one sandbox (``edge``: its node)."""

    def __init__(self, edge: EdgeAPI, sandbox_id: str) -> None:
        self.edge, self.sandbox_id = edge, sandbox_id

    # -- where a session's state lives (in the sandbox) ---------------------------------------

    @staticmethod
    def _state_path(name: str) -> str:
        raw = name.encode()
        if not raw or len(raw) > 120:
            raise SwerexError("builtins.ValueError", f"invalid session name {name!r}: 1-120 bytes")
        return f"{STATE_DIR}/{raw.hex()}.json"

    async def _load(self, name: str) -> dict | None:
        try:
            return json.loads(await self.edge.read_file(self.sandbox_id, self._state_path(name)))
        except SandboxFileNotFound:
            return None

    async def _save(self, name: str, state: dict) -> None:
        await self.edge.write_file(self.sandbox_id, self._state_path(name), json.dumps(state).encode(), 0o600)

    async def _session(self, name: str) -> dict:
        state = await self._load(name)
        if state is None:
            raise _swerex("SessionDoesNotExistError", f"session {name!r} does not exist")
        return state

    async def _exec(self, command: str, timeout: float = 60.0, stdin: str | None = None, **kw: Any):
        return await self.edge.exec(self.sandbox_id, ExecRequest(
            command=command, timeout=timeout, stdin=stdin, max_output_bytes=MAX_OUTPUT_BYTES_LIMIT, **kw))

    # -- the calls -----------------------------------------------------------------------------

    async def is_alive(self) -> dict:
        info = await self.edge.get(self.sandbox_id)
        if info.status in (SandboxStatus.running, SandboxStatus.paused):  # (a paused one resumes on its next call)
            return {"is_alive": True, "message": ""}
        return {"is_alive": False, "message": f"sandbox {self.sandbox_id} is {info.status.value}"}

    async def create_session(self, request: CreateBashSessionRequest) -> dict:
        await self.edge.make_dir(self.sandbox_id, STATE_DIR)
        old = await self._load(request.session)
        if old is not None and await self._running(old["session"]):
            raise _swerex("SessionExistsError", f"session {request.session} already exists")
        try:
            session = await self.edge.open_session(self.sandbox_id, OpenSessionRequest(
                shell="bash", idle_timeout=SESSION_IDLE_S))
        except (SessionClosed, InvalidRequest) as exc:
            raise SwerexError("builtins.RuntimeError", f"cannot start a bash session: {exc.message}") from None
        await self._save(request.session, {"session": session.id, "program": None, "offset": 0, "pty": False})
        output = ""
        if request.startup_source:
            sources = " ; ".join(f"source {shlex.quote(path)}" for path in request.startup_source)
            try:
                result = await self.edge.session_exec(self.sandbox_id, session.id, ExecRequest(
                    command=_merged(sources), timeout=_timeout(request.startup_timeout + 5.0)))
            except CommandTimeout as exc:
                raise _swerex("CommandTimeoutError", f"timeout while sourcing {request.startup_source}: {exc.message}") from None
            output = _clean(result.stdout)
        return {"output": output, "session_type": "bash"}

    async def _running(self, pid: int) -> bool:
        try:
            return (await self.edge.get_process(self.sandbox_id, pid)).running
        except ProcessNotFound:
            return False

    async def run_in_session(self, action: BashAction | BashInterruptAction) -> BashObservation:
        state = await self._session(action.session)
        if isinstance(action, BashInterruptAction):
            return await self._interrupt(action, state)
        if state["program"] is not None:
            return await self._to_program(action, state)
        if action.is_interactive_command or action.is_interactive_quit:
            return await self._start_program(action, state)
        observation = await self._run_normal(action, state)
        if action.check == "raise" and observation.exit_code != 0:
            msg = (f"Command {action.command!r} failed with exit code {observation.exit_code}. "
                   f"Here is the output:\n{observation.output!r}")
            raise _swerex("NonZeroExitCodeError", f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return observation

    async def _run_normal(self, action: BashAction, state: dict) -> BashObservation:
        try:
            result = await self.edge.session_exec(self.sandbox_id, state["session"], ExecRequest(
                command=_merged(action.command), timeout=_timeout(action.timeout),
                max_output_bytes=MAX_OUTPUT_BYTES_LIMIT))
        except CommandTimeout as exc:
            raise _swerex("CommandTimeoutError", f"timeout after {action.timeout} seconds while running command "
                                                 f"{action.command!r} ({exc.message})") from None
        except SessionClosed as exc:
            raise _swerex("SessionNotInitializedError", f"session {action.session!r}: {exc.message}") from None
        if result.exit_code == 2 and result.stderr.strip():
            # The command's own stderr goes to its stdout: what is on stderr is bash's, failing
            # to parse the command (it parses the whole group first, so nothing of it ran).
            msg = (f"Error (exit code 2) while checking bash command \n{action.command!r}\n"
                   f"---- Stderr ----\n{result.stderr}\n---- Stdout ----\n{result.stdout}")
            raise _swerex("BashIncorrectSyntaxError", msg, {"bash_stdout": result.stdout, "bash_stderr": result.stderr})
        exit_code = None if action.check == "ignore" else result.exit_code
        return BashObservation(output=_clean(result.stdout), exit_code=exit_code, expect_string=PS1)

    # -- interactive programs: a background process fed through its stdin -----------------------

    async def _start_program(self, action: BashAction, state: dict) -> BashObservation:
        # The program starts where the session's shell is, with what it exported.
        try:
            where = await self.edge.session_exec(self.sandbox_id, state["session"], ExecRequest(
                command="pwd; command -v script >/dev/null && echo pty || echo pipe; export -p", timeout=30.0))
        except SessionClosed as exc:
            raise _swerex("SessionNotInitializedError", f"session {action.session!r}: {exc.message}") from None
        cwd, kind, *exports = where.stdout.split("\n")
        inner = (f"exec 2>&1\n{{ {chr(10).join(exports)}\n}} 2>/dev/null\ncd {shlex.quote(cwd)} 2>/dev/null\n"
                 f"{action.command}\n")
        bash = f"bash --norc --noprofile -c {shlex.quote(inner)}"
        pty = kind == "pty"
        command = f"exec script -qfec {shlex.quote(bash)} /dev/null" if pty else f"exec {bash}"
        program = await self.edge.start_process(self.sandbox_id, StartProcessRequest(command=command))
        state.update(program=program.pid, offset=0, pty=pty)
        await self._save(action.session, state)
        return await self._answer(action, state, quitting=action.is_interactive_quit)

    async def _to_program(self, action: BashAction, state: dict) -> BashObservation:
        try:
            await self.edge.process_stdin(self.sandbox_id, state["program"], action.command + "\n", False)
        except (SandboxStateError, ProcessNotFound):
            pass  # it ended meanwhile: its last output and its end are read below
        return await self._answer(action, state, quitting=action.is_interactive_quit)

    async def _answer(self, action: BashAction, state: dict, quitting: bool) -> BashObservation:
        try:
            output, matched, ended = await self._read_until(state, action.expect, action.timeout)
        except TimeoutError:
            await self._save(action.session, state)
            raise _swerex("CommandTimeoutError", f"timeout after {action.timeout} seconds while running command "
                                                 f"{action.command!r}") from None
        if ended:
            state["program"] = None
        await self._save(action.session, state)
        output = _clean(output)
        if not quitting:  # (a terminal echoes what was typed)
            output = output.lstrip().removeprefix(action.command).strip()
        return BashObservation(output=output, exit_code=0, expect_string=matched)

    async def _read_until(self, state: dict, expect: list[str], timeout: float | None) -> tuple[str, str, bool]:
        """The program's output from ``state["offset"]`` up to the first of ``expect`` (or its
        end: ``PS1``, ended); the offset moves past what was read. ``TimeoutError`` past
        ``timeout`` (what came stays unread, for the next call)."""
        text, taken = "", 0
        stream = self.edge.stream_process(self.sandbox_id, state["program"],
                                          ProcessStreamRequest(stdout_offset=state["offset"], timeout=NO_TIMEOUT_S))
        async with asyncio.timeout(_timeout(timeout)), aclosing(stream):
            async for event in stream:
                if event.event == "error":
                    raise error_from_wire({"error": event.error}, 500)
                if event.event == "exit":
                    state["offset"] += len(text.encode())
                    return text, PS1, True
                if event.event != "stdout":
                    continue
                text += event.data
                hits = [(at, e) for e in expect if e and (at := text.find(e, max(0, taken - len(e)))) >= 0]
                taken = len(text)
                if hits:
                    at, found = min(hits)
                    state["offset"] += len(text[:at + len(found)].encode())
                    return text[:at], found, False
        raise SandboxStateError("the program's output stream ended without its exit")

    async def _interrupt(self, action: BashInterruptAction, state: dict) -> BashObservation:
        if state["program"] is None:
            # A command past its timeout was interrupted already; one running now gets Ctrl-C.
            try:
                await self.edge.interrupt_session(self.sandbox_id, state["session"])
            except SessionClosed as exc:
                raise _swerex("SessionNotInitializedError", f"session {action.session!r}: {exc.message}") from None
            return BashObservation(output="", exit_code=0, expect_string=PS1)
        output = ""
        for _ in range(max(1, action.n_retry)):
            try:
                if state["pty"]:  # Ctrl-C typed at its terminal
                    await self.edge.process_stdin(self.sandbox_id, state["program"], "\x03", False)
                else:
                    await self.edge.signal_process(self.sandbox_id, state["program"], 2)
            except (SandboxStateError, ProcessNotFound):
                pass
            try:
                text, matched, ended = await self._read_until(state, action.expect, action.timeout)
            except TimeoutError:
                continue
            if ended:
                state["program"] = None
            await self._save(action.session, state)
            return BashObservation(output=_clean(output + text).strip(), exit_code=0, expect_string=matched)
        # As SWE-ReX falls back to kill -9 of the job.
        try:
            await self.edge.signal_process(self.sandbox_id, state["program"], 9)
        except (SandboxStateError, ProcessNotFound):
            pass
        state["program"] = None
        await self._save(action.session, state)
        return BashObservation(output="", exit_code=0, expect_string=PS1)

    # -- the rest ---------------------------------------------------------------------------------

    async def close_session(self, request: CloseBashSessionRequest) -> dict:
        state = await self._session(request.session)
        await self._end(request.session, state)
        return {"session_type": "bash"}

    async def _end(self, name: str, state: dict) -> None:
        if state.get("program") is not None:
            try:
                await self.edge.signal_process(self.sandbox_id, state["program"], 9)
            except (SandboxStateError, ProcessNotFound):
                pass
        await self.edge.close_session(self.sandbox_id, state["session"])
        await self.edge.remove_path(self.sandbox_id, self._state_path(name), False)

    async def execute(self, command: Command) -> CommandResponse:
        if isinstance(command.command, list):
            line = shlex.join(command.command)
        else:
            line = command.command if command.shell else shlex.quote(command.command)
        line = line or ":"  # (as `sh -c ''`: nothing, exit 0)
        if command.merge_output_streams:
            line = _merged(line)
        try:
            result = await self._exec(line, timeout=_timeout(command.timeout), env=command.env or {},
                                      workdir=command.cwd)
        except CommandTimeout:
            raise _swerex("CommandTimeoutError", f"Timeout ({command.timeout}s) exceeded while running command") from None
        response = CommandResponse(stdout=result.stdout, stderr=result.stderr, exit_code=result.exit_code)
        if command.check and result.exit_code != 0:
            msg = (f"Command {command.command!r} failed with exit code {result.exit_code}. "
                   f"Stdout:\n{response.stdout!r}\nStderr:\n{response.stderr!r}")
            raise _swerex("NonZeroExitCodeError", f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return response

    async def _path(self, path: str) -> str:
        """``path``, a relative one taken from the sandbox's working directory (``execute``'s)."""
        if path.startswith("/"):
            return path
        return posixpath.join((await self.edge.get(self.sandbox_id)).workdir, path)

    async def read_file(self, request: ReadFileRequest) -> dict:
        try:
            data = await self.edge.read_file(self.sandbox_id, await self._path(request.path))
        except DSecError as exc:
            raise _os_error(exc, request.path) from None
        try:
            content = data.decode(request.encoding or "utf-8", request.errors or "strict")
        except LookupError as exc:
            raise SwerexError("builtins.LookupError", str(exc)) from None
        except UnicodeDecodeError as exc:  # (a ValueError: SWE-ReX's client cannot make this one again)
            raise SwerexError("builtins.ValueError", f"cannot decode {request.path}: {exc}") from None
        return {"content": content}

    async def write_file(self, request: WriteFileRequest) -> dict:
        await self._write(request.path, request.content.encode())
        return {}

    async def _write(self, path: str, data: bytes) -> None:
        """``data`` into the file at ``path``, its parent made first (as SWE-ReX's local runtime)."""
        target = await self._path(path)
        try:
            if (parent := posixpath.dirname(target)) != "/":
                await self.edge.make_dir(self.sandbox_id, parent)
            await self.edge.write_file(self.sandbox_id, target, data, 0o644)
        except DSecError as exc:
            raise _os_error(exc, path) from None

    async def upload(self, data: bytes, target_path: str, unzip: bool) -> dict:
        if not unzip:
            await self._write(target_path, data)
        else:
            await self.edge.upload_tree(self.sandbox_id, await self._path(target_path), zip_to_tar(data))
        return {}

    async def close(self) -> dict:
        """End every SWE-ReX session of the sandbox (the sandbox goes on: DSecDeployment stops it)."""
        try:
            entries = await self.edge.list_dir(self.sandbox_id, STATE_DIR)
        except SandboxFileNotFound:
            return {}
        for entry in entries:
            try:
                name = bytes.fromhex(entry.name.removesuffix(".json")).decode()
                state = await self._load(name)
            except ValueError:
                continue
            if state is not None:
                await self._end(name, state)
        return {}


def zip_to_tar(data: bytes) -> bytes:
    """The zip SWE-ReX sends for a directory, as the tar DSec's tree upload takes (modes and
    links kept; the node checks every member's name and link)."""
    out = io.BytesIO()
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise InvalidRequest(f"the upload is not a zip file: {exc}") from None
    with archive, tarfile.open(fileobj=out, mode="w") as tar:
        for item in archive.infolist():
            mode = item.external_attr >> 16
            member = tarfile.TarInfo(item.filename.rstrip("/"))
            if not member.name:
                continue
            member.mtime = 0
            if item.is_dir():
                member.type, member.mode = tarfile.DIRTYPE, stat.S_IMODE(mode) or 0o755
                tar.addfile(member)
            elif stat.S_ISLNK(mode):
                member.type, member.linkname, member.mode = tarfile.SYMTYPE, archive.read(item).decode(), 0o777
                tar.addfile(member)
            else:
                body = archive.read(item)
                member.size, member.mode = len(body), stat.S_IMODE(mode) or 0o644
                tar.addfile(member, io.BytesIO(body))
    return out.getvalue()


# -- answers kept for retries ---------------------------------------------------------------------

class Replays:
    """The answers of calls by their request ids, for the retries that send them again.

    ``once(key, work)`` runs ``work`` (it answers a ``Response`` and whether to keep it) once
    per key, in a task of its own (a client that broke off does not cancel it: its retry gets
    its answer): a call with a key in flight awaits it, one with a key answered gets the same
    answer. Finished answers are kept up to ``max_answers`` of them and ``max_bytes`` of body,
    the oldest dropped first; one not kept (nothing ran: ``Overloaded``) is run again."""

    def __init__(self, max_answers: int = 1024, max_bytes: int = 64 << 20) -> None:
        self.max_answers, self.max_bytes = max_answers, max_bytes
        self._running: dict[tuple, asyncio.Task[tuple[Response, bool]]] = {}
        self._answers: OrderedDict[tuple, tuple[int, bytes, str | None]] = OrderedDict()
        self._bytes = 0

    async def once(self, key: tuple, work: Callable[[], Awaitable[tuple[Response, bool]]]) -> Response:
        if (kept := self._answers.get(key)) is not None:
            self._answers.move_to_end(key)
            return Response(kept[1], status_code=kept[0], media_type=kept[2])
        task = self._running.get(key)
        if task is None:
            task = self._running[key] = asyncio.create_task(work())
            task.add_done_callback(lambda t: self._done(key, t))
        response, _ = await asyncio.shield(task)
        return Response(response.body, status_code=response.status_code, media_type=response.media_type)

    def _done(self, key: tuple, task: asyncio.Task[tuple[Response, bool]]) -> None:
        del self._running[key]
        if task.cancelled() or task.exception() is not None:
            return
        response, keep = task.result()
        if not keep or len(response.body) > self.max_bytes:
            return
        self._answers[key] = (response.status_code, bytes(response.body), response.media_type)
        self._bytes += len(response.body)
        while len(self._answers) > self.max_answers or self._bytes > self.max_bytes:
            _, (_, body, _) = self._answers.popitem(last=False)
            self._bytes -= len(body)

    def __len__(self) -> int:
        return len(self._answers)


# -- routes: parse, call one SwerexRuntime method, answer as SWE-ReX's server ----------------------

def add_swerex_routes(app: FastAPI, cluster, authenticator) -> None:
    async def runtime(request: Request, sandbox_id: str) -> SwerexRuntime:
        key = request.headers.get("x-api-key")
        caller = authenticator.caller(f"Bearer {key}" if key else request.headers.get("authorization", ""))
        try:
            return SwerexRuntime(await cluster.edge_for_caller(sandbox_id, caller), sandbox_id)
        except InvalidRequest as exc:  # a malformed id names no sandbox either
            raise SandboxNotFound(exc.message) from None

    def parsed(model, body: bytes):
        try:
            if isinstance(model, TypeAdapter):
                return model.validate_json(body)
            return model.model_validate_json(body or b"{}")
        except ValidationError as exc:
            raise _Unparsed(exc) from None

    replays = Replays()

    def route(name: str, model=None):
        async def answer(rt: SwerexRuntime, body: bytes) -> tuple[Response, bool]:
            """The call's answer, and whether a retry may get it (not when nothing ran)."""
            try:
                if model is None:
                    answer = await getattr(rt, name)()
                else:
                    answer = await getattr(rt, name)(parsed(model, body))
            except _Unparsed as exc:
                return JSONResponse({"detail": exc.errors}, status_code=422), True
            except (DSecError, SwerexError) as exc:
                return error_answer(exc), not isinstance(exc, Overloaded)
            return JSONResponse(answer.model_dump(mode="json") if isinstance(answer, BaseModel) else answer), True

        async def handler(request: Request, sandbox_id: str):
            try:
                rt = await runtime(request, sandbox_id)  # (a retry is authenticated again)
            except (DSecError, SwerexError) as exc:
                return error_answer(exc)
            body = await request.body()
            request_id = request.headers.get("x-request-id")
            if not request_id:
                return (await answer(rt, body))[0]
            return await replays.once((sandbox_id, name, request_id), lambda: answer(rt, body))
        handler.__name__ = f"swerex_{name}"
        return handler

    app.add_api_route(PREFIX + "/is_alive", route("is_alive"), methods=["GET"], include_in_schema=False)
    for name, model in (("create_session", CreateBashSessionRequest), ("run_in_session", Action),
                        ("close_session", CloseBashSessionRequest), ("execute", Command),
                        ("read_file", ReadFileRequest), ("write_file", WriteFileRequest), ("close", None)):
        app.add_api_route(f"{PREFIX}/{name}", route(name, model), methods=["POST"], include_in_schema=False)

    async def upload(request: Request, sandbox_id: str):
        try:
            rt = await runtime(request, sandbox_id)
            async with request.form(max_part_size=1 << 30) as form:
                file, target = form.get("file"), form.get("target_path")
                if file is None or isinstance(file, str) or not isinstance(target, str):
                    return JSONResponse({"detail": "upload needs the form fields file and target_path"}, status_code=422)
                unzip = str(form.get("unzip", "false")).lower() in ("true", "1", "yes", "on")
                return await rt.upload(await file.read(), target, unzip)
        except (DSecError, SwerexError) as exc:
            return error_answer(exc)

    app.add_api_route(PREFIX + "/upload", upload, methods=["POST"], include_in_schema=False)


class _Unparsed(Exception):
    def __init__(self, exc: ValidationError) -> None:
        super().__init__(str(exc))
        self.errors = exc.errors(include_url=False, include_context=False, include_input=False)
