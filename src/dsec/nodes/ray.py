"""Edges on the nodes of a Ray cluster.

``RayNodes(address)`` connects to the cluster (``ray.init(address=…)``, ``auto`` included) and
keeps one edge on every alive node that offers the custom resource ``dsec_edge`` (operators start
workers with ``ray start --address … --resources '{"dsec_edge": 1}'``). Each edge runs in an
``EdgeHost`` actor pinned to its node (node affinity, not soft; it takes the node's ``dsec_edge``),
with its own node name and state dir, and serves the node seam on its own HTTP endpoint
(``dsec.edge.server``) at the node's address; the apiserver calls it there (``RemoteEdge``).
Ray carries membership, placement of the actors and their health; the data path is the edge's
own endpoint, which costs the apiserver a fraction of an actor call per request
(docs/BENCHMARKS.md → Cluster).

Membership is polled (``poll_s``): a node that joins gets an edge within seconds; one that Ray
declares dead is marked lost (its sandboxes answer ``SandboxLost``, stop counting against
quotas, and new creates go elsewhere). A node that comes back under the same name starts an edge
on the same state dir, which re-adopts the sandboxes still running there.

Names: a node's ``dsec-node`` label (``ray start --labels '{"dsec-node": "a1"}'``), else one made
from its Ray node name (its address by default), so that a machine keeps its name across
restarts. Several unlabelled nodes of one machine (two ``ray start`` on one host, or
``ray.cluster_utils.Cluster``) would share that name: each then gets it with the start of its Ray
node id, a name of its own while it lives (label them for names that outlive a restart). Actors
are named ``dsec-edge-<name>`` in the ``dsec`` namespace and detached: a second apiserver finds
the same edges, and an apiserver that restarts finds them still running (an edge already running
on a node keeps its name).

A node whose edge does not start (or whose label clashes with another's) is tried again after
1, 2, 4, … s (at most a minute apart), and meanwhile said where a user looks: the cluster's
``failed`` nodes (``/v1/nodes?all=true``, ``dsec info``), the apiserver's log at start, and the
refusal of a create when no node is serving.

Bursting (``burst=BurstSettings(…)``; ``dsec.nodes.ray_burst``): after each poll, more nodes are
asked of Ray's autoscaler when the cluster is busy, and burst nodes drained and let go when quiet.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from libdsec import BackendError

from ..apiserver.cluster import Cluster
from ..edge.api import NODE_NAME
from ..edge.remote import RemoteEdge
from .burst import BurstSettings
from .ray_burst import BURST_RESOURCE, RayBurst

log = logging.getLogger("dsec.nodes.ray")

RESOURCE = "dsec_edge"
LABEL = "dsec-node"
NAMESPACE = "dsec"
ACTOR_PREFIX = "dsec-edge-"
ID_CHARS = 8  # of a Ray node id, in the names of unlabelled nodes that share a machine
JOIN_HINT = (f"start nodes for DSec with `ray start --address HEAD:6379 --resources '{{\"{RESOURCE}\": 1}}'` "
             f"(and `--labels '{{\"{LABEL}\": \"n1\"}}'` to name each)")
RETRY_MAX_S = 60.0  # a node whose edge did not start is tried again after 1, 2, 4, … s, up to this


def request_burst_nodes(count: int) -> None:
    """Ask the autoscaler for ``count`` burst nodes in all (blocking; a driver of the cluster)."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[{RESOURCE: 1, BURST_RESOURCE: 1}] * count)


def node_name(ray_node: dict) -> str:
    """The DSec name a Ray node takes when it is alone under it: its label, else one made from its
    Ray node name (see the module docstring)."""
    label = labelled(ray_node)
    if label:
        return label
    name = re.sub(r"[^a-z0-9]", "", str(ray_node.get("NodeName", "")).lower())
    if NODE_NAME.match(name) and not name.isdigit():
        return name
    return "r" + hashlib.sha256(str(ray_node.get("NodeName", ray_node.get("NodeID"))).encode()).hexdigest()[:12]


