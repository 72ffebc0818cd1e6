"""The lifecycle's one transition table (dsec.edge.lifecycle): every state × action, accepted and
the state it leads to, or refused with its message; every edge method that acts on a sandbox
asks it; a record's JSON round trip."""

from __future__ import annotations

import asyncio

import pytest

from dsec.backends.base import Capability, Handle
from dsec.backends.fake import FakeBackend
from dsec.edge.edge import Edge, EdgeConfig
from dsec.edge.lifecycle import MOVES, TRANSITIONS, Action, Finished, IllegalMove, Record, check, move, refusal
from dsec.images.store import Image
from libdsec import SandboxStateError
from libdsec.protocol import DSecContainerRunArgs, ExecRequest, SandboxKind, SandboxStatus

creating, running, paused, stopping, stopped, failed = (
    SandboxStatus.creating, SandboxStatus.running, SandboxStatus.paused,
    SandboxStatus.stopping, SandboxStatus.stopped, SandboxStatus.failed,
)
STATES = (creating, running, paused, stopping, stopped, failed)

# The table written out again, by hand: the state each action leads to, or None where refused.
EXPECTED: dict[Action, tuple[SandboxStatus | None, ...]] = {
    #                         creating  running   paused   stopping  stopped  failed
    Action.exec:              (None,    running,  running, None,     None,    None),
    Action.read_file:         (None,    running,  running, None,     None,    None),
    Action.write_file:        (None,    running,  running, None,     None,    None),
    Action.pack_diff:         (None,    running,  None,    None,     None,    None),
    Action.clean_copy:        (None,    running,  None,    None,     None,    None),
    Action.fork:              (None,    running,  None,    None,     None,    None),
    Action.snapshot:          (None,    running,  None,    None,     None,    None),
    Action.set_network_rules: (None,    running,  None,    None,     None,    None),
    Action.set_ttl:           (None,    running,  paused,  None,     None,    None),
    Action.pause:             (None,    paused,   None,    None,     None,    None),
    Action.resume:            (None,    None,     running, None,     None,    None),
    Action.stop:              (None,    stopping, stopping, stopping, stopped, failed),
}
VERBS = {
    Action.exec: "exec", Action.read_file: "read a file", Action.write_file: "write a file",
    Action.pack_diff: "pack", Action.clean_copy: "make a clean copy of",
    Action.fork: "fork", Action.snapshot: "snapshot", Action.set_network_rules: "change network rules",
    Action.set_ttl: "change the TTL of",
    Action.pause: "pause", Action.resume: "resume", Action.stop: "stop",
}
SID = "n0-0123456789abcdef"


def expected_message(action: Action, state: SandboxStatus) -> str:
    if (state, action) == (paused, Action.pause):
        return f"cannot pause: sandbox {SID} is paused already"
    if (state, action) == (creating, Action.stop):
        return f"cannot stop: sandbox {SID} is still being created"
    if action is Action.resume:
        return f"cannot resume: sandbox {SID} is {state.value}, not paused"
    return f"cannot {VERBS[action]}: sandbox {SID} is {state.value}"


def test_the_table_covers_every_state_and_action():
    assert set(TRANSITIONS) == set(SandboxStatus) and set(EXPECTED) == set(Action)


@pytest.mark.parametrize("action", list(Action), ids=lambda a: a.name)
@pytest.mark.parametrize("state", STATES, ids=lambda s: s.value)
def test_every_state_and_action(state, action):
    leads_to = EXPECTED[action][STATES.index(state)]
    if leads_to is not None:
        assert check(action, SID, state) is leads_to
    else:
        with pytest.raises(SandboxStateError) as info:
            check(action, SID, state)
        assert str(info.value) == expected_message(action, state)


def test_a_refusal_says_why_the_sandbox_ended():
    assert str(refusal(Action.exec, SID, stopped, "idle for over ttl_running_stop=1s")) == (
        f"cannot exec: sandbox {SID} is stopped: idle for over ttl_running_stop=1s"
    )
    with pytest.raises(SandboxStateError, match=f"cannot pause: sandbox {SID} is failed: sandbox processes died"):
        check(Action.pause, SID, failed, "sandbox processes died")


# Every move a record's state may make, written out again: where actions lead, and the edge's steps.
LEGAL_MOVES = {
    creating: {running},
    running: {paused, stopping, failed},
    paused: {running, stopping, failed},
    stopping: {stopped, failed},
    stopped: set(),
    failed: set(),
}


def a_record(status: SandboxStatus) -> Record:
    image = Image(name="tiny", layers=("sha256-a",), env={}, workdir="/", user="root")
    return Record(id=SID, kind="container", handle=Handle(cid="c1", image="tiny", layers=image.layers),
                  args=DSecContainerRunArgs(container_image="tiny"), image=image, status=status,
                  created_at=100.0, last_active=100.0)


def test_the_moves_are_the_actions_and_the_edges_own_steps():
    assert {status: set(to) for status, to in MOVES.items()} == LEGAL_MOVES


