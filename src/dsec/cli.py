"""The ``dsec`` command line: serve, run, ps, stop, image …, info, demo, bench …"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Column, Table

from libdsec import DSecClient, DSecContainerRunArgs, DSecError, InvalidRequest
from .cli_common import DEFAULT_STATE, StateDir, console, err_console, fail, run_sdk

from .cli_resources import register as register_resource_commands
from .cli_shell import register as register_shell
from .cli_top import register as register_top

from .cli_images import image_app
from .cli_jobs import job_app

app = typer.Typer(help="DSec: sandboxes for agent training.", no_args_is_help=True, add_completion=False)
bench_app = typer.Typer(help="Benchmarks, each against a peer measured in the same run.", no_args_is_help=True)
app.add_typer(image_app, name="image")
app.add_typer(job_app, name="job")
app.add_typer(bench_app, name="bench")




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
            "max_commands_queued": 4 * max_queued, "max_queue_wait_s": max_queue_wait_s}
    if min(max_creates, max_commands) < 1 or max_queued < 0 or max_queue_wait_s <= 0:
        fail(ValueError("--max-creates and --max-commands must be at least 1, --max-queued at least 0 and "
                        "--max-queue-wait-s above 0"))
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
    except DSecError as exc:
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


# -- the main job and benchmarks --------------------------------------------------------------


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


@bench_app.command("lifecycle")
def bench_lifecycle(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server.")] = Path("/var/lib/dsec-bench"),
    idle_count: Annotated[int, typer.Option(help="Idle sandboxes held at once for the memory figure.")] = 1000,
    lifecycles: Annotated[int, typer.Option(help="Measured DSec lifecycles (all rounds).")] = 1200,
    rounds: Annotated[int, typer.Option(help="Throughput rounds: crun, podman and DSec in turn, each round.")] = 2,
    concurrency: Annotated[int, typer.Option(help="Lifecycles in flight (DSec and peers).")] = 32,
    latency_rounds: Annotated[int, typer.Option(help="Rounds of 64 creates with a warm pool (and for crun).")] = 5,
    cold_rounds: Annotated[int, typer.Option(help="Rounds of 64 creates without a pool.")] = 3,
    pool_max: Annotated[int, typer.Option(help="--pool-max of the warm server.")] = 64,
    crun_runs: Annotated[int, typer.Option(help="Measured bare crun lifecycles (all rounds).")] = 800,
    podman_runs: Annotated[int, typer.Option(help="Measured podman lifecycles (all rounds).")] = 96,
    podman: Annotated[bool, typer.Option(help="Measure podman as a peer.")] = True,
    layer_attach: Annotated[str, typer.Option(help="DSEC_LAYER_ATTACH of the servers: auto, file or loop "
                                              "(default: the environment's).")] = "",
    compare_loop: Annotated[bool, typer.Option(help="Each throughput round also with layers on loop devices "
                                               "(the path of kernels before 6.12).")] = False,
    compare_metrics: Annotated[bool, typer.Option(help="Each throughput round also on a server with metrics off "
                                                  "(DSEC_METRICS=0), the DSec rounds scraped every second.")] = False,
    compare_e2b: Annotated[bool, typer.Option(help="Each throughput round also the lifecycle on the python image "
                                              "through DSec's SDK and through the e2b SDK (DSec's E2B API).")] = False,
    strict: Annotated[bool, typer.Option(help="Exit 2 when a goal is missed.")] = False,
) -> None:
    """Full sandbox lifecycle against podman run --rm and bare crun run (see docs/BENCHMARKS.md)."""
    from .bench.lifecycle import main as run_bench

    raise typer.Exit(run_bench(
        state_dir=state_dir, console=console, idle_count=idle_count, lifecycles=lifecycles, rounds=rounds,
        concurrency=concurrency,
        latency_rounds=latency_rounds, cold_rounds=cold_rounds, pool_max=pool_max, crun_runs=crun_runs,
        podman_runs=podman_runs, podman=podman, layer_attach=layer_attach, compare_loop=compare_loop,
        compare_metrics=compare_metrics, compare_e2b=compare_e2b,
        strict=strict,
    ))


@bench_app.command("harness")
def bench_harness(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server.")] = Path("/var/lib/dsec-bench-harness"),
    files: Annotated[int, typer.Option(help="Source files in the task's context.")] = 200,
    build_rounds: Annotated[int, typer.Option(help="Builds with nothing cached, each way.")] = 3,
    rebuild_rounds: Annotated[int, typer.Option(help="Builds with nothing changed, each way.")] = 5,
    start_rounds: Annotated[int, typer.Option(help="DSec starts to a first answer.")] = 30,
    podman_start_rounds: Annotated[int, typer.Option(help="podman run + exec to a first answer.")] = 10,
    podman: Annotated[bool, typer.Option(help="Measure podman as a peer.")] = True,
    harbor: Annotated[bool, typer.Option(help="Harbor oracle trials per minute, DSec's environment against Harbor's docker one.")] = True,
    harbor_venv: Annotated[Path, typer.Option(help="A venv with Harbor 0.25.0 (tests/integration/test_harbor.py makes it).")] = Path("/var/lib/dsec-test/harbor-venv-0.25.0"),
    harbor_concurrency: Annotated[int, typer.Option(help="harbor run -n, both ways.")] = 4,
) -> None:
    """A task's environment as a harness uses it: Dockerfile build, rebuild, start to first answer, against podman;
    Harbor oracle trials per minute on DSec against Harbor's docker environment."""
    from .bench.harness import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, console=console, files=files, build_rounds=build_rounds,
                               rebuild_rounds=rebuild_rounds, start_rounds=start_rounds,
                               podman_start_rounds=podman_start_rounds, podman=podman, harbor=harbor,
                               harbor_venv=harbor_venv, harbor_concurrency=harbor_concurrency))


