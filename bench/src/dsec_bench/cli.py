"""``dsec bench NAME``: each benchmark with its peer, measured in the same run.

This distribution (``dsec-bench``) adds the ``bench`` group to the ``dsec`` command line by its
entry point (group ``dsec.cli``, ``bench = "dsec_bench.cli:app"``); ``python -m dsec_bench NAME``
runs the same commands. Each command imports its benchmark when it runs, so ``dsec --help`` loads
none of them.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from libdsec import InvalidRequest
from dsec.cli_common import console, fail

app = typer.Typer(help="Benchmarks, each against a peer measured in the same run.", no_args_is_help=True)


@app.command("lifecycle")
def bench_lifecycle(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server.")] = Path("/var/lib/dsec-bench"),
    idle_count: Annotated[int, typer.Option(help="Idle sandboxes held at once for the memory figure.")] = 1000,
    lifecycles: Annotated[int, typer.Option(help="Measured DSec lifecycles (all rounds).")] = 1200,
    warmup: Annotated[int, typer.Option(help="DSec lifecycles before each throughput round, not measured.")] = 64,
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
    throughput_only: Annotated[bool, typer.Option(help="Only the throughput rounds: no create latency "
                                                  "and no idle memory phases.")] = False,
    strict: Annotated[bool, typer.Option(help="Exit 2 when a goal is missed.")] = False,
) -> None:
    """Full sandbox lifecycle against podman run --rm and bare crun run (see docs/BENCHMARKS.md)."""
    from .lifecycle import main as run_bench

    raise typer.Exit(run_bench(
        state_dir=state_dir, console=console, idle_count=idle_count, lifecycles=lifecycles, rounds=rounds,
        concurrency=concurrency, warmup=warmup,
        latency_rounds=latency_rounds, cold_rounds=cold_rounds, pool_max=pool_max, crun_runs=crun_runs,
        podman_runs=podman_runs, podman=podman, layer_attach=layer_attach, compare_loop=compare_loop,
        compare_metrics=compare_metrics, compare_e2b=compare_e2b, throughput_only=throughput_only,
        strict=strict,
    ))


@app.command("harness")
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
    from .harness import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, console=console, files=files, build_rounds=build_rounds,
                               rebuild_rounds=rebuild_rounds, start_rounds=start_rounds,
                               podman_start_rounds=podman_start_rounds, podman=podman, harbor=harbor,
                               harbor_venv=harbor_venv, harbor_concurrency=harbor_concurrency))


@app.command("tti")
def bench_tti(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server.")] = Path("/var/lib/dsec-bench-tti"),
    iterations: Annotated[int, typer.Option(help="Sandboxes a mode (sequential, staggered, burst).")] = 100,
    stagger_ms: Annotated[float, typer.Option(help="Between two launches of the staggered mode.")] = 200.0,
    systems: Annotated[str, typer.Option(help="Comma-separated: dsec, e2b, podman.")] = "dsec,e2b,podman",
) -> None:
    """Time to interactive (create → first command's answer) in ComputeSDK's method: DSec's SDK, the e2b SDK on DSec, podman."""
    from .tti import main as run_bench

    chosen = tuple(s.strip() for s in systems.split(",") if s.strip())
    unknown = set(chosen) - {"dsec", "e2b", "podman"}
    if unknown:
        fail(InvalidRequest(f"--systems: unknown {', '.join(sorted(unknown))} (dsec, e2b, podman)"))
    raise typer.Exit(run_bench(state_dir=state_dir, console=console, iterations=iterations, stagger_ms=stagger_ms,
                               systems=chosen))


@app.command("clean-copy")
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
    from .clean_copy import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, console=console, rounds=rounds, pack_rounds=pack_rounds,
                               podman_rounds=podman_rounds, tree_mb=tree_mb, files=files, podman=podman))


