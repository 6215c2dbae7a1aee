"""Templates: the project's named container specs, created and deleted through
``services.templates`` (the pod and job forms offer them)."""

from __future__ import annotations

import shlex
from typing import Any

from fastapi import APIRouter, Request, Response

from gpucloud.console.web import ConsoleRoute, CurrentViewer, Form, back, page
from gpucloud.core.spec import TemplateCreateRequest
from gpucloud.services import templates

router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)


@router.get("/templates")
def template_list(request: Request, viewer: CurrentViewer) -> Response:
    return page(request, "templates.html", viewer,
                templates=templates.list_templates(viewer.ctx, viewer.principal))


def create_request(form: dict[str, str]) -> TemplateCreateRequest:
    """The template form as the API's request (fields left empty take their defaults)."""
    body: dict[str, Any] = {"name": form.get("name", "").strip(),
                            "image": form.get("image", "").strip()}
    for name in ("gpus", "gpu_type"):
        if form.get(name, "").strip():
            body[name] = form[name].strip()
    if form.get("command", "").strip():
        body["command"] = shlex.split(form["command"])
    if form.get("ports", "").strip():
        body["ports"] = [p.strip() for p in form["ports"].split(",") if p.strip()]
    return TemplateCreateRequest.model_validate(body)


@router.post("/templates")
def template_create(viewer: CurrentViewer, form: Form) -> Response:
    templates.create_template(viewer.ctx, viewer.principal, create_request(form))
    return back("/console/templates")


@router.post("/templates/{ref}/delete")
def template_delete(ref: str, viewer: CurrentViewer, _form: Form) -> Response:
    templates.delete_template(viewer.ctx, viewer.principal, ref)
    return back("/console/templates")