def labelled(ray_node: dict) -> str | None:
    """The node's ``dsec-node`` label; ``BackendError`` when it is no DSec node name."""
    label = (ray_node.get("Labels") or {}).get(LABEL)
    if label and not NODE_NAME.match(label):
        raise BackendError(f"Ray node {ray_node.get('NodeID', '?')[:12]}: label {LABEL}={label!r} is not a "
                           "DSec node name (lowercase letters and digits, at most 32)")
    return label or None


def own_name(base: str, ray_id: str) -> str:
    """The name of an unlabelled node that shares ``base`` with another (several Ray nodes on one
    machine): ``base`` and the start of its Ray node id, unique while the node lives."""
    return base[:32 - ID_CHARS] + ray_id[:ID_CHARS].lower()


def _probe(address: str) -> None:
    """Fail at once where nothing listens at a ``host:port`` address (Ray itself retries a
    missing head for minutes)."""
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=3).close()
    except ValueError:
        raise BackendError(f"Ray address {address!r}: expected HOST:PORT or 'auto'") from None
    except OSError as exc:
        raise BackendError(f"no Ray cluster at {address!r}: {exc.strerror or exc}. Start one with "
                           "`ray start --head`, and nodes for DSec with "
                           f"`ray start --address HEAD:6379 --resources '{{\"{RESOURCE}\": 1}}'`") from None


def _loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def join(address: str) -> None:
    """``ray.init`` on the cluster at ``address`` in the namespace of DSec's actors; a clear
    ``BackendError`` at once where none runs there."""
    import ray

    _probe(address)
    if _loopback(address):
        # A cluster of this machine's loopback (tests, a one-machine trial): Ray would turn
        # 127.0.0.1 into the machine's outward address, where its head does not listen.
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING,
                 ignore_reinit_error=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise BackendError(f"cannot join the Ray cluster at {address!r}: {exc}. Start one with "
                           "`ray start --head`, and nodes for DSec with "
                           f"`ray start --address HEAD:6379 --resources '{{\"{RESOURCE}\": 1}}'`") from None


class EdgeHost:
    """A Ray actor holding one node's edge (made by ``RayNodes``): it runs the edge daemon
    (``dsec.nodes.edged``) in a session of its own, which dies with the actor (a parent-death
    signal) while the sandboxes it started outlive both (see edged's docstring).

    ``start()`` starts the daemon on the node's state dir (it re-adopts what runs there) and
    returns its URL and token (a second call returns the same); ``stop()`` ends the daemon,
    leaving running sandboxes to be adopted by the next edge on that state dir."""

    def __init__(self, name: str, state_dir: str, store_dir: str, token: str, edge: dict,
                 fncall: dict | None) -> None:
        self.name, self.state_dir, self.store_dir = name, Path(state_dir), Path(store_dir)
        self.token, self.edge_overrides, self.fncall = token, edge, fncall
        self._proc: asyncio.subprocess.Process | None = None
        self._url = ""

    async def start(self) -> tuple[str, str]:
        """(URL, node token). The token is the one this actor was made with: an apiserver that
        finds the actor made by another (``get_if_exists``) learns it here (whoever reaches the
        Ray cluster is trusted with its nodes anyway)."""
        if self._url and self._proc is not None and self._proc.returncode is None:
            return self._url, self.token
        import ray

        self.state_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.state_dir / "edged.log"
        config = json.dumps({"edge": self.edge_overrides, "fncall": self.fncall})
        with open(log_path, "ab") as log_file:
            self._proc = await asyncio.create_subprocess_exec(
                "setpriv", "--pdeathsig", "KILL", "--", sys.executable, "-m", "dsec.nodes.edged",
                "--state-dir", str(self.state_dir), "--node", self.name, "--store", str(self.store_dir),
                "--host", ray.util.get_node_ip_address(), "--config", config,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log_file,
                start_new_session=True)
        self._proc.stdin.write(self.token.encode() + b"\n")
        await self._proc.stdin.drain()
        line = await self._proc.stdout.readline()
        if not line:
            await self._proc.wait()
            tail = log_path.read_text(errors="replace")[-2000:]
            raise BackendError(f"the edge of node {self.name} exited at start ({self._proc.returncode}): {tail}")
        self._url = json.loads(line)["url"]
        log.info("edge %s serving at %s", self.name, self._url)
        return self._url, self.token

    async def stop(self) -> None:
        proc, self._proc, self._url = self._proc, None, ""
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()

    async def ping(self) -> str:
        return self.name

    async def dirs(self) -> tuple[str, str]:
        """(state dir, store dir) this edge was made with (by whichever apiserver made it)."""
        return str(self.state_dir), str(self.store_dir)

    async def where(self) -> str:
        """The Ray node id this actor (and so this edge) lives on."""
        import ray

        return ray.get_runtime_context().get_node_id()