@pytest.mark.parametrize("to", STATES, ids=lambda s: s.value)
@pytest.mark.parametrize("start", STATES, ids=lambda s: s.value)
def test_a_move_the_lifecycle_has_is_made_and_any_other_raises(start, to):
    rec = a_record(start)
    if to in LEGAL_MOVES[start]:
        move(rec, to, "why")
        assert (rec.status, rec.reason) == (to, "why")
    else:
        with pytest.raises(IllegalMove, match=f"cannot move from {start.value} to {to.value}"):
            move(rec, to, "why")
        assert (rec.status, rec.reason) == (start, None)  # unchanged


def test_a_move_without_a_reason_keeps_the_one_it_had():
    rec = a_record(running)
    rec.reason = "kept"
    move(rec, stopping)
    assert (rec.status, rec.reason) == (stopping, "kept")


def test_record_json_round_trip():
    image = Image(name="tiny", layers=("sha256-a", "sha256-b"), env={"PATH": "/bin"}, workdir="/w", user="agent",
                  roles=("base", "snapshot"))
    args = DSecContainerRunArgs(container_image="tiny", memory_limit_mb=64, env={"A": "1"})
    rec = Record(id=SID, kind="container", handle=Handle(cid="c1", image="tiny", layers=image.layers, pid=7),
                 args=args, image=image, status=running, created_at=100.0, last_active=100.0, uid=1000, gid=1000,
                 project="team")
    back = Record.from_json(rec.to_json())
    assert (back.id, back.kind, back.handle.cid, back.args, back.image, back.status, back.uid, back.project) == (
        SID, "container", "c1", args, image, running, 1000, "team")
    rec.paused_at = 150.0
    assert Record.from_json(rec.to_json()).status is paused  # a paused one comes back paused
    assert Record.from_json(rec.to_json()).pause_mode == "full"  # (a record of before modes: a full pause)
    rec.pause_mode = "filesystem"
    assert Record.from_json(rec.to_json()).pause_mode == "filesystem"


def test_the_finished_table_keeps_each_ended_sandbox_compact_and_at_most_kept():
    image = Image(name="tiny", layers=("sha256-a",), env={}, workdir="/", user="root")
    finished = Finished(kept=3)
    infos = []
    for n in range(5):
        rec = Record(id=f"n0-{n:016x}", kind="container", handle=Handle(cid=f"c{n}", image="tiny", layers=image.layers),
                     args=DSecContainerRunArgs(container_image="tiny", memory_limit_mb=64, labels={"job": str(n)}),
                     image=image, status=stopped, created_at=100.0 + n, last_active=200.0 + n, reason=f"done {n}")
        infos.append(rec.info("n0"))
        finished.add(infos[-1])
    assert len(finished) == 3 and finished.get(infos[0].id) is None and infos[1].id not in finished
    assert [finished.get(i.id) for i in infos[2:]] == infos[2:]  # each comes back whole
    assert max(len(p) for p in finished._infos.values()) < 200  # not a model object: about 100 bytes
    assert finished[infos[4].id] == infos[4] and finished.popitem(last=False)[0] == infos[2].id  # as a mapping
    with pytest.raises(KeyError):
        finished[infos[2].id]


# -- the edge asks the table ------------------------------------------------------------------


def args(**kw) -> DSecContainerRunArgs:
    return DSecContainerRunArgs(container_image="tiny", **{"memory_limit_mb": 64, **kw})


def calls(edge: Edge, sandbox_id: str):
    """Every edge method that acts on a sandbox, by the action it asks the table for."""
    return {
        Action.exec: lambda: edge.exec(sandbox_id, ExecRequest(command="true")),
        Action.read_file: lambda: edge.read_file(sandbox_id, "/etc/passwd"),
        Action.write_file: lambda: edge.write_file(sandbox_id, "/a", b"x", 0o644),
        Action.pack_diff: lambda: edge.pack_diff(sandbox_id),
        Action.clean_copy: lambda: edge.clean_copy(sandbox_id, ["/testbed"]),
        Action.snapshot: lambda: edge.snapshot(sandbox_id),
        Action.set_network_rules: lambda: edge.set_network_rules(sandbox_id, {}),
        Action.set_ttl: lambda: edge.set_ttl(sandbox_id, 60),
        Action.pause: lambda: edge.pause(sandbox_id),
        Action.resume: lambda: edge.resume(sandbox_id),
        Action.stop: lambda: edge.stop(sandbox_id),
    }


async def test_a_sandbox_being_created_refuses_everything(tmp_path, store):
    backend = FakeBackend()
    release = asyncio.Event()
    real_create = backend.create

    async def slow_create(cid, spec):
        await release.wait()
        return await real_create(cid, spec)

    backend.create = slow_create
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=0, pool_max=0), backend, store)
    await edge.start()
    try:
        creating_task = asyncio.create_task(edge.create(args()))
        for _ in range(100):
            if edge._records:
                break
            await asyncio.sleep(0.01)
        (sandbox_id,) = edge._records
        for action, call in calls(edge, sandbox_id).items():
            with pytest.raises(SandboxStateError, match=f"cannot {VERBS[action]}: sandbox {sandbox_id} is "):
                await call()
        release.set()
        assert (await creating_task).status is running
    finally:
        await edge.close()


