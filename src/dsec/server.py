"""``dsec serve``: apiserver and one edge in one process, state under one directory.

State dir layout: ``token`` (the root project's API token, made on first start),
``projects.db`` (projects, quotas and the other tokens, unless ``--db`` names a PostgreSQL
database that several apiservers share), ``store/`` (layers and image
manifests; may be shared between nodes) and ``node/`` (this node's mounts, sandboxes, records).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import secrets
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from . import memtrace, settings
from .apiserver.app import Cluster
from .apiserver.portlane import lane_protocol
from .apiserver.ports import DEFAULT_DOMAIN
from .apiserver.projects import open_project_store
from .app import create_app
from .node import NodeConfig, build_edge, lock_node, open_store, prepare_host, use_pidfd_child_watcher
from .placement import Overcommit
from .resources.coldmem import ColdMemoryReclaimer

log = logging.getLogger("dsec.server")

DEFAULT_STATE_DIR = settings.one("state_dir")
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765


@dataclass
class ServerConfig:
    state_dir: Path = DEFAULT_STATE_DIR
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    # Ports by host name: PORT-SANDBOXID.<domain> (dsec.apiserver.ports); "" turns them off.
    domain: str = DEFAULT_DOMAIN
    node: str = "n0"
    edge: dict = field(default_factory=dict)  # EdgeConfig overrides
    fncall: dict | None = field(default_factory=dict)  # FnCallConfig overrides; None: no fncall pool
    # ColdMemoryReclaimer settings (idle_s, interval_s, fraction); empty: no cold-memory reclaim.
    cold_memory: dict = field(default_factory=dict)
    # A cluster instead of the embedded edge: the Ray cluster's address (``ray.init`` form,
    # ``auto`` included), or a file listing node endpoints (``dsec.nodes.static``).
    ray: str | None = None
    nodes_file: Path | None = None
    # On Ray: each node's state dir is node_state_dir/NAME on that node; every node reads the
    # layer store at store_dir (a shared filesystem on a real cluster; docs/CLUSTER.md).
    node_state_dir: Path | None = None
    store_dir: Path | None = None
    # Projects, quotas and tokens: a postgresql:// URL; None: projects.db in the state dir.
    db: str | None = None
    # On Ray: BurstSettings overrides (dsec.nodes.burst); None: no bursting.
    burst: dict | None = None


def node_config(config: ServerConfig) -> NodeConfig:
    return NodeConfig(state_dir=config.state_dir, node=config.node, edge=config.edge, fncall=config.fncall)


def load_or_create_token(state_dir: Path) -> str:
    path = state_dir / "token"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        token = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token


def build_cluster_app(config: ServerConfig):
    """The apiserver alone, over the nodes of a cluster (Ray, or a node list): no edge here."""
    from .nodes.static import StaticNodes

    config.state_dir.mkdir(parents=True, exist_ok=True)
    token = load_or_create_token(config.state_dir)
    projects = open_project_store(config.db or config.state_dir / "projects.db")
    if config.ray is not None:
        from .nodes.burst import BurstSettings
        from .nodes.ray import RayNodes

        # Absolute: the edges start in Ray's workers, whose working directory is Ray's.
        provider = RayNodes(config.ray, secrets.token_urlsafe(32),
                            node_state_dir=Path(os.path.abspath(config.node_state_dir or config.state_dir / "nodes")),
                            store_dir=Path(os.path.abspath(config.store_dir or config.state_dir / "store")),
                            edge=config.edge,
                            fncall=config.fncall,
                            burst=BurstSettings(**config.burst) if config.burst is not None else None)
        provider.connect()  # here, so that no cluster at the address is a clear error at start
    else:
        assert config.nodes_file is not None
        provider = StaticNodes.from_file(config.nodes_file)
    # The nodes' own overcommit (the edge settings they are started with) for placement.
    overcommit = Overcommit(**{k: config.edge[f"{k}_overcommit"] for k in ("cpu", "memory")
                               if f"{k}_overcommit" in config.edge})
    cluster = Cluster([], projects=projects, overcommit=overcommit, view_max_age_s=1.0)

    @asynccontextmanager
    async def lifespan(app):
        await provider.start(cluster)
        log.info("apiserver ready over %d nodes: %s", len(cluster.edges), ", ".join(sorted(cluster.edges)))
        for node, (_, why) in sorted(cluster.failed.items()):
            log.error("node %s: its edge did not start (tried again, less and less often): %s", node, why)
        if not cluster.edges:
            log.error("no node is serving: creates are refused until one is (%s)", cluster.no_node_ready())
        gc.freeze()
        try:
            yield
        finally:
            await provider.close()
            projects.close()

    return create_app(cluster, token, lifespan=lifespan, domain=config.domain), cluster


def build_app(config: ServerConfig):
    config.state_dir.mkdir(parents=True, exist_ok=True)
    # First: a --db that cannot be reached ends the start here, before anything else is set up.
    projects = open_project_store(config.db or config.state_dir / "projects.db")
    for note in prepare_host():
        log.info(note)
    lock_node(config.state_dir)  # kept open (and locked) until the process exits
    token = load_or_create_token(config.state_dir)
    store = open_store(config.state_dir)
    edge = build_edge(node_config(config), store)
    overcommit = Overcommit(cpu=edge.config.cpu_overcommit, memory=edge.config.memory_overcommit)
    cold = None
    if config.cold_memory:
        container = edge.backends["container"]
        cold = ColdMemoryReclaimer(
            container.cgroup_parent,
            lambda idle_s: [h.cid for kind, h in edge.idle_sandboxes(idle_s) if kind == "container"],
            **config.cold_memory,
        )

    @asynccontextmanager
    async def lifespan(app):
        use_pidfd_child_watcher()
        await edge.start()
        if cold is not None:
            cold.start()
            log.info("cold-memory reclaimer on: %s", config.cold_memory)
        warm_ups = [asyncio.create_task(b.warm_up()) for b in edge.backends.values()]
        log.info("edge %s ready: %d sandboxes adopted", edge.node, len(await edge.list()))
        # What start-up made (modules, routes, schemas, adopted records) lives as long as the
        # server: out of the collector's sight, a full collection no longer walks it all (one
        # took 6 ms in the middle of a burst of creates).
        gc.freeze()
        try:
            yield
        finally:
            for task in warm_ups:
                task.cancel()
            if cold is not None:
                await cold.close()
            await edge.close()
            projects.close()

    cluster = Cluster([edge], projects=projects, overcommit=overcommit)
    return create_app(cluster, token, lifespan=lifespan, domain=config.domain), edge


def serve(config: ServerConfig) -> None:
    settings.load()  # every DSEC_* variable read and checked once, here (SettingsError names a bad one)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if memtrace.install_from_env(config.state_dir) is not None:
        log.info("tracing allocations (DSEC_TRACEMALLOC): SIGUSR2 writes %s", config.state_dir / memtrace.REPORT)
    clustered = config.ray is not None or bool(config.nodes_file)
    app, _ = build_cluster_app(config) if clustered else build_app(config)
    log.info("serving on http://%s:%d (state in %s)", config.host, config.port, config.state_dir)
    # An embedded server runs the plain asyncio loop, on purpose: it spawns crun with vfork
    # (≈0.6 ms), where uvloop forks the whole server (≈4 ms), and every sandbox call spawns
    # crun. A cluster's apiserver spawns nothing: it only forwards, on uvloop.
    uvicorn.run(app, host=config.host, port=config.port, loop="uvloop" if clustered else "asyncio",
                log_level="warning",
                # uvicorn's own HTTP protocol, port requests relayed on the client's connection
                # (dsec.apiserver.portlane)
                http=lane_protocol(app.state.port_lane),
                timeout_graceful_shutdown=10,
                # No proxy stands in front: its headers would only be one more layer a request
                # passes through (and a client could set them).
                proxy_headers=False,
                # Well above the SDK's idle-connection expiry (httpx: 5 s), so a request never
                # leaves on a connection the server is closing.
                timeout_keep_alive=75)