@bench_app.command("tti")
def bench_tti(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server.")] = Path("/var/lib/dsec-bench-tti"),
    iterations: Annotated[int, typer.Option(help="Sandboxes a mode (sequential, staggered, burst).")] = 100,
    stagger_ms: Annotated[float, typer.Option(help="Between two launches of the staggered mode.")] = 200.0,
    systems: Annotated[str, typer.Option(help="Comma-separated: dsec, e2b, podman.")] = "dsec,e2b,podman",
) -> None:
    """Time to interactive (create → first command's answer) in ComputeSDK's method: DSec's SDK, the e2b SDK on DSec, podman."""
    from .bench.tti import main as run_bench

    chosen = tuple(s.strip() for s in systems.split(",") if s.strip())
    unknown = set(chosen) - {"dsec", "e2b", "podman"}
    if unknown:
        fail(InvalidRequest(f"--systems: unknown {', '.join(sorted(unknown))} (dsec, e2b, podman)"))
    raise typer.Exit(run_bench(state_dir=state_dir, console=console, iterations=iterations, stagger_ms=stagger_ms,
                               systems=chosen))


@bench_app.command("clean-copy")
def bench_clean_copy(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server (removed at the end; results in <state-dir>.json).")] = Path("/var/lib/dsec-bench-clean-copy"),
    rounds: Annotated[int, typer.Option(help="Measured clean copies.")] = 20,
    pack_rounds: Annotated[int, typer.Option(help="Measured pack_diff + run.")] = 5,
    podman_rounds: Annotated[int, typer.Option(help="Measured podman copies (the peer).")] = 5,
    tree_mb: Annotated[int, typer.Option(help="Size of the kept tree.")] = 50,
    files: Annotated[int, typer.Option(help="Files in the kept tree.")] = 500,
    podman: Annotated[bool, typer.Option(help="Measure podman as the peer.")] = True,
) -> None:
    """A grader's clean copy of a kept tree against podman run + a tar copy (see docs/BENCHMARKS.md)."""
    from .bench.clean_copy import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, console=console, rounds=rounds, pack_rounds=pack_rounds,
                               podman_rounds=podman_rounds, tree_mb=tree_mb, files=files, podman=podman))


