"""What an edge is configured with (``EdgeConfig``): its node, its limits and its timings. Its
parts (admission, the warm pool, the TTL reaper) read it; ``dsec.edge.edge`` builds on it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..placement import DEFAULT_CPU_OVERCOMMIT, DEFAULT_MEMORY_OVERCOMMIT


@dataclass
class EdgeConfig:
    node_dir: Path
    # Where sandbox records live; they must outlive an edge restart, like the sandboxes.
    records_dir: Path | None = None
    node: str = "n0"
    max_sandboxes: int = 4096
    memory_overcommit: float = DEFAULT_MEMORY_OVERCOMMIT
    cpu_overcommit: float = DEFAULT_CPU_OVERCOMMIT
    # A paused sandbox is stopped after this long paused (its run TTL does not run meanwhile).
    paused_ttl_s: float = 24 * 3600.0
    batch_concurrency: int = 16
    # A batch's sandboxes not committed this long after their stream ended are stopped.
    batch_commit_s: float = 60.0
    reaper_interval_s: float = 1.0
    max_file_bytes: int = 64 << 20
    max_upload_bytes: int = 1 << 30  # a tar for upload_tree (streamed into a container; held for a VM)
    # Warm pool per image: grows to the peak number of creates in flight, within these bounds;
    # an image unused for pool_idle_s loses its pool.
    pool_min: int = 2
    pool_max: int = 64
    pool_idle_s: float = 600.0
    pool_fill_concurrency: int = 2
    # While creates keep arriving and the pool still has a quarter of its target, refills wait
    # until none has arrived for this long: starting sandboxes takes the CPU that a burst being
    # served from the pool needs.
    pool_quiet_s: float = 0.05
    finished_kept: int = 10_000
    # Overload (admission.WorkGate): creates and commands running at once, how many more may
    # wait for a slot and for how long; past that a call gets ``Overloaded`` (429, Retry-After).
    max_creates_running: int = 256
    max_creates_queued: int = 1024
    max_commands_running: int = 1024
    max_commands_queued: int = 4096
    max_queue_wait_s: float = 30.0
    # How long a create or a call into a sandbox waits for the layer store's filesystem to answer
    # before it is refused with StoreUnavailable (images.store.StoreHealth).
    store_check_s: float = 10.0
