"""A Gymnasium environment over DSec sandboxes: ``SandboxEnv(client, image=…, task=…)``.

One episode is one sandbox. ``reset(seed=…)`` stops the last episode's sandbox (if any),
creates a new one from ``image`` — or branches from a snapshot image, ``reset(options={"image":
snapshot.image})`` — runs the task's ``setup`` (``options={"key": …}``: the create's idempotency
key, so that a retried reset, or one of a resumed job, gets the same sandbox) and returns the first observation (the task's
instruction) and info (the image; ``env.sandbox`` is the episode's sandbox). ``step(action)`` runs the action and returns
``(observation, reward, terminated, truncated, info)``. An action is a shell command (text), or
a tool call dict: ``{"tool": "shell", "command": …}``, ``{"tool": "write_file", "path": …,
"content": …}``, ``{"tool": "read_file", "path": …}``, ``{"tool": "submit"}``. The episode
terminates on ``submit`` and is truncated after ``task.max_steps`` steps; then the reward comes
from the task's grader, run in a clean copy of the sandbox (``Sandbox.clean_copy(keep=task.keep)``:
the image's own layers plus only the agent's changes under the kept paths, so an agent that
replaced ``/bin/sh`` cannot forge it): ``task.reward`` when it exits 0, else 0. Other steps
reward 0. ``close()`` stops the sandbox (a second ``close()`` does nothing).

Observations are text (``gymnasium.spaces.Text`` over printable ASCII, at most
``max_observation`` characters): ``exit N`` and the output, other characters shown as ``?``.

Two ways to drive it: with a ``SyncDSecClient`` the plain methods block (what
``gymnasium.utils.env_checker.check_env`` and most trainers call), and the async twins
(``areset``, ``astep``, ``aclose``) work from any event loop; with an async ``DSecClient``,
use the async twins from that client's loop (``asyncio.gather`` over many envs is a rollout).
Needs the ``gym`` extra (``pip install 'dsec[gym]'``).
"""

from __future__ import annotations

import asyncio
import string
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import gymnasium
from gymnasium import spaces

from ._client import DSecClient, Sandbox
from ._errors import InvalidRequest
from ._sync import SyncDSecClient
from .protocol import DSecContainerRunArgs

T = TypeVar("T")
CHARSET = frozenset(string.printable)


@dataclass(frozen=True)
class Task:
    """What an episode is about. ``grader``: a shell command run in the clean copy (exit 0:
    solved), from a place the agent could not write (an image path outside ``keep``);
    ``keep``: the paths that carry the agent's work into the copy (they must exist after
    ``setup``)."""

    instruction: str
    grader: str
    keep: list[str]
    setup: str | None = None
    workdir: str | None = None
    max_steps: int = 20
    reward: float = 1.0
    command_timeout: float = 60.0
    run_args: dict = field(default_factory=dict)  # more DSecContainerRunArgs fields (memory_limit_mb, …)


def _text(value: str, limit: int) -> str:
    """``value``'s last ``limit`` characters, those outside the space's charset as ``?``."""
    return "".join(c if c in CHARSET else "?" for c in value[-limit:])