@app.command("fork")
def bench_fork(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server (removed at the end; results in <state-dir>.json).")] = Path("/var/lib/dsec-bench-fork"),
    children: Annotated[int, typer.Option(help="Children of the fork (and podman runs of the committed image, or cold boots); default 100 for containers, 16 for microVMs.")] = 0,
    changed_mb: Annotated[int, typer.Option(help="MB the parent changed before the fork.")] = 50,
    files: Annotated[int, typer.Option(help="Files those MB are in.")] = 2000,
    concurrency: Annotated[int, typer.Option(help="podman runs at once (the peer).")] = 8,
    podman: Annotated[bool, typer.Option(help="Measure podman commit + run as the peer.")] = True,
    kind: Annotated[str, typer.Option(help="container: podman commit + run as the peer; microvm: a microVM holding --touched-mb forked into --children, against as many cold boots.")] = "container",
    touched_mb: Annotated[int, typer.Option(help="microvm: MiB the parent's process holds (random bytes and text).")] = 256,
) -> None:
    """A live sandbox forked into many: a container against podman commit + a podman run per child,
    a microVM against cold boots (see docs/BENCHMARKS.md)."""
    if kind == "microvm":
        from .fork_microvm import main as run_vm_bench

        raise typer.Exit(run_vm_bench(state_dir=state_dir, console=console, children=children or 16, touched_mb=touched_mb))
    if kind != "container":
        raise typer.BadParameter(f"--kind is container or microvm, not {kind!r}")
    from .fork import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, console=console, children=children or 100, changed_mb=changed_mb,
                               files=files, podman=podman, concurrency=concurrency))


@app.command("rollout")
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
    from .rollout import main as run_bench

    raise typer.Exit(run_bench(state_dir, console, store_dir=store_dir, episodes=episodes, concurrency=concurrency,
                               tasks=tasks, branch_every=branch_every, podman_episodes=podman_episodes))


@app.command("joblog")
def bench_joblog(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server (removed at the end; results in <state-dir>.json).")] = Path("/var/lib/dsec-bench-joblog"),
    lifecycles: Annotated[int, typer.Option(help="Measured lifecycles per arm (all rounds).")] = 1200,
    rounds: Annotated[int, typer.Option(help="Rounds, the two arms in turn.")] = 4,
    concurrency: Annotated[int, typer.Option(help="Lifecycles in flight.")] = 32,
) -> None:
    """Lifecycle throughput with a job log (DSecClient(job=...), keyed creates) beside without."""
    from .joblog import main as run_bench

    raise typer.Exit(run_bench(state_dir, console, lifecycles=lifecycles, rounds=rounds, concurrency=concurrency))


@app.command("cluster-ray")
def bench_cluster_ray(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark (removed at the end).")] = Path("/var/lib/dsec-bench-ray"),
    lifecycles: Annotated[int, typer.Option(help="Measured lifecycles per side (all rounds).")] = 400,
    rounds: Annotated[int, typer.Option(help="Rounds, embedded and Ray in turn.")] = 2,
    concurrency: Annotated[int, typer.Option(help="Lifecycles (and creates under the node kill) in flight.")] = 16,
) -> None:
    """Real crun containers on 3 Ray nodes of this machine vs embedded (the median round of each), and a node killed
    under load."""
    from .ray_nodes import main as run_bench

    raise typer.Exit(run_bench(state_dir, console, lifecycles=lifecycles, rounds=rounds, concurrency=concurrency))


@app.command("microvm")
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
    from .microvm import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, store_dir=store_dir, console=console, image=image,
                               idle=idle, many=many, memory_mb=memory, strict=strict))