@bench_app.command("rollout")
def bench_rollout(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server (removed at the end; results in <state-dir>.json).")] = Path("/var/lib/dsec-bench-rollout"),
    store_dir: Annotated[Optional[Path], typer.Option("--store-dir", help="Layer store with (or to get) the python base and the task set (default: <state-dir>-store).")] = None,
    episodes: Annotated[int, typer.Option(help="DSec episodes.")] = 1000,
    podman_episodes: Annotated[int, typer.Option(help="Episodes of the podman exec peer (0: none).")] = 48,
    concurrency: Annotated[int, typer.Option(help="Episodes in flight (both ways).")] = 16,
    tasks: Annotated[int, typer.Option(help="Task repositories (workspace layers over the python base).")] = 32,
    branch_every: Annotated[int, typer.Option(help="A mid-episode pack_diff branch every this many episodes (0: none).")] = 8,
) -> None:
    """A SWE-style RL rollout (tasks, scripted policy, branch, clean-copy verdict) against podman exec."""
    from .bench.rollout import main as run_bench

    raise typer.Exit(run_bench(state_dir, console, store_dir=store_dir, episodes=episodes, concurrency=concurrency,
                               tasks=tasks, branch_every=branch_every, podman_episodes=podman_episodes))


@bench_app.command("joblog")
def bench_joblog(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server (removed at the end; results in <state-dir>.json).")] = Path("/var/lib/dsec-bench-joblog"),
    lifecycles: Annotated[int, typer.Option(help="Measured lifecycles per arm (all rounds).")] = 1200,
    rounds: Annotated[int, typer.Option(help="Rounds, the two arms in turn.")] = 4,
    concurrency: Annotated[int, typer.Option(help="Lifecycles in flight.")] = 32,
) -> None:
    """Lifecycle throughput with a job log (DSecClient(job=...), keyed creates) beside without."""
    from .bench.joblog import main as run_bench

    raise typer.Exit(run_bench(state_dir, console, lifecycles=lifecycles, rounds=rounds, concurrency=concurrency))


@bench_app.command("cluster-ray")
def bench_cluster_ray(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark (removed at the end).")] = Path("/var/lib/dsec-bench-ray"),
    lifecycles: Annotated[int, typer.Option(help="Measured lifecycles per side (all rounds).")] = 400,
    rounds: Annotated[int, typer.Option(help="Rounds, embedded and Ray in turn.")] = 2,
    concurrency: Annotated[int, typer.Option(help="Lifecycles (and creates under the node kill) in flight.")] = 16,
) -> None:
    """Real crun containers on 3 Ray nodes of this machine vs embedded, and a node killed under load."""
    from .bench.ray_nodes import main as run_bench

    raise typer.Exit(run_bench(state_dir, console, lifecycles=lifecycles, rounds=rounds, concurrency=concurrency))


@bench_app.command("microvm")
def bench_microvm(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's VMs.")] = Path("/var/lib/dsec-bench-vm"),
    store_dir: Annotated[Path, typer.Option("--store", help="Layer store with the image.")] = Path("/var/lib/dsec/store"),
    image: Annotated[str, typer.Option(help="Image (python if the store has it, else busybox).")] = "python",
    idle: Annotated[int, typer.Option(help="Idle microVMs per side for the memory figure.")] = 20,
    many: Annotated[int, typer.Option(help="Idle microVMs held at once.")] = 50,
    memory: Annotated[int, typer.Option(help="Guest memory in MB.")] = 256,
    strict: Annotated[bool, typer.Option(help="Exit 2 when a goal is missed.")] = False,
) -> None:
    """MicroVMs: snapshot restore vs cold boot, pmem/DAX + KSM vs private layers, density (docs/BENCHMARKS.md)."""
    from .bench.microvm import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, store_dir=store_dir, console=console, image=image,
                               idle=idle, many=many, memory_mb=memory, strict=strict))


