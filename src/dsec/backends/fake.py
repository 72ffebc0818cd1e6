"""An in-memory backend for testing the control plane (edge, apiserver, SDK) without a kernel.

It keeps each sandbox's files in a dict and understands a handful of commands (``echo``,
``echo … >&2``, ``cat``, ``exit N``, ``sleep N``, ``true``, ``false``), joined by ``;``. That is enough for the
edge's lifecycle, TTL and error paths, and for the backend conformance suite; anything else
answers exit code 127, as a shell would for an unknown command.
"""

from __future__ import annotations

import asyncio
import shlex
import time

from libdsec import BackendError, CommandTimeout, InvalidRequest, PortUnreachable, SandboxFileNotFound, SandboxStateError
from libdsec.protocol import ExecRequest, ExecResult

from ..images import scrub
from ..images.carry import Carried, is_system_path
from ..resources.cgroups import Limits
from .base import Capability, Emit, ExecContext, Handle, PackedDiff, SandboxSpec, numeric_user, user_from_passwd


class FakeBackend:
    """Stands in for the backend of any sandbox kind (``container`` unless told otherwise)."""

    capabilities = frozenset({Capability.WARM_POOL, Capability.CARRY, Capability.PORTS, Capability.REBOOT})

    def __init__(self, kind: str = "container") -> None:
        self.kind = kind
        self.files: dict[str, dict[str, bytes]] = {}
        self.paused: set[str] = set()
        self.halted: set[str] = set()  # (``halt``: its files kept, nothing runs)
        self.boots: dict[str, int] = {}  # how many times each was started (its create the first)
        self.limits: dict[str, Limits] = {}
        self.destroyed: list[str] = []
        self.fail_next_create: str | None = None

    def describe(self) -> str:
        return f"{self.kind}: the in-memory fake (no sandbox runs)"

    def host_view(self) -> None:
        return None

    async def warm_up(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _files(self, handle: Handle) -> dict[str, bytes]:
        files = self.files.get(handle.cid)
        if files is None:
            raise SandboxStateError(f"sandbox {handle.cid} is gone")
        return files

    async def create(self, cid: str, spec: SandboxSpec) -> Handle:
        if self.fail_next_create:
            message, self.fail_next_create = self.fail_next_create, None
            raise BackendError(message)
        self.files[cid] = {"/etc/passwd": b"root:x:0:0::/root:/bin/sh\nagent:x:1000:1000::/home/agent:/bin/sh\n"}
        if spec.limits is not None:
            self.limits[cid] = spec.limits
        return Handle(cid=cid, image=spec.image, layers=spec.layers, pid=1, env=dict(spec.env))

    async def apply_limits(self, handle: Handle, limits: Limits) -> None:
        self._files(handle)
        self.limits[handle.cid] = limits

    async def exec(self, handle: Handle, request: ExecRequest, ctx: ExecContext) -> ExecResult:
        return await self.exec_stream(handle, request, ctx, None)

    async def exec_stream(self, handle: Handle, request: ExecRequest, ctx: ExecContext, emit: Emit | None) -> ExecResult:
        """``exec``; the whole output handed to ``emit`` at the end (the fake's commands take
        no time to write)."""
        files = self._files(handle)
        start = time.perf_counter()
        out = bytearray()
        err = bytearray()
        code = 0

        async def run() -> int:
            for part in request.command.split(";"):
                words = shlex.split(part)
                if not words:
                    continue
                cmd, args = words[0], words[1:]
                if cmd == "echo" and args[-1:] == [">&2"]:
                    err.extend((" ".join(args[:-1]) + "\n").encode())
                elif cmd == "echo":
                    out.extend((" ".join(args) + "\n").encode())
                elif cmd == "cat":
                    for path in args:
                        if path in files:
                            out.extend(files[path])
                        else:
                            err.extend(f"cat: {path}: No such file or directory\n".encode())
                            return 1
                elif cmd == "sleep":
                    await asyncio.sleep(float(args[0]))
                elif cmd in ("true", ":"):
                    pass
                elif cmd == "false":
                    return 1
                elif cmd == "exit":
                    return int(args[0]) if args else 0
                else:
                    err.extend(f"sh: {cmd}: not found\n".encode())
                    return 127
            return 0

        try:
            code = await asyncio.wait_for(run(), request.timeout)
        except TimeoutError:
            raise CommandTimeout(f"command timed out after {request.timeout:g}s and was killed") from None
        if emit is not None:
            for kind, data in (("stdout", out), ("stderr", err)):
                if data:
                    await emit(kind, bytes(data))
        cap = request.max_output_bytes
        return ExecResult(
            exit_code=code, stdout=out[:cap].decode(), stderr=err[:cap].decode(),
            duration_s=time.perf_counter() - start,
            stdout_truncated=len(out) > cap, stderr_truncated=len(err) > cap,
            stdout_bytes=len(out), stderr_bytes=len(err),
        )

    async def open_pty(self, handle: Handle, command: str, ctx: ExecContext, cols: int, rows: int) -> FakePty:
        self._files(handle)
        pty = FakePty(self, handle, ctx, cols, rows)
        if command.split()[0].rsplit("/", 1)[-1] in ("sh", "bash", "ash"):
            pty.out.put_nowait(b"$ ")
        else:
            pty.task = asyncio.ensure_future(pty.run_line(command, then_exit=True))
        return pty

    async def read_file(self, handle: Handle, path: str, max_bytes: int) -> bytes:
        files = self._files(handle)
        if path not in files:
            raise SandboxFileNotFound(f"no such file in sandbox: {path}")
        if len(files[path]) > max_bytes:
            raise InvalidRequest(f"cannot read {path}: over the {max_bytes}-byte limit")
        return files[path]

    async def write_file(self, handle: Handle, path: str, data: bytes, mode: int, uid: int, gid: int) -> None:
        if not path.startswith("/"):
            raise InvalidRequest(f"path must be absolute: {path!r}")
        self._files(handle)[path] = bytes(data)

    async def make_dir(self, handle: Handle, path: str, uid: int, gid: int) -> None:
        self._files(handle)

    async def resolve_user(self, handle: Handle, user: str) -> tuple[int, int]:
        ids = numeric_user(user)
        return ids if ids is not None else user_from_passwd(user, self._files(handle)["/etc/passwd"].decode())

    async def pack_diff(self, handle: Handle, once: bool = False) -> PackedDiff:
        self._files(handle)
        raise BackendError("the fake backend keeps no layers: it cannot pack a sandbox")

    # -- clean copies: the files written since create are the writable layer -------------------

    async def check_kept(self, handle: Handle, keep: list[str]) -> None:
        files = self._files(handle)
        for path in keep:
            if path not in files and not any(p.startswith(path + "/") for p in files):
                raise InvalidRequest(f"keep path {path!r} does not exist in the sandbox")

    async def carry(self, source: Handle, target: Handle, keep: list[str]) -> Carried:
        files, into = self._files(source), self._files(target)
        carried = Carried()
        for path, data in files.items():
            if any(path == k or path.startswith(k + "/") for k in keep):
                if scrub.is_residue(path.lstrip("/")):
                    carried.scrubbed.append(path)
                    continue
                into[path] = data
                carried.files += 1
                carried.bytes += len(data)
        return carried

    def tampered(self, handle: Handle) -> list[str]:
        return sorted(p for p in self.files.get(handle.cid, {}) if p != "/etc/passwd" and is_system_path(p.lstrip("/")))

    async def pause(self, handle: Handle) -> None:
        self._files(handle)
        self.paused.add(handle.cid)

    async def resume(self, handle: Handle) -> None:
        self._files(handle)
        self.paused.discard(handle.cid)

    async def halt(self, handle: Handle) -> None:
        self._files(handle)
        self.paused.discard(handle.cid)
        self.halted.add(handle.cid)
        handle.pid = 0

    async def boot(self, handle: Handle) -> None:
        self._files(handle)
        if handle.cid not in self.halted:
            raise BackendError(f"cannot boot {handle.cid}: it is not halted")
        self.halted.discard(handle.cid)
        self.boots[handle.cid] = self.boots.get(handle.cid, 1) + 1

    async def is_alive(self, handle: Handle) -> bool:
        return handle.cid in self.files and handle.cid not in self.halted

    async def connect_port(self, handle: Handle, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A fake sandbox has no network of its own: its ports are the node's loopback's (so a
        test can serve one and reach it through the edge and the node seam)."""
        self._files(handle)
        try:
            return await asyncio.open_connection("127.0.0.1", port)
        except ConnectionRefusedError:
            raise PortUnreachable(f"nothing listens on port {port} in the sandbox (connection refused)") from None

    async def destroy(self, handle: Handle) -> None:
        if self.files.pop(handle.cid, None) is not None:
            self.destroyed.append(handle.cid)
        self.paused.discard(handle.cid)
        self.halted.discard(handle.cid)
        self.limits.pop(handle.cid, None)

    async def recover(self, handles: list[Handle]) -> list[Handle]:
        alive = [h for h in handles if h.cid in self.files]
        keep = {h.cid for h in alive}
        for cid in [c for c in self.files if c not in keep]:
            del self.files[cid]
        return alive

    def release_unused(self) -> None:
        pass

    def memory_usage(self, handle: Handle) -> int | None:
        return 0 if handle.cid in self.files else None

    def kill(self, cid: str) -> None:
        """Make a sandbox die as if its processes were killed from outside."""
        self.files.pop(cid, None)


class FakePty:
    """A terminal in cooked mode with the fake's shell: what is typed is echoed (CR as CRLF), a
    line is run when it ends, ``stty size`` says the size, ``exit N`` ends it, Ctrl-C drops
    the line."""

    def __init__(self, backend: FakeBackend, handle: Handle, ctx: ExecContext, cols: int, rows: int) -> None:
        self.backend, self.handle, self.ctx = backend, handle, ctx
        self.cols, self.rows = cols, rows
        self.out: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.line = bytearray()
        self.code: int | None = None
        self.ended = asyncio.Event()
        self.task: asyncio.Future | None = None
        self.closed = False

    def _end(self, code: int) -> None:
        if self.code is None:
            self.code = code
            self.out.put_nowait(None)
            self.ended.set()

    async def run_line(self, line: str, then_exit: bool = False) -> None:
        if line.strip() == "stty size":
            self.out.put_nowait(f"{self.rows} {self.cols}\r\n".encode())
            code = 0
        elif line.strip().startswith("exit"):
            self._end(int(line.split()[1]) if len(line.split()) > 1 else 0)
            return
        else:
            result = await self.backend.exec(self.handle, ExecRequest(command=line), self.ctx) if line.strip() else None
            code = result.exit_code if result else 0
            for text in (result.stdout, result.stderr) if result else ():
                if text:
                    self.out.put_nowait(text.replace("\n", "\r\n").encode())
        if then_exit:
            self._end(code)
        else:
            self.out.put_nowait(b"$ ")

    async def read(self) -> bytes:
        data = await self.out.get()
        if data is None:
            self.out.put_nowait(None)
            return b""
        return data

    def _check(self, what: str) -> None:
        if self.closed:
            raise SandboxStateError(f"cannot {what}: the PTY is closed")
        if self.code is not None:
            raise SandboxStateError(f"cannot {what}: the PTY's command has exited (exit code {self.code})")

    async def write(self, data: bytes) -> None:
        self._check("write to the PTY")
        for byte in data:
            if byte == 3:  # Ctrl-C
                self.line.clear()
                self.out.put_nowait(b"^C\r\n$ ")
            elif byte in (10, 13):
                self.out.put_nowait(b"\r\n")
                line, self.line = self.line.decode(errors="replace"), bytearray()
                await self.run_line(line)
                if self.code is not None:
                    return
            else:
                self.line.append(byte)
                self.out.put_nowait(bytes([byte]))

    async def resize(self, cols: int, rows: int) -> None:
        self._check("resize the PTY")
        self.cols, self.rows = cols, rows

    async def wait(self) -> int:
        await self.ended.wait()
        assert self.code is not None
        return self.code

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.task is not None:
            self.task.cancel()
        self._end(129)  # as a hangup would
