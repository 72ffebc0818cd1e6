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
``DesktopEnv(client, image="desktop", task=DesktopTask(...), snapshot=NAME)`` is the computer-use
twin: observations are the screen (and the accessibility tree), actions are dicts (click, type,
press, scroll, drag, wait, done), and every episode starts from one snapshot of a ready desktop
(its docstring, docs/RL.md).

Needs the ``gym`` extra (``pip install 'dsec[gym]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import string
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import gymnasium
import numpy
from gymnasium import spaces

from ._client import DSecClient, Sandbox
from ._errors import InvalidRequest, SnapshotNotFound
from ._sync import SyncDSecClient
from .protocol import DesktopSpec, DSecContainerRunArgs, check_snapshot_name

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


class _Env(gymnasium.Env):
    """What both environments share: the client (sync or async), the sync face and its async
    twins, and the episode's sandbox. A subclass gives ``_reset``, ``_step`` and ``_close``."""

    metadata = {"render_modes": []}

    def __init__(self, client: DSecClient | SyncDSecClient) -> None:
        if isinstance(client, SyncDSecClient):
            self._client, self._runner = client._async, client._loop()
        elif isinstance(client, DSecClient):
            self._client, self._runner = client, None
        else:
            raise InvalidRequest(f"{type(self).__name__} needs a DSecClient or SyncDSecClient, "
                                 f"not {type(client).__name__}")
        self.sandbox: Sandbox | None = None
        self.steps = 0
        self._done = False

    # -- the sync face (a SyncDSecClient's loop thread runs the async one) ---------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._runner is None:
            coro.close()
            raise InvalidRequest(f"this {type(self).__name__} has an async DSecClient: await areset/astep/aclose "
                                 "(or give it a SyncDSecClient)")
        return self._runner.run(coro)

    async def _on_client_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._runner is None:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._runner.loop))

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        return self._run(self._reset(options))

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        return self._run(self._step(action))

    def close(self) -> None:
        self._run(self._close())

    # -- the async twins -------------------------------------------------------------------

    async def areset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        return await self._on_client_loop(self._reset(options))

    async def astep(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        return await self._on_client_loop(self._step(action))

    async def aclose(self) -> None:
        await self._on_client_loop(self._close())

    async def _reset(self, options: dict | None) -> tuple[Any, dict]:
        raise NotImplementedError

    async def _step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        raise NotImplementedError

    async def _close(self) -> None:
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            await sandbox.stop()

    async def _graded(self, task: Task | DesktopTask) -> bool:
        """The task's grader, run in a clean copy of the episode's sandbox: whether it exits 0."""
        assert self.sandbox is not None
        async with await self.sandbox.clean_copy(keep=task.keep) as grader:
            result = await grader.run_shell(task.grader, workdir=task.workdir, timeout=task.command_timeout)
        return result.exit_code == 0


class SandboxEnv(_Env):
    def __init__(self, client: DSecClient | SyncDSecClient, *, image: str, task: Task,
                 max_observation: int = 8192, max_action: int = 65536) -> None:
        super().__init__(client)
        if not task.keep:
            raise InvalidRequest("a task needs keep paths: what of the agent's work the grader sees")
        self.image = image
        self.task = task
        self.max_observation = max_observation
        self.observation_space = spaces.Text(max_length=max_observation, min_length=0, charset="".join(sorted(CHARSET)))
        self.action_space = spaces.Text(max_length=max_action, min_length=1, charset="".join(sorted(CHARSET)))

    def close(self) -> None:
        if self.sandbox is not None:
            self._run(self._close())

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
        return await self._graded(self.task)


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


# -- a desktop: computer use ------------------------------------------------------------------

@dataclass(frozen=True)
class DesktopTask:
    """What a computer-use episode is about. ``setup``: a shell command run once, in the
    desktop that every episode then starts from (its files kept as a snapshot); ``launch``:
    desktop entries started at each episode's start, each with a file or URL after a space if
    given (``org.xfce.mousepad /home/user/note.txt``), waited for until their windows show; ``grader`` and ``keep`` as ``Task``'s (the grader runs in a clean
    copy: exit 0, solved)."""

    instruction: str
    grader: str
    keep: list[str]
    setup: str | None = None
    launch: tuple[str, ...] = ()
    workdir: str | None = None
    max_steps: int = 30
    reward: float = 1.0
    command_timeout: float = 60.0
    desktop: DesktopSpec = field(default_factory=DesktopSpec)
    run_args: dict = field(default_factory=dict)  # more DSecContainerRunArgs fields (memory_limit_mb, …)


ACTIONS: dict[str, dict[str, type | tuple[type, ...]]] = {
    # action -> its fields and their types (those not in OPTIONAL are required)
    "click": {"x": int, "y": int, "button": str, "count": int},
    "type": {"text": str},
    "press": {"keys": str},
    "scroll": {"dy": int, "dx": int, "x": int, "y": int},
    "drag": {"x": int, "y": int, "to_x": int, "to_y": int, "button": str},
    "wait": {"seconds": (int, float)},
    "done": {},
}
OPTIONAL = frozenset({("click", "x"), ("click", "y"), ("click", "button"), ("click", "count"), ("scroll", "dy"), ("scroll", "dx"), ("scroll", "x"),
                      ("scroll", "y"), ("drag", "button")})
MAX_WAIT_S = 60.0


def check_desktop_action(action: object, width: int, height: int) -> dict:
    """``action`` if it is a valid desktop action for a screen of ``width`` x ``height``;
    else ``InvalidRequest`` naming the field at fault."""
    if not isinstance(action, dict):
        raise InvalidRequest(f"a desktop action is a dict with an 'action' field, not {type(action).__name__}")
    name = action.get("action")
    if name not in ACTIONS:
        raise InvalidRequest(f"action: {name!r} is not one of {', '.join(ACTIONS)}")
    fields = ACTIONS[name]
    unknown = sorted(set(action) - set(fields) - {"action"})
    if unknown:
        raise InvalidRequest(f"{unknown[0]}: not a field of {name!r} (its fields: {', '.join(fields) or 'none'})")
    for key, kind in fields.items():
        if key not in action:
            if (name, key) not in OPTIONAL:
                raise InvalidRequest(f"{key}: {name!r} needs it")
            continue
        value = action[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise InvalidRequest(f"{key}: {value!r} is not {getattr(kind, '__name__', 'a number')}")
        if key in ("x", "to_x") and not 0 <= value < width or key in ("y", "to_y") and not 0 <= value < height:
            raise InvalidRequest(f"{key}: {value} is outside the {width}x{height} screen")
    if ("x" in action) != ("y" in action):
        raise InvalidRequest(f"{'y' if 'x' in action else 'x'}: give both x and y, or neither")
    if name == "wait" and not 0 <= action["seconds"] <= MAX_WAIT_S:
        raise InvalidRequest(f"seconds: {action['seconds']} is outside 0-{MAX_WAIT_S:.0f}")
    if name == "scroll" and not action.get("dy") and not action.get("dx"):
        raise InvalidRequest("dy: a scroll needs dy or dx, not zero")
    if name in ("type", "press") and not action[next(iter(fields))]:
        raise InvalidRequest(f"{next(iter(fields))}: empty")
    return action


class DesktopActions(spaces.Space):
    """The space of desktop actions (dicts: ``{"action": "click", "x": 10, "y": 20}``, see
    ``ACTIONS``). ``sample()`` gives a pointer move-free action a trainer may take anywhere: a
    click, a scroll or a wait of none."""

    def __init__(self, width: int, height: int, seed: int | None = None) -> None:
        super().__init__(None, None, seed)
        self.width, self.height = width, height

    def sample(self, mask: Any = None, probability: Any = None) -> dict:
        kind = int(self.np_random.integers(3))
        x, y = int(self.np_random.integers(self.width)), int(self.np_random.integers(self.height))
        if kind == 0:
            return {"action": "click", "x": x, "y": y}
        if kind == 1:
            return {"action": "scroll", "dy": int(self.np_random.integers(1, 4)), "x": x, "y": y}
        return {"action": "wait", "seconds": 0}

    def contains(self, x: Any) -> bool:
        try:
            check_desktop_action(x, self.width, self.height)
        except InvalidRequest:
            return False
        return True

    @property
    def is_np_flattenable(self) -> bool:
        return False


_NO_BLINK = ('mkdir -p "$HOME/.config/gtk-3.0" && f="$HOME/.config/gtk-3.0/settings.ini" && '
             '{ grep -q "^\\[Settings\\]" "$f" 2>/dev/null || echo "[Settings]" >> "$f"; } && '
             'echo "gtk-cursor-blink = false" >> "$f"')


class DesktopEnv(_Env):
    """A computer-use environment: one episode is one desktop sandbox, every one started from
    the same desktop. The first ``reset()`` makes that desktop once: a sandbox of ``image``
    with the task's desktop, its ``setup`` run, then a filesystem snapshot of it named
    ``snapshot`` (made unless one of that name exists; removed by ``close()`` if this env made
    it); each episode is a new sandbox from that snapshot (run args ``snapshot=``), its
    ``launch`` apps started and the screen let settle. The ready desktop has GTK's text cursor
    blink off (its ``settings.ini``), so the same actions give the same screens (an xfce4
    session's own settings may still make it blink: the task's ``DesktopSpec(session="wm")``
    does not).

    Observation: the screen, ``Box(0, 255, (height, width, 3), uint8)`` (RGB); with
    ``a11y=True`` a ``Dict`` of it (``screen``) and the accessibility tree as text
    (``accessibility_tree``, at most ``max_a11y_chars``, characters outside printable ASCII as
    ``?``). Actions: dicts, see ``ACTIONS`` (click / type / press / scroll / drag / wait /
    done); a bad one is ``InvalidRequest`` naming its field. ``done`` ends the episode, which is
    truncated after ``task.max_steps``; then the reward is the grader's, run in a clean copy."""

    def __init__(self, client: DSecClient | SyncDSecClient, *, image: str, task: DesktopTask,
                 snapshot: str, a11y: bool = False, max_a11y_chars: int = 50_000, settle_s: float = 0.1) -> None:
        super().__init__(client)
        if not task.keep:
            raise InvalidRequest("a task needs keep paths: what of the agent's work the grader sees")
        self.image, self.task, self.snapshot_name = image, task, check_snapshot_name(snapshot)
        self.a11y, self.max_a11y_chars, self.settle_s = a11y, max_a11y_chars, settle_s
        width, height = task.desktop.width, task.desktop.height
        screen = spaces.Box(0, 255, (height, width, 3), numpy.uint8)
        self.observation_space = spaces.Dict({
            "screen": screen,
            "accessibility_tree": spaces.Text(max_length=max_a11y_chars, min_length=0,
                                              charset="".join(sorted(CHARSET))),
        }) if a11y else screen
        self.action_space = DesktopActions(width, height)
        self._made_snapshot = False
        self._snapshot_ready = False

    async def _ensure_snapshot(self) -> None:
        if self._snapshot_ready:
            return
        try:
            await self._client.get_snapshot(self.snapshot_name)
        except SnapshotNotFound:
            args = DSecContainerRunArgs(container_image=self.image, desktop=self.task.desktop, **self.task.run_args)
            async with await self._client.run_container(args) as ready:
                # No blinking text cursor (GTK's setting): the same actions, the same screens.
                await ready.run_shell(_NO_BLINK, timeout=self.task.command_timeout)
                if self.task.setup:
                    setup = await ready.run_shell(self.task.setup, workdir=self.task.workdir,
                                                  timeout=self.task.command_timeout)
                    if setup.exit_code != 0:
                        raise InvalidRequest(f"the task's setup failed (exit {setup.exit_code}): "
                                             f"{setup.stderr[-300:]}") from None
                await ready.snapshot(mode="filesystem", name=self.snapshot_name)
            self._made_snapshot = True
        self._snapshot_ready = True

    async def _reset(self, options: dict | None) -> tuple[Any, dict]:
        await self._close_episode()
        if options:
            raise InvalidRequest(f"unknown reset options {sorted(options)}: DesktopEnv takes none")
        await self._ensure_snapshot()
        args = DSecContainerRunArgs(snapshot=self.snapshot_name, desktop=self.task.desktop, **self.task.run_args)
        self.sandbox = await self._client.run_container(args)
        self.steps, self._done = 0, False
        desktop = self.sandbox.desktop
        if self.task.launch:
            before = len(await desktop.windows())
            for entry in self.task.launch:
                app, _, uri = entry.partition(" ")
                await desktop.launch(app, uri or None)
            deadline = asyncio.get_running_loop().time() + 30
            while len(await desktop.windows()) < before + len(self.task.launch):
                if asyncio.get_running_loop().time() > deadline:
                    raise InvalidRequest(f"the task's apps {list(self.task.launch)} showed no window in 30 s")
                await asyncio.sleep(0.1)
        # The same start every time: the last window opened has the keyboard, the pointer in the
        # bottom-right corner (no hover), the screen settled.
        windows = await desktop.windows()
        if windows:
            await desktop.focus(windows[-1])
        await desktop.move(self.task.desktop.width - 1, self.task.desktop.height - 1)
        await self._settle(timeout=5.0)
        return await self._observe(), {"instruction": self.task.instruction, "snapshot": self.snapshot_name}

    async def _settle(self, timeout: float) -> None:
        """Until two screenshots ``settle_s`` apart are the same (or ``timeout``)."""
        assert self.sandbox is not None
        deadline = asyncio.get_running_loop().time() + timeout
        last = await self.sandbox.desktop.screenshot(format="raw")
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(self.settle_s)
            now = await self.sandbox.desktop.screenshot(format="raw")
            if now == last:
                return
            last = now

    async def _observe(self) -> Any:
        assert self.sandbox is not None
        spec = self.task.desktop
        raw = await self.sandbox.desktop.screenshot(format="raw")
        screen = numpy.frombuffer(raw, numpy.uint8).reshape(spec.height, spec.width, 4)[:, :, 2::-1].copy()
        if not self.a11y:
            return screen
        tree = await self.sandbox.desktop.accessibility_tree(max_chars=max(1000, self.max_a11y_chars))
        return {"screen": screen, "accessibility_tree": _text(tree[:self.max_a11y_chars], self.max_a11y_chars)}

    async def _step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        if self.sandbox is None or self._done:
            raise InvalidRequest("step() before reset(), or after the episode ended: call reset()")
        spec = self.task.desktop
        action = check_desktop_action(action, spec.width, spec.height)
        self.steps += 1
        name = action["action"]
        desktop = self.sandbox.desktop
        if name == "click":
            await desktop.click(action.get("x"), action.get("y"), button=action.get("button", "left"),
                                count=action.get("count", 1))
        elif name == "type":
            await desktop.type(action["text"])
        elif name == "press":
            await desktop.press(action["keys"])
        elif name == "scroll":
            await desktop.scroll(action.get("dy", 0), action.get("dx", 0), x=action.get("x"), y=action.get("y"))
        elif name == "drag":
            await desktop.drag(action["x"], action["y"], action["to_x"], action["to_y"],
                               button=action.get("button", "left"))
        elif name == "wait":
            await asyncio.sleep(action["seconds"])
        if name != "wait":
            await self._settle(timeout=2.0)  # (the application's answer to the input drawn)
        terminated = name == "done"
        truncated = not terminated and self.steps >= self.task.max_steps
        info: dict = {"action": name, "step": self.steps}
        reward = 0.0
        if terminated or truncated:
            self._done = True
            solved = await self._graded(self.task)
            info["solved"] = solved
            reward = self.task.reward if solved else 0.0
        return await self._observe(), reward, terminated, truncated, info

    async def _close_episode(self) -> None:
        await _Env._close(self)

    async def _close(self) -> None:
        await self._close_episode()
        if self._made_snapshot:
            self._made_snapshot = self._snapshot_ready = False
            with contextlib.suppress(SnapshotNotFound):
                await self._client.remove_snapshot(self.snapshot_name)
