"""Join tokens: what an admin hands a new node to register with.

A token expires (``Settings.join_token_ttl_seconds``, or the TTL asked for), may be limited
to N registrations (``--uses N``; ``--uses 1`` is single-use), and can be revoked at any
time. Only its SHA-256 is stored; its value is shown once, at creation. Each registration
of a *new* node uses it once, counted with a guarded ``UPDATE … WHERE uses < max_uses`` so
two agents racing for the last use cannot both get it. A node registered with a token
keeps working after the token expires or is revoked: it holds its own node token.

A re-registration (an agent restarting, a known node name) is checked the same way —
the token valid, unexpired, unrevoked and not used up — but spends no use: ``uses`` counts
the nodes a token joined. A new node's use is spent by one statement of its own, before
the registration's transaction (``spend``), and given back if that fails (``refund``):
the token's row is locked only while PostgreSQL runs that one statement. Spent inside the
registration's transaction, the row stayed locked until its commit, and a fleet
registering at once (or a thousand agents restarting) queued on that one row, each
holding a pooled connection while it waited, until healthy nodes could not renew.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from gpucloud.core.errors import Conflict, NotFound, Unauthorized
from gpucloud.core.models import JoinTokenInfoOut, JoinTokenOut, JoinTokenRequest
from gpucloud.db.models import JoinTokenModel
from gpucloud.services.context import (
    ServiceContext,
    hash_secret,
    new_id,
    new_secret,
    secret_matches,
)
from gpucloud.services.projects import Principal

TOKEN_PREFIX = "gpj"
PRINTED_PREFIX = 10
REFUSED = "invalid, expired, used up or revoked join token"


def _info(row: JoinTokenModel) -> JoinTokenInfoOut:
    return JoinTokenInfoOut(id=row.id, prefix=row.prefix, created_at=row.created_at,
                            expires_at=row.expires_at, max_uses=row.max_uses, uses=row.uses,
                            revoked_at=row.revoked_at)


def create(ctx: ServiceContext, caller: Principal,
           request: JoinTokenRequest | None = None) -> JoinTokenOut:
    caller.require_admin()
    request = request or JoinTokenRequest()
    now = ctx.clock.now()
    token = new_secret(TOKEN_PREFIX)
    ttl = request.ttl_seconds or ctx.settings.join_token_ttl_seconds
    row = JoinTokenModel(id=new_id(), token_hash=hash_secret(token), created_at=now,
                         expires_at=now + timedelta(seconds=ttl), prefix=token[:PRINTED_PREFIX],
                         max_uses=request.uses, uses=0, revoked_at=None)
    with ctx.db.transaction() as session:
        session.add(row)
        info = _info(row)
    return JoinTokenOut(**info.model_dump(), token=token)


def check(session: Session, token: str, now: datetime) -> str:
    """The id of ``token`` if it may register a node now (read only, no lock); 401 when
    it is unknown, expired, revoked or used up (one message for all: no oracle)."""
    row = session.scalar(
        select(JoinTokenModel).where(JoinTokenModel.token_hash == hash_secret(token)))
    if row is None or not secret_matches(token, row.token_hash) or row.revoked_at is not None \
            or row.expires_at <= now or (row.max_uses is not None and row.uses >= row.max_uses):
        raise Unauthorized(REFUSED)
    return row.id


def spend(ctx: ServiceContext, token: str, now: datetime) -> str:
    """Spend one use of ``token`` for a new node, as a statement of its own (autocommit:
    the row is locked only while it runs); its id. The guard ``uses < max_uses`` in the
    same statement: two agents racing for the last use cannot both get it. 401 when it is
    unknown, expired, revoked or used up."""
    row = ctx.db.first_atomic(update(JoinTokenModel).where(
        JoinTokenModel.token_hash == hash_secret(token), JoinTokenModel.revoked_at.is_(None),
        JoinTokenModel.expires_at > now,
        or_(JoinTokenModel.max_uses.is_(None), JoinTokenModel.uses < JoinTokenModel.max_uses),
    ).values(uses=JoinTokenModel.uses + 1).returning(JoinTokenModel.id,
                                                     JoinTokenModel.token_hash))
    if row is None or not secret_matches(token, row._mapping["token_hash"]):
        raise Unauthorized(REFUSED)
    return str(row._mapping["id"])


def refund(ctx: ServiceContext, token_id: str) -> None:
    """Give back the use ``spend`` took for a registration that then failed (a crash in
    between loses that use: the safe direction)."""
    ctx.db.first_atomic(update(JoinTokenModel).where(
        JoinTokenModel.id == token_id, JoinTokenModel.uses > 0,
    ).values(uses=JoinTokenModel.uses - 1).returning(JoinTokenModel.id))


def list_tokens(ctx: ServiceContext, caller: Principal) -> list[JoinTokenInfoOut]:
    caller.require_admin()
    with ctx.db.read() as session:
        rows = session.scalars(select(JoinTokenModel).order_by(JoinTokenModel.created_at))
        return [_info(row) for row in rows]


def revoke(ctx: ServiceContext, caller: Principal, ref: str) -> JoinTokenInfoOut:
    """Revoke a token named by its id or printed prefix; nodes it registered stay."""
    caller.require_admin()
    with ctx.db.transaction() as session:
        rows = session.scalars(select(JoinTokenModel).where(
            or_(JoinTokenModel.id == ref, JoinTokenModel.prefix == ref))).all()
        if not rows:
            raise NotFound(f"no join token {ref!r}")
        if len(rows) > 1:
            raise Conflict(f"{ref!r} names {len(rows)} join tokens; use the id")
        row = rows[0]
        if row.revoked_at is None:
            row.revoked_at = ctx.clock.now()
        return _info(row)
