"""HTTP routes for job logs: list, read and remove (``dsec job ls | show | rm``). A token sees
its own project's jobs; the root token sees every job. Recording happens in the sandbox routes
(a request with an ``x-dsec-job`` header, see ``jobs``)."""

from __future__ import annotations

from fastapi import Depends, FastAPI, Path, Query

from libdsec.protocol import JobList, JobLog

from .auth import Caller
from .jobs import Jobs

_JOB_PATH = Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def add_job_routes(app: FastAPI, jobs: Jobs, authenticated, errors: dict) -> None:
    @app.get("/v1/jobs", responses=errors)
    async def list_jobs(caller: Caller = Depends(authenticated)) -> JobList:
        return await jobs.list(caller)

    @app.get("/v1/jobs/{job}", responses=errors)
    async def show_job(job: str = _JOB_PATH, after: int = Query(0, ge=0),
                       caller: Caller = Depends(authenticated)) -> JobLog:
        """The job and its log entries past ``after`` (a ``seq``), in order."""
        return await jobs.show(caller, job, after)

    @app.delete("/v1/jobs/{job}", responses=errors)
    async def remove_job(job: str = _JOB_PATH, caller: Caller = Depends(authenticated)) -> dict:
        await jobs.remove(caller, job)
        return {"removed": job}
