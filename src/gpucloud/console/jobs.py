"""Jobs: the list with its create form (a template or an image, nodes × GPUs per node from
the fleet's free capacity), a job's page (members by rank, gang state), stop and delete.

Creation goes through ``services.jobs.create_job`` as the API's does; a template is the
base of the request through ``services.templates`` (its GPUs and ports are a pod's, so a
job takes only its container spec)."""

from __future__ import annotations

import shlex
from typing import Any

from fastapi import APIRouter, Request, Response

from gpucloud.console.views import free_capacity
from gpucloud.console.web import ConsoleRoute, CurrentViewer, Form, Viewer, back, page
from gpucloud.core.jobs import JOB_FINAL_PHASES, MAX_JOB_NODES, JobCreateRequest
from gpucloud.services import jobs, nodes, occupancy, templates

router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)

#: Template fields a job does not take (a job's GPUs are per node, it has no ports).
POD_ONLY_FIELDS = ("gpus", "ports")


def _wake(request: Request) -> None:
    runner = getattr(request.app.state, "controllers", None)
    if runner is not None:
        runner.wake()


def _form_context(viewer: Viewer) -> dict[str, Any]:
    ctx, caller = viewer.ctx, viewer.principal
    capacity = free_capacity(nodes.list_nodes(ctx), occupancy.gpu_occupancy(ctx, caller))
    return {"templates": templates.list_templates(ctx, caller), "capacity": capacity,
            "max_gpus": max(capacity.values(), default=0), "max_nodes": MAX_JOB_NODES}


@router.get("/jobs")
def job_list(request: Request, viewer: CurrentViewer) -> Response:
    return page(request, "jobs.html", viewer, jobs=jobs.list_jobs(viewer.ctx, viewer.principal),
                **_form_context(viewer))


def given_fields(form: dict[str, str]) -> dict[str, Any]:
    """The fields the job form filled in (an empty field leaves the template's value)."""
    body: dict[str, Any] = {"name": form.get("name", "").strip()}
    for name in ("image", "gpu_type", "nodes", "gpus_per_node"):
        if form.get(name, "").strip():
            body[name] = form[name].strip()
    if form.get("command", "").strip():
        body["command"] = shlex.split(form["command"])
    return body


def create_request(viewer: Viewer, form: dict[str, str]) -> JobCreateRequest:
    """The job form as the API's request, over the chosen template's spec if any."""
    given = given_fields(form)
    template = form.get("template", "").strip()
    if not template:
        return JobCreateRequest.model_validate(given)
    base = templates.template_fields(viewer.ctx, viewer.principal, template)
    for name in POD_ONLY_FIELDS:
        base.pop(name, None)
    return templates.merge_over(JobCreateRequest, base, given)


@router.post("/jobs")
def job_create(request: Request, viewer: CurrentViewer, form: Form) -> Response:
    job = jobs.create_job(viewer.ctx, viewer.principal, create_request(viewer, form))
    _wake(request)
    return back(f"/console/jobs/{job.id}")


@router.get("/jobs/{ref}")
def job_page(ref: str, request: Request, viewer: CurrentViewer) -> Response:
    job = jobs.get_job(viewer.ctx, viewer.principal, ref)
    why = jobs.why_job(viewer.ctx, viewer.principal, job.id)
    members = sorted(job.members, key=lambda m: m.rank)
    return page(request, "job.html", viewer, job=job, why=why, members=members,
                final=job.phase in JOB_FINAL_PHASES)


@router.post("/jobs/{ref}/stop")
def job_stop(ref: str, viewer: CurrentViewer, _form: Form) -> Response:
    job = jobs.stop_job(viewer.ctx, viewer.principal, ref)
    return back(f"/console/jobs/{job.id}")


@router.post("/jobs/{ref}/delete")
def job_delete(ref: str, viewer: CurrentViewer, _form: Form) -> Response:
    jobs.delete_job(viewer.ctx, viewer.principal, ref)
    return back("/console/jobs")