@bench_app.command("fncall")
def bench_fncall(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server.")] = Path("/var/lib/dsec-bench-fncall"),
    store_dir: Annotated[Optional[Path], typer.Option("--store", help="Layer store with the python image (default: the state dir's; built if missing).")] = None,
    calls: Annotated[int, typer.Option(help="Calls for the throughput figure (fncall_many).")] = 6000,
    latency_calls: Annotated[int, typer.Option(help="Calls for the latency figures (one request each).")] = 3000,
    peer_calls: Annotated[int, typer.Option(help="Calls per peer (python3 -c, bwrap).")] = 300,
    in_flight: Annotated[int, typer.Option(help="Calls in flight (DSec and peers).")] = 32,
    workers: Annotated[int, typer.Option(help="--fncall-workers of the server (0: one per core).")] = 0,
    strict: Annotated[bool, typer.Option(help="Exit 2 when a goal is missed.")] = False,
    fusion: Annotated[bool, typer.Option(help="The SandboxFusion arm: run_code python and cpp against bwrap.")] = True,
    fusion_calls: Annotated[int, typer.Option(help="run_code python calls (and bwrap peer calls).")] = 300,
    fusion_cpp_calls: Annotated[int, typer.Option(help="run_code cpp calls (and bwrap g++ peer calls).")] = 30,
    fusion_cpp_in_flight: Annotated[int, typer.Option(help="cpp calls in flight (each compiles).")] = 2,
) -> None:
    """Stateless calls: the warm pool against bwrap python3 -c and python3 -c (docs/BENCHMARKS.md)."""
    from .bench.fncall import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, store_dir=store_dir, console=console, calls=calls,
                               latency_calls=latency_calls, peer_calls=peer_calls, in_flight=in_flight,
                               workers=workers, strict=strict, fusion=fusion, fusion_calls=fusion_calls,
                               fusion_cpp_calls=fusion_cpp_calls, fusion_cpp_in_flight=fusion_cpp_in_flight))


@bench_app.command("inside")
def bench_inside(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server.")] = Path("/var/lib/dsec-bench-inside"),
    samples: Annotated[int, typer.Option(help="Samples of each DSec latency.")] = 100,
    podman_samples: Annotated[int, typer.Option(help="Samples of each podman exec latency.")] = 30,
    slow_s: Annotated[float, typer.Option(help="Seconds `yes` is streamed to the slow reader.")] = 30.0,
    read_mb_s: Annotated[float, typer.Option(help="The slow reader's pace, MB/s.")] = 1.0,
    tree_mb: Annotated[int, typer.Option(help="Size of the tree for upload_dir/download_dir.")] = 200,
    podman: Annotated[bool, typer.Option(help="Measure podman exec as the peer.")] = True,
) -> None:
    """Streaming, sessions and file trees inside a container, against podman exec and local tar."""
    from .bench.inside import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, console=console, samples=samples, podman_samples=podman_samples,
                               slow_s=slow_s, read_mb_s=read_mb_s, tree_mb=tree_mb, podman=podman))


@bench_app.command("ports")
def bench_ports(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server.")] = Path("/var/lib/dsec-bench-ports"),
    seconds: Annotated[float, typer.Option(help="Seconds of each requests/s load.")] = 5.0,
    concurrency: Annotated[int, typer.Option(help="Keep-alive connections of the load, one request in flight on each.")] = 8,
    samples: Annotated[int, typer.Option(help="Samples of each latency.")] = 200,
) -> None:
    """HTTP and WebSocket to a port inside a sandbox (port_url, host name) against the port reached directly."""
    from .bench.ports import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, console=console, seconds=seconds, concurrency=concurrency,
                               samples=samples))


