"""The sync twin: a thin layer over the async client, with no logic of its own.

Each ``SyncDSecClient`` runs one event loop in a private thread and hands every call to the
async client there, so the two clients cannot drift apart.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from ._client import DSecClient, ProgressCallback, Sandbox
from .protocol import DSecContainerRunArgs, ExecResult, ImageInfo, ImageList, PackDiffResult, PauseResult, SandboxInfo
from .protocol import DSecFullVMRunArgs, DSecMicroVMRunArgs, SnapshotInfo
from .protocol import ClusterStats, DSecFnCallArgs, FnCallResult
from ._projects import _SyncProjectMethods

T = TypeVar("T")


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="libdsec-sync", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class SyncSandbox:
    """Blocking twin of :class:`libdsec.Sandbox`."""

    def __init__(self, runner: _LoopThread, sandbox: Sandbox) -> None:
        self._run = runner.run
        self._sandbox = sandbox

    @property
    def id(self) -> str:
        return self._sandbox.id

    @property
    def info(self) -> SandboxInfo:
        return self._sandbox.info

    def run_shell(self, command: str, **kwargs: Any) -> ExecResult:
        return self._run(self._sandbox.run_shell(command, **kwargs))

    def write_file(self, path: str, data: bytes | str, **kwargs: Any) -> None:
        self._run(self._sandbox.write_file(path, data, **kwargs))

    def read_file(self, path: str) -> bytes:
        return self._run(self._sandbox.read_file(path))

    def pack_diff(self, name: str | None = None, *, role: str = "snapshot") -> PackDiffResult:
        return self._run(self._sandbox.pack_diff(name, role=role))

    def security_events(self) -> list:
        return self._run(self._sandbox.security_events())

    def set_network_rules(self, network_rules: dict) -> None:
        self._run(self._sandbox.set_network_rules(network_rules))

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

    def stats(self) -> ClusterStats:
        return self._loop().run(self._async.stats())

    def fncall(self, args: DSecFnCallArgs, **kwargs: Any) -> FnCallResult:
        return self._loop().run(self._async.fncall(args, **kwargs))

    def fncall_many(self, calls: Iterable[DSecFnCallArgs], **kwargs: Any) -> list[FnCallResult]:
        return self._loop().run(self._async.fncall_many(calls, **kwargs))