@app.command("fncall")
def bench_fncall(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server.")] = Path("/var/lib/dsec-bench-fncall"),
    store_dir: Annotated[Optional[Path], typer.Option("--store", help="Layer store with the python image (default: the state dir's; built if missing).")] = None,
    calls: Annotated[int, typer.Option(help="Calls for the throughput figure (fncall_many), a round.")] = 6000,
    rounds: Annotated[int, typer.Option(help="Rounds of the throughput and floor figures, in turn (median judged).")] = 3,
    latency_calls: Annotated[int, typer.Option(help="Calls for the latency figures (one request each).")] = 3000,
    peer_calls: Annotated[int, typer.Option(help="Calls per peer (python3 -c, bwrap).")] = 300,
    in_flight: Annotated[int, typer.Option(help="Calls in flight (DSec and peers).")] = 32,
    workers: Annotated[int, typer.Option(help="--fncall-workers of the server (0: one per core).")] = 0,
    strict: Annotated[bool, typer.Option(help="Exit 2 when a goal is missed.")] = False,
    fusion: Annotated[bool, typer.Option(help="The SandboxFusion arm: run_code python and cpp against bwrap.")] = True,
    fusion_calls: Annotated[int, typer.Option(help="run_code python calls (and bwrap peer calls).")] = 300,
    fusion_cpp_calls: Annotated[int, typer.Option(help="run_code cpp calls (and bwrap g++ peer calls).")] = 30,
    fusion_cpp_in_flight: Annotated[int, typer.Option(help="cpp calls in flight (each compiles).")] = 2,
    quick: Annotated[bool, typer.Option(help="Developer size: 600 calls, 300 for latency, 40 a peer, no SandboxFusion arm.")] = False,
) -> None:
    """Stateless calls: the warm pool against bwrap python3 -c and python3 -c, latency at the client (docs/BENCHMARKS.md)."""
    from .fncall import main as run_bench

    sequential_min = 100
    if quick:
        calls, latency_calls, peer_calls, fusion, sequential_min = 600, 300, 40, False, 50

    raise typer.Exit(run_bench(state_dir=state_dir, store_dir=store_dir, console=console, calls=calls,
                               latency_calls=latency_calls, peer_calls=peer_calls, in_flight=in_flight,
                               workers=workers, strict=strict, fusion=fusion, fusion_calls=fusion_calls,
                               fusion_cpp_calls=fusion_cpp_calls, fusion_cpp_in_flight=fusion_cpp_in_flight,
                               sequential_min=sequential_min, rounds=rounds))


@app.command("inside")
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
    from .inside import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, console=console, samples=samples, podman_samples=podman_samples,
                               slow_s=slow_s, read_mb_s=read_mb_s, tree_mb=tree_mb, podman=podman))


@app.command("ports")
def bench_ports(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server.")] = Path("/var/lib/dsec-bench-ports"),
    seconds: Annotated[float, typer.Option(help="Seconds of each requests/s load.")] = 5.0,
    concurrency: Annotated[int, typer.Option(help="Keep-alive connections of the load, one request in flight on each.")] = 8,
    samples: Annotated[int, typer.Option(help="Samples of each latency.")] = 200,
    rounds: Annotated[int, typer.Option(help="Rounds of the three loads, taken in turn (the median is reported).")] = 3,
) -> None:
    """HTTP and WebSocket to a port inside a sandbox (port_url, host name) against the port reached directly."""
    from .ports import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, console=console, seconds=seconds, concurrency=concurrency,
                               samples=samples, rounds=rounds))


