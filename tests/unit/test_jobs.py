"""Idempotency keys and job logs, over a fake edge (control plane only), against both project
stores (SQLite and a real PostgreSQL): a key used again returns the same sandbox (after an
apiserver restart too, and from a second apiserver over the same database), a key reused with
other arguments is ``KeyReused``; a job's log holds every create, command, file write and stop in
order; a resumed client answers from it without running anything again, then goes live; a call
that differs is ``ReplayDiverged``; bad resumes are refused."""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
import threading
from contextlib import asynccontextmanager
from datetime import datetime, timezone

import httpx
import pytest

import libdsec
from dsec.apiserver.app import Cluster
from dsec.app import create_app
from dsec.apiserver.projects import open_project_store
from libdsec import DSecClient, DSecContainerRunArgs
from libdsec.protocol import (
    CleanCopyResult,
    ExecRequest,
    ExecResult,
    NodeInfo,
    PackDiffResult,
    SandboxInfo,
    SandboxStatus,
)

TOKEN = "s3cret"
ARGS = DSecContainerRunArgs(container_image="busybox")


class CountingEdge:
    """An edge whose sandboxes keep a list of lines: ``append X`` adds one, ``cat`` shows them,
    ``fail`` exits 1; every create makes a new id."""

    node = "n0"

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.lines: dict[str, list[str]] = {}
        self.files: dict[tuple[str, str], bytes] = {}
        self.creates = 0
        self.execs = 0
        self.stopped: set[str] = set()
        self.projects: dict[str, str] = {}

    def _info(self, sid: str) -> SandboxInfo:
        now = datetime.now(timezone.utc)
        status = SandboxStatus.stopped if sid in self.stopped else SandboxStatus.running
        return SandboxInfo(id=sid, node=self.node, image="busybox", status=status, created_at=now,
                           last_active_at=now, memory_limit_mb=64, cpu_cores_limit=1, ttl_running_stop=60,
                           init_user="root", workdir="/", project=self.projects[sid])

    def _check(self, sid: str) -> None:
        if sid not in self.lines:
            raise libdsec.SandboxNotFound(f"no sandbox {sid} on node n0")

    async def create(self, args, kind="container", project="root"):
        if args.container_image != "busybox":
            raise libdsec.ImageNotFound(f"unknown image {args.container_image!r}")
        await asyncio.sleep(0.02)  # long enough for a second create with the key to arrive meanwhile
        self.creates += 1
        sid = f"n0-{next(self.ids):016x}"
        self.lines[sid] = []
        self.projects[sid] = project
        return self._info(sid)

    async def create_batch(self, args, count, kind="container", project="root", batch=None):
        for i in range(count):
            yield i, await self.create(args, kind, project)

    async def commit_batch(self, batch):
        pass

    async def get(self, sid):
        self._check(sid)
        return self._info(sid)

    async def list(self):
        return [self._info(s) for s in self.lines]

    async def exec(self, sid, request: ExecRequest):
        self._check(sid)
        self.execs += 1
        word, _, rest = request.command.partition(" ")
        if word == "append":
            self.lines[sid].append(rest)
        if word == "fail":
            return ExecResult(exit_code=1, stdout="", stderr="failed", duration_s=0.0)
        return ExecResult(exit_code=0, stdout="\n".join(self.lines[sid]), stderr="", duration_s=0.0)

    async def write_file(self, sid, path, data, mode):
        self._check(sid)
        self.files[sid, path] = data

    async def set_network_rules(self, sid, rules):
        self._check(sid)
        self.rules = getattr(self, "rules", []) + [rules]

    async def read_file(self, sid, path):
        self._check(sid)
        if (sid, path) not in self.files:
            raise libdsec.SandboxFileNotFound(f"no such file in sandbox: {path}")
        self.reads = getattr(self, "reads", 0) + 1
        return self.files[sid, path]

    async def stop(self, sid, reason="stopped by request"):
        self._check(sid)
        self.stopped.add(sid)
        return self._info(sid)

    async def clean_copy(self, sid, keep):
        self._check(sid)
        self.creates += 1
        new = f"n0-{next(self.ids):016x}"
        self.lines[new] = list(self.lines[sid])
        self.projects[new] = self.projects[sid]
        return CleanCopyResult(sandbox=self._info(new), source=sid, keep=keep, files=1, bytes=1, scrubbed=[],
                               tampered=[], copy_s=0.0)

    async def pack_diff(self, sid, name=None, role="snapshot"):
        self._check(sid)
        self.packs = getattr(self, "packs", 0) + 1
        return PackDiffResult(image=name or f"snap-{self.packs}", layer="l", layers=["l"], size_bytes=1, scrubbed=[])

    async def node_info(self):
        return NodeInfo(node="n0", cgroup_version="v1", runtime="fake", sandboxes=len(self.lines),
                        memory_total_mb=1 << 20, cpu_cores=64)


