"""``libdsec.gym.SandboxEnv`` against a real ``dsec serve``: gymnasium's own env checker, the
reward from a grader in a clean copy (a forged /bin/sh does not fool it), tool-call actions,
truncation, branching from a snapshot, and the async twins."""

from __future__ import annotations

import asyncio

import pytest
from gymnasium.utils.env_checker import check_env

from libdsec import DSecClient, InvalidRequest, SyncDSecClient
from libdsec.gym import SandboxEnv, Task

pytestmark = [pytest.mark.slow, pytest.mark.root]

TASK = Task(instruction="write 42 into /work/answer, then submit", setup="mkdir -p /work",
            grader='test "$(cat /work/answer 2>/dev/null)" = 42', keep=["/work"], max_steps=4,
            run_args={"memory_limit_mb": 64})


def test_env_checker_and_rewards(server):
    with SyncDSecClient(server.endpoint, token=server.token) as client:
        env = SandboxEnv(client, image="busybox", task=TASK)
        try:
            check_env(env, skip_render_check=True)
            obs, info = env.reset(seed=1)
            assert obs == TASK.instruction and info == {"image": "busybox"} and env.sandbox is not None
            obs, reward, terminated, truncated, info = env.step("echo 42 > /work/answer; cat /work/answer")
            assert (obs, reward, terminated, truncated) == ("exit 0\n42\n", 0.0, False, False)
            _, reward, terminated, _, info = env.step({"tool": "submit"})
            assert (reward, terminated, info["solved"]) == (1.0, True, True)
            with pytest.raises(InvalidRequest, match="reset"):
                env.step("true")

            # An agent that forges the shell the grader would run: the clean copy has the image's own.
            env.reset()
            env.step({"tool": "write_file", "path": "/work/answer", "content": "41"})
            env.step("cp /bin/busybox /bin/real; printf '#!/bin/real sh\\nexit 0\\n' > /bin/sh.new; "
                     "chmod +x /bin/sh.new; mv /bin/sh.new /bin/sh")
            assert env.step({"tool": "read_file", "path": "/work/answer"})[0] == "41"
            _, reward, terminated, truncated, info = env.step({"tool": "submit"})
            assert (reward, info["solved"]) == (0.0, False)

            # Out of steps: truncated, and graded all the same.
            env.reset()
            for _ in range(TASK.max_steps - 1):
                assert env.step("echo 42 > /work/answer")[3] is False
            _, reward, terminated, truncated, _ = env.step("true")
            assert (terminated, truncated, reward) == (False, True, 1.0)

            # Branch: a snapshot of a solved state, every reset from it starts solved.
            env.reset()
            env.step("echo 42 > /work/answer")
            snap = client._loop().run(env.sandbox.pack_diff())
            obs, info = env.reset(options={"image": snap.image})
            assert info["image"] == snap.image
            assert env.step({"tool": "submit"})[1] == 1.0
            for bad in ("", 7, {"tool": "rm"}, {"tool": "shell"}):
                env.reset()
                with pytest.raises(InvalidRequest):
                    env.step(bad)
        finally:
            env.close()
            env.close()
        client.remove_image(snap.image)


async def test_async_twins_run_episodes_side_by_side(server):
    async with DSecClient(server.endpoint, token=server.token) as client:
        envs = [SandboxEnv(client, image="busybox", task=TASK) for _ in range(4)]

        async def episode(env: SandboxEnv, right: bool) -> float:
            await env.areset(seed=0)
            await env.astep(f"echo {42 if right else 7} > /work/answer")
            reward = (await env.astep({"tool": "submit"}))[1]
            await env.aclose()
            return reward

        rewards = await asyncio.gather(*(episode(env, i % 2 == 0) for i, env in enumerate(envs)))
        assert rewards == [1.0, 0.0, 1.0, 0.0]
        with pytest.raises(InvalidRequest, match="async DSecClient"):
            envs[0].reset()
