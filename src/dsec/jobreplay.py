"""Replay a job: its logged calls run again, in log order, on fresh sandboxes (``dsec job
replay``), for debugging and for rebuilding state whose sandboxes are gone.

Each logged create makes a new sandbox from the same arguments (the new one stands in for the
old id in the calls after it), each command runs again with the same request, each file write
writes the logged bytes again, each stop stops, each clean copy, fork and pack_diff is made again (a create from a logged snapshot
image starts from the replay's own), each read reads again, each pause, resume, network rule
change and TTL is made again, and so is each pause or resume of a group (``pause_sandboxes``: those
the job made of the sandboxes it paused, in one call); a command whose exit code, stdout or error differs from the log,
and a read whose size, bytes or error does, is a divergence, and so is each call the log holds
only as made (``unrecorded``: a streamed command, a process, a session …), which is not replayed. The replay's own sandboxes are stopped at the end, and
its calls are not recorded (its client has no job).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from libdsec import DSecClient, DSecError, Sandbox
from libdsec.protocol import DSecContainerRunArgs, DSecFullVMRunArgs, DSecMicroVMRunArgs, JobEntry, JobLog

_ARGS = {"container": DSecContainerRunArgs, "microvm": DSecMicroVMRunArgs, "fullvm": DSecFullVMRunArgs}


@dataclass(frozen=True)
class Divergence:
    seq: int
    sandbox: str | None
    call: str
    logged: str
    now: str


@dataclass
class ReplayReport:
    job: str
    replayed: int
    divergences: list[Divergence]


def _outcome(result: dict | None, error: dict | None) -> str:
    if error is not None:
        return f"error {error.get('code')}: {error.get('message')}"
    result = result or {}
    return f"exit {result.get('exit_code')}, stdout {result.get('stdout')!r}"


async def replay(client: DSecClient, log: JobLog, *, on_entry: Callable[[JobEntry], None] | None = None) -> ReplayReport:
    """Run ``log``'s calls again through ``client`` (one without a job)."""
    made: dict[str, Sandbox] = {}
    images: dict[str, str] = {}  # logged pack_diff image → the replay's own
    divergences: list[Divergence] = []
    done = 0

    def diverged(entry: JobEntry, call: str, logged: str, now: str) -> None:
        divergences.append(Divergence(entry.seq, entry.sandbox, call, logged, now))

    try:
        for entry in log.entries:
            if on_entry is not None:
                on_entry(entry)
            request = entry.request
            if entry.op in ("create", "create_batch"):
                kind = request.get("kind", "container")
                args = _ARGS.get(kind, DSecContainerRunArgs).model_validate(request["args"])
                if args.container_image in images:
                    args = args.model_copy(update={"container_image": images[args.container_image]})
                if entry.op == "create":
                    runner = {"container": client.run_container, "microvm": client.run_microvm,
                              "fullvm": client.run_vm}[kind]
                    new = [await runner(args)]
                    old = [entry.sandbox]
                else:
                    new = await client.run_containers(args, count=request["count"])
                    old = [info["id"] for info in entry.result or []]
                made.update(zip(old, new))
            elif entry.op in ("pause_sandboxes", "resume_sandboxes"):
                await _group(client, entry, made, diverged)
            elif entry.sandbox not in made:
                diverged(entry, entry.op, "a sandbox this job made", f"no create of {entry.sandbox} in the log")
            elif entry.op == "exec":
                sandbox = made[entry.sandbox]
                call = f"exec {request['command']!r}"
                kwargs = {k: request[k] for k in ("timeout", "env", "workdir", "user", "stdin", "max_output_bytes")
                          if k in request}
                try:
                    result, error = (await sandbox.run_shell(request["command"], **kwargs)).model_dump(mode="json"), None
                except DSecError as exc:
                    result, error = None, exc.to_wire()["error"]
                logged, now = _outcome(entry.result, entry.error), _outcome(result, error)
                if logged != now:
                    diverged(entry, call, logged, now)
            elif entry.op == "write_file":
                call = f"write_file {request['path']!r}"
                if "data_b64" not in request:
                    diverged(entry, call, f"{request['bytes']} bytes", "not replayed: the log kept no bytes this large")
                else:
                    await made[entry.sandbox].write_file(request["path"], base64.b64decode(request["data_b64"]),
                                                         mode=request["mode"])
            elif entry.op == "read_file":
                call = f"read_file {request['path']!r}"
                try:
                    data, error = await made[entry.sandbox].read_file(request["path"]), None
                except DSecError as exc:
                    data, error = None, exc.to_wire()["error"]
                logged = (_outcome(None, entry.error) if entry.error is not None else
                          f"{entry.result['bytes']} bytes, sha256 {entry.result['sha256'][:16]}")
                now = (_outcome(None, error) if error is not None else
                       f"{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}")
                if logged != now:
                    diverged(entry, call, logged, now)
            elif entry.op == "pause":
                await made[entry.sandbox].pause(request.get("mode", "full"))
            elif entry.op == "resume":
                await made[entry.sandbox].resume()
            elif entry.op == "set_network_rules":
                await made[entry.sandbox].set_network_rules(request["network_rules"])
            elif entry.op == "set_ttl":
                await made[entry.sandbox].set_ttl(request["ttl_running_stop"])
            elif entry.op == "unrecorded":
                diverged(entry, request.get("call", "?"), "made (the log holds no request body nor result)",
                         "not replayed")
            elif entry.op == "stop":
                await made[entry.sandbox].stop()
            elif entry.op == "clean_copy":
                copy = await made[entry.sandbox].clean_copy(keep=request["keep"])
                if isinstance(entry.result, dict):
                    made[entry.result["sandbox"]["id"]] = copy
            elif entry.op == "fork":
                # Each logged child becomes the replay's own child at its place (a child that
                # failed then is made now too, and stopped with the rest at the end).
                children = await made[entry.sandbox].fork(request["count"], all_or_none=request["all_or_none"],
                                                          ttl_running_stop=request.get("ttl_running_stop"))
                logged = entry.result.get("children", []) if isinstance(entry.result, dict) else []
                for was, now in zip(logged, children, strict=False):
                    if isinstance(now, DSecError):
                        continue
                    if was.get("sandbox"):
                        made[was["sandbox"]["id"]] = now
                    else:
                        made[now.id] = now
            elif entry.op == "pack_diff":
                # (a new image of its own: the creates after it that named the logged one use it)
                snapshot = await made[entry.sandbox].pack_diff(role=request.get("role", "snapshot"))
                if isinstance(entry.result, dict):
                    images[entry.result["image"]] = snapshot.image
            done += 1
    finally:
        for sandbox in made.values():
            try:
                await sandbox.stop()
            except DSecError:
                pass
        for image in images.values():
            try:
                await client.remove_image(image)
            except DSecError:
                pass
    return ReplayReport(log.job.name, done, divergences)


async def _group(client: DSecClient, entry: JobEntry, made: dict[str, Sandbox],
                 diverged: Callable[[JobEntry, str, str, str], None]) -> None:
    """A group's pause or resume again, as one call, of the replay's sandboxes standing in for
    those it paused or resumed then; one it acted on that this job did not make is a divergence."""
    action = entry.op.removesuffix("_sandboxes")
    acted = [o["id"] for o in (entry.result or {}).get("sandboxes", []) if o.get("outcome") == f"{action}d"]
    ours = [made[sid].id for sid in acted if sid in made]
    for sid in acted:
        if sid not in made:
            diverged(entry, f"{entry.op} {sid}", f"{action}d", "not replayed: a sandbox this job did not make")
    if ours:
        call = client.pause_sandboxes if action == "pause" else client.resume_sandboxes
        result = await call(ids=ours)
        if result.failed:
            failed = [o for o in result.sandboxes if o.outcome == "error"]
            diverged(entry, entry.op, f"{len(ours)} {action}d", f"{result.failed} failed: {failed[0].error}")
