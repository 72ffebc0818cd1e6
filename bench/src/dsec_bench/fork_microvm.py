"""``dsec bench fork --kind microvm``: a microVM with a process holding memory, forked into many,
against as many cold boots of the same image.

A parent microVM (busybox, through a ``dsec serve`` of the benchmark's own) runs a process that
holds ``touched_mb`` MiB of touched memory, half random bytes and half text (``dd`` holding one
block it cannot write on: no zero pages, no two pages alike for KSM to fold). Measured in one run:

- **DSec** ``parent.fork(count=children)``: from the call until every child answered a command
  that finds the parent's memory-holding process alive in it (restored, not started again), as
  the client sees it; the server's ``fork_s`` and how long the parent was frozen beside it.
- **cold boots** (the peer): ``children`` microVMs of the same image and memory size created at
  once (``run_microvm``, the server's own concurrency), until every one answered ``echo``; the
  benchmark's server keeps no boot templates (DSEC_VM_BOOT_TEMPLATES=0), so each boots its kernel.
- **host memory**: the QEMU processes' proportional set size (``/proc/PID/smaps_rollup``: a page
  shared by k processes counts 1/k to each, so shared pages are counted once in the sum),
  parent + children once all children answered, against the parent's alone just before the
  fork (one such VM). The page cache of the memory image the children map privately is in the
  children's PSS, split among them. KSM runs as the platform sets it (its pages merged by then
  are recorded): the figure is taken at once, not after KSM settled.

Everything runs on this machine; the server runs microVMs (TCG where KVM is not usable).
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from libdsec import DSecClient, DSecMicroVMRunArgs

from dsec.backends.vm import machine
from dsec.local import serving
from dsec.resources import ksm
from .hoststats import pss_bytes
from .results import busybox_store_beside, run_noting, save_results, source_commit

MiB = 1 << 20
# The parent's memory-holding process: dd reads one block of touched_mb MiB (random bytes, then
# text) and blocks writing it into a pipe no one reads, holding the block.
HOLDER_PID = "/root/holder.pid"
ALIVE = f"kill -0 $(cat {HOLDER_PID}) && echo alive"


def _hold(touched_mb: int) -> str:
    half = touched_mb // 2 * MiB  # (busybox's head takes no M suffix)
    # Text as base64 of random bytes: no two pages alike (seq is too slow under TCG).
    return (f"((head -c {half} /dev/urandom; head -c {half * 3 // 4 + 4096} /dev/urandom | base64) "
            f"| dd bs={touched_mb * MiB} count=1 iflag=fullblock 2>/dev/null | sleep 999999) >/dev/null 2>&1 & "
            f"i=0; until pidof dd > {HOLDER_PID}; do i=$((i + 1)); [ $i -lt 100 ] || exit 1; sleep 0.1; done; "
            f"cat {HOLDER_PID}")


async def _held_kib(parent, touched_mb: int, timeout: float = 1200.0) -> int:
    """Wait until the holder has its whole block resident (VmRSS, KiB)."""
    deadline = time.monotonic() + timeout
    while True:
        r = await parent.run_shell(f"grep VmRSS /proc/$(cat {HOLDER_PID})/status | tr -s ' ' | cut -d' ' -f2")
        rss = int(r.stdout.strip() or 0)
        # (VmRSS lags by the page faults a blocked task has not yet counted: up to 64 pages.)
        if rss >= touched_mb * 1024 - 512:
            return rss
        if time.monotonic() > deadline:
            raise RuntimeError(f"the parent's holder has {rss} KiB resident after {timeout:g}s, not {touched_mb} MiB")
        await asyncio.sleep(1.0)


def _qemu_pids(state_dir: Path) -> list[int]:
    """The QEMU processes of this benchmark's server (their command line names its state dir)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and b"qemu-system" in argv[0] and any(str(state_dir).encode() in a for a in argv):
            found.append(int(entry))
    return found


def _pss_parts(pids: list[int]) -> dict[str, int]:
    """Their PSS split as ``smaps_rollup`` splits it (bytes): anonymous (QEMU's heap and TCG's
    translation cache, guest pages written since the restore: copy-on-write) and file-backed
    (the memory image's pages read in place, the shared layers, QEMU's libraries)."""
    parts = {"Pss_Anon": 0, "Pss_File": 0}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in parts:
                        parts[key] += int(rest.split()[0]) * 1024
        except (OSError, ValueError):
            continue
    return parts