@dataclass
class _Member:
    ray_id: str
    name: str
    edge: RemoteEdge | None = None
    starting: asyncio.Task | None = None
    since: float = field(default_factory=time.monotonic)
    burst: bool = False  # offers dsec_burst: came for bursting


class RayNodes:
    """Follows a Ray cluster's ``dsec_edge`` nodes (see the module docstring)."""

    def __init__(self, address: str, token: str, *, node_state_dir: Path, store_dir: Path,
                 edge: dict | None = None, fncall: dict | None = None, poll_s: float = 1.0,
                 start_timeout_s: float = 120.0, burst: BurstSettings | None = None) -> None:
        self.address, self.token = address, token
        self.node_state_dir, self.store_dir = Path(node_state_dir), Path(store_dir)
        self.edge_overrides, self.fncall = edge or {}, fncall
        self.poll_s, self.start_timeout_s = poll_s, start_timeout_s
        self._members: dict[str, _Member] = {}  # by Ray node id
        self._cluster: Cluster | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._actor_class = None
        self.burst = burst
        self._burst: RayBurst | None = None
        # Burst nodes let go (by Ray node id): no edge again until the autoscaler removes them.
        self._released: set[str] = set()
        # Nodes whose edge did not start, by Ray node id: (name, attempts, when to try again).
        self._failing: dict[str, tuple[str, int, float]] = {}

    async def start(self, cluster: Cluster) -> None:
        self._cluster = cluster
        cluster.join_hint = JOIN_HINT
        if self.burst is not None:
            self._burst = RayBurst(self.burst, cluster, self.let_go, request=request_burst_nodes,
                                   view_max_age_s=self.poll_s)
        if self._actor_class is None:
            await asyncio.to_thread(self.connect)
        await self._poll()
        pending = [m.starting for m in self._members.values() if m.starting is not None]
        if pending:
            await asyncio.wait(pending, timeout=self.start_timeout_s)
        self._task = asyncio.create_task(self._follow(), name="dsec-ray-membership")

    def connect(self) -> None:
        """Join the Ray cluster (blocking); ``BackendError`` naming the address if none runs there."""
        import ray

        join(self.address)
        self._actor_class = ray.remote(EdgeHost)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for member in self._members.values():
            if member.starting is not None:
                member.starting.cancel()
            if member.edge is not None:
                await member.edge.close()
        self._members.clear()
        import ray

        if ray.is_initialized():
            await asyncio.to_thread(ray.shutdown)

    # -- membership --------------------------------------------------------------------------

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self._poll()
            except Exception as exc:  # noqa: BLE001 - the next poll tries again
                log.warning("Ray membership poll failed: %s", exc)
            if self._burst is not None:
                try:
                    await self._burst.step({m.name for m in self._members.values() if m.burst})
                except Exception as exc:  # noqa: BLE001 - the next poll tries again
                    log.warning("bursting step failed: %s", exc)

    async def _poll(self) -> None:
        import ray

        nodes = await asyncio.to_thread(ray.nodes)
        alive = {n["NodeID"]: n for n in nodes if n.get("Alive") and (n.get("Resources") or {}).get(RESOURCE, 0) > 0}
        self._released &= alive.keys()
        for ray_id in self._failing.keys() - alive.keys():
            name = self._failing.pop(ray_id)[0]
            if self._cluster is not None and not any(m.name == name for m in self._members.values()):
                self._cluster.forget_failed(name)
        for ray_id, member in list(self._members.items()):
            if ray_id not in alive:
                self._lose(member, "its Ray node died or left the cluster")
        now = time.monotonic()
        new = {ray_id: n for ray_id, n in alive.items() if ray_id not in self._members
               and ray_id not in self._released and now >= self._failing.get(ray_id, ("", 0, 0.0))[2]}
        if not new:
            return
        for ray_id, name in (await self._names(new, alive)).items():
            if any(m.name == name for m in self._members.values()):
                other = next(m.ray_id for m in self._members.values() if m.name == name)
                self._failed(ray_id, f"{name}-{ray_id[:ID_CHARS]}",
                             f"Ray node {ray_id[:12]} is labelled {LABEL}={name} like Ray node {other[:12]}: "
                             "give each node a label of its own")
                continue
            ray_node = alive[ray_id]
            member = self._members[ray_id] = _Member(ray_id, name,
                                                     burst=ray_node["Resources"].get(BURST_RESOURCE, 0) > 0)
            member.starting = asyncio.create_task(self._join(member), name=f"dsec-join-{name}")

    async def _names(self, new: dict[str, dict], alive: dict[str, dict]) -> dict[str, str]:
        """The DSec names of the ``new`` Ray nodes (by id). A label names a node; an edge actor
        already running on a node (started by an earlier or another apiserver) keeps its name;
        else the name made from the Ray node's name, when no other node alive shares it (a
        machine keeps its name across restarts), or that name and the start of its node id when
        several do (Ray nodes on one machine)."""
        names: dict[str, str] = {}
        unlabelled = {}
        for ray_id, ray_node in new.items():
            try:
                label = labelled(ray_node)
            except BackendError as exc:
                self._failed(ray_id, f"ray{ray_id[:ID_CHARS].lower()}", str(exc))
                continue
            if label:
                names[ray_id] = label
            else:
                unlabelled[ray_id] = ray_node
        if not unlabelled:
            return names
        running = await self._running_edges()
        bases: dict[str, int] = {}
        for ray_node in alive.values():
            base = node_name(ray_node)
            bases[base] = bases.get(base, 0) + 1
        taken = {m.name for m in self._members.values()} | set(names.values())
        for ray_id, ray_node in unlabelled.items():
            base = node_name(ray_node)
            name = running.get(ray_id) or (base if bases[base] == 1 and base not in taken else own_name(base, ray_id))
            names[ray_id] = name
            taken.add(name)
        return names

    async def _running_edges(self) -> dict[str, str]:
        """Ray node id -> name of the edge actors already running that no member holds."""
        import ray

        held = {m.name for m in self._members.values()}
        found: dict[str, str] = {}
        try:
            actors = await asyncio.to_thread(ray.util.list_named_actors)
        except Exception as exc:  # noqa: BLE001 - names are then made afresh
            log.warning("cannot list Ray's named actors: %s", exc)
            return found
        for actor_name in actors:
            name = actor_name[len(ACTOR_PREFIX):] if actor_name.startswith(ACTOR_PREFIX) else None
            if not name or name in held:
                continue
            try:
                actor = await asyncio.to_thread(ray.get_actor, actor_name, namespace=NAMESPACE)
                found[await asyncio.wait_for(actor.where.remote(), 10)] = name
            except Exception as exc:  # noqa: BLE001 - gone meanwhile, or older than where()
                log.info("edge actor %s: no node id (%s)", actor_name, exc)
        return found

    def _failed(self, ray_id: str, name: str, why: str) -> None:
        """A node whose edge did not start (or cannot be named): said where a user looks, and
        tried again after a while that doubles each time."""
        _, attempts, _ = self._failing.get(ray_id, (name, 0, 0.0))
        self._failing[ray_id] = (name, attempts + 1, time.monotonic() + min(RETRY_MAX_S, 2.0 ** attempts))
        if attempts == 0:
            log.warning("node %s: %s", name, why)
        if self._cluster is not None:
            self._cluster.note_failed(name, why)

    def _lose(self, member: _Member, why: str) -> None:
        self._members.pop(member.ray_id, None)
        if member.starting is not None:
            member.starting.cancel()
        assert self._cluster is not None
        if self._cluster.edges.get(member.name) is member.edge:
            self._cluster.mark_lost(member.name, why)
        if member.edge is not None:
            asyncio.create_task(member.edge.close())

    async def let_go(self, name: str) -> None:
        """Let a drained burst node go: out of the cluster, its edge stopped and its actor ended
        (the node then holds nothing of Ray's, and the autoscaler removes it once idle); it gets
        no edge again while Ray keeps it."""
        import ray

        member = next((m for m in self._members.values() if m.name == name), None)
        if member is None:
            return
        self._members.pop(member.ray_id)
        self._released.add(member.ray_id)
        if member.starting is not None:
            member.starting.cancel()
        assert self._cluster is not None
        if self._cluster.edges.get(name) is member.edge:
            self._cluster.remove_edge(name)
        if member.edge is not None:
            await member.edge.close()
        try:
            actor = await asyncio.to_thread(ray.get_actor, f"dsec-edge-{name}", namespace=NAMESPACE)
        except ValueError:
            actor = None  # its edge never started
        if actor is not None:
            try:  # the edge closes (its warm pool with it), then the actor goes
                await asyncio.wait_for(actor.stop.remote(), self.start_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the actor goes anyway
                log.warning("node %s: its edge did not stop: %s", name, exc)
            finally:
                await asyncio.to_thread(ray.kill, actor)
        log.info("node %s let go", name)

    async def _join(self, member: _Member) -> None:
        """Start (or find) the node's edge actor and add its endpoint to the cluster."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        assert self._cluster is not None and self._actor_class is not None
        try:
            actor = self._actor_class.options(
                name=f"dsec-edge-{member.name}", namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, resources={RESOURCE: 1}, max_restarts=0, max_concurrency=1000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(member.ray_id, soft=False),
            ).remote(member.name, str(self.node_state_dir / member.name), str(self.store_dir), self.token,
                     self.edge_overrides, self.fncall)
            state_dir, store_dir = str(self.node_state_dir / member.name), str(self.store_dir)
            made_with = tuple(await asyncio.wait_for(actor.dirs.remote(), self.start_timeout_s))
            if made_with != (state_dir, store_dir):
                raise BackendError(
                    f"its edge was started by an earlier apiserver with its state in {made_with[0]} and the store "
                    f"{made_with[1]}, not {state_dir} and {store_dir}: start this apiserver with that "
                    "--node-state-dir and --store-dir, or end that edge first (ray.kill(ray.get_actor("
                    f"'dsec-edge-{member.name}', namespace='dsec')); its sandboxes are adopted by the next edge "
                    "on its state dir)")
            url, token = await asyncio.wait_for(actor.start.remote(), self.start_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the node stays out, said so, and is tried again
            self._members.pop(member.ray_id, None)
            why = (f"its edge did not answer within {self.start_timeout_s:g} s (its log: "
                   f"{self.node_state_dir / member.name / 'edged.log'} on that node)"
                   if isinstance(exc, TimeoutError) else reason(exc))
            self._failed(member.ray_id, member.name, why)
            return
        finally:
            member.starting = None
        if self._members.get(member.ray_id) is not member:
            return
        self._failing.pop(member.ray_id, None)
        member.edge = RemoteEdge(member.name, url, token)
        self._cluster.add_edge(member.edge)
        log.info("node %s joined: edge at %s", member.name, url)


def reason(exc: BaseException) -> str:
    """What a failed edge start says, without Ray's wrapping (a task error's traceback) or the
    edge log's earlier lines: its last line that says ``error:``, else its message."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause) or type(cause).__name__
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    return (errors[-1].removeprefix("error: ") if errors else text.strip())[-1000:]