@pytest.fixture
def edge() -> CountingEdge:
    return CountingEdge()


@asynccontextmanager
async def apiserver(edge, project_db):
    """An apiserver over ``edge`` and the project store at ``project_db``; its client factory."""
    with open_project_store(project_db) as projects:
        app = create_app(Cluster([edge], projects=projects), TOKEN)

        def client(token: str = TOKEN, **kwargs) -> DSecClient:
            return DSecClient("http://api", token=token, transport=httpx.ASGITransport(app=app), **kwargs)

        yield client


async def test_a_key_used_again_returns_the_same_sandbox_also_after_a_restart(edge, project_db):
    async with apiserver(edge, project_db) as client:
        async with client() as c:
            first = await c.run_container(ARGS, key="episode-17")
            again = await c.run_container(ARGS, key="episode-17")
            other = await c.run_container(ARGS, key="episode-18")
            # Two creates with one key at once (a retry while the first is under way): one sandbox.
            racing = await asyncio.gather(*(c.run_container(ARGS, key="episode-19") for _ in range(4)))
    assert again.id == first.id and other.id != first.id
    assert len({s.id for s in racing}) == 1
    assert edge.creates == 3
    async with apiserver(edge, project_db) as client:  # a new apiserver over the same database
        async with client() as c:
            after = await c.run_container(ARGS, key="episode-17")
            await after.stop()
            stopped = await c.run_container(ARGS, key="episode-17")
    assert after.id == first.id and edge.creates == 3
    assert stopped.id == first.id and stopped.status == SandboxStatus.stopped


async def test_a_key_reused_with_other_args_is_a_typed_error(edge, project_db):
    async with apiserver(edge, project_db) as client, client() as c:
        await c.run_container(ARGS, key="k1")
        with pytest.raises(libdsec.KeyReused, match="'k1'.*other arguments"):
            await c.run_container(ARGS.model_copy(update={"memory_limit_mb": 128}), key="k1")
        with pytest.raises(libdsec.KeyReused):
            await c.run_containers(ARGS, count=2, key="k1")
        # A create that failed leaves its key free.
        with pytest.raises(libdsec.ImageNotFound):
            await c.run_container(DSecContainerRunArgs(container_image="nope"), key="k2")
        made = await c.run_container(ARGS, key="k2")
        assert made.status == SandboxStatus.running
        for bad in ("", "has space", "x" * 201, "new\nline"):
            with pytest.raises(libdsec.InvalidRequest, match="idempotency key"):
                await c.run_container(ARGS, key=bad)
    assert edge.creates == 2


async def test_batch_keys(edge, project_db):
    async with apiserver(edge, project_db) as client, client() as c:
        first = await c.run_containers(ARGS, count=3, key="batch-1")
        again = await c.run_containers(ARGS, count=3, key="batch-1")
    assert [s.id for s in again] == [s.id for s in first]
    assert edge.creates == 3


