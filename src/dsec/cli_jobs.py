"""``dsec job …``: job logs (``DSecClient(job=…)``) from the command line: list, show, remove,
and replay a job's calls on fresh sandboxes."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from libdsec import DSecClient
from libdsec.protocol import JobEntry

from .cli_common import console, run_sdk

job_app = typer.Typer(help="Job logs: every create, command, file write and read, pause, resume and stop of a job, in order.",
                      no_args_is_help=True)

JobName = Annotated[str, typer.Argument(help="The job (as in DSecClient(job=...)).")]


def _summary(entry: JobEntry) -> tuple[str, str]:
    """(what was asked, what came back) of one entry, short."""
    request, result = entry.request, entry.result
    if entry.op == "exec":
        asked = request.get("command", "")
    elif entry.op == "write_file":
        asked = f"{request.get('path')} ({request.get('bytes')} bytes)"
    elif entry.op == "clean_copy":
        asked = f"keep {','.join(request.get('keep', []))}"
    elif entry.op == "fork":
        asked = f"x{request.get('count')}"
    elif entry.op in ("create", "create_batch"):
        asked = f"{request.get('kind')} {request.get('args', {}).get('container_image')}" + (
            f" x{request['count']}" if "count" in request else "")
    elif entry.op == "read_file":
        asked = str(request.get("path"))
    elif entry.op in ("pause_sandboxes", "resume_sandboxes"):
        asked = (f"job {request['job']}" if request.get("job") else f"project {request['project']}"
                 if request.get("project") else f"{len(request.get('ids') or [])} ids")
        if "asked_by_job" in request:  # (another caller's, selecting this job)
            asked += f", asked by {'job ' + request['asked_by_job'] if request['asked_by_job'] else 'a caller with no job'}"
    elif entry.op == "unrecorded":
        asked = str(request.get("call"))
    elif entry.op in ("set_network_rules", "set_ttl"):
        asked = str(request.get("network_rules", request.get("ttl_running_stop")))
    else:
        asked = ""
    if entry.error is not None:
        came = f"error {entry.error.get('code')}"
    elif entry.op == "exec" and isinstance(result, dict):
        came = f"exit {result.get('exit_code')}"
    elif entry.op == "create" and isinstance(result, dict):
        came = str(result.get("id"))
    elif entry.op == "clean_copy" and isinstance(result, dict):
        came = str(result.get("sandbox", {}).get("id"))
    elif entry.op == "fork" and isinstance(result, dict):
        came = f"{result.get('kind')} fork: " + ", ".join(
            str((c.get("sandbox") or {}).get("id") or (c.get("error") or {}).get("code")) for c in result.get("children", []))
    elif entry.op == "pack_diff" and isinstance(result, dict):
        came = str(result.get("image"))
    elif entry.op == "create_batch" and isinstance(result, list):
        came = f"{len(result)} sandboxes"
    elif entry.op in ("pause_sandboxes", "resume_sandboxes") and isinstance(result, dict):
        came = (f"{result.get('done')} {entry.op.split('_')[0]}d, {result.get('already')} already, "
                f"{result.get('failed')} failed")
    elif entry.op == "read_file" and isinstance(result, dict):
        came = f"{result.get('bytes')} bytes"
    elif entry.op == "unrecorded":
        came = "made (no result logged)"
    else:
        came = "ok"
    return asked[:70], came


@job_app.command("ls")
def job_ls() -> None:
    """The jobs of the token's project (every job, for the root token)."""

    async def go():
        async with DSecClient() as client:
            return await client.list_jobs()

    table = Table("JOB", "PROJECT", "ENTRIES", "CREATED", "LAST WRITTEN")
    for job in run_sdk(go()):
        table.add_row(job.name, job.project, str(job.entries), f"{job.created_at:%Y-%m-%d %H:%M:%S}",
                      f"{job.updated_at:%Y-%m-%d %H:%M:%S}")
    console.print(table)


@job_app.command("show")
def job_show(job: JobName,
             as_json: Annotated[bool, typer.Option("--json", help="The whole log, as JSON.")] = False) -> None:
    """A job's log, in order."""

    async def go():
        async with DSecClient() as client:
            return await client.job_log(job)

    log = run_sdk(go())
    if as_json:
        print(log.model_dump_json(indent=2))
        return
    table = Table("SEQ", "OP", "SANDBOX", "KEY", "ASKED", "RESULT", title=f"job {log.job.name} ({log.job.project})")
    for entry in log.entries:
        asked, came = _summary(entry)
        table.add_row(str(entry.seq), entry.op, entry.sandbox or "", entry.key or "", asked, came)
    console.print(table)


@job_app.command("rm")
def job_rm(job: JobName) -> None:
    """Remove a job's log (and the idempotency keys of its creates)."""

    async def go():
        async with DSecClient() as client:
            await client.remove_job(job)

    run_sdk(go())
    console.print(f"removed job {job}")


@job_app.command("replay")
def job_replay(job: JobName,
               as_json: Annotated[bool, typer.Option("--json", help="The report, as JSON.")] = False) -> None:
    """Run a job's logged calls again, in log order, on fresh sandboxes; report each command
    whose exit code or stdout differs from the log. Exit status 1 when any does."""
    from .jobreplay import replay

    async def go():
        async with DSecClient() as client:
            return await replay(client, await client.job_log(job))

    report = run_sdk(go())
    if as_json:
        print(json.dumps({"job": report.job, "replayed": report.replayed,
                          "divergences": [d.__dict__ for d in report.divergences]}, indent=2))
    else:
        console.print(f"job {report.job}: {report.replayed} calls replayed, {len(report.divergences)} diverged")
        for d in report.divergences:
            console.print(f"  #{d.seq} {d.sandbox} {d.call}\n    logged: {d.logged}\n    now:    {d.now}")
    if report.divergences:
        raise typer.Exit(1)


