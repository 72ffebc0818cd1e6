"""The basic lifecycle against a real ``dsec serve``: create, exec, files, stop, batch."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from libdsec import DSecContainerRunArgs, SandboxStatus
from dsec.isolation.profile import seccomp_profile

pytestmark = [pytest.mark.slow, pytest.mark.root]


async def test_create_exec_stop(client):
    sandbox = await client.run_container(DSecContainerRunArgs(container_image="busybox", memory_limit_mb=64))
    assert sandbox.status is SandboxStatus.running
    result = await sandbox.run_shell("echo hello; echo oops >&2; exit 7")
    assert (result.exit_code, result.stdout, result.stderr) == (7, "hello\n", "oops\n")
    await sandbox.stop()
    assert sandbox.status is SandboxStatus.stopped
    await sandbox.stop()  # a second stop does nothing
    assert (await client.get_sandbox(sandbox.id)).status is SandboxStatus.stopped


async def test_files_round_trip(client):
    async with await client.run_container(DSecContainerRunArgs(container_image="busybox")) as sandbox:
        payload = bytes(range(256)) * 100
        await sandbox.write_file("/work/deep/data.bin", payload)
        assert await sandbox.read_file("/work/deep/data.bin") == payload
        result = await sandbox.run_shell("wc -c < /work/deep/data.bin")
        assert result.stdout.strip() == str(len(payload))


async def test_batch(client):
    seen = []
    sandboxes = await client.run_containers(
        DSecContainerRunArgs(container_image="busybox", memory_limit_mb=32), count=12,
        progress=lambda done, total: seen.append(done),
    )
    assert len({s.id for s in sandboxes}) == 12 and seen[-1] == 12
    assert all(s.status is SandboxStatus.running for s in sandboxes)
    # Each a sandbox of its own: its hostname, its own init as pid 1, its own writable layer.
    for s in sandboxes:
        await s.write_file("/tmp/me", s.id)
    results = [await s.run_shell("hostname; cat /proc/1/cmdline | tr '\\0' ' '; echo; cat /tmp/me") for s in sandboxes]
    assert [(r.exit_code, r.stdout) for r in results] == [(0, f"sandbox\n/dev/.dsec-init \n{s.id}") for s in sandboxes]
    for s in sandboxes:
        await s.stop()


async def test_no_zombie_left_by_crun(client, server):
    """`crun run --detach` leaves a forked process of its own to the server (the subreaper):
    the server reaps it, so sandboxes made and stopped leave no zombie behind."""
    def zombies() -> list[str]:
        found = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    comm, fields = f.read().rsplit(")", 1)
            except (OSError, ValueError):
                continue
            state, ppid = fields.split()[:2]
            if state == "Z" and int(ppid) == server.proc.pid:
                found.append(f"{pid} {comm.split('(', 1)[-1]}")
        return found

    for _ in range(2):
        sandboxes = await client.run_containers(DSecContainerRunArgs(container_image="busybox"), count=4)
        await asyncio.gather(*(s.stop() for s in sandboxes))
    for _ in range(50):
        if not zombies():
            break
        await asyncio.sleep(0.1)
    assert zombies() == []


async def _bundle_configs(crun_root) -> list[dict]:
    """The config of every bundle under crun's root. The server's warm pool refills beside the
    test: a bundle it is still writing (or has just removed) is read again a moment later."""
    for _ in range(100):
        try:
            return [json.loads((d / "config.json").read_text()) for d in crun_root.iterdir()
                    if not d.name.startswith(".")]
        except (FileNotFoundError, json.JSONDecodeError):
            await asyncio.sleep(0.05)
    raise AssertionError(f"the bundles under {crun_root} were never all whole")


async def test_seccomp_program_compiled_once(client, server):
    """crun compiles the seccomp profile for the first sandbox; later ones get that program
    (run.oci.seccomp_bpf_data) and refuse the same calls, and record the refusal."""
    # The first sandbox's create compiles it; the ones made after it get the program (a batch
    # made all at once on a fresh server would start before the first compile is in).
    sandboxes = [await client.run_container(DSecContainerRunArgs(container_image="busybox"))]
    sandboxes += await client.run_containers(DSecContainerRunArgs(container_image="busybox"), count=3)
    try:
        crun_root = server.state_dir / "node" / "run" / "crun"
        configs = await _bundle_configs(crun_root)
        with_program = [c for c in configs if c.get("annotations", {}).get("run.oci.seccomp_bpf_data")]
        assert with_program, "no sandbox got the compiled seccomp program"
        assert all(c["linux"]["seccomp"]["flags"] == ["SECCOMP_FILTER_FLAG_LOG"] for c in with_program)
        # The profile is serialized once and spliced into each config: the same profile in all.
        assert all(c["linux"]["seccomp"] == seccomp_profile() for c in configs), "a config lost its profile"
        for sb in sandboxes:
            r = await sb.run_shell("kill -TERM 1; echo rc=$?")
            assert "Operation not permitted" in r.stderr and r.stdout == "rc=1\n", r
            # (the kernel's log of the refusal is read as it comes: allow it a moment)
            for _ in range(50):
                events = await sb.security_events()
                if any(e.kind == "syscall.denied" and e.detail.startswith("kill ") for e in events):
                    break
                await asyncio.sleep(0.1)
            assert any(e.kind == "syscall.denied" and e.detail.startswith("kill ") for e in events), events
    finally:
        await asyncio.gather(*(s.stop() for s in sandboxes))


async def test_started_sandboxes_keep_only_their_bundle_on_the_host(client, server):
    """Once a sandbox runs on its own mount namespace's copy of its overlay, the host unmounts its
    copy (with the next sandbox's mount) and keeps the bundle's tmpfs: fewer host mounts for every
    later `crun run` to copy. The sandboxes go on working: commands, files, stop."""
    sandboxes_dir = server.state_dir / "node" / "run" / "sandboxes"

    def mounted() -> tuple[set[str], set[str]]:
        bundles, overlays = set(), set()
        with open("/proc/self/mountinfo") as f:
            for line in f:
                point = line.split()[4]
                if point.startswith(f"{sandboxes_dir}/"):
                    rest = point[len(str(sandboxes_dir)) + 1:].split("/")
                    (bundles if len(rest) == 1 else overlays if rest[1:] == ["rootfs"] else set()).add(rest[0])
        return bundles, overlays

    sandboxes = []
    try:
        for _ in range(4):  # each create mounts a sandbox (its own or the pool's refill)
            sandboxes.append(await client.run_container(DSecContainerRunArgs(container_image="busybox")))
        for _ in range(50):
            bundles, overlays = mounted()
            if bundles - overlays:
                break
            await asyncio.sleep(0.1)
        assert bundles and bundles - overlays, (bundles, overlays)
        assert overlays <= bundles
        for i, sb in enumerate(sandboxes):
            await sb.write_file(f"/tmp/f{i}", f"data {i}".encode())
            assert await sb.read_file(f"/tmp/f{i}") == f"data {i}".encode()
            assert (await sb.run_shell(f"cat /tmp/f{i}; ls /bin/busybox")).stdout == f"data {i}/bin/busybox\n"
    finally:
        await asyncio.gather(*(s.stop() for s in sandboxes))