def _cpu_s(pids: list[int]) -> float:
    """The user + system CPU seconds these processes have used so far (those gone count 0)."""
    return sum(machine.cpu_seconds(pid) or 0.0 for pid in pids)


def _ksm_sharing() -> int:
    return ksm.stats().get("pages_sharing", 0) if ksm.available() else 0


async def _fork(client: DSecClient, state_dir: Path, args: DSecMicroVMRunArgs, children: int, touched_mb: int,
                console: Console) -> dict:
    async with await client.run_microvm(args, timeout=600) as parent:
        made = await parent.run_shell(_hold(touched_mb), timeout=600)
        if made.exit_code != 0 or not made.stdout.strip():
            raise RuntimeError(f"cannot start the parent's memory holder (exit {made.exit_code}): "
                               f"{made.stdout[-200:]} {made.stderr[-300:]}")
        holder_kib = await _held_kib(parent, touched_mb)
        await asyncio.sleep(2.0)  # (the parent idle again)
        parent_pids = _qemu_pids(state_dir)
        one_vm = pss_bytes(parent_pids)
        t0 = time.perf_counter()
        forked = await parent.fork(count=children)
        fork_s = time.perf_counter() - t0
        try:
            child_pids = [p for p in _qemu_pids(state_dir) if p not in parent_pids]
            cpu_at_fork = _cpu_s(child_pids)
            answers = await asyncio.gather(*(child.run_shell(ALIVE) for child in forked))
            answering = time.perf_counter() - t0
            cpu_at_answer = _cpu_s(child_pids)
            pids = _qemu_pids(state_dir)
            all_vms = pss_bytes(pids)
            children_parts = _pss_parts([p for p in pids if p not in parent_pids])
            ksm_pages = _ksm_sharing()
            identities = await asyncio.gather(*(vm.run_shell("hostname") for vm in (parent, *forked)))
        finally:
            await asyncio.gather(*(child.stop() for child in forked), return_exceptions=True)
        result = forked[0].fork_result
        checked = (all(a.exit_code == 0 and a.stdout == "alive\n" for a in answers)
                   and len({i.stdout for i in identities}) == children + 1
                   and (await parent.run_shell(ALIVE)).stdout == "alive\n")
    out = {"children": children, "fork_s": fork_s, "all_answering_s": answering, "server_fork_s": result.fork_s,
           "frozen_s": result.frozen_s, "kind": result.kind, "checked": checked, "holder_kib": holder_kib,
           "one_vm_pss": one_vm, "all_vms_pss": all_vms, "qemu_processes": len(pids), "ksm_pages_sharing": ksm_pages,
           "children_pss_anon": children_parts["Pss_Anon"], "children_pss_file": children_parts["Pss_File"],
           "children_cpu_at_fork_s": cpu_at_fork, "children_cpu_first_command_s": cpu_at_answer - cpu_at_fork}
    console.print(f"  DSec fork: {children} children in {fork_s:.2f} s, all answering at {answering:.2f} s "
                  f"(parent frozen {result.frozen_s * 1000:.0f} ms); PSS parent alone {one_vm / MiB:.0f} MiB, "
                  f"parent + children {all_vms / MiB:.0f} MiB (the children's: {children_parts['Pss_Anon'] / MiB:.0f} MiB "
                  f"anonymous, {children_parts['Pss_File'] / MiB:.0f} MiB file-backed); the children's QEMU CPU "
                  f"{cpu_at_fork:.1f} s until the fork answered, {cpu_at_answer - cpu_at_fork:.1f} s for their first "
                  f"command")
    return out


async def _cold(client: DSecClient, args: DSecMicroVMRunArgs, count: int, console: Console) -> dict:
    made: list = []

    async def boot() -> bool:
        vm = await client.run_microvm(args, timeout=900)
        made.append(vm)
        return (await vm.run_shell("echo up")).stdout == "up\n"

    t0 = time.perf_counter()
    try:
        answers = await asyncio.gather(*(boot() for _ in range(count)))
        answering = time.perf_counter() - t0
    finally:
        await asyncio.gather(*(vm.stop() for vm in made), return_exceptions=True)
    console.print(f"  cold boots: {count} microVMs all answering at {answering:.2f} s")
    return {"count": count, "all_answering_s": answering, "checked": all(answers)}


