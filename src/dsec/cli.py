"""The ``dsec`` command line: serve, run, ps, stop, image …, info, demo; ``bench …`` once the
``dsec-bench`` distribution is installed (``cli_plugins``)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Column, Table

from libdsec import DSecClient, DSecContainerRunArgs, DSecError

from . import settings
from .cli_common import DEFAULT_STATE, StateDir, console, err_console, fail, run_sdk
from .cli_plugins import register as register_plugins

from .cli_resources import register as register_resource_commands
from .cli_shell import register as register_shell
from .cli_top import register as register_top

from .cli_images import image_app
from .cli_jobs import job_app
from .cli_snapshots import snapshot_app

app = typer.Typer(help="DSec: sandboxes for agent training.", no_args_is_help=True, add_completion=False)
app.add_typer(image_app, name="image")
app.add_typer(job_app, name="job")
app.add_typer(snapshot_app, name="snapshot")
register_plugins(app)




@app.command()
def serve(
    state_dir: StateDir = DEFAULT_STATE,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8765,
    domain: Annotated[str, typer.Option(
        help="Sandboxes' ports by host name: PORT-SANDBOXID.DOMAIN reaches that port (wildcard DNS to this "
             "server; *.localhost is loopback already). Empty: off.")] = "localhost",
    node: Annotated[str, typer.Option(help="This node's name (lowercase letters and digits).")] = "n0",
    max_sandboxes: Annotated[int, typer.Option(help="Most sandboxes this node admits.")] = 4096,
    pool_max: Annotated[int, typer.Option(help="Most pre-created sandboxes kept per image (0: no warm pool).")] = 64,
    ended_kept: Annotated[int, typer.Option(
        help="Ended sandboxes this node remembers (about 200 bytes each), so a late get still answers; "
             "the oldest is forgotten first.")] = 10_000,
    cpu_overcommit: Annotated[Optional[float], typer.Option(help="CPU weights committed per core (default 2048).")] = None,
    memory_overcommit: Annotated[Optional[float], typer.Option(help="Memory limits committed per MB of RAM (default 2.5).")] = None,
    cold_memory_idle_s: Annotated[float, typer.Option(help="Reclaim memory of sandboxes idle this long (0: off).")] = 0.0,
    cold_memory_interval_s: Annotated[float, typer.Option(help="Seconds between cold-memory passes.")] = 30.0,
    fncall_workers: Annotated[int, typer.Option(help="Warm fncall workers per image in use (0: one per core).")] = 0,
    fncall_max: Annotated[int, typer.Option(help="Most fncall workers on this node (0: no fncall).")] = 64,
    ray: Annotated[Optional[str], typer.Option(
        help="Serve a Ray cluster instead (ADDRESS as ray.init takes it, 'auto' included): an edge on every node "
             "with the dsec_edge resource.")] = None,
    nodes_file: Annotated[Optional[Path], typer.Option(
        help='Serve the nodes listed in this JSON file instead: {"token": T, "nodes": {NAME: URL}}.')] = None,
    node_state_dir: Annotated[Optional[Path], typer.Option(
        help="On Ray: each node keeps its state in DIR/NAME on its own disk (default STATE_DIR/nodes).")] = None,
    store_dir: Annotated[Optional[Path], typer.Option(
        help="On Ray: the layer store every node reads, on a shared filesystem (default STATE_DIR/store).")] = None,
    db: Annotated[Optional[str], typer.Option(
        help="Projects, quotas and tokens in PostgreSQL (postgresql://USER@HOST:PORT/DB), shared by several "
             "apiservers; default: projects.db in the state dir.")] = None,
    burst_max: Annotated[int, typer.Option(
        help="On Ray: above 80% committed, ask the autoscaler for up to this many burst nodes (offering "
             "dsec_burst); 0: no bursting.")] = 0,
    burst_quiet_s: Annotated[float, typer.Option(
        help="On Ray: let burst nodes go after this long below 50% committed.")] = 60.0,
    max_creates: Annotated[int, typer.Option(
        help="Creates this node runs at once; more wait in a bounded queue, past which they get 429.")] = 256,
    max_commands: Annotated[int, typer.Option(
        help="Commands this node runs at once (more wait, as for creates).")] = 1024,
    max_queued: Annotated[int, typer.Option(
        help="Creates (and 4x as many commands) that may wait for a slot; past that: 429 with Retry-After.")] = 1024,
    max_queue_wait_s: Annotated[float, typer.Option(
        help="Longest a create or command waits for a slot before it gets 429.")] = 30.0,
) -> None:
    """Run the apiserver and an edge for this machine in one process (or the apiserver of a cluster)."""
    from .server import ServerConfig
    from .server import serve as run_server

    edge = {"max_sandboxes": max_sandboxes, "pool_max": pool_max, "max_creates_running": max_creates,
            "max_commands_running": max_commands, "max_creates_queued": max_queued,
            "max_commands_queued": 4 * max_queued, "max_queue_wait_s": max_queue_wait_s, "finished_kept": ended_kept}
    if min(max_creates, max_commands) < 1 or max_queued < 0 or max_queue_wait_s <= 0 or ended_kept < 0:
        fail(ValueError("--max-creates and --max-commands must be at least 1, --max-queued and --ended-kept at "
                        "least 0 and --max-queue-wait-s above 0"))
    if pool_max == 0:
        edge["pool_min"] = 0
    if cpu_overcommit is not None:
        edge["cpu_overcommit"] = cpu_overcommit
    if memory_overcommit is not None:
        edge["memory_overcommit"] = memory_overcommit
    cold = {"idle_s": cold_memory_idle_s, "interval_s": cold_memory_interval_s} if cold_memory_idle_s > 0 else {}
    try:
        fncall = {"workers_min": fncall_workers, "workers_max": fncall_max} if fncall_max > 0 else None
        if ray is not None and nodes_file is not None:
            fail(ValueError("--ray and --nodes-file: one or the other"))
        run_server(ServerConfig(state_dir=state_dir, host=host, port=port, domain=domain, node=node, edge=edge,
                                cold_memory=cold,
                                fncall=fncall, ray=ray, nodes_file=nodes_file, node_state_dir=node_state_dir,
                                store_dir=store_dir, db=db,
                                burst={"max_nodes": burst_max, "quiet_s": burst_quiet_s} if burst_max > 0 else None))
    except (DSecError, settings.SettingsError) as exc:
        fail(exc)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    image: Annotated[str, typer.Argument(help="Image name.")],
    memory: Annotated[int, typer.Option("--memory", "-m", help="Memory limit in MB.")] = 512,
    cpus: Annotated[float, typer.Option("--cpus", help="CPU cores limit.")] = 1.0,
    user: Annotated[Optional[str], typer.Option("--user", "-u", help="User to run as (default: the image's).")] = None,
    workdir: Annotated[Optional[str], typer.Option("--workdir", "-w", help="Default: the image's.")] = None,
    env: Annotated[Optional[list[str]], typer.Option("--env", "-e", help="KEY=VALUE")] = None,
    timeout: Annotated[float, typer.Option(help="Command timeout in seconds.")] = 60.0,
    cpu_cap: Annotated[Optional[float], typer.Option(help="Hard CPU cap in cores (--cpus is a weight).")] = None,
    best_effort: Annotated[bool, typer.Option(help="Run under SCHED_IDLE, committing no CPU.")] = False,
) -> None:
    """Create a sandbox, run a command in it, print its output, stop it: dsec run IMAGE -- CMD…"""
    command = ctx.args
    if not command:
        fail(ValueError("no command: use dsec run IMAGE -- CMD …"))
    env_map = dict(e.split("=", 1) for e in (env or []) if "=" in e)
    args = DSecContainerRunArgs(container_image=image, memory_limit_mb=memory, cpu_cores_limit=cpus,
                                init_user=user, workdir=workdir, env=env_map, cpu_cores_cap=cpu_cap,
                                best_effort=best_effort)

    async def go() -> int:
        async with DSecClient() as client:
            async with await client.run_container(args) as sandbox:
                result = await sandbox.run_shell(shlex.join(command), timeout=timeout)
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        return result.exit_code

    raise typer.Exit(run_sdk(go()))


@app.command()
def create(
    image: Annotated[str, typer.Argument(help="Image name (or ref: base+workspace+toolkit).")],
    count: Annotated[int, typer.Option("--count", "-n", help="How many sandboxes, in one request.")] = 1,
    memory: Annotated[int, typer.Option("--memory", "-m", help="Memory limit in MB.")] = 512,
    cpus: Annotated[float, typer.Option("--cpus", help="CPU cores limit.")] = 1.0,
    ttl: Annotated[float, typer.Option(help="Stop a sandbox after this many seconds without a call.")] = 1800.0,
    user: Annotated[Optional[str], typer.Option("--user", "-u", help="User to run as (default: the image's).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the whole batch.")] = 3600.0,
) -> None:
    """Create sandboxes and leave them running: one batch request (all or none), spread over the
    cluster's nodes, with a progress bar; prints their ids, one a line."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    args = DSecContainerRunArgs(container_image=image, memory_limit_mb=memory, cpu_cores_limit=cpus,
                                ttl_running_stop=ttl, init_user=user)

    async def go() -> int:
        async with DSecClient() as client:
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=err_console, transient=True) as progress:
                bar = progress.add_task(f"creating {count} from {image!r}", total=count)
                sandboxes = await client.run_containers(
                    args, count=count, timeout=timeout, progress=lambda done, _: progress.update(bar, completed=done))
        for s in sandboxes:
            print(s.id)
        return 0

    raise typer.Exit(run_sdk(go()))


