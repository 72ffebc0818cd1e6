"""DSec as a Harbor environment: ``harbor run --env dsec.integrations.harbor:DSecEnvironment``
(``pip install dsec[harbor]``; Harbor needs Python 3.12). Environment kwargs (``--ek key=value``)
are ``DSecEnvironment``'s keyword arguments: ``endpoint``, ``token``, ``memory_mb``, ``cpus``,
``ttl_running_stop``, ``public_network``, ``build_args``.

One trial environment is one DSec container sandbox. Lifecycle, as Harbor's trial drives it:

- ``__init__`` checks the task and refuses, before anything starts, what DSec cannot do: a
  ``docker-compose.yaml`` (several containers), GPUs or TPUs, Windows, host mounts, SSH stream
  mode, and network allowlists of wildcards, CIDR ranges or IPv6 (Harbor's own validators
  raise from the capabilities this class declares; the compose check is ``_validate_definition``).
- ``start(force_build)`` builds ``environment/Dockerfile`` on the server with
  ``client.build_image`` (cached by content: the same Dockerfile and files return at once;
  ``force_build`` builds again) into an image named after the task, or takes the task's
  ``docker_image`` (a DSec image or a registry reference) as ``FROM`` of a one-line build; then
  creates the sandbox with the task's cpus, memory and storage and its network policy. A failed
  build raises Harbor's ``SandboxBuildFailedError`` naming DSec's reason, and nothing runs.
- ``exec`` runs ``bash -c COMMAND`` in the sandbox as Harbor's docker environment does
  (``docker compose exec -w CWD -e … -u USER main bash -c``): stderr merged into stdout, the
  output streamed to Harbor's output callbacks and kept whole, past ``timeout_sec`` a
  ``RuntimeError`` ("Command timed out after N seconds", docker's). The default user is the
  image's ``USER``; file transfers are made as root, as ``docker cp`` makes them.
- ``set_network_policy`` swaps the sandbox's allowlist while it runs (agent and verifier
  phases); ``stop(delete)`` stops the sandbox and closes the client; a second ``stop`` does
  nothing; any call after it raises ``SandboxStateError`` (a ``RuntimeError``).

Network: DSec sandboxes have no network unless their rules allow names. ``no-network`` is
that; ``allowlist`` of hostnames and IPv4 addresses becomes ``{"domains": [...]}`` (names the
node's network configuration knows, on its ``domain_ports``); ``public`` cannot be given (no
open internet): it runs with ``public_network`` rules, none by default, with a warning, or is
refused with ``--ek public_network=refuse``.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import shutil
import stat
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult, SandboxBuildFailedError
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
from harbor.environments.definition import require_agent_environment_definition, should_use_prebuilt_docker_image
from harbor.models.task.config import NetworkMode, NetworkPolicy
from harbor.models.trial.config import ResourceMode

from libdsec import (
    CommandTimeout,
    DSecClient,
    DSecContainerRunArgs,
    ImageBuildFailed,
    ImageNotFound,
    InvalidRequest,
    Sandbox,
    SandboxFileNotFound,
    SandboxNotFound,
    SandboxStateError,
)

__all__ = ["DSecEnvironment"]

ENVIRONMENT_TYPE = "dsec"
# What ``timeout_sec=None`` (docker: no limit) becomes: DSec's longest command timeout.
_NO_TIMEOUT_S = 24 * 3600
# Files up to this size go in one write; larger ones as a tree (the whole-file limit is 64 MiB).
_ONE_WRITE_BYTES = 16 << 20
_IMAGE_NAME_BAD = re.compile(r"[^a-z0-9._-]+")
TASK_LABEL = "harbor.task"
SESSION_LABEL = "harbor.session"


class DSecEnvironment(BaseEnvironment):
    """A Harbor trial's environment on one DSec sandbox (see the module docstring)."""

    def __init__(self, environment_dir: Path, environment_name: str, session_id: str, trial_paths: Any,
                 task_env_config: Any, *args: Any, endpoint: str | None = None, token: str | None = None,
                 memory_mb: int = 2048, cpus: float = 1.0, ttl_running_stop: float = 7200.0,
                 public_network: str | dict = "none", build_args: dict[str, str] | None = None,
                 **kwargs: Any) -> None:
        """``memory_mb`` and ``cpus``: what a task that names none gets (docker: no limit).
        ``public_network``: what a ``public`` network policy gets, as DSec ``network_rules``
        (a dict), ``"none"`` (no network, the default) or ``"refuse"`` (the task is refused)."""
        if public_network not in ("none", "refuse") and not isinstance(public_network, dict):
            raise ValueError(f"public_network must be 'none', 'refuse' or a dict of DSec network_rules, "
                             f"not {public_network!r}")
        self._public_network = public_network
        self._endpoint = endpoint
        self._token = token
        self._default_memory_mb = int(memory_mb)
        self._default_cpus = float(cpus)
        self._ttl_running_stop = float(ttl_running_stop)
        self._build_args = {str(k): str(v) for k, v in (build_args or {}).items()}
        self._client: DSecClient | None = None
        self._sandbox: Sandbox | None = None
        self._stopped = False
        self._image: str | None = None
        self._image_user: str | None = None
        self._warned_public = False
        super().__init__(environment_dir, environment_name, session_id, trial_paths, task_env_config, *args,
                         **kwargs)

    # -- what Harbor asks before anything starts -------------------------------------------------

    @staticmethod
    def type() -> str:
        return ENVIRONMENT_TYPE

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # Only what holds: no GPUs/TPUs, no Windows, no host mounts, no SSH, one container.
        # Allowlists: exact hostnames and IPv4 addresses (DSec's "domains" rules).
        return EnvironmentCapabilities(
            disable_internet=True, network_allowlist=True, network_allowlist_hostnames=True,
            network_allowlist_ipv4_addresses=True, dynamic_network_policy=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        # cpus: the sandbox's CPU weight (its commitment on the node) and a hard cap;
        # memory: the cgroup's limit.
        return EnvironmentResourceCapabilities(cpu_limit=True, cpu_request=True, memory_limit=True,
                                               fractional_cpus=True)

    def _validate_definition(self) -> None:
        compose = self.environment_dir / "docker-compose.yaml"
        if compose.exists() or (self.environment_dir / "docker-compose.yml").exists():
            raise ValueError(
                f"DSec runs a trial in one sandbox: task {self.environment_name!r} has "
                f"{compose.parent.name}/docker-compose.yaml (several containers), which the dsec "
                "environment does not run. Use Harbor's docker environment for compose tasks.")
        require_agent_environment_definition(self.environment_dir, docker_image=self.task_env_config.docker_image)

    def _validate_gpu_support(self) -> None:
        if self._effective_gpus > 0:
            raise RuntimeError(
                f"Task {self.environment_name!r} asks for {self._effective_gpus} GPU(s): DSec sandboxes have "
                "no GPUs. Run it on a GPU-capable Harbor environment.")

    def validate_network_policy_support(self, network_policy: NetworkPolicy | None = None) -> None:
        policy = network_policy or self._network_policy
        if policy.network_mode == NetworkMode.PUBLIC and self._public_network == "refuse":
            raise ValueError(
                "network_mode='public' is not supported by the dsec environment: DSec sandboxes have no open "
                "internet (public_network=refuse). Set [environment].network_mode to 'no-network' or "
                "'allowlist' in task.toml, or run with public_network=none.")
        super().validate_network_policy_support(network_policy)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        if self._stopped:
            raise SandboxStateError("this DSec environment was stopped: a stopped environment does not start again")
        if self._sandbox is not None:
            raise SandboxStateError(f"this DSec environment is running already (sandbox {self._sandbox.id})")
        client = await DSecClient(self._endpoint, token=self._token).open()
        try:
            image = await self._build(client, force_build)
            info = await client.inspect_image(image)
            self._image_user = info.user
            self._sandbox = await client.run_container(self._run_args(image, info.workdir),
                                                       timeout=max(120.0, self.task_env_config.build_timeout_sec))
        except BaseException:
            await client.close()
            raise
        self._client = client
        self.logger.info(f"DSec sandbox {self._sandbox.id} of image {image} started")
        # Harbor's output dirs (/logs/agent, /logs/verifier, …): made here, as by every provider
        # that does not mount them from the host.
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()

    async def _build(self, client: DSecClient, force_build: bool) -> str:
        config = self.task_env_config
        dockerfile = self.environment_dir / "Dockerfile"
        name = self._image_name()
        prebuilt = should_use_prebuilt_docker_image(self.environment_dir, docker_image=config.docker_image,
                                                    force_build=force_build)
        source = {"dockerfile_text": f"FROM {config.docker_image}\n"} if prebuilt else \
            {"dockerfile": dockerfile, "context": self.environment_dir}
        memory = self._limits()[0]
        try:
            result = await client.build_image(
                name, **source, build_args=self._build_args, no_cache=force_build and not prebuilt,
                on_log=lambda line: self.logger.debug(f"[build {name}] {line}"), memory_limit_mb=memory,
                timeout=max(60.0, min(config.build_timeout_sec, 24 * 3600.0)))
        except (ImageBuildFailed, ImageNotFound) as exc:
            what = f"FROM {config.docker_image}" if prebuilt else str(dockerfile)
            raise SandboxBuildFailedError(f"DSec could not build {what} of task {self.environment_name!r}: "
                                          f"{exc}") from exc
        self.logger.debug(f"DSec image {result.image} ({'cached' if result.cached else 'built'}, key {result.key})")
        return result.image

    def _image_name(self) -> str:
        slug = _IMAGE_NAME_BAD.sub("-", self.environment_name.lower()).strip("-._")[:80] or "task"
        return f"harbor-{slug}-{self.environment_id[:16]}"

    def _limits(self) -> tuple[int, float, float | None]:
        """Memory (MiB), CPU weight and CPU cap from the task, Harbor's overrides and modes."""
        memory = self._effective_memory_mb or self._default_memory_mb
        storage = self._effective_storage_mb
        if storage:  # a sandbox's writable layer holds half its memory limit (dsec.isolation.disk)
            memory = max(memory, 2 * storage)
        cpus = self._effective_cpus
        if cpus is None:
            return memory, self._default_cpus, None
        mode = self._cpu_resource_mode
        cap = None if mode == ResourceMode.REQUEST else float(cpus)
        return memory, float(cpus), cap

    def _run_args(self, image: str, image_workdir: str) -> DSecContainerRunArgs:
        memory, weight, cap = self._limits()
        return DSecContainerRunArgs(
            container_image=image, memory_limit_mb=memory, cpu_cores_limit=weight, cpu_cores_cap=cap,
            ttl_running_stop=self._ttl_running_stop, network_rules=self._rules(self._network_policy),
            # Root, so that files land as docker cp lands them; commands default to the image's USER.
            init_user="root", workdir=self.task_env_config.workdir or image_workdir, env=self._startup_env(),
            labels={TASK_LABEL: self.environment_name[:4096], SESSION_LABEL: self.session_id[:4096]})

    async def stop(self, delete: bool) -> None:
        """Stop the sandbox and close the client; a second call does nothing. The image stays
        in the store (cached by content) whatever ``delete`` says: ``dsec image gc`` frees it."""
        sandbox, client = self._sandbox, self._client
        self._sandbox = self._client = None
        self._stopped = True
        if client is None:
            return
        try:
            if sandbox is not None:
                await sandbox.stop()
        except SandboxNotFound:
            pass  # gone already (its TTL, an operator's stop)
        finally:
            await client.close()

    # -- network -------------------------------------------------------------------------------------

    def _rules(self, policy: NetworkPolicy) -> dict[str, bool | list[str]]:
        if policy.network_mode == NetworkMode.NO_NETWORK:
            return {}
        if policy.network_mode == NetworkMode.ALLOWLIST:
            return {"domains": list(policy.allowed_hosts)} if policy.allowed_hosts else {}
        if self._public_network == "refuse":  # (validate_network_policy_support refused it before)
            raise ValueError("network_mode='public' is refused by this dsec environment (public_network=refuse)")
        if isinstance(self._public_network, dict):
            return dict(self._public_network)
        if not self._warned_public:
            self._warned_public = True
            self.logger.warning(f"Task {self.environment_name!r} asks for public network: DSec sandboxes have no open "
                                "internet, so it runs with none (public_network=none).")
        return {}

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        if self._sandbox is not None:
            await self._sandbox.set_network_rules(self._rules(network_policy))

    # -- commands and files ----------------------------------------------------------------------

    def _running(self) -> Sandbox:
        if self._sandbox is None:
            state = "was stopped" if self._stopped else "is not started"
            raise SandboxStateError(f"this DSec environment {state}: it has no sandbox to use")
        return self._sandbox

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        sandbox = self._running()
        user = self._resolve_user(user)
        callback = self._output_callback()
        chunks: list[str] = []
        try:
            async for event in sandbox.stream_shell(
                    f"exec bash -c {shlex.quote(command)} 2>&1", timeout=min(timeout_sec or _NO_TIMEOUT_S, _NO_TIMEOUT_S),
                    env=self._merge_env(env), workdir=cwd or self.task_env_config.workdir,
                    user=str(user) if user is not None else self._image_user, max_output_bytes=0):
                if event.event in ("stdout", "stderr"):
                    chunks.append(event.data)
                    if callback is not None:
                        await callback(event.data, "stdout")
                elif event.event == "exit" and event.result is not None:
                    return ExecResult(stdout="".join(chunks) or None, stderr=None, return_code=event.result.exit_code)
        except CommandTimeout as exc:  # docker's words for it
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from exc
        except InvalidRequest as exc:  # no such user or working dir: docker exec's failed result
            return ExecResult(stdout=f"{exc}\n", stderr=None, return_code=126)
        raise SandboxStateError(f"the command's stream in DSec sandbox {sandbox.id} ended without its exit")

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        sandbox = self._running()
        source = Path(source_path)
        target = target_path
        if target.endswith("/") or await self._is_dir_as_root(sandbox, target):
            target = str(PurePosixPath(target) / source.name)
        size = source.stat().st_size
        if size <= _ONE_WRITE_BYTES:
            await sandbox.write_file(target, await asyncio.to_thread(source.read_bytes),
                                     mode=stat.S_IMODE(source.stat().st_mode))
            return
        with tempfile.TemporaryDirectory(prefix="dsec-harbor-") as tmp:
            staged = Path(tmp) / PurePosixPath(target).name
            await asyncio.to_thread(shutil.copy2, source, staged)
            await sandbox.files.upload_dir(tmp, str(PurePosixPath(target).parent))

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self._running().files.upload_dir(source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._running().read_file(source_path)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(target.write_bytes, data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self._running().files.download_dir(source_dir, target_dir)

    async def is_dir(self, path: str, user: str | int | None = None) -> bool:
        if user is not None:  # what that user sees (permissions on the way): a command as them
            return await super().is_dir(path, user=user)
        return await self._is_dir_as_root(self._running(), path)

    async def is_file(self, path: str, user: str | int | None = None) -> bool:
        if user is not None:
            return await super().is_file(path, user=user)
        try:
            kind = (await self._running().files.stat(path)).type
        except SandboxFileNotFound:
            return False
        if kind not in ("dir", "file"):
            return await super().is_file(path, user="root")
        return kind == "file"

    async def _is_dir_as_root(self, sandbox: Sandbox, path: str) -> bool:
        try:
            kind = (await sandbox.files.stat(path)).type
        except SandboxFileNotFound:
            return False
        if kind not in ("dir", "file"):  # a link: test -d follows it
            return await super().is_dir(path, user="root")
        return kind == "dir"

    @property
    def sandbox_id(self) -> str | None:
        """The running sandbox's id (None before ``start`` and after ``stop``)."""
        return self._sandbox.id if self._sandbox is not None else None