async def test_a_stopped_sandbox_refuses_all_but_stop(tmp_path, store):
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=0, pool_max=0), FakeBackend(), store)
    await edge.start()
    try:
        info = await edge.create(args())
        await edge.stop(info.id, reason="done with it")
        for action, call in calls(edge, info.id).items():
            if action is Action.stop:
                assert (await call()).status is stopped  # nothing left to do
                continue
            with pytest.raises(SandboxStateError, match=f"cannot {VERBS[action]}: sandbox {info.id} is stopped") as e:
                await call()
            assert str(e.value).endswith(": done with it")  # why it ended
    finally:
        await edge.close()


async def test_a_paused_sandbox_refuses_a_pack_a_clean_copy_a_snapshot_and_new_rules(tmp_path, store):
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=0, pool_max=0), FakeBackend(), store)
    await edge.start()
    try:
        info = await edge.create(args())
        await edge.pause(info.id)
        table = calls(edge, info.id)
        for action in (Action.pack_diff, Action.clean_copy, Action.snapshot, Action.set_network_rules):
            with pytest.raises(SandboxStateError, match=f"cannot {VERBS[action]}: sandbox {info.id} is paused"):
                await table[action]()
        assert (await edge.get(info.id)).status is paused  # none of them resumed it
    finally:
        await edge.close()


async def test_a_filesystem_pause_halts_it_a_call_is_refused_and_resume_boots_it(tmp_path, store):
    backend = FakeBackend()
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=0, pool_max=0), backend, store)
    await edge.start()
    try:
        info = await edge.create(args())
        await edge.write_file(info.id, "/kept", b"files", 0o644)
        cid = edge._records[info.id].handle.cid
        result = await edge.pause(info.id, "filesystem")
        assert result.sandbox.status is paused and result.sandbox.pause_mode == "filesystem"
        assert cid in backend.halted and cid not in backend.paused
        with pytest.raises(SandboxStateError, match=f"cannot exec: sandbox {info.id} is paused keeping its files only"):
            await edge.exec(info.id, ExecRequest(command="true"))
        assert cid in backend.halted  # the call did not start it
        back = await edge.resume(info.id)
        assert back.status is running and back.pause_mode is None
        assert backend.boots[cid] == 2 and cid not in backend.halted
        assert await edge.read_file(info.id, "/kept") == b"files"
        assert (await edge.pause(info.id)).sandbox.pause_mode == "full"  # the default: memory kept
        assert cid in backend.paused and cid not in backend.halted
    finally:
        await edge.close()


async def test_a_filesystem_pause_is_refused_where_the_backend_cannot_boot_again(tmp_path, store):
    from libdsec import InvalidRequest

    backend = FakeBackend("microvm")
    backend.capabilities = backend.capabilities - {Capability.REBOOT}
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=0, pool_max=0), backend, store)
    await edge.start()
    try:
        info = await edge.create(args(), SandboxKind.microvm)
        with pytest.raises(InvalidRequest, match="keeping its files only: a microvm sandbox cannot start again"):
            await edge.pause(info.id, "filesystem")
        assert (await edge.get(info.id)).status is running
    finally:
        await edge.close()


async def test_a_filesystem_paused_sandbox_is_paused_so_after_an_edge_restart(tmp_path, store):
    backend = FakeBackend()
    config = EdgeConfig(node_dir=tmp_path / "node", pool_min=0, pool_max=0)
    edge = Edge(config, backend, store)
    await edge.start()
    info = await edge.create(args())
    await edge.pause(info.id, "filesystem")
    await edge.close()
    again = Edge(config, backend, store)
    await again.start()
    try:
        assert (await again.get(info.id)).pause_mode == "filesystem"
        assert (await again.resume(info.id)).status is running
    finally:
        await again.close()


async def test_a_sandbox_stopped_while_it_resumes_stays_stopped(tmp_path, store):
    """A stop that comes while the backend resumes a sandbox wins: the resume fails, and its
    record is not written back (a restarted edge would find it and call it failed)."""
    from dsec.edge import journal

    backend = FakeBackend()
    real_resume = backend.resume

    async def slow_resume(handle):
        await real_resume(handle)
        await asyncio.sleep(0.1)

    backend.resume = slow_resume
    edge = Edge(EdgeConfig(node_dir=tmp_path / "node", pool_min=0, pool_max=0), backend, store)
    await edge.start()
    try:
        info = await edge.create(args())
        await edge.pause(info.id)
        resuming = asyncio.create_task(edge.resume(info.id))
        await asyncio.sleep(0.03)
        assert (await edge.stop(info.id)).status is stopped
        with pytest.raises(SandboxStateError, match=f"sandbox {info.id} was stopped while it was being resumed"):
            await resuming
        assert (await edge.get(info.id)).status is stopped
        assert info.id not in journal.read(edge.records_dir)
    finally:
        await edge.close()
