"""DSec as an Inspect (inspect-ai) sandbox environment: ``Task(..., sandbox="dsec")``, or
``sandbox=("dsec", "dsec.yaml")`` with a config file, or ``SandboxEnvironmentSpec("dsec",
DSecSandboxConfig(...))``. ``pip install dsec`` declares this module under the ``inspect_ai``
entry point group, so Inspect imports it (and ``@sandboxenv`` registers "dsec") on its own.

Lifecycle, as Inspect drives it: ``task_init`` once per config (is the image there?);
``sample_init`` makes one DSec sandbox per sample, with a client of its own; ``sample_cleanup``
stops it and closes the client (Inspect skips it under ``--no-sandbox-cleanup``);
``task_cleanup`` stops any sandbox of the batch still running, or, without cleanup, names them
for ``inspect sandbox cleanup dsec ID``; ``cli_cleanup`` stops one sandbox by id, or every
sandbox an eval made (they carry the ``inspect_ai.task`` label).

``exec`` keeps Inspect's docker semantics: the command runs as ``exec cmd…`` in the sandbox's
``/bin/sh`` (so ``cmd[0]`` goes through the sandbox's ``PATH``), each output stream keeps its
last ``MAX_EXEC_OUTPUT_SIZE`` bytes, a timeout raises ``TimeoutError`` with the partial output
as ``truncated_output``, an unknown user or working dir is a failed result (exit 126), and a
file that is not executable is a ``PermissionError``.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import posixpath
import shlex
import uuid
from logging import getLogger
from pathlib import Path
from typing import Any, Literal, Union, overload

import yaml
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUnavailableError,
    sandboxenv,
)
from inspect_ai.util._sandbox.lifecycle import sandbox_lifecycle_state
from pydantic import BaseModel, ConfigDict, Field

from libdsec import (
    CommandTimeout,
    DSecClient,
    DSecContainerRunArgs,
    DSecError,
    DSecFullVMRunArgs,
    DSecMicroVMRunArgs,
    InvalidRequest,
    Sandbox,
    SandboxFileNotFound,
    SandboxLost,
    SandboxNotFound,
    SandboxStateError,
)

__all__ = ["DSecSandboxConfig", "DSecSandboxEnvironment"]

logger = getLogger(__name__)

# What Inspect's ``timeout=None`` (no limit) becomes: DSec's longest command timeout.
_NO_TIMEOUT_S = 24 * 3600
# Labels every sandbox of an eval carries: the task, and which process made it.
TASK_LABEL = "inspect_ai.task"
RUN_LABEL = "inspect_ai.run"
_RUN_ID = uuid.uuid4().hex[:12]
# A command longer than this goes as a script file: one argument of sh -c may not be longer than
# Linux's MAX_ARG_STRLEN (128 KiB), where docker exec passes each argument on its own.
_MAX_COMMAND_BYTES = 100_000
_RUN_ARGS = {"container": DSecContainerRunArgs, "microvm": DSecMicroVMRunArgs, "fullvm": DSecFullVMRunArgs}


class DSecSandboxConfig(BaseModel):
    """The sandbox each sample gets (as a model, or a YAML file of the same fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str = "python"
    kind: Literal["container", "microvm", "fullvm"] = "container"
    memory_limit_mb: int = 1024
    cpu_cores_limit: float = 1.0
    user: str = "root"  # who runs a command given no user
    workdir: str = "/"  # where relative paths and commands given no cwd land (made if missing)
    env: dict[str, str] = Field(default_factory=dict)
    network_rules: dict[str, bool | list[str]] = Field(default_factory=dict)  # default: no network
    ttl_running_stop: float = 3600.0  # stopped after this long without a call: evals that died
    endpoint: str | None = None  # DSEC_ENDPOINT, else the local default
    token: str | None = None  # DSEC_TOKEN, else the local state dir's token file

    def client(self) -> DSecClient:
        return DSecClient(self.endpoint, self.token)


class _Batch:
    """What one eval batch keeps across its tasks (Inspect's lifecycle state): config files
    read in their task's directory, and the sandboxes made and not yet cleaned up."""

    def __init__(self) -> None:
        self.configs: dict[str, DSecSandboxConfig] = {}
        self.live: dict[str, DSecSandboxConfig] = {}


_OUTSIDE_AN_EVAL = _Batch()


def _batch() -> _Batch:
    state = sandbox_lifecycle_state()
    return _OUTSIDE_AN_EVAL if state is None else state.get(_Batch)


def _config(config: SandboxEnvironmentConfigType | None) -> DSecSandboxConfig:
    if config is None:
        return DSecSandboxConfig()
    if isinstance(config, DSecSandboxConfig):
        return config
    if isinstance(config, str):
        loaded = _batch().configs.get(config)
        return loaded if loaded is not None else DSecSandboxConfig.model_validate(yaml.safe_load(Path(config).read_text()) or {})
    raise ValueError(f"the dsec sandbox takes a DSecSandboxConfig or a YAML file, not {type(config).__name__}")


class _Tail:
    """The last ``limit`` bytes of a stream, as Inspect's docker sandbox keeps them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = bytearray()

    def add(self, text: str) -> None:
        self.kept += text.encode()
        if len(self.kept) > 2 * self.limit:  # trimmed now and then: linear in what streams past
            del self.kept[: -self.limit]

    @property
    def text(self) -> str:
        return bytes(self.kept[-self.limit:]).decode(errors="replace")


@sandboxenv(name="dsec")
class DSecSandboxEnvironment(SandboxEnvironment):
    """One DSec sandbox of a sample."""

    def __init__(self, client: DSecClient, sandbox: Sandbox, config: DSecSandboxConfig) -> None:
        super().__init__()
        self.client = client
        self.sandbox = sandbox
        self.config = config

    @classmethod
    def config_files(cls) -> list[str]:
        return ["dsec.yaml"]

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return DSecSandboxConfig(**config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        # Inspect calls this in the task's directory: a relative config file is read here.
        resolved = _config(config)
        if isinstance(config, str):
            _batch().configs[config] = resolved
        async with resolved.client() as client:
            await client.inspect_image(resolved.image)  # ImageNotFound before any sample starts

    @classmethod
    async def sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                          metadata: dict[str, str]) -> dict[str, SandboxEnvironment]:
        resolved = _config(config)
        args = _RUN_ARGS[resolved.kind](
            container_image=resolved.image, memory_limit_mb=resolved.memory_limit_mb,
            cpu_cores_limit=resolved.cpu_cores_limit, init_user=resolved.user, workdir=resolved.workdir,
            env=resolved.env, network_rules=resolved.network_rules, ttl_running_stop=resolved.ttl_running_stop,
            labels={TASK_LABEL: task_name[:4096], RUN_LABEL: _RUN_ID},
        )
        client = await resolved.client().open()
        try:
            sandbox = await {"container": client.run_container, "microvm": client.run_microvm,
                             "fullvm": client.run_vm}[resolved.kind](args)
        except BaseException:
            await client.close()
            raise
        _batch().live[sandbox.id] = resolved
        environments: dict[str, SandboxEnvironment] = {"default": cls(client, sandbox, resolved)}
        if resolved.workdir != "/":
            try:  # the image need not have it: made, as docker makes a WORKDIR
                await sandbox.files.make_dir(resolved.workdir)
            except BaseException:
                await cls.sample_cleanup(task_name, config, environments, True)
                raise
        return environments

    @classmethod
    async def sample_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                             environments: dict[str, SandboxEnvironment], interrupted: bool) -> None:
        for environment in environments.values():
            env = environment.as_type(DSecSandboxEnvironment)
            try:
                await env.sandbox.stop()
                _batch().live.pop(env.sandbox.id, None)
            except DSecError as exc:
                logger.warning("could not stop DSec sandbox %s: %s", env.sandbox.id, exc)
            finally:
                await env.client.close()

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool) -> None:
        resolved = _config(config)
        live = _batch().live
        left = [sandbox_id for sandbox_id, made_with in live.items() if made_with == resolved]
        if not left:
            return
        if not cleanup:
            print("DSec sandboxes left running (stop them with `inspect sandbox cleanup dsec ID`):", *left)
            return
        async with resolved.client() as client:
            for sandbox_id in left:
                await _stop(client, sandbox_id)
                live.pop(sandbox_id, None)

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """``inspect sandbox cleanup dsec [ID]``, with DSEC_ENDPOINT / DSEC_TOKEN: that sandbox,
        or every sandbox of the project an Inspect eval made."""
        async with DSecClient() as client:
            ids = [id] if id else [s.id for s in await client.list_sandboxes() if TASK_LABEL in s.labels]
            for sandbox_id in ids:
                await _stop(client, sandbox_id)

    async def exec(self, cmd: list[str], input: str | bytes | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, user: str | None = None, timeout: int | None = None,
                   timeout_retry: bool = True, concurrency: bool = True) -> ExecResult[str]:
        if not cmd:
            raise ValueError("exec needs a command")
        command = "exec " + shlex.join(cmd)
        if isinstance(input, bytes):
            try:
                input = input.decode()
            except UnicodeDecodeError:  # stdin travels as text: these bytes go as base64
                command = f"/usr/bin/base64 -d | {command}"
                input = base64.b64encode(input).decode("ascii")
        script = None
        if len(command.encode()) > _MAX_COMMAND_BYTES:
            script = f"/tmp/.dsec-inspect-{uuid.uuid4().hex}.sh"
            await self.sandbox.write_file(script, command)
            command = f". {script}"
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        stdout, stderr = _Tail(limit), _Tail(limit)
        try:
            result = await self.sandbox.run_shell(
                command, timeout=min(timeout or _NO_TIMEOUT_S, _NO_TIMEOUT_S), env=env, workdir=self._path(cwd or "."),
                user=user, stdin=input, max_output_bytes=0, on_stdout=stdout.add, on_stderr=stderr.add)
        except CommandTimeout as exc:
            error = TimeoutError(f"Command timed out after {timeout} seconds")
            if partial := stdout.text + stderr.text:
                setattr(error, "truncated_output", partial)
            raise error from exc
        except InvalidRequest as exc:  # no such user or working dir: docker exec's exit 126
            return ExecResult(success=False, returncode=126, stdout="", stderr=f"{exc}\n")
        except (SandboxNotFound, SandboxStateError, SandboxLost) as exc:  # stopped (its TTL), died, node lost
            raise SandboxUnavailableError(f"DSec sandbox {self.sandbox.id} cannot execute: {exc}") from exc
        finally:
            if script is not None:
                with contextlib.suppress(DSecError):
                    await self.sandbox.files.remove(script)
        errors = stderr.text
        if result.exit_code == 126 and errors.strip().endswith(f"exec: {cmd[0]}: Permission denied") \
                and len(errors.strip().splitlines()) == 1:
            raise PermissionError(errno.EACCES, f"Permission denied executing command: {errors.strip()}", cmd[0])
        return ExecResult(success=result.exit_code == 0, returncode=result.exit_code, stdout=stdout.text,
                          stderr=errors)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        path = self._path(file)
        try:
            entry = await self.sandbox.files.stat(path)
        except SandboxFileNotFound:
            mode = 0o644
        else:
            if entry.type == "dir":
                raise IsADirectoryError(errno.EISDIR, "Is a directory.", file)
            mode = entry.mode & 0o7777  # an existing file keeps its mode, as with tee
        try:
            await self.sandbox.write_file(path, contents, mode=mode)
        except InvalidRequest as exc:
            raise _os_error(exc, file) from exc

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> Union[str, bytes]:
        path = self._path(file)
        try:
            entry = await self.sandbox.files.stat(path)
            if entry.type == "dir":
                raise IsADirectoryError(errno.EISDIR, "Is a directory.", file)
            if entry.size > SandboxEnvironmentLimits.MAX_READ_FILE_SIZE:
                raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
            if entry.type == "file" and not entry.mode & 0o400:  # as docker: unreadable to its owner
                raise PermissionError(errno.EACCES, "Permission denied.", file)
            data = await self.sandbox.read_file(path)
        except SandboxFileNotFound as exc:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory.", file) from exc
        except InvalidRequest as exc:
            raise _os_error(exc, file) from exc
        return data.decode("utf-8") if text else data

    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        command = ["dsec", "shell", self.sandbox.id, *(["--user", user] if user else []), "--command", "bash -l"]
        prefix = f"DSEC_ENDPOINT={shlex.quote(self.config.endpoint)} " if self.config.endpoint else ""
        return SandboxConnection(type="dsec", command=prefix + shlex.join(command), container=self.sandbox.id)

    def default_polling_interval(self) -> float:
        return 0.2

    def _path(self, file: str) -> str:
        return posixpath.normpath(posixpath.join(self.config.workdir, file))


def _os_error(exc: InvalidRequest, file: str) -> Exception:
    """DSec's refusal of a file call as the ``OSError`` Inspect's callers expect."""
    message = str(exc).lower()
    if "directory" in message:
        return IsADirectoryError(errno.EISDIR, "Is a directory.", file)
    if "permission denied" in message or "read-only" in message:
        return PermissionError(errno.EACCES, "Permission denied.", file)
    if "limit" in message:
        return OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
    return exc


async def _stop(client: DSecClient, sandbox_id: str) -> None:
    try:
        await (await client.get_sandbox(sandbox_id)).stop()
    except DSecError as exc:
        logger.warning("could not stop DSec sandbox %s: %s", sandbox_id, exc)
