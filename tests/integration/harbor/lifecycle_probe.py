"""Run by tests/integration/test_harbor.py with the Harbor virtualenv's Python (Harbor needs
3.12; the test suite's may be older): DSecEnvironment driven call by call as Harbor's trial
drives it, each outcome printed as one JSON object. argv: TASK_DIR WORK_DIR."""

import asyncio
import json
import sys
from pathlib import Path

from harbor.models.task.config import NetworkMode, NetworkPolicy
from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths

from dsec.integrations.harbor import DSecEnvironment


async def main(task_dir: Path, work: Path) -> dict:
    task = Task(task_dir)
    paths = TrialPaths(work / "trial")
    paths.mkdir()
    env = DSecEnvironment(task.paths.environment_dir, task.short_name, "probe__env", paths, task.config.environment,
                          network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK))
    out: dict = {}
    await env.start(force_build=False)
    out["sandbox_id"] = env.sandbox_id
    try:
        r = await env.exec("pwd; id -un; echo $A; echo err >&2; exit 3", env={"A": "1"})
        out["exec"] = [r.stdout, r.stderr, r.return_code]
        r = await env.exec("pwd; id -un", cwd="/tmp", user="nobody")
        out["exec_cwd_user"] = [r.stdout, r.return_code]
        streamed: list[tuple[str, str]] = []

        async def collect(text: str, stream: str) -> None:
            streamed.append((stream, text))
        with env.scoped_output_callback(collect):
            await env.exec("echo one; echo two >&2")
        out["streamed"] = [sorted({s for s, _ in streamed}), "".join(t for _, t in streamed)]
        try:
            await env.exec("sleep 30", timeout_sec=1)
        except RuntimeError as exc:
            out["timeout"] = str(exc)
        (work / "up").mkdir()
        (work / "up" / "a.sh").write_text("echo hi\n")
        (work / "up" / "a.sh").chmod(0o755)
        (work / "up" / "sub").mkdir()
        (work / "up" / "sub" / "b.txt").write_text("b\n")
        await env.upload_dir(work / "up", "/probe/dir")
        await env.upload_file(work / "up" / "a.sh", "/probe/file.sh")
        await env.upload_file(work / "up" / "sub" / "b.txt", "/probe/dir/sub")  # into the directory
        r = await env.exec("/probe/file.sh && ls -R /probe | sort | tr '\\n' ' '")
        out["uploaded"] = r.stdout
        out["is"] = [await env.is_dir("/probe/dir"), await env.is_file("/probe/dir"), await env.is_file("/probe/file.sh"),
                     await env.is_dir("/nowhere"), await env.is_file("/nowhere")]
        await env.download_file("/probe/dir/sub/b.txt", work / "down" / "b.txt")
        await env.download_dir("/probe/dir", work / "down-dir")
        out["downloaded"] = [(work / "down" / "b.txt").read_text(),
                             sorted(str(p.relative_to(work / "down-dir")) for p in (work / "down-dir").rglob("*"))]
        await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["example.invalid"]))
        await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.NO_NETWORK))
        out["network_switched"] = True
    finally:
        await env.stop(delete=True)
    await env.stop(delete=True)  # a second stop does nothing
    out["stopped_twice"] = True
    try:
        await env.exec("true")
    except RuntimeError as exc:
        out["exec_after_stop"] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2])))))
