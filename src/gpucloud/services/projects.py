"""Projects (tenants) and their API keys; authentication of callers."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpucloud.core.errors import Conflict, Forbidden, NotFound, Unauthorized
from gpucloud.core.models import KeyCreatedOut, KeyOut, ProjectCreatedOut, ProjectOut
from gpucloud.db.models import ApiKeyModel, ProjectModel
from gpucloud.services.context import (
    ServiceContext,
    hash_secret,
    new_id,
    new_secret,
    secret_matches,
)

ADMIN_PROJECT = "admin"
KEY_PREFIX = "gpc"


@dataclass(frozen=True)
class Principal:
    """The caller of an API request: a project and whether it is the admin project."""

    project_id: str
    project_name: str
    is_admin: bool

    def require_admin(self) -> None:
        if not self.is_admin:
            raise Forbidden("this needs an admin key")


def _project_out(project: ProjectModel) -> ProjectOut:
    return ProjectOut(
        id=project.id, name=project.name, is_admin=project.is_admin, created_at=project.created_at
    )


def _key_out(key: ApiKeyModel, project_name: str) -> KeyOut:
    return KeyOut(
        id=key.id,
        name=key.name,
        project=project_name,
        prefix=key.prefix,
        created_at=key.created_at,
        revoked_at=key.revoked_at,
    )


def _add_key(ctx: ServiceContext, session: Session, project: ProjectModel, name: str,
             value: str | None = None) -> KeyCreatedOut:
    secret = value or new_secret(KEY_PREFIX)
    key = ApiKeyModel(
        id=new_id(), project_id=project.id, name=name, prefix=secret[:10],
        key_hash=hash_secret(secret), created_at=ctx.clock.now(), revoked_at=None,
    )
    session.add(key)
    return KeyCreatedOut(**_key_out(key, project.name).model_dump(), key=secret)


def bootstrap_admin(ctx: ServiceContext) -> str | None:
    """Create the admin project and key on first start.

    Returns the generated key when one was written to ``$GPUCLOUD_HOME/admin.key``, so the
    caller can print it once; ``None`` when the admin project already existed or the key
    came from ``GPUCLOUD_ADMIN_KEY``.
    """
    try:
        with ctx.db.transaction() as session:
            if session.scalar(select(ProjectModel).where(ProjectModel.name == ADMIN_PROJECT)):
                _ensure_env_admin_key(ctx, session)
                return None
            project = ProjectModel(
                id=new_id(), name=ADMIN_PROJECT, is_admin=True, created_at=ctx.clock.now()
            )
            session.add(project)
            session.flush()
            created = _add_key(ctx, session, project, "admin", ctx.settings.admin_key)
    except IntegrityError:
        return None  # another server worker bootstrapped it at the same moment
    if ctx.settings.admin_key:
        return None
    _write_key_file(ctx.settings.home / "admin.key", created.key)
    return created.key


def _ensure_env_admin_key(ctx: ServiceContext, session: Session) -> None:
    """Honour a GPUCLOUD_ADMIN_KEY set after the first start: add it if it is unknown."""
    value = ctx.settings.admin_key
    if not value or session.scalar(
        select(ApiKeyModel.id).where(ApiKeyModel.key_hash == hash_secret(value))
    ):
        return
    project = session.scalars(select(ProjectModel).where(ProjectModel.is_admin)).one()
    _add_key(ctx, session, project, "admin-env", value)


def _write_key_file(path: Path, key: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "w") as handle:
        handle.write(key + "\n")


def cached_principal(ctx: ServiceContext, key: str | None) -> Principal | None:
    """The caller of a key authenticated in the last few seconds, without a query."""
    if not key:
        return None
    cached = ctx.cache.get(hash_secret(key))
    return cached if isinstance(cached, Principal) else None


def authenticate(ctx: ServiceContext, key: str | None) -> Principal:
    if not key:
        raise Unauthorized("missing API key (send 'Authorization: Bearer KEY')")
    cached = cached_principal(ctx, key)
    if cached is not None:
        return cached
    key_hash = hash_secret(key)
    with ctx.db.transaction() as session:
        row = session.execute(  # by hash: see secret_matches for why that is safe
            select(ProjectModel.id, ProjectModel.name, ProjectModel.is_admin,
                   ApiKeyModel.key_hash)
            .join(ApiKeyModel, ApiKeyModel.project_id == ProjectModel.id)
            .where(ApiKeyModel.key_hash == key_hash, ApiKeyModel.revoked_at.is_(None),
                   ApiKeyModel.scope.is_(None))  # a worker's key is no project key
        ).first()
    if row is None or not secret_matches(key, row[3]):
        raise Unauthorized("invalid or revoked API key")
    principal = Principal(project_id=row[0], project_name=row[1], is_admin=row[2])
    ctx.cache.put(key_hash, principal)
    return principal


def create_project(ctx: ServiceContext, caller: Principal, name: str) -> ProjectCreatedOut:
    caller.require_admin()
    try:
        with ctx.db.transaction() as session:
            project = ProjectModel(id=new_id(), name=name, is_admin=False,
                                   created_at=ctx.clock.now())
            session.add(project)
            session.flush()
            key = _add_key(ctx, session, project, "default")
    except IntegrityError:
        raise Conflict(f"a project named {name!r} already exists") from None
    return ProjectCreatedOut(project=_project_out(project), key=key)


def list_projects(ctx: ServiceContext, caller: Principal) -> list[ProjectOut]:
    with ctx.db.transaction() as session:
        query = select(ProjectModel).order_by(ProjectModel.created_at)
        if not caller.is_admin:
            query = query.where(ProjectModel.id == caller.project_id)
        return [_project_out(p) for p in session.scalars(query)]


def create_key(ctx: ServiceContext, caller: Principal, name: str) -> KeyCreatedOut:
    with ctx.db.transaction() as session:
        project = session.get_one(ProjectModel, caller.project_id)
        return _add_key(ctx, session, project, name)


def list_keys(ctx: ServiceContext, caller: Principal) -> list[KeyOut]:
    with ctx.db.transaction() as session:
        keys = session.scalars(
            select(ApiKeyModel)
            .where(ApiKeyModel.project_id == caller.project_id, ApiKeyModel.scope.is_(None))
            .order_by(ApiKeyModel.created_at)
        )
        return [_key_out(k, caller.project_name) for k in keys]


def revoke_key(ctx: ServiceContext, caller: Principal, key_ref: str) -> KeyOut:
    """Revoke a key of the caller's project, named by id, name or its printed prefix."""
    with ctx.db.transaction() as session:
        keys = session.scalars(
            select(ApiKeyModel).where(
                ApiKeyModel.project_id == caller.project_id, ApiKeyModel.revoked_at.is_(None),
                ApiKeyModel.scope.is_(None),
            )
        ).all()
        matches = [k for k in keys if key_ref in (k.id, k.name, k.prefix)]
        if not matches:
            raise NotFound(f"no active key {key_ref!r} in project {caller.project_name!r}")
        if len(matches) > 1:
            raise Conflict(f"{key_ref!r} names {len(matches)} keys; use the key id")
        key = matches[0]
        key.revoked_at = ctx.clock.now()
        revoked = _key_out(key, caller.project_name)
    ctx.cache.clear()
    return revoked
