"""What the benchmarks read from the host: memory in use, CPU time, percentiles, machine facts."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info


def memory_used() -> int:
    """Host memory in use: MemTotal − MemAvailable, bytes."""
    info = meminfo()
    return info["MemTotal"] - info["MemAvailable"]


MEMINFO_PARTS = ("AnonPages", "Shmem", "Slab", "SUnreclaim", "KernelStack", "PageTables", "Percpu")


async def settled_memory(settle_s: float = 3.0, samples: int = 5, every_s: float = 0.2) -> dict[str, int]:
    """Wait ``settle_s``, then the median of a few readings (other work on the host moves them):
    ``used`` (MemTotal − MemAvailable) and the kernel's parts that sandboxes add to."""
    import asyncio

    await asyncio.sleep(settle_s)
    readings = []
    for i in range(samples):
        if i:
            await asyncio.sleep(every_s)
        info = meminfo()
        readings.append({"used": info["MemTotal"] - info["MemAvailable"],
                         **{k: info.get(k, 0) for k in MEMINFO_PARTS}})
    return {k: int(statistics.median(r[k] for r in readings)) for k in readings[0]}


def per_item_mib(after: dict[str, int], before: dict[str, int], count: int) -> dict[str, float]:
    """(after − before) / count for every field, in MiB."""
    return {k: round((after[k] - before[k]) / max(count, 1) / 2**20, 3) for k in after}


def pss_bytes(pids: list[int]) -> int:
    """Proportional set size of these processes together (shared pages split among sharers):
    their user-space memory, not moved by what other processes on the host do."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError):
            continue
    return total


def cgroup_pids(parent: str) -> list[int]:
    """Processes in the cgroups under ``parent`` (the memory hierarchy on v1)."""
    from dsec.resources import cgroups

    base = cgroups.CGROUP_ROOT / parent if cgroups.is_v2() else cgroups.CGROUP_ROOT / "memory" / parent
    pids: list[int] = []
    try:
        children = [d for d in base.iterdir() if d.is_dir()]
    except OSError:
        return pids
    for d in [base, *children]:
        try:
            pids += [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            continue
    return pids


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))]


def latency_summary(values: list[float]) -> dict:
    """Seconds in, milliseconds out."""
    return {
        "n": len(values),
        "p50_ms": percentile(values, 50) * 1e3,
        "p90_ms": percentile(values, 90) * 1e3,
        "p99_ms": percentile(values, 99) * 1e3,
        "max_ms": (max(values) * 1e3) if values else float("nan"),
        "mean_ms": (statistics.fmean(values) * 1e3) if values else float("nan"),
    }


@dataclass
class CpuSample:
    """Host-wide CPU time (all cores) from /proc/stat, and wall time."""

    busy_s: float
    total_s: float
    wall_s: float

    @classmethod
    def now(cls) -> CpuSample:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
        return cls(busy_s=(total - idle) / _CLK_TCK, total_s=total / _CLK_TCK, wall_s=time.perf_counter())

    def since(self, earlier: CpuSample) -> dict:
        busy = self.busy_s - earlier.busy_s
        total = self.total_s - earlier.total_s
        return {"busy_cpu_s": busy, "wall_s": self.wall_s - earlier.wall_s,
                "utilisation": busy / total if total > 0 else float("nan")}


class Meter:
    """CPU used during a phase: by the host as a whole, and by what the benchmark runs (this
    process, its waited-for children such as crun or podman, and a server process with its own
    children). ``others`` is the rest: work on the host that is not part of the benchmark."""

    def __init__(self, server_pid: int | None = None) -> None:
        self.server_pid = server_pid
        self._host = CpuSample.now()
        self._ours = self._ours_now()

    def _ours_now(self) -> float:
        t = os.times()
        total = t.user + t.system + t.children_user + t.children_system
        if self.server_pid is not None:
            own, children = process_cpu(self.server_pid)
            total += own + children
        return total

    def stop(self, count: int) -> dict:
        host = CpuSample.now().since(self._host)
        ours = self._ours_now() - self._ours
        cores = os.cpu_count() or 1
        others = max(0.0, host["busy_cpu_s"] - ours)
        return {
            "wall_s": host["wall_s"],
            "host_cpu_ms_per_op": host["busy_cpu_s"] / max(count, 1) * 1e3,
            "own_cpu_ms_per_op": ours / max(count, 1) * 1e3,
            "host_utilisation": host["utilisation"],
            # Share of the machine's capacity used by work that is not the benchmark's.
            "others_share": others / (host["wall_s"] * cores) if host["wall_s"] > 0 else float("nan"),
        }


def process_cpu(pid: int) -> tuple[float, float]:
    """(own CPU seconds, CPU seconds of its waited-for children) of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime) / _CLK_TCK, (cutime + cstime) / _CLK_TCK


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "not available"
    return out.strip().splitlines()[0] if out.strip() else "not available"


def machine() -> dict:
    from dsec.resources import cgroups

    info = meminfo()
    return {
        "cores": os.cpu_count(),
        "memory_total_gib": round(info["MemTotal"] / 2**30, 1),
        "kernel": platform.release(),
        "cgroups": cgroups.version(),
        "crun": _first_line(["crun", "--version"]),
        "podman": _first_line(["podman", "--version"]),
        "python": platform.python_version(),
        "loadavg_at_start": open("/proc/loadavg").read().split()[:3],
    }