@app.command("desktop")
def bench_desktop(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server.")] = Path("/var/lib/dsec-bench-desktop"),
    store: Annotated[Optional[Path], typer.Option(help="A layer store that has the desktop image (else built in the state dir).")] = None,
    width: Annotated[int, typer.Option(help="Screen width.")] = 1280,
    height: Annotated[int, typer.Option(help="Screen height.")] = 800,
    samples: Annotated[int, typer.Option(help="Samples of each DSec latency (moves: 4x this).")] = 100,
    peer_samples: Annotated[int, typer.Option(help="Samples of each exec latency (the peers').")] = 30,
    creates: Annotated[int, typer.Option(help="Sandboxes made for create-to-first-screenshot.")] = 5,
    density: Annotated[int, typer.Option(help="Idle desktops to hold at once, against as many podman run (0: off).")] = 0,
    density_only: Annotated[bool, typer.Option(help="Only the density arm.")] = False,
    density_session: Annotated[str, typer.Option(help="Session of the idle desktops: wm, xfce4 or none.")] = "wm",
    density_peer: Annotated[Optional[int], typer.Option(help="podman desktops of the peer (default: --density).")] = None,
    density_batch: Annotated[int, typer.Option(help="Desktops created at once.")] = 10,
    density_memory_mb: Annotated[int, typer.Option(help="Memory limit of each idle desktop (admission counts it).")] = 384,
    density_reserve_gib: Annotated[float, typer.Option(help="Stop filling when MemAvailable would go under this.")] = 4.0,
    density_settle_s: Annotated[float, typer.Option(help="Wait this long for the host's memory to settle.")] = 10.0,
    kind: Annotated[str, typer.Option(help="container, or microvm / fullvm: the same desktop in a VM against it in a container.")] = "container",
) -> None:
    """A sandbox's desktop (screenshot, input, create to first screenshot) against scrot and xdotool by podman exec (and crun exec)."""
    from .desktop import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, console=console, store=store, width=width, height=height,
                               samples=samples, peer_samples=peer_samples, creates=creates, density=density,
                               density_only=density_only, density_session=density_session, density_peer=density_peer,
                               density_batch=density_batch, density_memory_mb=density_memory_mb,
                               density_reserve_gib=density_reserve_gib, density_settle_s=density_settle_s,
                               kind=kind))


@app.command("density")
def bench_density(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own servers.")] = Path("/var/lib/dsec-bench-density"),
    max_count: Annotated[int, typer.Option(help="A safety cap on the idle sandboxes (0: none: fill until a limit is hit).")] = 0,
    step: Annotated[int, typer.Option(help="Time single creates every STEP sandboxes.")] = 400,
    peer_count: Annotated[int, typer.Option(help="Idle bare crun containers (the floor).")] = 400,
    pause_count: Annotated[int, typer.Option(help="Sandboxes paused after writing --pause-mb of heap-like content each.")] = 100,
    pause_mb: Annotated[int, typer.Option(help="MiB each paused (or idling) sandbox writes.")] = 64,
    text_count: Annotated[int, typer.Option(help="Sandboxes paused with agent-like text.")] = 100,
    random_count: Annotated[int, typer.Option(help="Sandboxes paused with random (incompressible) data.")] = 10,
    cold_count: Annotated[int, typer.Option(help="Idle running sandboxes for the cold-memory reclaimer.")] = 20,
    cold_wait_s: Annotated[float, typer.Option(help="Seconds the cold-memory reclaimer is given.")] = 40.0,
    time_limit_s: Annotated[float, typer.Option(help="Bound on the whole run.")] = 2400.0,
    max_sandboxes: Annotated[int, typer.Option(help="The idle server's --max-sandboxes (its admission).")] = 16384,
    memory_overcommit: Annotated[float, typer.Option(
        help="The idle server's --memory-overcommit (0: what --max-sandboxes idle sandboxes of 16 MB commit).")] = 0.0,
    only: Annotated[str, typer.Option(help="Run one phase alone: placement, crun, idle, pause or cold.")] = "",
    quick: Annotated[bool, typer.Option(help="Developer size: at most 400 sandboxes, 20 paused, 6 cold.")] = False,
    strict: Annotated[bool, typer.Option(help="Exit 2 when a goal is missed.")] = False,
) -> None:
    """How many idle sandboxes fit on this node and what each costs the host vs bare crun, create latency as
    the node fills, memory returned by pause (heap-like content), the cold-memory reclaimer, placement decisions/s."""
    from .density import main as run_bench

    if only not in ("", "placement", "crun", "idle", "pause", "cold"):
        raise typer.BadParameter(f"{only!r}: one of placement, crun, idle, pause, cold", param_hint="--only")
    if quick:
        max_count, step, peer_count, pause_count, text_count, random_count, cold_count = 400, 100, 100, 20, 10, 4, 6
    raise typer.Exit(run_bench(
        state_dir=state_dir, console=console, max_count=max_count, step=step, peer_count=peer_count, pause_count=pause_count,
        pause_mb=pause_mb, text_count=text_count, random_count=random_count, cold_count=cold_count,
        cold_wait_s=cold_wait_s, time_limit_s=time_limit_s, strict=strict, max_sandboxes=max_sandboxes,
        memory_overcommit=memory_overcommit, only=only,
    ))