@bench_app.command("density")
def bench_density(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own servers.")] = Path("/var/lib/dsec-bench-density"),
    count: Annotated[int, typer.Option(help="Idle sandboxes to hold at once.")] = 3200,
    step: Annotated[int, typer.Option(help="Time single creates every STEP sandboxes.")] = 400,
    peer_count: Annotated[int, typer.Option(help="Idle bare crun containers (the floor).")] = 400,
    pause_count: Annotated[int, typer.Option(help="Sandboxes paused after touching --pause-mb each.")] = 100,
    pause_mb: Annotated[int, typer.Option(help="MiB each paused (or idling) sandbox touches.")] = 64,
    text_count: Annotated[int, typer.Option(help="Sandboxes paused with agent-like text.")] = 100,
    random_count: Annotated[int, typer.Option(help="Sandboxes paused with random (incompressible) data.")] = 10,
    cold_count: Annotated[int, typer.Option(help="Idle running sandboxes for the cold-memory reclaimer.")] = 20,
    time_limit_s: Annotated[float, typer.Option(help="Bound on the whole run.")] = 2400.0,
    quick: Annotated[bool, typer.Option(help="Developer size: 400 sandboxes, 20 paused, 6 cold.")] = False,
    strict: Annotated[bool, typer.Option(help="Exit 2 when a goal is missed.")] = False,
) -> None:
    """Idle sandboxes per node and their memory vs bare crun, create latency as the node fills,
    memory returned by pause, the cold-memory reclaimer, placement decisions/s."""
    from .bench.density import main as run_bench

    if quick:
        count, step, peer_count, pause_count, text_count, random_count, cold_count = 400, 100, 100, 20, 10, 4, 6
    raise typer.Exit(run_bench(
        state_dir=state_dir, console=console, count=count, step=step, peer_count=peer_count, pause_count=pause_count,
        pause_mb=pause_mb, text_count=text_count, random_count=random_count, cold_count=cold_count,
        time_limit_s=time_limit_s, strict=strict,
    ))


register_resource_commands(app)  # dsec project …, dsec pause, dsec resume
register_top(app)  # dsec top
register_shell(app)  # dsec shell


@bench_app.command("burst")
def bench_burst(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark (its disk is measured).")] = Path("/var/lib/dsec-bench-burst"),
    count: Annotated[int, typer.Option("--count", "-n", help="Sandboxes (N), all started at once.")] = 256,
    images: Annotated[int, typer.Option("--images", "-m", help="Distinct task images (M) over one shared base.")] = 32,
    quick: Annotated[bool, typer.Option(help="Developer size: N=32, M=4.")] = False,
    base: Annotated[str, typer.Option(help="Shared base: python-pkgs (python + Python packages) or python.")] = "python-pkgs",
    concurrency: Annotated[int, typer.Option(help="Peer creates and tasks in flight.")] = 32,
    pull_concurrency: Annotated[int, typer.Option(help="Images unpacked/imported at once (eager, podman).")] = 2,
    podman: Annotated[bool, typer.Option(help="Measure podman as a peer.")] = True,
    podman_max: Annotated[int, typer.Option(help="Cap the podman arm at this many sandboxes (0: all).")] = 0,
    strict: Annotated[bool, typer.Option(help="Exit 2 when a goal is missed.")] = False,
) -> None:
    """A burst of N sandboxes from M task images: on demand (DSec) vs unpack-then-run vs podman."""
    from .bench.burst import main as run_bench

    raise typer.Exit(run_bench(
        state_dir=state_dir, console=console, command=shlex.join(["dsec", *sys.argv[1:]]), count=count,
        images=images, quick=quick, base=base, concurrency=concurrency, pull_concurrency=pull_concurrency,
        podman=podman, podman_max=podman_max, strict=strict,
    ))


