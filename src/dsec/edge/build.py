"""A node's Dockerfile builds (``Edge.build_image``): the plan of ``dsec.images.dockerfile`` run in
one sandbox of its base image, through the node's own calls (create, exec, tree upload,
``pack_diff``, stop), and what its steps changed packed as one ``step`` layer on the base's.

Cache: the image is kept in the store under ``dockerfile-<key>`` as well as its own name, the
key being the plan's content key and the base's layers; a build of the same key finds it and
runs nothing (a second trial of the same task starts at once, on any node of the store). Two
builds of one key run once: on one node they share the first one's run; across nodes they take
a lock file in the store in turn, and the second finds the first's image.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import fcntl
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

from libdsec import BackendError, DSecContainerRunArgs, DSecError, ImageBuildFailed, ImageNotFound, InvalidRequest
from libdsec.protocol import (
    MAX_BUILD_CONTEXT_BYTES,
    BuildImageRequest,
    BuildResult,
    ExecEvent,
    ExecRequest,
    ExecResult,
    SandboxKind,
)

from ..images import dockerfile, registry
from ..images.store import Image, LayerStore

LOG_TAIL_CHARS = 3000
# A FROM naming no image of the store is pulled from a registry when it looks like a reference.
_REFERENCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*\Z")


def cache_name(key: str) -> str:
    return f"dockerfile-{key[:32]}"


class Log:
    """The build's log: lines for the caller's stream, and the end kept for an error."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[ExecEvent | None] = asyncio.Queue()
        self.tail = ""

    def __call__(self, text: str) -> None:
        if not text.endswith("\n"):
            text += "\n"
        self.tail = (self.tail + text)[-LOG_TAIL_CHARS:]
        self.queue.put_nowait(ExecEvent(event="stdout", data=text))