@app.command("burst")
def bench_burst(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark (its disk is measured).")] = Path("/var/lib/dsec-bench-burst"),
    count: Annotated[int, typer.Option("--count", "-n", help="Sandboxes (N), all started at once.")] = 256,
    images: Annotated[int, typer.Option("--images", "-m", help="Distinct task images (M) over one shared base.")] = 32,
    quick: Annotated[bool, typer.Option(help="Developer size: N=32, M=4.")] = False,
    base: Annotated[str, typer.Option(help="Shared base: python-pkgs (python + Python packages) or python.")] = "python-pkgs",
    concurrency: Annotated[int, typer.Option(help="Peer creates and tasks in flight.")] = 32,
    pull_concurrency: Annotated[int, typer.Option(help="Images pulled at once after the first (eager, podman).")] = 2,
    podman: Annotated[bool, typer.Option(help="Measure podman as a peer.")] = True,
    podman_max: Annotated[int, typer.Option(help="Cap the podman arm at this many sandboxes (0: all).")] = 0,
    strict: Annotated[bool, typer.Option(help="Exit 2 when a goal is missed.")] = False,
) -> None:
    """A burst of N sandboxes from M task images: on demand (DSec) vs pulling the layered images from a loopback
    registry into a layer-sharing store, then crun (eager) or podman run."""
    from .burst import main as run_bench

    raise typer.Exit(run_bench(
        state_dir=state_dir, console=console, command=shlex.join(["dsec", *sys.argv[1:]]), count=count,
        images=images, quick=quick, base=base, concurrency=concurrency, pull_concurrency=pull_concurrency,
        podman=podman, podman_max=podman_max, strict=strict,
    ))


@app.command("layercache")
def bench_layercache(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark.")] = Path("/var/lib/dsec-bench-layercache"),
    images: Annotated[int, typer.Option("--images", "-m", help="Task images (over one shared base).")] = 8,
    per_image: Annotated[int, typer.Option("--per-image", "-n", help="Sandboxes created of each image per arm.")] = 8,
    cache_mb: Annotated[int, typer.Option(help="The node's layer cache (DSEC_LAYER_CACHE_MB) in the cached arms.")] = 4096,
    base: Annotated[str, typer.Option(help="Shared base: python-pkgs (python + Python packages) or python.")] = "python-pkgs",
    nodes: Annotated[int, typer.Option(help="DSec nodes: 1 (one dsec serve), or a Ray cluster of this many on this machine.")] = 1,
) -> None:
    """A burst of creates of images on a GlusterFS store: no cache, the node's layer cache cold and warm (after a
    node restart), against the store on local disk; bytes read from the shared filesystem."""
    from .layercache import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, console=console, command=shlex.join(["dsec", *sys.argv[1:]]),
                               images=images, per_image=per_image, cache_mb=cache_mb, base=base, nodes=nodes))


@app.command("vm-pause")
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
    from .vm_pause import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, store_dir=store_dir, console=console, image=image, count=count,
                               memory_mb=memory, state_mb=state_mb, strict=strict))