def main(state_dir: Path, console: Console, children: int = 16, touched_mb: int = 256, cold: bool = True,
         goal_s: float = 3.0, goal_ratio: float = 10.0, goal_memory: float = 2.5) -> int:
    """Run it, print the table, write ``<state_dir>.json``; 0 when it ran cleanly and every child
    had the parent's process."""
    state_dir = Path(state_dir).resolve()
    started = datetime.now(timezone.utc)
    state_dir.mkdir(parents=True, exist_ok=True)
    busybox_store_beside(state_dir)
    memory_mb = max(128, touched_mb + 128)  # the holder, and room for the guest's kernel and init
    r: dict = {"kind": "microvm", "commit": source_commit(), "started": started.isoformat(timespec="seconds"),
               "children": children, "touched_mb": touched_mb, "memory_mb": memory_mb,
               "load_start": os.getloadavg()[0]}
    console.print(f"[bold]dsec bench fork --kind microvm[/bold]: a {memory_mb} MB microVM holding {touched_mb} MiB "
                  f"forks {children} children; commit {r['commit']}, load {r['load_start']:.1f}")
    errors: list[str] = []
    args = DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=memory_mb)

    async def run() -> None:
        # Without boot templates: the peer is what it says, microVMs booted (with them, the
        # 16 would restore the first one's memory, a fork without the parent's state).
        with serving(state_dir, "--pool-max", "0", env={"DSEC_VM_BOOT_TEMPLATES": "0"}) as server:
            async with DSecClient(server.endpoint, token=server.token) as client:
                r["dsec"] = await _fork(client, state_dir, args, children, touched_mb, console)
                if cold:
                    r["cold"] = await _cold(client, args, children, console)

    run_noting(run(), r, errors)
    r["errors"] = errors
    table = Table(title=f"fork of a {memory_mb} MB microVM holding {touched_mb} MiB into {children} children")
    for col in ("way", "until all answer (s)", "of which", "checked"):
        table.add_column(col)
    if "dsec" in r:
        d = r["dsec"]
        table.add_row(f"DSec fork ({d['kind']})", f"{d['all_answering_s']:.2f}",
                      f"fork {d['fork_s']:.2f} s, parent frozen {d['frozen_s'] * 1000:.0f} ms; host memory "
                      f"{d['all_vms_pss'] / MiB:.0f} MiB for all, one VM {d['one_vm_pss'] / MiB:.0f} MiB",
                      "yes" if d["checked"] else "NO")
    if "cold" in r:
        c = r["cold"]
        table.add_row(f"{c['count']} cold boots (peer)", f"{c['all_answering_s']:.2f}", "", "yes" if c["checked"] else "NO")
    console.print(table)
    if "dsec" in r:
        d = r["dsec"]
        memory = d["all_vms_pss"] / d["one_vm_pss"]
        r["memory_over_one_vm"] = memory
        r["goals"] = {"all_answering": d["all_answering_s"] <= goal_s, "memory": memory <= goal_memory}
        line = (f"DSec's {children} children all answer in {d['all_answering_s']:.2f} s (goal ≤ {goal_s:g} s: "
                f"{'met' if r['goals']['all_answering'] else 'MISSED'}); parent + children hold {memory:.2f}× "
                f"one VM's memory (goal ≤ {goal_memory:g}×: {'met' if r['goals']['memory'] else 'MISSED'})")
        if "cold" in r:
            ratio = r["cold"]["all_answering_s"] / d["all_answering_s"]
            r["cold_over_fork"] = ratio
            r["goals"]["ratio"] = ratio >= goal_ratio
            line += (f"; cold boots take {ratio:.1f}× as long (goal ≥ {goal_ratio:g}×: "
                     f"{'met' if r['goals']['ratio'] else 'MISSED'})")
        console.print(line)
    save_results(console, state_dir, r, errors)
    ok = not errors and all(r[w]["checked"] for w in ("dsec", "cold") if w in r)
    return 0 if ok else 1
