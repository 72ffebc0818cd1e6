"""The sync twin: a thin layer over the async client, with no logic of its own.

Each ``SyncDSecClient`` runs one event loop in a private thread and hands every call to the
async client there, so the two clients cannot drift apart.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

from ._client import DSecClient, OutputCallback, ProgressCallback, Sandbox  # noqa: F401 - (twins' signatures name them)
from ._files import SandboxFiles
from ._process import Process, Session
from ._pty import Pty
from ._watch import DirWatch
from .protocol import BuildResult, ExecEvent, FileEntry, FsEvent, ProcessInfo
from .protocol import DSecContainerRunArgs, ExecResult, ImageInfo, ImageList, PackDiffResult, PauseResult, SandboxInfo
from .protocol import DSecFullVMRunArgs, DSecMicroVMRunArgs, SnapshotInfo
from .protocol import ClusterStats, DSecFnCallArgs, FnCallResult, JobInfo, JobLog, NodeInfo, SandboxStatus
from ._projects import _SyncProjectMethods
from ._twin import twin_of

T = TypeVar("T")


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="libdsec-sync", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        """An async iterator as a blocking one; leaving it early closes the async one."""
        try:
            while True:
                try:
                    yield self.run(anext(agen))
                except StopAsyncIteration:
                    return
        finally:
            self.run(agen.aclose())  # type: ignore[attr-defined]

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


@twin_of(Process)
class SyncProcess:
    """Blocking twin of :class:`libdsec.Process`."""

    def __init__(self, runner: _LoopThread, process: Process) -> None:
        self._runner = runner
        self._run = runner.run
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def info(self) -> ProcessInfo:
        return self._process.info

    def stream(self, **kwargs: Any) -> Iterator[ExecEvent]:
        return self._runner.iterate(self._process.stream(**kwargs))

    def send_stdin(self, data: str | bytes) -> None:
        self._run(self._process.send_stdin(data))

    def close_stdin(self) -> None:
        self._run(self._process.close_stdin())

    def signal(self, sig: int) -> None:
        self._run(self._process.signal(sig))

    def kill(self) -> None:
        self._run(self._process.kill())

    def wait(self, **kwargs: Any) -> ProcessInfo:
        return self._run(self._process.wait(**kwargs))

    def refresh(self) -> ProcessInfo:
        return self._run(self._process.refresh())

    def __enter__(self) -> SyncProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self._run(self._process.__aexit__(*exc))


@twin_of(DirWatch)
class SyncDirWatch:
    """Blocking twin of :class:`libdsec.DirWatch`."""

    def __init__(self, runner: _LoopThread, watch: DirWatch) -> None:
        self._runner = runner
        self._run = runner.run
        self._watch = watch

    @property
    def id(self) -> int:
        return self._watch.id

    @property
    def ended(self) -> bool:
        return self._watch.ended

    @property
    def dropped(self) -> int:
        return self._watch.dropped

    def events(self, **kwargs: Any) -> list[FsEvent]:
        return self._run(self._watch.events(**kwargs))

    def __iter__(self) -> Iterator[FsEvent]:
        return self._runner.iterate(aiter(self._watch))

    def close(self) -> None:
        self._run(self._watch.close())

    def __enter__(self) -> SyncDirWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# aclose stops an async reading loop; a blocking loop closes its reader when it is left.
@twin_of(Pty, not_here=("aclose",))
class SyncPty:
    """Blocking twin of :class:`libdsec.Pty`."""

    def __init__(self, runner: _LoopThread, pty: Pty) -> None:
        self._runner = runner
        self._run = runner.run
        self._pty = pty

    @property
    def id(self) -> int:
        return self._pty.id

    @property
    def exit_code(self) -> int | None:
        return self._pty.exit_code

    def write(self, data: bytes | str) -> None:
        self._run(self._pty.write(data))

    def resize(self, cols: int, rows: int) -> None:
        self._run(self._pty.resize(cols, rows))

    def events(self, **kwargs: Any) -> Iterator[ExecEvent]:
        return self._runner.iterate(self._pty.events(**kwargs))

    def __iter__(self) -> Iterator[bytes]:
        return self._runner.iterate(self._pty)

    def wait(self) -> int:
        return self._run(self._pty.wait())

    def close(self) -> None:
        self._run(self._pty.close())

    def __enter__(self) -> SyncPty:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@twin_of(Session)
class SyncSession:
    """Blocking twin of :class:`libdsec.Session`."""

    def __init__(self, runner: _LoopThread, session: Session) -> None:
        self._run = runner.run
        self._session = session

    @property
    def id(self) -> int:
        return self._session.id

    def run_shell(self, command: str, **kwargs: Any) -> ExecResult:
        return self._run(self._session.run_shell(command, **kwargs))

    def interrupt(self) -> None:
        self._run(self._session.interrupt())

    def close(self) -> None:
        self._run(self._session.close())

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@twin_of(SandboxFiles)
class SyncFiles:
    """Blocking twin of ``Sandbox.files``."""

    def __init__(self, runner: _LoopThread, files: SandboxFiles) -> None:
        self._run = runner.run
        self._files = files

    def list(self, path: str) -> list[FileEntry]:
        return self._run(self._files.list(path))

    def stat(self, path: str) -> FileEntry:
        return self._run(self._files.stat(path))

    def remove(self, path: str, **kwargs: Any) -> None:
        self._run(self._files.remove(path, **kwargs))

    def make_dir(self, path: str) -> None:
        self._run(self._files.make_dir(path))

    def rename(self, src: str, dst: str) -> None:
        self._run(self._files.rename(src, dst))

    def upload_dir(self, local_dir: Any, path: str) -> None:
        self._run(self._files.upload_dir(local_dir, path))

    def download_dir(self, path: str, local_dir: Any) -> None:
        self._run(self._files.download_dir(path, local_dir))

    def upload_file(self, local_file: Any, path: str, **kwargs: Any) -> None:
        self._run(self._files.upload_file(local_file, path, **kwargs))

    def download_file(self, path: str, local_file: Any) -> None:
        self._run(self._files.download_file(path, local_file))


@twin_of(Sandbox)
class SyncSandbox:
    """Blocking twin of :class:`libdsec.Sandbox`."""

    def __init__(self, runner: _LoopThread, sandbox: Sandbox) -> None:
        self._runner = runner
        self._run = runner.run
        self._sandbox = sandbox

    @property
    def files(self) -> SyncFiles:
        return SyncFiles(self._runner, self._sandbox.files)

    @property
    def id(self) -> str:
        return self._sandbox.id

    @property
    def info(self) -> SandboxInfo:
        return self._sandbox.info

    @property
    def status(self) -> SandboxStatus:
        return self._sandbox.status

    def run_shell(self, command: str, **kwargs: Any) -> ExecResult:
        return self._run(self._sandbox.run_shell(command, **kwargs))

    def stream_shell(self, command: str, **kwargs: Any) -> Iterator[ExecEvent]:
        return self._runner.iterate(self._sandbox.stream_shell(command, **kwargs))

    def start_shell(self, command: str, **kwargs: Any) -> SyncProcess:
        return SyncProcess(self._runner, self._run(self._sandbox.start_shell(command, **kwargs)))

    def list_processes(self) -> list[ProcessInfo]:
        return self._run(self._sandbox.list_processes())

    def open_session(self, **kwargs: Any) -> SyncSession:
        return SyncSession(self._runner, self._run(self._sandbox.open_session(**kwargs)))

    def open_pty(self, **kwargs: Any) -> SyncPty:
        return SyncPty(self._runner, self._run(self._sandbox.open_pty(**kwargs)))

    def watch_dir(self, path: str, **kwargs: Any) -> SyncDirWatch:
        return SyncDirWatch(self._runner, self._run(self._sandbox.watch_dir(path, **kwargs)))

    def port_url(self, port: int) -> str:
        return self._sandbox.port_url(port)

    def connect_session(self, session_id: int) -> SyncSession:
        return SyncSession(self._runner, self._run(self._sandbox.connect_session(session_id)))

    def connect_process(self, pid: int) -> SyncProcess:
        return SyncProcess(self._runner, self._run(self._sandbox.connect_process(pid)))

    def write_file(self, path: str, data: bytes | str, **kwargs: Any) -> None:
        self._run(self._sandbox.write_file(path, data, **kwargs))

    def read_file(self, path: str) -> bytes:
        return self._run(self._sandbox.read_file(path))

    def pack_diff(self, name: str | None = None, *, role: str = "snapshot") -> PackDiffResult:
        return self._run(self._sandbox.pack_diff(name, role=role))

    def clean_copy(self, keep) -> SyncSandbox:
        return SyncSandbox(self._runner, self._run(self._sandbox.clean_copy(keep)))

    @property
    def clean_copy_result(self):
        return self._sandbox.clean_copy_result

    def fork(self, count: int = 1, **kwargs: Any) -> list:
        return [SyncSandbox(self._runner, child) if isinstance(child, Sandbox) else child
                for child in self._run(self._sandbox.fork(count, **kwargs))]

    @property
    def fork_result(self):
        return self._sandbox.fork_result

    def security_events(self) -> list:
        return self._run(self._sandbox.security_events())

    def set_network_rules(self, network_rules: dict) -> None:
        self._run(self._sandbox.set_network_rules(network_rules))

    def set_ttl(self, ttl_running_stop: float) -> SandboxInfo:
        return self._run(self._sandbox.set_ttl(ttl_running_stop))

    def refresh(self) -> SandboxInfo:
        return self._run(self._sandbox.refresh())

    def pause(self) -> PauseResult:
        return self._run(self._sandbox.pause())

    def resume(self) -> SandboxInfo:
        return self._run(self._sandbox.resume())

    def snapshot(self) -> SnapshotInfo:
        return self._run(self._sandbox.snapshot())

    def stop(self) -> None:
        self._run(self._sandbox.stop())

    def __enter__(self) -> SyncSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@twin_of(DSecClient)
class SyncDSecClient(_SyncProjectMethods):
    """Blocking twin of :class:`libdsec.DSecClient`; same arguments, same errors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._async = DSecClient(*args, **kwargs)
        self._runner: _LoopThread | None = None

    def _loop(self) -> _LoopThread:
        if self._runner is None:
            self._runner = _LoopThread()
        return self._runner

    def open(self) -> SyncDSecClient:
        self._loop().run(self._async.open())
        return self

    def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            runner.run(self._async.close())
            runner.stop()

    def __enter__(self) -> SyncDSecClient:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_container(self, args: DSecContainerRunArgs, **kwargs: Any) -> SyncSandbox:
        runner = self._loop()
        return SyncSandbox(runner, runner.run(self._async.run_container(args, **kwargs)))

    def run_microvm(self, args: DSecMicroVMRunArgs, **kwargs: Any) -> SyncSandbox:
        runner = self._loop()
        return SyncSandbox(runner, runner.run(self._async.run_microvm(args, **kwargs)))

    def run_vm(self, args: DSecFullVMRunArgs, **kwargs: Any) -> SyncSandbox:
        runner = self._loop()
        return SyncSandbox(runner, runner.run(self._async.run_vm(args, **kwargs)))

    def run_containers(
        self, args: DSecContainerRunArgs, *, count: int, progress: ProgressCallback | None = None, **kwargs: Any
    ) -> list[SyncSandbox]:
        runner = self._loop()
        made = runner.run(self._async.run_containers(args, count=count, progress=progress, **kwargs))
        return [SyncSandbox(runner, s) for s in made]

    def stop_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return self._loop().run(self._async.stop_sandbox(sandbox_id))

    def get_sandbox(self, sandbox_id: str) -> SyncSandbox:
        runner = self._loop()
        return SyncSandbox(runner, runner.run(self._async.get_sandbox(sandbox_id)))

    def list_sandboxes(self) -> list[SandboxInfo]:
        return self._loop().run(self._async.list_sandboxes())

    def list_images(self) -> ImageList:
        return self._loop().run(self._async.list_images())

    def inspect_image(self, ref: str) -> ImageInfo:
        return self._loop().run(self._async.inspect_image(ref))

    def remove_image(self, name: str) -> None:
        self._loop().run(self._async.remove_image(name))

    def gc_images(self) -> list[str]:
        return self._loop().run(self._async.gc_images())

    def build_image(self, name: str, dockerfile: str | os.PathLike | None = None,
                    context: str | os.PathLike | None = None, *, dockerfile_text: str | None = None,
                    build_args: dict[str, str] | None = None, no_cache: bool = False,
                    on_log: Callable[[str], None] | None = None, memory_limit_mb: int = 2048,
                    cpu_cores_limit: float = 1.0, timeout: float = 3600.0) -> BuildResult:
        return self._loop().run(self._async.build_image(
            name, dockerfile, context, dockerfile_text=dockerfile_text, build_args=build_args, no_cache=no_cache,
            on_log=on_log, memory_limit_mb=memory_limit_mb, cpu_cores_limit=cpu_cores_limit, timeout=timeout))

    def node_info(self, include_unready: bool = False) -> list[NodeInfo]:
        return self._loop().run(self._async.node_info(include_unready))

    def stats(self) -> ClusterStats:
        return self._loop().run(self._async.stats())

    def fncall(self, args: DSecFnCallArgs, **kwargs: Any) -> FnCallResult:
        return self._loop().run(self._async.fncall(args, **kwargs))

    def fncall_many(self, calls: Iterable[DSecFnCallArgs], **kwargs: Any) -> list[FnCallResult]:
        return self._loop().run(self._async.fncall_many(calls, **kwargs))

    def list_jobs(self) -> list[JobInfo]:
        return self._loop().run(self._async.list_jobs())

    def job_log(self, job: str, **kwargs: Any) -> JobLog:
        return self._loop().run(self._async.job_log(job, **kwargs))

    def remove_job(self, job: str) -> None:
        self._loop().run(self._async.remove_job(job))

    @property
    def replayed(self) -> int:
        return self._async.replayed
