"""Templates: named container specs of a project that pods are created from.

A pod created with ``template`` copies the template's spec at creation (a later change
or deletion of the template does not touch it) and records the template's name.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpucloud.core.errors import InvalidInput, NotFound
from gpucloud.core.models import PodCreateRequest
from gpucloud.core.spec import TemplateCreateRequest, TemplateOut
from gpucloud.db.models import TemplateModel
from gpucloud.services.context import ServiceContext, new_id
from gpucloud.services.projects import Principal
from gpucloud.services.spec import check_spec, spec_columns, spec_out, spec_request

M = TypeVar("M", bound=BaseModel)


def template_out(template: TemplateModel, project_name: str) -> TemplateOut:
    return TemplateOut(id=template.id, name=template.name, project=project_name,
                       gpus=template.gpus, ports=template.ports,
                       created_at=template.created_at, **spec_out(template))


def create_template(ctx: ServiceContext, caller: Principal,
                    request: TemplateCreateRequest) -> TemplateOut:
    check_spec(ctx, caller.project_id, request)
    template = TemplateModel(
        id=new_id(), project_id=caller.project_id, name=request.name, gpus=request.gpus,
        ports=request.ports, created_at=ctx.clock.now(), **spec_columns(request))
    try:
        with ctx.db.transaction() as session:
            session.add(template)
            session.flush()
            return template_out(template, caller.project_name)
    except IntegrityError:
        raise InvalidInput("name", f"a template named {request.name!r} already exists in "
                           f"project {caller.project_name!r}") from None


def _find(session: Session, caller: Principal, ref: str) -> TemplateModel | None:
    return session.scalar(select(TemplateModel).where(
        TemplateModel.project_id == caller.project_id,
        (TemplateModel.id == ref) | (TemplateModel.name == ref)))


def _get(session: Session, caller: Principal, ref: str) -> TemplateModel:
    template = _find(session, caller, ref)
    if template is None:
        raise NotFound(f"template {ref!r} not found")
    return template


def list_templates(ctx: ServiceContext, caller: Principal) -> list[TemplateOut]:
    with ctx.db.read() as session:
        rows = session.scalars(select(TemplateModel).where(
            TemplateModel.project_id == caller.project_id).order_by(TemplateModel.name))
        return [template_out(row, caller.project_name) for row in rows]


def get_template(ctx: ServiceContext, caller: Principal, ref: str) -> TemplateOut:
    with ctx.db.read() as session:
        return template_out(_get(session, caller, ref), caller.project_name)


def delete_template(ctx: ServiceContext, caller: Principal, ref: str) -> None:
    """Pods created from it keep their copy of its spec."""
    with ctx.db.transaction() as session:
        session.delete(_get(session, caller, ref))


def apply_template(ctx: ServiceContext, caller: Principal,
                   request: PodCreateRequest) -> PodCreateRequest:
    """The request over its template: the template's spec, then every field the request
    gave (``model_fields_set``; a default it did not give never overrides). Without a
    template the request must name its image."""
    if request.template is None:
        if request.image is None:
            raise InvalidInput("image", "field required (or name a template)")
        return request
    return merge_over(PodCreateRequest, template_fields(ctx, caller, request.template),
                      request.model_dump(include=request.model_fields_set))


def template_fields(ctx: ServiceContext, caller: Principal, name: str) -> dict[str, Any]:
    """A template's spec, GPUs and ports as request fields (422 ``template`` if unknown):
    the base that pods and serverless endpoints created from it start from."""
    with ctx.db.read() as session:
        template = session.scalar(select(TemplateModel).where(
            TemplateModel.project_id == caller.project_id,
            TemplateModel.name == name))
        if template is None:
            raise InvalidInput("template", f"no template named {name!r} in "
                               f"project {caller.project_name!r}")
        return {**spec_request(template), "gpus": template.gpus, "ports": list(template.ports)}


def merge_over(model: type[M], base: dict[str, Any], given: dict[str, Any]) -> M:
    """``given`` over ``base`` validated as ``model``; the first error is a 422 naming its
    field (the base's values were valid on their own, a combination may not be)."""
    try:
        return model.model_validate({**base, **given})
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "template"
        raise InvalidInput(field, str(first["msg"]).removeprefix("Value error, ")) from None