async def test_keys_are_scoped_by_project_and_job(edge, project_db):
    async with apiserver(edge, project_db) as client:
        async with client() as root:
            await root.create_project("team-a")
            await root.create_project("team-b")
            a_token, b_token = await root.create_project_token("team-a"), await root.create_project_token("team-b")
        async with client(a_token) as a, client(b_token) as b, client(a_token, job="run-1") as a_job:
            in_a = await a.run_container(ARGS, key="e1")
            in_b = await b.run_container(ARGS, key="e1")
            in_job = await a_job.run_container(ARGS, key="e1")
            assert len({in_a.id, in_b.id, in_job.id}) == 3
            assert (await a_job.run_container(ARGS, key="e1")).id == in_job.id


async def rollout(c: DSecClient, episodes: int = 2) -> list[str]:
    """A trainer's loop: per episode a keyed create, commands that change state, a file, a stop."""
    out = []
    for n in range(episodes):
        sandbox = await c.run_container(ARGS, key=f"episode-{n}")
        await sandbox.run_shell(f"append step-{n}-a")
        await sandbox.write_file("/work/patch.diff", f"patch {n}")
        result = await sandbox.run_shell(f"append step-{n}-b")
        failed = await sandbox.run_shell("fail")
        out.append(f"{sandbox.id}:{result.stdout!r}:{failed.exit_code}")
        await sandbox.stop()
    return out


async def test_the_job_log_holds_every_call_in_order(edge, project_db):
    async with apiserver(edge, project_db) as client, client(job="run-42") as c:
        await rollout(c)
        log = await c.job_log("run-42")
        jobs = await c.list_jobs()
    assert [e.key for e in log.entries if e.op == "create"] == ["episode-0", "episode-1"]
    assert [e.op for e in log.entries] == ["create", "exec", "write_file", "exec", "exec", "stop"] * 2
    assert [e.seq for e in log.entries] == sorted(e.seq for e in log.entries)
    first_exec = log.entries[1]
    assert first_exec.request["command"] == "append step-0-a" and first_exec.result["exit_code"] == 0
    assert log.entries[4].result["exit_code"] == 1
    write = log.entries[2]
    assert write.request["path"] == "/work/patch.diff" and write.request["bytes"] == len("patch 0")
    assert [j.name for j in jobs] == ["run-42"] and jobs[0].entries == 12 and log.job.project == "root"


async def test_a_recorded_call_waits_out_another_writer_of_the_sqlite_file(edge, tmp_path, monkeypatch):
    """The log's writes go on the event loop while no other writer holds the file's lock; while
    one does (another apiserver's process), the call is answered only once its entry is
    written, by the writer's thread, after it; checkpoints are that thread's too."""
    from dsec.apiserver import projects_sqlite

    checkpoints: list[str] = []
    checkpoint = projects_sqlite.SQLiteProjectStore.checkpoint_blocking
    monkeypatch.setattr(projects_sqlite, "CHECKPOINT_EVERY", 4)
    monkeypatch.setattr(projects_sqlite.SQLiteProjectStore, "checkpoint_blocking",
                        lambda store: (checkpoints.append(threading.current_thread().name), checkpoint(store)))
    path = tmp_path / "projects.db"
    async with apiserver(edge, path) as client, client(job="locked") as c:
        sandbox = await c.run_container(ARGS, key="e1")
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        command = asyncio.create_task(sandbox.run_shell("append while-locked"))
        await asyncio.sleep(0.3)
        assert not command.done() and edge.execs == 1  # (it ran; its answer waits for its entry)
        other.execute("COMMIT")
        other.close()
        assert (await asyncio.wait_for(command, 10)).exit_code == 0
        for n in range(8):
            await sandbox.run_shell(f"append {n}")
        log = await c.job_log("locked")
    assert [e.op for e in log.entries] == ["create"] + ["exec"] * 9
    assert [e.request["command"] for e in log.entries[1:3]] == ["append while-locked", "append 0"]
    assert checkpoints and set(checkpoints) == {"dsec-joblog_0"}