@app.command("pause")
def bench_pause(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="State dir of the benchmark's own server (removed at the end; results in <state-dir>.json).")] = Path("/var/lib/dsec-bench-pause"),
    count: Annotated[int, typer.Option("--count", "-n", help="Sandboxes in the job.")] = 500,
    mb: Annotated[int, typer.Option(help="MiB of heap-like content (text, structures, random bytes) each holds.")] = 64,
    probes: Annotated[int, typer.Option(help="Paused sandboxes whose first call (auto-resume) is timed.")] = 5,
    loop: Annotated[bool, typer.Option(help="Also pause them one call each (sandbox.pause(), 4 at a time).")] = False,
) -> None:
    """A whole job paused and resumed in one call each: time, memory given back, auto-resume's cost."""
    from .job_pause import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, console=console, count=count, mb=mb, probes=probes, loop=loop))


@app.command("pulls")
def bench_pulls(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="Work dir of the benchmark (removed at the end; results in <state-dir>.json).")] = Path("/var/lib/dsec-bench-pulls"),
    images: Annotated[int, typer.Option(help="Task images over the one base.")] = 32,
    files: Annotated[int, typer.Option(help="Files in each task image's own layer.")] = 200,
    base: Annotated[str, typer.Option(help="The shared base: python (about 400 MB) or busybox.")] = "python",
    concurrency: Annotated[int, typer.Option(help="Images pulled at a time (both ways).")] = 4,
    peer: Annotated[bool, typer.Option(help="Measure skopeo copy into containers-storage as the peer.")] = True,
) -> None:
    """Many task images sharing a base pulled from a loopback registry: DSec's pull --many against skopeo into containers-storage."""
    from .pulls import main as run_bench

    if base not in ("python", "busybox"):
        raise typer.BadParameter(f"--base {base!r}: use python or busybox")
    raise typer.Exit(run_bench(state_dir=state_dir, console=console, images=images, files=files, base=base,
                               concurrency=concurrency, peer=peer))


@app.command("soak")
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
    from .soak import main as run_bench

    raise typer.Exit(run_bench(state_dir=state_dir, console=console, lifecycles=lifecycles, concurrency=concurrency,
                               sample_every=sample_every, pause_every=pause_every, pack_every=pack_every,
                               fncall_every=fncall_every, store=store_dir, tracemalloc=tracemalloc))


@app.command("images")
def bench_images(
    state_dir: Annotated[Path, typer.Option("--state-dir", help="Where the two stores and their servers go (the stores "
                                            "are removed at the end; results in <state-dir>/images.json).")] = Path("/var/lib/dsec-bench-images"),
    bases: Annotated[int, typer.Option(help="Base images in the big store.")] = 10_000,
    workspaces: Annotated[int, typer.Option(help="Workspaces in the big store (the small one has 10).")] = 100_000,
    creates: Annotated[int, typer.Option(help="Measured creates on each store (a p99 of 600 is its 6th worst).")] = 600,
    repeat: Annotated[int, typer.Option(help="Times each store operation is timed (the median is shown).")] = 20,
    quick: Annotated[bool, typer.Option(help="1,000 bases and 10,000 workspaces, 30 creates each.")] = False,
    keep: Annotated[bool, typer.Option(help="Keep the generated stores.")] = False,
    strict: Annotated[bool, typer.Option(help="Exit 2 when the create-latency goal is missed.")] = False,
) -> None:
    """The layer store at production size (10,000 bases, 100,000 workspaces) against one of ten: create latency
    p50/p99, image ls / inspect / gc / a build's store work (see docs/BENCHMARKS.md)."""
    from .images import main as run_bench

    if quick:
        bases, workspaces, creates = 1_000, 10_000, min(creates, 30)
    raise typer.Exit(run_bench(state_dir=state_dir, console=console, bases=bases, workspaces=workspaces,
                               creates=creates, repeat=repeat, keep=keep, strict=strict))