@app.command()
def call(
    code: Annotated[Optional[str], typer.Argument(help="The code ('-' or none: read it from stdin).")] = None,
    language: Annotated[str, typer.Option("--language", "-l", help="python or bash.")] = "python",
    code_file: Annotated[Optional[Path], typer.Option("--file", "-f", help="Read the code from this file.")] = None,
    image: Annotated[str, typer.Option(help="Image the call runs in.")] = "python",
    timeout: Annotated[float, typer.Option(help="Wall-clock limit in seconds.")] = 10.0,
    memory: Annotated[int, typer.Option("--memory", "-m", help="Memory limit in MB.")] = 256,
    stdin_file: Annotated[Optional[Path], typer.Option("--stdin", help="Feed this file to the call's stdin.")] = None,
    put: Annotated[Optional[list[str]], typer.Option("--put", help="PATH=LOCAL_FILE into the working dir.")] = None,
    fetch: Annotated[Optional[list[str]], typer.Option("--fetch", help="A file to bring back into --out.")] = None,
    out: Annotated[Path, typer.Option("--out", help="Where fetched files go.")] = Path("."),
    env: Annotated[Optional[list[str]], typer.Option("--env", "-e", help="NAME=VALUE")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole result as JSON.")] = False,
) -> None:
    """Run code once in a fresh process of the warm pool and print its output: dsec call 'print(1)'.

    Exits with the call's exit code (124 after a timeout, 128+N when killed by signal N)."""
    from libdsec import DSecFnCallArgs

    from .fncall.cli import read_inputs, run_call

    try:
        source, stdin, files, variables = read_inputs(code, code_file, stdin_file, put or [], env or [])
        args = DSecFnCallArgs(code=source, language=language, image=image, timeout=timeout, memory_limit_mb=memory,
                              stdin=stdin, files=files, fetch_files=fetch or [], env=variables)
        status = run_call(args, out, as_json)
    except (DSecError, OSError, ValueError) as exc:
        fail(exc)
    raise typer.Exit(status)


@app.command()
def ps() -> None:
    """List the sandboxes on every node."""

    async def go():
        async with DSecClient() as client:
            return await client.list_sandboxes()

    table = Table(Column("ID", no_wrap=True, min_width=20), "IMAGE", "STATUS", "MEMORY", "CPUS", "CREATED",
                  "LAST ACTIVE")  # (ids whole: they are pasted into dsec stop)
    for s in run_sdk(go()):
        table.add_row(s.id, s.image, s.status.value, f"{s.memory_limit_mb} MB", f"{s.cpu_cores_limit:g}",
                      s.created_at.strftime("%H:%M:%S"), s.last_active_at.strftime("%H:%M:%S"))
    console.print(table)


@app.command()
def stop(ids: Annotated[list[str], typer.Argument(help="Sandbox ids.")]) -> None:
    """Stop sandboxes (each on its own: one that fails does not keep the others running)."""

    async def go() -> int:
        failed = 0
        async with DSecClient() as client:
            for sandbox_id in ids:
                try:
                    info = await client.stop_sandbox(sandbox_id)
                except DSecError as exc:
                    err_console.print(f"{sandbox_id}: {type(exc).__name__}: {escape(str(exc))}")
                    failed += 1
                else:
                    console.print(f"{sandbox_id} {info.status.value}")
        return failed

    if run_sdk(go()):
        raise typer.Exit(1)


@app.command()
def events(sandbox_id: Annotated[str, typer.Argument(help="Sandbox id.")]) -> None:
    """Security events of a sandbox: blocked connections and names, denied syscalls, limit hits."""

    async def go():
        async with DSecClient() as client:
            return await (await client.get_sandbox(sandbox_id)).security_events()

    table = Table("TIME", "KIND", "COUNT", "DETAIL")
    for e in run_sdk(go()):
        table.add_row(e.at.strftime("%H:%M:%S"), e.kind, str(e.count), e.detail)
    console.print(table)


_LAYER_ATTACH = {"file": "file-backed", "loop": "on read-only loop devices"}


@app.command()
def info() -> None:
    """Show the nodes of the cluster and what they run, and why any is not serving."""

    async def go():
        async with DSecClient() as client:
            return await client.node_info(include_unready=True)

    everything = run_sdk(go())
    nodes = [n for n in everything if n.state == "ready"]
    table = Table("NODE", "RUNTIME", "CGROUPS", "SANDBOXES", "CPU CORES", "MEMORY")
    for n in nodes:
        table.add_row(n.node, n.runtime, n.cgroup_version, str(n.sandboxes), str(n.cpu_cores), f"{n.memory_total_mb} MB")
    console.print(table)
    for n in nodes:
        console.print(
            f"{n.node}: committed {n.committed_cpu:g} of {n.cpu_cores * n.cpu_overcommit:g} CPU cores "
            f"({n.cpu_overcommit:g}×, weights) and {n.committed_memory_mb} of "
            f"{int(n.memory_total_mb * n.memory_overcommit)} MB ({n.memory_overcommit:g}×); {n.paused} paused; "
            f"swap {n.swap_total_mb} MB; SCHED_IDLE {'yes' if n.sched_idle else 'no'}; "
            f"core scheduling {n.core_scheduling}; layers {_LAYER_ATTACH.get(n.layer_attach, n.layer_attach)}; "
            f"AppArmor {n.apparmor}")
    for n in everything:
        if n.state != "ready":
            what = "lost" if n.state == "lost" else "its edge did not start"
            console.print(f"[red]{n.node}: {what}: {escape(n.problem)}[/red]")
    if not nodes:
        console.print("[red]no node is serving: creates are refused until one is[/red]")
        raise typer.Exit(1)


@app.command()
def reset(
    state_dir: StateDir = DEFAULT_STATE,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask.")] = False,
) -> None:
    """Stop every sandbox of this node's state dir and release its mounts and cgroups (after a
    crash; never while `dsec serve` runs on it)."""
    from .node import reset_node

    if not yes and not typer.confirm(f"stop every sandbox under {state_dir}?"):
        raise typer.Exit(1)
    removed = run_sdk(reset_node(state_dir))
    console.print(f"reset {state_dir}: {removed} sandbox(es) removed")


# -- the main job -----------------------------------------------------------------------------


@app.command()
def demo(
    count: Annotated[int, typer.Option(help="Sandboxes to create in one batch.")] = 200,
    image: Annotated[str, typer.Option(help="Image to run.")] = "python",
    state_dir: StateDir = DEFAULT_STATE,
    port: Annotated[int, typer.Option(help="Port for the embedded server.")] = 8765,
) -> None:
    """The main job: start the embedded server, run a task in COUNT sandboxes, report, clean up."""
    from .demo import run_demo

    raise typer.Exit(run_demo(count=count, image=image, state_dir=state_dir, port=port, console=console))


register_resource_commands(app)  # dsec project …, dsec pause, dsec resume
register_top(app)  # dsec top
register_shell(app)  # dsec shell


def main() -> None:
    try:
        debug = settings.current().debug
    except settings.SettingsError:
        debug = False  # (`dsec serve` says which variable, once it starts)
    if debug:
        app()
        return
    try:
        app()
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
