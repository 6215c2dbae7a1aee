"""/v1/jobs: jobs (gangs of member pods) of the caller's project."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response

from gpucloud.api.deps import Caller, Ctx
from gpucloud.core.joblogs import OFFSETS_PATTERN, parse_offsets
from gpucloud.core.jobs import JobCreateRequest, JobEventOut, JobLogsOut, JobOut, JobWhyOut
from gpucloud.services import job_history, jobs

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


def _wake_scheduler(request: Request) -> None:
    runner = getattr(request.app.state, "controllers", None)
    if runner is not None:
        runner.wake()


@router.post("", status_code=201)
def create_job(body: JobCreateRequest, ctx: Ctx, caller: Caller, request: Request) -> JobOut:
    job = jobs.create_job(ctx, caller, body)
    _wake_scheduler(request)
    return job


@router.get("")
def list_jobs(ctx: Ctx, caller: Caller,
              limit: int = Query(default=1000, ge=1, le=10000)) -> list[JobOut]:
    return jobs.list_jobs(ctx, caller, limit)


@router.get("/{ref}")
def get_job(ref: str, ctx: Ctx, caller: Caller) -> JobOut:
    return jobs.get_job(ctx, caller, ref)


@router.get("/{ref}/why")
def job_why(ref: str, ctx: Ctx, caller: Caller) -> JobWhyOut:
    return jobs.why_job(ctx, caller, ref)


@router.get("/{ref}/logs")
def job_logs(
    ref: str, ctx: Ctx, caller: Caller,
    offsets: str | None = Query(
        default=None, json_schema_extra={"pattern": OFFSETS_PATTERN},
        description="Follow: RANK:ATTEMPT:OFFSET,... from the last answer's "
        "`offsets` (empty: from the start); whole lines only while a member runs"),
    tail: int | None = Query(default=None, ge=0,
                             description="The last N lines of each member starting afresh"),
) -> JobLogsOut:
    positions = None if offsets is None else parse_offsets(offsets)
    return job_history.job_logs(ctx, caller, ref, positions, tail)


@router.get("/{ref}/events")
def job_events(ref: str, ctx: Ctx, caller: Caller) -> list[JobEventOut]:
    return job_history.job_events(ctx, caller, ref)


@router.post("/{ref}/stop")
def stop_job(ref: str, ctx: Ctx, caller: Caller) -> JobOut:
    return jobs.stop_job(ctx, caller, ref)


@router.delete("/{ref}", status_code=204)
def delete_job(ref: str, ctx: Ctx, caller: Caller) -> Response:
    jobs.delete_job(ctx, caller, ref)
    return Response(status_code=204)
