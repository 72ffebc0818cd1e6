"""A SWE-style RL rollout with DSec: the reference loop to copy.

    sudo dsec serve &                               # a local apiserver and edge
    sudo python examples/rl_rollout.py --episodes 64 --concurrency 8

Builds the task set (32 git repositories with a failing test, each a workspace layer over the
``python`` base, in the local layer store: ``dsec_bench.rollout.build_task_set``), then runs
episodes through ``libdsec.gym.SandboxEnv``'s async twins, ``concurrency`` at a time: reset on the
task image, the scripted policy's commands and patch (``dsec_bench.rollout.plan``: right in some
episodes, wrong in others), submit; the reward comes from the task's grader run in a clean copy
(only ``/testbed`` carried over).

``dsec bench rollout`` measures the same loop (with mid-episode ``pack_diff`` branches) against
podman exec.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from libdsec import DSecClient
from libdsec.gym import SandboxEnv, Task

from dsec_bench.rollout import GRADE, KEEP, MEMORY_MB, build_task_set, plan
from dsec.images.store import LayerStore


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--store", type=Path, default=Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec")) / "store")
    opts = parser.parse_args()

    tasks = build_task_set(LayerStore(opts.store))
    task = Task(instruction="make test_calc.py pass, then submit", grader=GRADE, keep=KEEP, workdir="/testbed",
                max_steps=16, run_args={"memory_limit_mb": MEMORY_MB})
    gate = asyncio.Semaphore(opts.concurrency)

    async with DSecClient() as client:

        async def episode(n: int) -> tuple[bool, float]:
            spec = tasks[n % len(tasks)]
            steps, right = plan(n, spec, branch_every=0)
            async with gate:
                env = SandboxEnv(client, image=spec.image, task=task)
                try:
                    await env.areset(seed=n)
                    for step in steps:
                        if step.kind == "sh":
                            await env.astep(step.text)
                        elif step.kind == "write":
                            await env.astep({"tool": "write_file", "path": step.path, "content": step.text})
                    _, reward, terminated, _, _ = await env.astep({"tool": "submit"})
                    assert terminated
                finally:
                    await env.aclose()
            return right, reward

        t0 = time.perf_counter()
        results = await asyncio.gather(*(episode(n) for n in range(opts.episodes)))
        seconds = time.perf_counter() - t0
        right = sum((reward == 1.0) == truth for truth, reward in results)
        print(f"{opts.episodes} episodes in {seconds:.1f}s ({opts.episodes / seconds:.2f}/s); "
              f"rewards match the script's ground truth in {right}/{opts.episodes}")
        if right != opts.episodes:
            raise SystemExit(1)


if __name__ == "__main__":
    asyncio.run(main())