@bench_app.command("vm-pause")
def bench_vm_pause(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's VMs.")] = Path("/var/lib/dsec-bench-vm-pause"),
    store_dir: Annotated[Path, typer.Option("--store", help="Layer store with the image.")] = Path("/var/lib/dsec/store"),
    image: Annotated[str, typer.Option(help="Image (busybox is built if the store lacks it).")] = "busybox",
    count: Annotated[int, typer.Option("--count", "-n", help="Idle microVMs to pause.")] = 8,
    memory: Annotated[int, typer.Option(help="Guest memory in MB.")] = 256,
    state_mb: Annotated[int, typer.Option(help="MiB of text each VM writes to its filesystem first.")] = 32,
    strict: Annotated[bool, typer.Option(help="Exit 2 when a goal is missed.")] = False,
) -> None:
    """Host memory of N paused idle microVMs: DSec's pause (stop + push-out) vs QMP stop alone."""
    from .bench.vm_pause import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, store_dir=store_dir, console=console, image=image, count=count,
                               memory_mb=memory, state_mb=state_mb, strict=strict))


@bench_app.command("soak")
def bench_soak(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server (removed at the end; results in <state-dir>.json).")] = Path("/var/lib/dsec-bench-soak"),
    store_dir: Annotated[Optional[Path], typer.Option("--store", help="A layer store to use (linked as the state dir's store; default: its own, with busybox built).")] = None,
    lifecycles: Annotated[int, typer.Option(help="Lifecycles in all.")] = 10_000,
    concurrency: Annotated[int, typer.Option(help="Lifecycles in flight.")] = 16,
    sample_every: Annotated[int, typer.Option(help="Read the server and the host after every this many.")] = 1000,
    pause_every: Annotated[int, typer.Option(help="Pause and resume every Nth sandbox (0: none).")] = 10,
    pack_every: Annotated[int, typer.Option(help="pack_diff every Nth sandbox (0: none).")] = 50,
    fncall_every: Annotated[int, typer.Option(help="A FnCall with every Nth lifecycle (0: none).")] = 5,
    tracemalloc: Annotated[bool, typer.Option(help="Trace the server's allocations (DSEC_TRACEMALLOC=1, slow) and print what grew after the first sample, by line and stack.")] = False,
) -> None:
    """Lifecycles mixed with pauses, pack_diffs, file writes and FnCalls: server RSS, fds, host memory (slab,
    page tables), mounts and cgroups from the first thousand to the last."""
    from .bench.soak import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, console=console, lifecycles=lifecycles, concurrency=concurrency,
                               sample_every=sample_every, pause_every=pause_every, pack_every=pack_every,
                               fncall_every=fncall_every, store=store_dir, tracemalloc=tracemalloc))


@bench_app.command("cluster")
def bench_cluster(
    nodes: Annotated[int, typer.Option(help="Simulated nodes (fake backend, each behind its own endpoint).")] = 160,
    processes: Annotated[int, typer.Option(help="Processes the simulated nodes are dealt out among.")] = 4,
    batch: Annotated[int, typer.Option(help="Sandboxes in the one batch.")] = 32_000,
    singles: Annotated[int, typer.Option(help="Single creates (closed loop).")] = 32_000,
    in_flight: Annotated[int, typer.Option(help="Single creates and stops outstanding at once.")] = 256,
    paced_rate: Annotated[float, typer.Option(help="Single creates offered per second in the paced phase (0: none).")] = 2000.0,
    embedded: Annotated[bool, typer.Option(help="Measure the embedded peer (in-process edges) too.")] = True,
    embedded_scale: Annotated[float, typer.Option(help="The embedded arm's counts, as a fraction of the remote arm's.")] = 1.0,
    results: Annotated[Optional[Path], typer.Option(help="Write the figures to this JSON file.")] = None,
    strict: Annotated[bool, typer.Option(help="Exit 2 when a goal is missed.")] = False,
) -> None:
    """The control plane: one big batch and many single creates over simulated nodes, against in-process edges."""
    from .bench.cluster import main as run_bench

    raise typer.Exit(run_bench(console=console, nodes=nodes, processes=processes, batch=batch, singles=singles,
                               in_flight=in_flight, paced_rate=paced_rate, embedded=embedded,
                               embedded_scale=embedded_scale, results=results, strict=strict))


def main() -> None:
    if os.environ.get("DSEC_DEBUG"):
        app()
        return
    try:
        app()
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