async def test_resume_fast_forwards_then_goes_live(edge, project_db):
    async with apiserver(edge, project_db) as client:
        async with client(job="run-42") as c:
            first = await rollout(c)
        execs, creates = edge.execs, edge.creates
    # The trainer restarted (and so did the apiserver): the same code, from the top.
    async with apiserver(edge, project_db) as client:
        async with client(job="run-42", resume=True) as c:
            again = await rollout(c)
            assert (edge.execs, edge.creates) == (execs, creates), "a logged call ran again"
            assert c.replayed == 12
            # Past the log: live, on the same job (and recorded).
            more = await rollout(c, episodes=3)
    assert again == first
    assert more[:2] != first[:2] or edge.creates == creates  # (episodes 0 and 1 are keyed: same sandboxes)
    assert edge.creates == creates + 1  # only episode-2 was new
    # A command that appends was not appended twice on the fast-forward.
    sid = first[0].split(":")[0]
    assert edge.lines[sid].count("step-0-a") == 2  # once in the first run, once live in `more`


async def test_a_call_that_differs_from_the_log_is_replay_diverged(edge, project_db):
    async with apiserver(edge, project_db) as client:
        async with client(job="run-7") as c:
            await rollout(c, episodes=1)
        async with client(job="run-7", resume=True) as c:
            sandbox = await c.run_container(ARGS, key="episode-0")
            with pytest.raises(libdsec.ReplayDiverged, match="append step-0-a.*append something-else"):
                await sandbox.run_shell("append something-else")
        async with client(job="run-7", resume=True) as c:
            with pytest.raises(libdsec.ReplayDiverged, match="episode-0"):
                await c.run_container(ARGS.model_copy(update={"memory_limit_mb": 256}), key="episode-0")


async def test_bad_resumes(edge, project_db):
    async with apiserver(edge, project_db) as client:
        async with client() as root:
            await root.create_project("team-a")
            await root.create_project("team-b")
            a_token, b_token = await root.create_project_token("team-a"), await root.create_project_token("team-b")
        with pytest.raises(libdsec.JobNotFound, match="no job log 'never-ran'"):
            async with client(job="never-ran", resume=True):
                pass
        async with client(a_token, job="a-job") as a:
            await (await a.run_container(ARGS)).stop()
        with pytest.raises(libdsec.JobNotFound, match="another project"):
            async with client(b_token, job="a-job", resume=True):
                pass
        async with client(b_token, job="a-job") as b:  # nor may it record into it
            with pytest.raises(libdsec.JobNotFound, match="another project"):
                await b.run_container(ARGS)
        with pytest.raises(libdsec.InvalidRequest, match="needs the job"):
            DSecClient("http://api", resume=True)
        with pytest.raises(libdsec.InvalidRequest, match="invalid job name"):
            DSecClient("http://api", job="../x")
        async with client() as root:
            assert {j.name for j in await root.list_jobs()} == {"a-job"}
            await root.remove_job("a-job")
            with pytest.raises(libdsec.JobNotFound):
                await root.job_log("a-job")


async def test_retention_removes_idle_jobs_and_their_keys(edge, project_db):
    async with apiserver(edge, project_db) as client, client(job="old") as c:
        first = await c.run_container(ARGS, key="e0")
    with open_project_store(project_db) as projects:
        cluster = Cluster([edge], projects=projects)
        cluster.jobs.retention_s = 0.0
        assert await cluster.jobs.prune() == ["old"]
        assert await projects.job("old") is None
    async with apiserver(edge, project_db) as client, client(job="old") as c:
        assert (await c.run_container(ARGS, key="e0")).id != first.id  # the key went with its job


