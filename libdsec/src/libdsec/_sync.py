"""The sync twin: a thin layer over the async client, with no logic of its own.

Each ``SyncDSecClient`` runs one event loop in a private thread and hands every call to the
async client there, so the two clients cannot drift apart.
"""

from __future__ import annotations

import asyncio
import os  # noqa: F401
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator  # noqa: F401
from typing import Any, TypeVar

# The twins take their originals' signatures (``_twin``): the names those annotations use are
# imported here too, for the tools that read them (pdoc, IDEs).
from ._client import DSecClient, OutputCallback, ProgressCallback, Sandbox  # noqa: F401
from ._desktop import Desktop
from ._files import SandboxFiles
from ._process import Process, Session
from ._pty import Pty
from ._watch import DirWatch
from .protocol import BuildResult, ExecEvent, FileEntry, FsEvent, ProcessInfo  # noqa: F401
from .protocol import DSecContainerRunArgs, ExecResult, ImageInfo, ImageList, PackDiffResult, PauseResult, SandboxInfo  # noqa: F401,E501
from .protocol import DSecFullVMRunArgs, DSecMicroVMRunArgs, Snapshot, SnapshotInfo, SnapshotMode  # noqa: F401
from .protocol import ClusterStats, DSecFnCallArgs, FnCallResult, JobInfo, JobLog, NodeInfo, SandboxStatus  # noqa: F401
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


@twin_of(Process, forward="_process")
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

    def __enter__(self) -> SyncProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self._run(self._process.__aexit__(*exc))


@twin_of(DirWatch, forward="_watch")
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

    def __iter__(self) -> Iterator[FsEvent]:
        return self._runner.iterate(aiter(self._watch))

    def close(self) -> None:
        self._run(self._watch.close())

    def __enter__(self) -> SyncDirWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# aclose stops an async reading loop; a blocking loop closes its reader when it is left.
@twin_of(Pty, not_here=("aclose",), forward="_pty")
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

    def events(self, **kwargs: Any) -> Iterator[ExecEvent]:
        return self._runner.iterate(self._pty.events(**kwargs))

    def __iter__(self) -> Iterator[bytes]:
        return self._runner.iterate(self._pty)

    def close(self) -> None:
        self._run(self._pty.close())

    def __enter__(self) -> SyncPty:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@twin_of(Session, forward="_session")
class SyncSession:
    """Blocking twin of :class:`libdsec.Session`."""

    def __init__(self, runner: _LoopThread, session: Session) -> None:
        self._run = runner.run
        self._session = session

    @property
    def id(self) -> int:
        return self._session.id

    def close(self) -> None:
        self._run(self._session.close())

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@twin_of(SandboxFiles, forward="_files")
class SyncFiles:
    """Blocking twin of ``Sandbox.files``."""

    def __init__(self, runner: _LoopThread, files: SandboxFiles) -> None:
        self._run = runner.run
        self._files = files


@twin_of(Desktop, forward="_desktop")
class SyncDesktop:
    """Blocking twin of ``Sandbox.desktop``."""

    def __init__(self, runner: _LoopThread, desktop: Desktop) -> None:
        self._run = runner.run
        self._desktop = desktop


@twin_of(Sandbox, forward="_sandbox")
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
    def desktop(self) -> SyncDesktop:
        return SyncDesktop(self._runner, self._sandbox.desktop)

    @property
    def id(self) -> str:
        return self._sandbox.id

    @property
    def info(self) -> SandboxInfo:
        return self._sandbox.info

    @property
    def status(self) -> SandboxStatus:
        return self._sandbox.status

    def stream_shell(self, command: str, **kwargs: Any) -> Iterator[ExecEvent]:
        return self._runner.iterate(self._sandbox.stream_shell(command, **kwargs))

    def start_shell(self, command: str, **kwargs: Any) -> SyncProcess:
        return SyncProcess(self._runner, self._run(self._sandbox.start_shell(command, **kwargs)))

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

    def __enter__(self) -> SyncSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@twin_of(DSecClient, forward="_async")
class SyncDSecClient:
    """Blocking twin of :class:`libdsec.DSecClient`; same arguments, same errors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._async = DSecClient(*args, **kwargs)
        self._runner: _LoopThread | None = None

    def _loop(self) -> _LoopThread:
        if self._runner is None:
            self._runner = _LoopThread()
        return self._runner

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop().run(coro)

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

    def get_sandbox(self, sandbox_id: str) -> SyncSandbox:
        runner = self._loop()
        return SyncSandbox(runner, runner.run(self._async.get_sandbox(sandbox_id)))

    @property
    def replayed(self) -> int:
        return self._async.replayed