class ImageBuilder:
    """Dockerfile builds on one node. ``edge`` is the node's own sandbox calls (an ``EdgeAPI``)."""

    def __init__(self, edge, store: LayerStore) -> None:
        self.edge, self.store = edge, store
        self._running: dict[str, asyncio.Task[BuildResult]] = {}  # by content key
        self._tasks: set[asyncio.Task] = set()  # builds whose callers may have gone

    async def build(self, request: BuildImageRequest, project: str) -> AsyncIterator[ExecEvent]:
        """The build's events: ``started``, its log, then ``exit`` (the ``BuildResult`` as the
        result's stdout) or ``error``. Bad input fails before ``started``, as a plain error. A
        caller that goes away does not stop the build: it ends (within its timeout) and is
        kept, for the next build of the same content."""
        log = Log()
        work = Path(tempfile.mkdtemp(prefix="build-", dir=self.store.tmp_dir))
        try:
            await asyncio.to_thread(unpack_context, request.context_b64, work)
            # A first look (no key: the copied files are read once, below, when the base is known).
            plan = await asyncio.to_thread(dockerfile.plan, request.dockerfile, work, request.build_args, None, False)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, work, True)
            raise
        started = time.monotonic()
        yield ExecEvent(event="started")
        task = asyncio.create_task(self._build_in(work, request, plan, project, log))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        while True:
            getter = asyncio.ensure_future(log.queue.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                break
            yield getter.result()
        while not log.queue.empty():
            yield log.queue.get_nowait()
        try:
            result = task.result()
        except DSecError as exc:
            yield ExecEvent(event="error", error=exc.to_wire()["error"])
            return
        except Exception as exc:  # noqa: BLE001 - said to the caller, as the node's other failures are
            yield ExecEvent(event="error", error=BackendError(f"the build failed: {exc}").to_wire()["error"])
            return
        result = result.model_copy(update={"duration_s": round(time.monotonic() - started, 3)})
        yield ExecEvent(event="exit", result=ExecResult(exit_code=0, stdout=result.model_dump_json(), stderr="",
                                                        duration_s=result.duration_s))

    async def _build_in(self, work: Path, request: BuildImageRequest, plan: dockerfile.BuildPlan, project: str,
                        log: Log) -> BuildResult:
        try:
            return await self._build_once(request, plan, work, project, log)
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)

    async def _build_once(self, request: BuildImageRequest, plan: dockerfile.BuildPlan, work: Path, project: str,
                          log: Log) -> BuildResult:
        for note in plan.notes:
            log(f"note: {note}")
        base = await self._base(plan.base, log)
        # Read again now that the base is known: its ENV is what $NAME in the Dockerfile sees.
        plan = await asyncio.to_thread(dockerfile.plan, request.dockerfile, work, request.build_args, base.env)
        key = hashlib.sha256(f"{plan.key}\0{','.join(base.layers)}{_commands(request)}".encode()).hexdigest()
        if not request.no_cache:
            cached = self._cached(key, request.name, log)
            if cached is not None:
                return cached
        # One run a key on this node (a second build of it waits for the first, then finds it).
        running = self._running.get(key)
        if running is not None:
            log(f"the same build ({key[:12]}) is running: waiting for it")
            await asyncio.shield(running)
            return self._cached(key, request.name, log) or await self._build_once(request, plan, work, project, log)
        task = asyncio.ensure_future(self._locked_run(request, plan, base, key, work, project, log))
        self._running[key] = task
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._running.pop(key, None)
            else:
                task.add_done_callback(lambda _: self._running.pop(key, None))

    async def _locked_run(self, request: BuildImageRequest, plan: dockerfile.BuildPlan, base: Image, key: str,
                          work: Path, project: str, log: Log) -> BuildResult:
        """The run, under the store's lock file for the key (another node's build of it waits)."""
        locks = self.store.root / "locks"  # (as LayerStore.locked's, polled: this loop must not block)
        locks.mkdir(exist_ok=True)
        fd = os.open(locks / f"build-{key[:32]}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(0.2)
            if not request.no_cache and (cached := self._cached(key, request.name, log)) is not None:
                return cached  # built meanwhile, elsewhere
            return await self._run(request, plan, base, key, work, project, log)
        finally:
            os.close(fd)

    def _cached(self, key: str, name: str, log: Log) -> BuildResult | None:
        if not self.store.has_image(cache_name(key)):
            return None
        image = self.store.get_image(cache_name(key))
        self._name(image, name)
        log(f"cached: {cache_name(key)} (nothing changed)")
        return BuildResult(image=name, cached=True, key=key, layers=len(image.layers))

    def _name(self, image: Image, name: str) -> None:
        if name != image.name:
            self.store.put_image(replace(image, name=name))

    async def _base(self, ref: str, log: Log) -> Image:
        """The FROM image: the store's of that name, else pulled from a registry (kept as
        ``from-<digest of the reference>``, so the next build takes it from the store)."""
        if self.store.has_image(ref):
            return self.store.get_image(ref)
        pulled = f"from-{hashlib.sha256(ref.encode()).hexdigest()[:24]}"
        if self.store.has_image(pulled):
            return self.store.get_image(pulled)
        if not _REFERENCE.match(ref):
            raise ImageNotFound(f"FROM {ref}: no such image in the store, and no registry reference")
        log(f"FROM {ref}: not in the store; pulling it")
        try:
            return await asyncio.to_thread(registry.pull, self.store, pulled, ref, log=log,
                                           insecure=_on_loopback(ref))
        except DSecError as exc:
            raise ImageNotFound(f"FROM {ref}: no image of that name in the store (dsec image ls), and pulling it "
                                f"from a registry failed: {exc}") from None

    async def _run(self, request: BuildImageRequest, plan: dockerfile.BuildPlan, base: Image, key: str, work: Path,
                   project: str, log: Log) -> BuildResult:
        deadline = time.monotonic() + request.timeout
        env = {**base.env, **plan.env}
        config = dict(env=env, workdir=plan.workdir or base.workdir, user=plan.user or base.user,
                      setuid=base.setuid, start_cmd=request.start_cmd, ready_cmd=request.ready_cmd)
        if not plan.steps:  # only config: the base's layers under a new config
            image = replace(base, name=cache_name(key), parent=base.name, **config)
            self.store.put_image(image)
            self._name(image, request.name)
            return BuildResult(image=request.name, cached=False, key=key, layers=len(image.layers))
        # As root in /: each step names its own user and directory (the base's USER may not be root).
        args = DSecContainerRunArgs(container_image=base.name, memory_limit_mb=request.memory_limit_mb,
                                    cpu_cores_limit=request.cpu_cores_limit, ttl_running_stop=request.timeout + 600,
                                    init_user="root", workdir="/")
        info = await self.edge.create(args, SandboxKind.container, project)
        sid = info.id
        log(f"building in sandbox {sid} over {base.name}")
        try:
            for n, step in enumerate(plan.steps, 1):
                log(f"step {n}/{len(plan.steps)}: {step.text[:200]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ImageBuildFailed(f"the build took over {request.timeout:g} s (at line {step.line}); "
                                           f"its log ends:\n{log.tail}")
                if isinstance(step, dockerfile.Copy):
                    try:
                        await self._copy(sid, step, work)
                    except ImageBuildFailed:
                        raise
                    except DSecError as exc:
                        raise ImageBuildFailed(f"line {step.line} ({step.text[:120]!r}) could not run: {exc.message}; "
                                               f"the build's log ends:\n{log.tail}") from None
                else:
                    await self._exec(sid, step, base.env, left, log)
            log("packing the changes")
            packed = await self.edge.pack_diff(sid, None, "step")
        finally:
            try:
                await self.edge.stop(sid, "image build done")
            except DSecError:
                pass
        image = replace(self.store.get_image(packed.image), name=cache_name(key), **config)
        self.store.put_image(image)  # (over the one a build with no_cache replaces)
        self.store.remove_image(packed.image)
        self._name(image, request.name)
        return BuildResult(image=request.name, cached=False, key=key, layers=len(image.layers))

    async def _copy(self, sid: str, step: dockerfile.Copy, work: Path) -> None:
        into_dir = step.into_dir
        if not into_dir:  # one file to a path that may be a directory of the image's
            try:
                into_dir = (await self.edge.stat_path(sid, step.dest)).type == "dir"
            except DSecError:
                into_dir = False
        data = await asyncio.to_thread(dockerfile.context_tar, work, step, into_dir)
        target = step.dest if into_dir else os.path.dirname(step.dest) or "/"
        await self.edge.upload_tree(sid, target, data)
        if step.chown:
            names = [m.name for m in tarfile.open(fileobj=io.BytesIO(data)).getmembers()]
            paths = [os.path.join(target, n) for n in names] or [target]
            await self._checked(sid, f"chown -h {shlex.quote(step.chown)} -- {' '.join(shlex.quote(p) for p in paths)}",
                                f"line {step.line}: --chown={step.chown}")

    async def _exec(self, sid: str, step: dockerfile.Run, base_env: dict[str, str], timeout: float, log: Log) -> None:
        request = ExecRequest(command=step.command, env={**base_env, **dict(step.env)}, workdir=step.workdir,
                              user=step.user, timeout=timeout, max_output_bytes=64 << 10)
        result: ExecResult | None = None
        async for event in self.edge.exec_stream(sid, request):
            if event.event in ("stdout", "stderr") and event.data:
                log(event.data)
            elif event.event == "exit":
                result = event.result
            elif event.event == "error":
                raise ImageBuildFailed(f"line {step.line} ({step.text[:120]!r}) could not run: "
                                       f"{(event.error or {}).get('message', '')}; the build's log ends:\n{log.tail}")
        if result is None or result.exit_code != 0:
            code = "none" if result is None else result.exit_code
            raise ImageBuildFailed(f"line {step.line} ({step.text[:120]!r}) failed with exit code {code}; "
                                   f"the build's log ends:\n{log.tail}")

    async def _checked(self, sid: str, command: str, what: str) -> None:
        result = await self.edge.exec(sid, ExecRequest(command=command, timeout=600))
        if result.exit_code != 0:
            raise ImageBuildFailed(f"{what} failed: {(result.stderr or result.stdout)[-1000:]}")


def _on_loopback(ref: str) -> bool:
    """A registry on this node's loopback (``localhost:5000/…``, ``127.0.0.1:…``) is spoken to in
    plain HTTP, as such a registry serves; any other with TLS checked. Credentials are the
    server's usual auth file (``REGISTRY_AUTH_FILE``, …: docs/COMPAT.md)."""
    host = ref.split("/", 1)[0] if "/" in ref else ""
    host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return host in ("localhost", "[::1]", "::1") or host.startswith("127.")


def _commands(request: BuildImageRequest) -> str:
    """The start and ready commands' part of the key (none: nothing, as before they existed)."""
    if request.start_cmd is None and request.ready_cmd is None:
        return ""
    return "\0" + json.dumps([request.start_cmd, request.ready_cmd])


def unpack_context(context_b64: str, dest: Path) -> None:
    """The build context (a tar, plain or gzip, base64) unpacked into ``dest``: members with
    absolute paths, ``..``, links out of the context or devices are refused, naming them."""
    if not context_b64:
        return
    try:
        data = base64.b64decode(context_b64, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("the build context is not base64") from None
    if len(data) > MAX_BUILD_CONTEXT_BYTES:
        raise InvalidRequest(f"the build context is over {MAX_BUILD_CONTEXT_BYTES >> 20} MiB")
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(dest, filter=_refuse_outside)
    except tarfile.TarError as exc:
        raise InvalidRequest(f"the build context is not a usable tar archive: {exc}") from None


def _refuse_outside(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo:
    try:
        return tarfile.data_filter(member, path)
    except tarfile.FilterError as exc:
        raise InvalidRequest(f"the build context has {member.name!r}, which {_why(exc)}") from None


def _why(exc: tarfile.FilterError) -> str:
    if isinstance(exc, (tarfile.AbsoluteLinkError, tarfile.LinkOutsideDestinationError)):
        return "links out of the context"
    if isinstance(exc, (tarfile.AbsolutePathError, tarfile.OutsideDestinationError)):
        return "is outside the context"
    if isinstance(exc, tarfile.SpecialFileError):
        return "is a device or other special file"
    return str(exc)

