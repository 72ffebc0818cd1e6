"""``DSecDeployment``: SWE-ReX's deployment interface on DSec (``pip install dsec[swerex]``).

``start()`` creates a sandbox and waits until SWE-ReX's runtime answers in it; ``runtime`` is
then a ``RemoteRuntime`` on ``<endpoint>/v1/sandboxes/<id>/swerex``; ``stop()`` closes the
runtime's sessions and stops the sandbox. Lifecycle: ``start`` once (a second start raises
``RuntimeError``), ``stop`` any number of times (a stopped or never started one does nothing).
``async with DSecDeployment(...) as deployment`` starts and stops it.

SWE-agent takes it as ``DSecDeploymentConfig(image=…).get_deployment()``.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import DeploymentNotStartedError, DeploymentStartupError
from swerex.runtime.abstract import IsAliveResponse
from swerex.runtime.remote import RemoteRuntime

from libdsec import DSecClient, DSecContainerRunArgs, default_token

__all__ = ["DSecDeployment", "DSecDeploymentConfig"]


class DSecDeploymentConfig(BaseModel):
    """Where and what to start (``run_args``: more of ``DSecContainerRunArgs``'s fields)."""

    model_config = ConfigDict(extra="forbid")

    image: str = "swe-agent"  # `python`, `less`, `git`, as SWE-agent's tasks assume (`dsec image build swe-agent`)
    endpoint: str | None = None  # DSEC_ENDPOINT, else the local default
    token: str | None = None  # DSEC_TOKEN, else the local state dir's
    memory_limit_mb: int = 2048
    cpu_cores_limit: float = 1.0
    run_args: dict[str, Any] = {}
    startup_timeout: float = 60.0
    runtime_timeout: float = 30.0  # RemoteRuntime's own timeout (its is_alive checks)
    type: Literal["dsec"] = "dsec"

    def get_deployment(self) -> DSecDeployment:
        return DSecDeployment.from_config(self)


class DSecDeployment(AbstractDeployment):
    def __init__(self, *, logger: logging.Logger | None = None, **kwargs: Any) -> None:
        self._config = DSecDeploymentConfig(**kwargs)
        self.logger = logger or logging.getLogger("dsec.swerex")
        self._hooks = CombinedDeploymentHook()
        self._client: DSecClient | None = None
        self._sandbox = None
        self._runtime: RemoteRuntime | None = None

    @classmethod
    def from_config(cls, config: DSecDeploymentConfig) -> DSecDeployment:
        return cls(**config.model_dump(exclude={"type"}))

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox_id(self) -> str:
        if self._sandbox is None:
            raise DeploymentNotStartedError()
        return self._sandbox.id

    @property
    def runtime(self) -> RemoteRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        if self._client is not None:
            raise RuntimeError("this DSecDeployment was started already")
        config = self._config
        token = config.token or default_token()
        if not token:
            raise DeploymentStartupError("no DSec token: pass token=, or set DSEC_TOKEN")
        self._client = await DSecClient(config.endpoint, token=token).open()
        try:
            self._hooks.on_custom_step(f"Starting a DSec sandbox of {config.image}")
            args = DSecContainerRunArgs(container_image=config.image, memory_limit_mb=config.memory_limit_mb,
                                        cpu_cores_limit=config.cpu_cores_limit, **config.run_args)
            self._sandbox = await self._client.run_container(args)
            self._runtime = RemoteRuntime(host=f"{self._client.endpoint}/v1/sandboxes/{self._sandbox.id}/swerex",
                                          port=None, auth_token=token, timeout=config.runtime_timeout,
                                          logger=self.logger)
            self._hooks.on_custom_step("Starting runtime")
            await self._runtime.wait_until_alive(timeout=config.startup_timeout)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        runtime, sandbox, client = self._runtime, self._sandbox, self._client
        self._runtime = self._sandbox = self._client = None
        try:
            if runtime is not None:
                try:
                    await runtime.close()
                except Exception as exc:  # the sandbox is stopped anyway
                    self.logger.warning("closing the runtime's sessions failed: %s", exc)
            if sandbox is not None:
                await sandbox.stop()
        finally:
            if client is not None:
                await client.close()

    async def __aenter__(self) -> DSecDeployment:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
