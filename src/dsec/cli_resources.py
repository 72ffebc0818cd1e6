"""``dsec project …`` (projects, quotas, tokens) and ``dsec pause|resume`` (ids, ``--job``, ``--project``): added to the
main command line by ``register(app)``. Everything goes through the SDK, so a project's own
token manages the projects below it just as the root token manages all."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from libdsec import DSecClient, ProjectInfo
from .cli_common import console, err_console, run_sdk

project_app = typer.Typer(help="Projects, their quotas and tokens (nested: a parent hands quota to its children).",
                          no_args_is_help=True)

QuotaValue = Annotated[Optional[str], typer.Option(help="A number, or 'none' for no cap of its own.")]


def _number(name: str, text: str | None, kind: type) -> int | float | None:
    if text is None or text.lower() == "none":
        return None
    try:
        return kind(text)
    except ValueError:
        err_console.print(f"[red]error:[/red] --{name} {text!r}: expected a number or 'none'")
        raise typer.Exit(2) from None


def _quota(sandboxes: str | None, cpu: str | None, memory: str | None) -> dict:
    return {"sandboxes": _number("sandboxes", sandboxes, int), "cpu_cores": _number("cpu", cpu, float),
            "memory_mb": _number("memory", memory, int)}


def _cell(used: float, cap: float | None, handed: float, unit: str = "") -> str:
    text = f"{used:g}{unit} / {'—' if cap is None else f'{cap:g}{unit}'}"
    return text + (f" ({handed:g}{unit} handed out)" if handed else "")


def _table(projects: list[ProjectInfo]) -> Table:
    table = Table("PROJECT", "SANDBOXES", "CPU CORES", "MEMORY", caption="used (own and below) / quota")
    for p in projects:
        u, q, h = p.subtree_usage, p.quota, p.handed_out
        table.add_row(p.path, _cell(u.sandboxes, q.sandboxes, h.sandboxes), _cell(u.cpu_cores, q.cpu_cores, h.cpu_cores),
                      _cell(u.memory_mb, q.memory_mb, h.memory_mb, " MB"))
    return table


@project_app.command("ls")
def project_ls() -> None:
    """The caller's project and every project below it, with usage and quotas."""

    async def go():
        async with DSecClient() as client:
            return await client.list_projects()

    console.print(_table(run_sdk(go())))


@project_app.command("create")
def project_create(
    name: Annotated[str, typer.Argument(help="Lowercase letters, digits and '-'.")],
    parent: Annotated[Optional[str], typer.Option(help="Parent project (default: the token's own).")] = None,
    sandboxes: QuotaValue = None,
    cpu: QuotaValue = None,
    memory: QuotaValue = None,
) -> None:
    """Create a project, with a quota handed down from its parent's."""

    async def go():
        async with DSecClient() as client:
            return await client.create_project(name, parent=parent, **_quota(sandboxes, cpu, memory))

    console.print(_table([run_sdk(go())]))


@project_app.command("quota")
def project_quota(
    name: Annotated[str, typer.Argument(help="Project.")],
    sandboxes: QuotaValue = None,
    cpu: QuotaValue = None,
    memory: QuotaValue = None,
) -> None:
    """Change a project's quota: the values given ('none': no cap of its own); the rest stay."""

    async def go():
        async with DSecClient() as client:
            quota = (await client.get_project(name)).quota.model_dump()
            given = {"sandboxes": sandboxes, "cpu_cores": cpu, "memory_mb": memory}
            new = _quota(sandboxes, cpu, memory)
            quota.update({k: v for k, v in new.items() if given[k] is not None})
            return await client.set_project_quota(name, **quota)

    console.print(_table([run_sdk(go())]))


@project_app.command("rm")
def project_rm(name: Annotated[str, typer.Argument(help="Project.")]) -> None:
    """Remove a project with no sub-projects and no sandboxes (its tokens go with it)."""

    async def go():
        async with DSecClient() as client:
            await client.remove_project(name)

    run_sdk(go())
    console.print(f"removed {name}")


@project_app.command("token")
def project_token(name: Annotated[str, typer.Argument(help="Project.")],
                  e2b: Annotated[bool, typer.Option("--e2b", help="In E2B's API key form (e2b_ + 40 hex digits), "
                                                    "for the e2b SDK (E2B_API_KEY).")] = False) -> None:
    """Make a new API token for a project and print it (it is not shown again)."""

    async def go():
        async with DSecClient() as client:
            return await client.create_project_token(name, e2b=e2b)

    print(run_sdk(go()))


IdArgs = Annotated[Optional[list[str]], typer.Argument(help="Sandbox ids (the same as --id).", show_default=False)]
JobOpt = Annotated[Optional[str], typer.Option("--job", help="Every sandbox the job made (DSecClient(job=...)).")]
ProjectOpt = Annotated[Optional[str], typer.Option("--project", help="Every sandbox of the project and those below it.")]
IdOpt = Annotated[Optional[list[str]], typer.Option("--id", help="A sandbox id (repeat for more).", show_default=False)]


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f}"


def _group(action: str, ids: list[str] | None, job: str | None, project: str | None, id_: list[str] | None) -> None:
    """Send one pause or resume for the selection and print each sandbox's outcome."""
    chosen = [*(ids or ()), *(id_ or ())] or None

    async def go():
        async with DSecClient() as client:
            call = client.pause_sandboxes if action == "pause" else client.resume_sandboxes
            return await call(job=job, project=project, ids=chosen)

    result = run_sdk(go())
    table = Table("SANDBOX", "NODE", "OUTCOME", "STATUS", "MEM BEFORE MiB", "MEM AFTER MiB", "MS", "ERROR")
    for o in result.sandboxes:
        colour = "red" if o.outcome == "error" else "green" if o.outcome in ("paused", "resumed") else "dim"
        table.add_row(o.id, o.node or "", f"[{colour}]{o.outcome}[/{colour}]", o.status.value if o.status else "",
                      _mib(o.memory_before_bytes), _mib(o.memory_after_bytes),
                      "" if o.seconds is None else f"{o.seconds * 1e3:.0f}",
                      "" if o.error is None else f"{o.error.get('code')}: {o.error.get('message')}")
    console.print(table)
    done = "paused" if action == "pause" else "resumed"
    memory = (f"; memory {_mib(result.memory_before_bytes)} → {_mib(result.memory_after_bytes)} MiB"
              if action == "pause" and result.done else "")
    console.print(f"{result.done} {done}, {result.already} already so, {result.failed} failed "
                  f"in {result.seconds:.2f} s{memory}")
    if result.failed:
        raise typer.Exit(1)


def pause(ids: IdArgs = None, job: JobOpt = None, project: ProjectOpt = None, id_: IdOpt = None) -> None:
    """Pause sandboxes in one call: a job's (--job), a project's (--project) or the ids given
    (--id, or as arguments). Containers are frozen and their memory pushed out to swap; each
    resumes on its next call (unless made with auto_resume=False) or with `dsec resume`."""
    _group("pause", ids, job, project, id_)


def resume(ids: IdArgs = None, job: JobOpt = None, project: ProjectOpt = None, id_: IdOpt = None) -> None:
    """Resume paused sandboxes in one call: a job's (--job), a project's (--project) or the ids given."""
    _group("resume", ids, job, project, id_)


def register(app: typer.Typer) -> None:
    app.add_typer(project_app, name="project")
    app.command()(pause)
    app.command()(resume)