class SandboxEnv(gymnasium.Env):
    metadata = {"render_modes": []}

    def __init__(self, client: DSecClient | SyncDSecClient, *, image: str, task: Task,
                 max_observation: int = 8192, max_action: int = 65536) -> None:
        if isinstance(client, SyncDSecClient):
            self._client, self._runner = client._async, client._loop()
        elif isinstance(client, DSecClient):
            self._client, self._runner = client, None
        else:
            raise InvalidRequest(f"SandboxEnv needs a DSecClient or SyncDSecClient, not {type(client).__name__}")
        if not task.keep:
            raise InvalidRequest("a task needs keep paths: what of the agent's work the grader sees")
        self.image = image
        self.task = task
        self.max_observation = max_observation
        self.observation_space = spaces.Text(max_length=max_observation, min_length=0, charset="".join(sorted(CHARSET)))
        self.action_space = spaces.Text(max_length=max_action, min_length=1, charset="".join(sorted(CHARSET)))
        self.sandbox: Sandbox | None = None
        self.steps = 0
        self._done = False

    # -- the sync face (a SyncDSecClient's loop thread runs the async one) ---------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._runner is None:
            coro.close()
            raise InvalidRequest("this SandboxEnv has an async DSecClient: await areset/astep/aclose "
                                 "(or give it a SyncDSecClient)")
        return self._runner.run(coro)

    async def _on_client_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._runner is None:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._runner.loop))

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        return self._run(self._reset(options))

    def step(self, action: str | dict) -> tuple[str, float, bool, bool, dict]:
        return self._run(self._step(action))

    def close(self) -> None:
        if self.sandbox is not None:
            self._run(self._close())

    # -- the async twins -------------------------------------------------------------------

    async def areset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        return await self._on_client_loop(self._reset(options))

    async def astep(self, action: str | dict) -> tuple[str, float, bool, bool, dict]:
        return await self._on_client_loop(self._step(action))

    async def aclose(self) -> None:
        await self._on_client_loop(self._close())

    # -- the episode -----------------------------------------------------------------------

    async def _reset(self, options: dict | None) -> tuple[str, dict]:
        await self._close()
        options = options or {}
        unknown = set(options) - {"image", "key"}
        if unknown:
            raise InvalidRequest(f"unknown reset options {sorted(unknown)}: 'image' (a snapshot to branch from), "
                                 "'key' (the create's idempotency key)")
        image = options.get("image", self.image)
        args = DSecContainerRunArgs(container_image=image, **self.task.run_args)
        self.sandbox = await self._client.run_container(args, key=options.get("key"))
        self.steps, self._done = 0, False
        if self.task.setup:
            setup = await self.sandbox.run_shell(self.task.setup, workdir=self.task.workdir,
                                                 timeout=self.task.command_timeout)
            if setup.exit_code != 0:
                raise InvalidRequest(f"the task's setup failed (exit {setup.exit_code}): {setup.stderr[-300:]}")
        return _text(self.task.instruction, self.max_observation), {"image": image}

    async def _step(self, action: str | dict) -> tuple[str, float, bool, bool, dict]:
        if self.sandbox is None or self._done:
            raise InvalidRequest("step() before reset(), or after the episode ended: call reset()")
        self.steps += 1
        tool, call = _tool_call(action)
        info: dict = {"tool": tool, "step": self.steps}  # (the same for the same actions: env_checker)
        terminated = tool == "submit"
        if tool == "shell":
            result = await self.sandbox.run_shell(call["command"], workdir=self.task.workdir,
                                                  timeout=self.task.command_timeout)
            info["exit_code"] = result.exit_code
            observation = f"exit {result.exit_code}\n{result.stdout}{result.stderr}"
        elif tool == "write_file":
            await self.sandbox.write_file(call["path"], call["content"])
            observation = f"wrote {call['path']}"
        elif tool == "read_file":
            observation = (await self.sandbox.read_file(call["path"])).decode(errors="replace")
        else:
            observation = "submitted"
        truncated = not terminated and self.steps >= self.task.max_steps
        reward = 0.0
        if terminated or truncated:
            self._done = True
            solved = await self.grade()
            info["solved"] = solved
            reward = self.task.reward if solved else 0.0
        return _text(observation, self.max_observation), reward, terminated, truncated, info

    async def grade(self) -> bool:
        """The task's grader, run in a clean copy of the episode's sandbox: whether it exits 0."""
        assert self.sandbox is not None
        async with await self.sandbox.clean_copy(keep=self.task.keep) as grader:
            result = await grader.run_shell(self.task.grader, workdir=self.task.workdir,
                                            timeout=self.task.command_timeout)
        return result.exit_code == 0

    async def _close(self) -> None:
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            await sandbox.stop()


def _tool_call(action: str | dict) -> tuple[str, dict]:
    if isinstance(action, str):
        if not action.strip():
            raise InvalidRequest("an empty action: give a shell command or a tool call dict")
        return "shell", {"command": action}
    if not isinstance(action, dict):
        raise InvalidRequest(f"an action is a shell command (str) or a tool call (dict), not {type(action).__name__}")
    tool = action.get("tool")
    needs = {"shell": ("command",), "write_file": ("path", "content"), "read_file": ("path",), "submit": ()}
    if tool not in needs:
        raise InvalidRequest(f"unknown tool {tool!r}: one of {', '.join(needs)}")
    missing = [k for k in needs[tool] if not isinstance(action.get(k), str)]
    if missing:
        raise InvalidRequest(f"tool call {tool!r} needs {', '.join(missing)} (text)")
    return tool, action
