"""Registry credentials of a project: named logins that pods and templates pull with.

The password is stored for the node agents, which need it to pull; it is never returned
by the API, never put in a log line or an event, and sent to an agent only in the
assignment of a pod whose image is on the credentials' registry.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from gpucloud.core.errors import InvalidInput, NotFound
from gpucloud.core.spec import RegistryAuthAddRequest, RegistryAuthOut
from gpucloud.db.models import RegistryAuthModel
from gpucloud.services.context import ServiceContext, new_id
from gpucloud.services.pods import bump_project_nodes
from gpucloud.services.projects import Principal


def _out(auth: RegistryAuthModel) -> RegistryAuthOut:
    return RegistryAuthOut(id=auth.id, name=auth.name, username=auth.username,
                           registry=auth.registry_host, created_at=auth.created_at)


def add_registry_auth(ctx: ServiceContext, caller: Principal,
                      request: RegistryAuthAddRequest) -> RegistryAuthOut:
    auth = RegistryAuthModel(
        id=new_id(), project_id=caller.project_id, name=request.name,
        registry_host=request.registry, username=request.username,
        password=request.password, created_at=ctx.clock.now())
    try:
        with ctx.db.transaction() as session:
            session.add(auth)
            session.flush()
            bump_project_nodes(session, caller.project_id, request.name)  # now named: found
            return _out(auth)
    except IntegrityError:
        raise InvalidInput("name", f"registry credentials named {request.name!r} already "
                           f"exist in project {caller.project_name!r}") from None


def list_registry_auths(ctx: ServiceContext, caller: Principal) -> list[RegistryAuthOut]:
    with ctx.db.read() as session:
        rows = session.scalars(select(RegistryAuthModel).where(
            RegistryAuthModel.project_id == caller.project_id).order_by(RegistryAuthModel.name))
        return [_out(row) for row in rows]


def remove_registry_auth(ctx: ServiceContext, caller: Principal, ref: str) -> None:
    """Pods already naming them pull anonymously from then on; new pods (also from a
    template that names them) are refused with a 422 naming ``registry_auth``."""
    with ctx.db.transaction() as session:
        auth = session.scalar(select(RegistryAuthModel).where(
            RegistryAuthModel.project_id == caller.project_id,
            (RegistryAuthModel.id == ref) | (RegistryAuthModel.name == ref)))
        if auth is None:
            raise NotFound(f"registry credentials {ref!r} not found")
        session.delete(auth)
        bump_project_nodes(session, caller.project_id, auth.name)