@app.command("cluster")
def bench_cluster(
    nodes: Annotated[int, typer.Option(help="Simulated nodes (fake backend, each behind its own endpoint).")] = 160,
    processes: Annotated[int, typer.Option(help="Processes the simulated nodes are dealt out among.")] = 4,
    batch: Annotated[int, typer.Option(help="Sandboxes in the one batch.")] = 32_000,
    singles: Annotated[int, typer.Option(help="Single creates (closed loop).")] = 32_000,
    in_flight: Annotated[int, typer.Option(help="Single creates and stops outstanding at once.")] = 256,
    paced_rate: Annotated[float, typer.Option(help="Single creates offered per second in the paced phase (0: none).")] = 2000.0,
    embedded: Annotated[bool, typer.Option(help="Measure the embedded peer (in-process edges) too.")] = True,
    embedded_scale: Annotated[float, typer.Option(help="The embedded arm's counts, as a fraction of the remote arm's.")] = 1.0,
    crun_nodes: Annotated[int, typer.Option(help="Real nodes (crun) on this machine in the crun arm.")] = 4,
    crun_count: Annotated[int, typer.Option(help="The crun arms' batch and single creates (0: no crun arms).")] = 256,
    crun_in_flight: Annotated[int, typer.Option(help="The crun arms' creates and stops outstanding at once.")] = 32,
    results: Annotated[Optional[Path], typer.Option(help="Write the figures to this JSON file.")] = None,
    strict: Annotated[bool, typer.Option(help="Exit 2 when a goal is missed.")] = False,
) -> None:
    """The control plane on the fake backend: one big batch and many single creates over simulated nodes, against
    in-process edges (both arms on the fake backend: no containers are made); then real containers (crun) on a few
    nodes of this machine behind one apiserver, against one embedded node."""
    from .cluster import main as run_bench

    raise typer.Exit(run_bench(console=console, nodes=nodes, processes=processes, batch=batch, singles=singles,
                               in_flight=in_flight, paced_rate=paced_rate, embedded=embedded,
                               embedded_scale=embedded_scale, crun_nodes=crun_nodes, crun_count=crun_count,
                               crun_in_flight=crun_in_flight, results=results, strict=strict))


@app.command("all")
def bench_all(
    quick: Annotated[bool, typer.Option(help="Each benchmark's quick mode, the whole within 20 minutes (without: the "
                                        "full runs, hours).")] = False,
    state_root: Annotated[Path, typer.Option(help="Where each benchmark's state dir, log and results go.")] = Path("/var/lib/dsec-bench-all"),
    doc: Annotated[Optional[Path], typer.Option(help="The BENCHMARKS.md whose glance table is rewritten (default: "
                                                "docs/BENCHMARKS.md of the checkout this runs from).")] = None,
    write: Annotated[bool, typer.Option(help="Rewrite the glance table (--no-write: print it only).")] = True,
    only: Annotated[str, typer.Option(help="Comma-separated: run only these benchmarks.")] = "",
    skip: Annotated[str, typer.Option(help="Comma-separated: leave these out.")] = "",
    seed_store: Annotated[Optional[Path], typer.Option(help="A layer store whose python, busybox and desktop images are linked "
                                                       "into each benchmark's store, so none is built again.")] = None,
) -> None:
    """Every benchmark, then docs/BENCHMARKS.md's glance table rewritten from what they measured."""
    from .refresh import QUICK, main as run_all

    names = {b.name for b in QUICK}
    only_list = [x.strip() for x in only.split(",") if x.strip()]
    skip_list = [x.strip() for x in skip.split(",") if x.strip()]
    if unknown := set(only_list + skip_list) - names:
        fail(InvalidRequest(f"unknown benchmarks: {', '.join(sorted(unknown))} ({', '.join(sorted(names))})"))
    if doc is None and write:
        doc = Path(__file__).resolve().parents[3] / "docs" / "BENCHMARKS.md"
        if not doc.exists():
            fail(InvalidRequest(f"no {doc}: name the document with --doc, or --no-write"))
    raise typer.Exit(run_all(console, state_root=state_root, doc=doc if write else None, quick=quick, only=only_list,
                             skip=skip_list, seed=seed_store))
