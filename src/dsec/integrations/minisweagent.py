"""``DSecEnvironment``: mini-swe-agent's ``Environment`` on DSec (``pip install dsec[harnesses]``).

Selected in mini-swe-agent's config (or with ``--environment-class``)::

    environment:
      environment_class: dsec.integrations.minisweagent.DSecEnvironment
      image: python

It does what mini-swe-agent's ``DockerEnvironment`` does, on a DSec sandbox: the sandbox is
made in ``__init__``; each action runs in a fresh ``bash -lc`` there (``interpreter``), so only
files carry over from one action to the next; stderr is merged into stdout; ``execute`` returns
``{"output", "returncode", "exception_info"}``; a command past its timeout is killed and comes
back as returncode -1 with ``exception_info``, not as an exception; output whose first line is
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (exit code 0) raises ``Submitted`` with the rest as the
submission. A failure of the platform itself (server gone, sandbox lost) raises DSec's typed
error instead of becoming an observation: the run ends with it as its exit status, rather than
an agent talking to a dead sandbox.

Lifecycle: ``__init__`` creates the sandbox or raises (``ImageNotFound``, ``ServerUnavailable``,
``Unauthenticated``, ``LimitOutOfRange``, …) leaving nothing behind; ``execute`` any number of
times; ``cleanup()`` stops the sandbox and closes the client, a second ``cleanup()`` does
nothing, and ``execute`` after it raises ``SandboxStateError``. mini-swe-agent's runners never
call ``cleanup()``: they drop the environment and count on ``__del__`` (docker's starts a
detached ``docker stop``). So ``__del__`` hands the stop to a thread of its own and returns (no
I/O in the collector), an ``atexit`` hook stops those still alive when the process ends, and
the sandbox's idle TTL (``sandbox_args={"ttl_running_stop": …}``) stops it if the process is killed.
"""

from __future__ import annotations

import atexit
import logging
import os
import platform
import shlex
import threading
import weakref
from typing import Any, Literal

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel, Field

from libdsec import CommandTimeout, DSecError, SandboxNotFound, SandboxStateError, SyncDSecClient, SyncSandbox
from libdsec.protocol import RUN_ARGS_BY_KIND

__all__ = ["DSecEnvironment", "DSecEnvironmentConfig"]

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class DSecEnvironmentConfig(BaseModel):
    """Docker's fields that mean something on DSec, and DSec's own. Unknown keys are ignored,
    as by every mini-swe-agent config: a benchmark's config carries docker's."""

    image: str = "python"
    cwd: str = "/"
    env: dict[str, str] = {}
    forward_env: list[str] = []  # the host's variables of these names, when set (``env`` wins)
    timeout: int = 30
    interpreter: list[str] = ["bash", "-lc"]
    kind: Literal["container", "microvm", "fullvm"] = "container"
    endpoint: str | None = None  # DSEC_ENDPOINT, else the local default
    # DSEC_TOKEN, else the local state dir's token file. Never dumped: the config goes into
    # every trajectory file and the prompt templates' variables.
    token: str | None = Field(default=None, exclude=True, repr=False)
    memory_limit_mb: int = 2048
    cpu_cores_limit: float = 1.0
    # More of DSecContainerRunArgs's fields (ttl_running_stop, network_rules, …); not named
    # run_args, docker's list of `docker run` flags, which a config may carry.
    sandbox_args: dict[str, Any] = {}
    startup_timeout: float = 120.0


class DSecEnvironment:
    def __init__(self, *, config_class: type = DSecEnvironmentConfig, logger: logging.Logger | None = None,
                 **kwargs: Any) -> None:
        """See ``DSecEnvironmentConfig`` for the keyword arguments."""
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self._client: SyncDSecClient | None = None
        self._sandbox: SyncSandbox | None = None
        self.config = config_class(**kwargs)
        config = self.config
        args = RUN_ARGS_BY_KIND[config.kind](
            container_image=config.image, workdir=config.cwd, memory_limit_mb=config.memory_limit_mb,
            cpu_cores_limit=config.cpu_cores_limit, **config.sandbox_args)
        client = SyncDSecClient(config.endpoint, token=config.token)
        create = {"container": client.run_container, "microvm": client.run_microvm, "fullvm": client.run_vm}
        try:
            client.open()
            self._sandbox = create[config.kind](args, timeout=config.startup_timeout)
        except BaseException:
            client.close()
            raise
        self._client = client
        _live.add(self)
        self.logger.info(f"Started DSec {config.kind} {self._sandbox.id} of {config.image}")

    @property
    def sandbox_id(self) -> str | None:
        """The sandbox's id; None once cleaned up."""
        return self._sandbox.id if self._sandbox is not None else None

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` in a fresh interpreter in the sandbox; the result as a dict."""
        if self._sandbox is None:
            raise SandboxStateError("this DSecEnvironment was cleaned up: its sandbox is stopped")
        forwarded = {key: value for key in self.config.forward_env if (value := os.getenv(key)) is not None}
        # `exec … 2>&1`: one pipe for both streams, so they interleave as docker's subprocess
        # sees them, and no shell stays between DSec and the interpreter.
        line = f"exec {shlex.join([*self.config.interpreter, action.get('command', '')])} 2>&1"
        try:
            result = self._sandbox.run_shell(line, workdir=cwd or self.config.cwd, env=forwarded | self.config.env,
                                             timeout=timeout or self.config.timeout)
            output = {"output": result.stdout, "returncode": result.exit_code, "exception_info": ""}
        except CommandTimeout as e:  # docker's subprocess.TimeoutExpired, caught as docker does
            output = {
                "output": "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict) -> None:
        """Raises Submitted if the output says the task is done (docker's rule, word for word)."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}}
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                },
                "sandbox_id": self.sandbox_id,
            }
        }

    def cleanup(self) -> None:
        """Stop the sandbox and close the client; a second call does nothing."""
        sandbox, client = self._take()
        if client is not None:
            _stop(sandbox, client)

    def __del__(self) -> None:
        # Never blocks: the collector may run this on any thread, the client's own loop included.
        sandbox, client = self._take()
        if client is not None:
            try:
                threading.Thread(target=_stop_quietly, args=(sandbox, client, self.logger),
                                 name="dsec-environment-cleanup").start()
            except RuntimeError:  # the interpreter is past starting threads: the TTL stops it
                pass

    def _take(self) -> tuple[SyncSandbox | None, SyncDSecClient | None]:
        # getattr: __del__ also runs on an instance whose __init__ failed early.
        sandbox, client = getattr(self, "_sandbox", None), getattr(self, "_client", None)
        if client is not None:  # else nothing to take, and late in shutdown _live may be gone
            self._sandbox = self._client = None
            _live.discard(self)
        return sandbox, client


def _stop(sandbox: SyncSandbox | None, client: SyncDSecClient) -> None:
    try:
        if sandbox is not None:
            sandbox.stop()
    except SandboxNotFound:
        pass  # gone already (its TTL, an operator's stop)
    finally:
        client.close()


def _stop_quietly(sandbox: SyncSandbox | None, client: SyncDSecClient, logger: logging.Logger) -> None:
    try:
        _stop(sandbox, client)
    except DSecError as e:
        logger.warning(f"Stopping DSec sandbox {sandbox.id if sandbox else '?'} failed: {e}")


# Environments not cleaned up yet, stopped when the process ends (``mini`` keeps its own to the end).
_live: weakref.WeakSet[DSecEnvironment] = weakref.WeakSet()


@atexit.register
def _cleanup_live() -> None:
    for env in list(_live):
        _stop_quietly(*env._take(), env.logger)