def test_retention_from_the_environment(monkeypatch):
    from dsec.apiserver.jobs import DEFAULT_RETENTION_S, retention_from_env
    from dsec.settings import SettingsError

    monkeypatch.delenv("DSEC_JOB_RETENTION_S", raising=False)
    assert retention_from_env() == DEFAULT_RETENTION_S
    monkeypatch.setenv("DSEC_JOB_RETENTION_S", "3600")
    assert retention_from_env() == 3600.0
    for bad in ("soon", "-1", "0"):
        monkeypatch.setenv("DSEC_JOB_RETENTION_S", bad)
        with pytest.raises(SettingsError, match="DSEC_JOB_RETENTION_S"):
            retention_from_env()


async def test_two_apiservers_over_one_database_share_keys_and_logs(edge, project_db):
    async with apiserver(edge, project_db) as first, apiserver(edge, project_db) as second:
        async with first(job="shared") as a, second(job="shared") as b:
            made = await asyncio.gather(*(c.run_container(ARGS, key="episode-1") for c in (a, b, a, b)))
            assert len({s.id for s in made}) == 1 and edge.creates == 1
            await made[0].run_shell("append from-a")
            await (await b.get_sandbox(made[0].id)).run_shell("append from-b")
            seen_by_b = await b.job_log("shared")
    assert [e.op for e in seen_by_b.entries] == ["create", "exec", "exec"]
    assert [e.request.get("command") for e in seen_by_b.entries[1:]] == ["append from-a", "append from-b"]


async def graded_episode(c: DSecClient, n: int) -> tuple[str, str, str]:
    """An episode as SandboxEnv runs it: commands, a pack_diff, the verdict from a clean copy."""
    sandbox = await c.run_container(ARGS, key=f"graded-{n}")
    await sandbox.run_shell("append fix")
    snapshot = await sandbox.pack_diff()
    async with await sandbox.clean_copy(keep=["/testbed"]) as grader:
        verdict = await grader.run_shell("cat")
    await sandbox.stop()
    return grader.id, snapshot.image, verdict.stdout


async def test_resume_fast_forwards_through_clean_copies_and_pack_diffs(edge, project_db):
    async with apiserver(edge, project_db) as client:
        async with client(job="graded") as c:
            first = await graded_episode(c, 0)
        async with client() as c:
            log = await c.job_log("graded")
        creates, execs = edge.creates, edge.execs
        async with client(job="graded", resume=True) as c:
            again = await graded_episode(c, 0)
            assert c.replayed == 7
        assert (edge.creates, edge.execs) == (creates, execs)
    assert again == first and first[2] == "fix"
    assert [e.op for e in log.entries] == ["create", "exec", "pack_diff", "clean_copy", "exec", "stop", "stop"]


async def test_network_rules_and_reads_are_recorded_and_fast_forwarded(edge, project_db):
    async def episode(c):
        sandbox = await c.run_container(ARGS, key="e0")
        await sandbox.set_network_rules({"domains": ["example.internal"]})
        await sandbox.write_file("/w", "data")
        seen = [await sandbox.read_file("/w")]
        with pytest.raises(libdsec.SandboxFileNotFound):  # an error is logged and raised again
            await sandbox.read_file("/missing")
        return seen

    async with apiserver(edge, project_db) as client:
        async with client(job="net") as c:
            first = await episode(c)
            log = await c.job_log("net")
        assert [e.op for e in log.entries] == ["create", "set_network_rules", "write_file", "read_file", "read_file"]
        assert log.entries[3].result["sha256"] and log.entries[4].error["code"] == "file_not_found"
        rules, reads = list(edge.rules), edge.reads
        async with client(job="net", resume=True) as c:
            assert await episode(c) == first == [b"data"]
            assert c.replayed == 5 and edge.rules == rules and edge.reads == reads
        async with client(job="net", resume=True) as c:
            sandbox = await c.run_container(ARGS, key="e0")
            with pytest.raises(libdsec.ReplayDiverged, match="set_network_rules"):
                await sandbox.set_network_rules({"domains": ["other.internal"]})
