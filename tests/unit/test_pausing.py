"""Pausing many sandboxes in one call, over an edge on the fake backend (control plane only):
a job's, a project's or a list of ids, each with its outcome; exactly one selector; a sandbox
made with ``auto_resume=False`` refuses calls while paused; ``on_ttl="pause"`` pauses at its TTL."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import httpx
import pytest

from dsec.apiserver.app import Cluster
from dsec.apiserver.projects import open_project_store
from dsec.app import create_app
from dsec.edge.reaper import expired, to_pause
from libdsec import (DSecClient, DSecContainerRunArgs, InvalidRequest, ReplayDiverged, SandboxStateError,
                     SandboxStatus)

TOKEN = "s3cret"
ARGS = DSecContainerRunArgs(container_image="tiny", memory_limit_mb=64)


@asynccontextmanager
async def apiserver(edge, tmp_path):
    with open_project_store(tmp_path / "projects.db") as projects:
        app = create_app(Cluster([edge], projects=projects), TOKEN)

        def client(token: str = TOKEN, **kwargs) -> DSecClient:
            return DSecClient("http://api", token=token, transport=httpx.ASGITransport(app=app), **kwargs)

        yield client, app


async def statuses(c: DSecClient) -> dict[str, SandboxStatus]:
    return {s.id: s.status for s in await c.list_sandboxes()}


async def test_a_jobs_sandboxes_pause_and_resume_in_one_call(edge, tmp_path):
    async with apiserver(edge, tmp_path) as (client, _), client(job="j1") as job, client() as c:
        mine = [await job.run_container(ARGS)] + await job.run_containers(ARGS, count=3)
        other = await c.run_container(ARGS)
        await mine[-1].stop()  # ended: no longer the job's to pause
        live = {s.id for s in mine[:-1]}

        result = await c.pause_sandboxes(job="j1")
        assert {o.id for o in result.sandboxes} == live
        assert result.done == 3 and result.already == 0 and result.failed == 0
        assert all(o.outcome == "paused" and o.status is SandboxStatus.paused for o in result.sandboxes)
        now = await statuses(c)
        assert all(now[i] is SandboxStatus.paused for i in live) and now[other.id] is SandboxStatus.running

        again = await c.pause_sandboxes(job="j1")
        assert again.done == 0 and again.already == 3

        # A call to one resumes it (auto_resume is the default); the call resumes the rest.
        assert (await mine[0].run_shell("echo hi")).exit_code == 0
        resumed = await c.resume_sandboxes(job="j1")
        by_outcome = {o.id: o.outcome for o in resumed.sandboxes}
        assert by_outcome == {mine[0].id: "already_running", mine[1].id: "resumed", mine[2].id: "resumed"}
        now = await statuses(c)
        assert all(now[i] is SandboxStatus.running for i in live)
        for s in [*mine[:-1], other]:
            await s.stop()


async def test_a_projects_sandboxes_and_those_below_it(edge, tmp_path):
    async with apiserver(edge, tmp_path) as (client, _), client() as root:
        await root.create_project("team")
        await root.create_project("sub", parent="team")
        team_token, sub_token = await root.create_project_token("team"), await root.create_project_token("sub")
        async with client(team_token) as team, client(sub_token) as sub:
            ours = [await team.run_container(ARGS), await sub.run_container(ARGS)]
            theirs = await root.run_container(ARGS)
            result = await team.pause_sandboxes(project="team")
            assert sorted(o.id for o in result.sandboxes) == sorted(s.id for s in ours) and result.done == 2
            assert (await statuses(root))[theirs.id] is SandboxStatus.running
            # A project sees only itself and below: another project is not found.
            with pytest.raises(Exception, match="no project 'root'"):
                await sub.pause_sandboxes(project="root")
            assert (await root.resume_sandboxes(project="sub")).done == 1
            for s in [*ours, theirs]:
                await s.stop()


async def test_ids_each_get_their_outcome_and_one_failure_stops_none(edge, tmp_path):
    async with apiserver(edge, tmp_path) as (client, _), client() as c:
        a, b = await c.run_container(ARGS), await c.run_container(ARGS)
        await b.stop()
        result = await c.pause_sandboxes(ids=[a.id, b.id, "nowhere-0123456789abcdef", "not an id", a.id])
        outcomes = {o.id: o for o in result.sandboxes}
        assert [o.id for o in result.sandboxes] == [a.id, b.id, "nowhere-0123456789abcdef", "not an id"]
        assert outcomes[a.id].outcome == "paused"
        assert outcomes[b.id].error["code"] == "sandbox_not_found"
        assert "node 'nowhere' is not in this cluster" in outcomes["nowhere-0123456789abcdef"].error["message"]
        assert outcomes["not an id"].error["code"] == "invalid_request"
        assert result.done == 1 and result.failed == 3
        await a.stop()


async def test_exactly_one_selector_is_a_clear_error(edge, tmp_path):
    async with apiserver(edge, tmp_path) as (client, app), client() as c:
        with pytest.raises(InvalidRequest, match="exactly one of job, project or ids"):
            await c.pause_sandboxes()
        with pytest.raises(InvalidRequest, match="got job and ids"):
            await c.resume_sandboxes(job="j", ids=["n0-0123456789abcdef"])
        with pytest.raises(InvalidRequest, match="invalid job name"):
            await c.pause_sandboxes(job="../x")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as raw:
            answer = await raw.post("/v1/sandboxes:pause", json={"job": "j", "project": "root"},
                                    headers={"authorization": f"Bearer {TOKEN}"})
            assert answer.status_code == 422, answer.text
            assert "give exactly one of job, project or ids" in answer.json()["error"]["message"]
            answer = await raw.post("/v1/sandboxes:resume", json={"job": "never-ran"},
                                    headers={"authorization": f"Bearer {TOKEN}"})
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "job_not_found"


async def test_auto_resume_false_refuses_calls_while_paused(edge, tmp_path):
    async with apiserver(edge, tmp_path) as (client, _), client() as c:
        s = await c.run_container(ARGS.model_copy(update={"auto_resume": False}))
        assert s.info.auto_resume is False
        await s.pause()
        with pytest.raises(SandboxStateError, match=r"is paused and was made with auto_resume=False.*dsec resume --id"):
            await s.run_shell("echo hi")
        assert (await c.get_sandbox(s.id)).status is SandboxStatus.paused
        await s.resume()
        assert (await s.run_shell("echo hi")).exit_code == 0
        await s.stop()


async def test_on_ttl_pause_pauses_an_idle_sandbox_instead_of_stopping_it(edge, tmp_path):
    async with apiserver(edge, tmp_path) as (client, _), client() as c:
        pausing = await c.run_container(ARGS.model_copy(update={"ttl_running_stop": 1, "on_ttl": "pause"}))
        stopping = await c.run_container(ARGS.model_copy(update={"ttl_running_stop": 1}))
        deadline = time.monotonic() + 5
        while (await c.get_sandbox(stopping.id)).status is not SandboxStatus.stopped and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert (await c.get_sandbox(stopping.id)).status is SandboxStatus.stopped
        info = (await c.get_sandbox(pausing.id)).info
        assert info.status is SandboxStatus.paused and info.on_ttl == "pause"
        assert (await pausing.run_shell("echo back")).stdout == "back\n"  # its next call resumes it
        await pausing.stop()


def test_the_reaper_splits_stop_and_pause(edge):
    class Rec:
        def __init__(self, on_ttl, status=SandboxStatus.running, idle_s=10.0):
            self.id, self.calls, self.batch, self.paused_at = on_ttl, 0, None, None
            self.status, self.last_active = status, 100.0 - idle_s
            self.args = ARGS.model_copy(update={"ttl_running_stop": 5, "on_ttl": on_ttl})

    records = [Rec("stop"), Rec("pause"), Rec("pause", idle_s=1), Rec("pause", SandboxStatus.paused)]
    assert [r.id for r, _ in expired(records, 100.0, paused_ttl_s=60)] == ["stop"]
    assert to_pause(records, 100.0) == [records[1]]


async def test_a_pause_says_its_mode_on_the_wire_and_none_is_a_full_one(edge, tmp_path):
    """``sandbox.pause("filesystem")`` through the apiserver; a pause sent with no body (a client
    from before modes) is a full one; a mode that is neither is refused, named."""
    async with apiserver(edge, tmp_path) as (client, app), client() as c:
        sandbox = await c.run_container(ARGS)
        result = await sandbox.pause("filesystem")
        assert (result.sandbox.status, result.sandbox.pause_mode) == (SandboxStatus.paused, "filesystem")
        with pytest.raises(SandboxStateError, match="keeping its files only"):
            await sandbox.run_shell("true")
        await sandbox.resume()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api",
                                     headers={"authorization": f"Bearer {TOKEN}"}) as raw:
            bad = await raw.post(f"/v1/sandboxes/{sandbox.id}/pause", json={"mode": "memory"})
            assert bad.status_code == 422 and "mode" in bad.json()["error"]["message"]
            bare = await raw.post(f"/v1/sandboxes/{sandbox.id}/pause")
            assert bare.status_code == 200 and bare.json()["sandbox"]["pause_mode"] == "full"
        await sandbox.stop()


async def test_a_resumed_job_answers_its_group_calls_from_the_log(edge, tmp_path):
    """``resume=True``: the job's own group pause and resume are answered from its log (nothing
    paused again); one another caller made selecting the job is not this run's; past the log
    they go live; a different group call at the log's place is ``ReplayDiverged``."""
    async with apiserver(edge, tmp_path) as (client, _), client() as c:
        async def run(job: DSecClient) -> tuple:
            sandboxes = [await job.run_container(ARGS, key=f"episode-{i}") for i in range(2)]
            paused = await job.pause_sandboxes(job="j2")
            resumed = await job.resume_sandboxes(job="j2")
            return [s.id for s in sandboxes], paused, resumed

        async with client(job="j2") as job:
            ids, paused, resumed = await run(job)
        assert paused.done == 2 and resumed.done == 2
        await c.pause_sandboxes(job="j2")  # another caller's, logged in j2's log too
        await c.resume_sandboxes(job="j2")
        assert [e.request.get("asked_by_job", "-") for e in (await c.job_log("j2")).entries
                if e.op.endswith("_sandboxes")] == ["-", "-", None, None]

        async with client(job="j2", resume=True) as job:
            again = await run(job)
            assert again == (ids, paused, resumed)
            assert job.replayed == 4
            assert (await statuses(c)) == {i: SandboxStatus.running for i in ids}  # (not paused again)
            live = await job.pause_sandboxes(job="j2")  # past the log: live
            assert live.done == 2
        async with client(job="j2", resume=True) as job:
            for i in range(2):
                await job.run_container(ARGS, key=f"episode-{i}")
            with pytest.raises(ReplayDiverged, match="the log has pause_sandboxes .* this run asks resume_sandboxes"):
                await job.resume_sandboxes(job="j2")
        for sid in ids:
            await (await c.get_sandbox(sid)).stop()
