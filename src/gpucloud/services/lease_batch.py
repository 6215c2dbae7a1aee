"""Many current lease renewals in one statement (group commit for the renewals' hot path).

``nodes.renew_current`` renews one grant with one guarded ``UPDATE … RETURNING``. At
thousands of renewals a second one statement each costs a thread, a pooled connection and
a round trip apiece; here the renewals that arrived together are renewed by one statement
with the same guard checked per row: the node token by its hash, the fencing token, the
grant still current (``Ready``, not lapsed) and, for an agent that would uncordon, no
cordon reason. Every row gets the same expiry: TTL after the earliest receipt among them
(a renewal that waited in a busy server extends the lease from when it came, so a node
whose agent died is not kept alive by its last renewal's queueing). A renewal
the statement did not match gets None: the caller then takes the full path, which gives it
its own answer (401, 409, a new grant), exactly as after ``renew_current``.

A row another transaction holds (a scheduling pass claiming its node, a pod report) is
skipped, never waited for; one whose guard held all the same gets ``BUSY`` (PostgreSQL:
one more statement, without a lock, over the rows not renewed), and the caller sends it
again with the next statement (api/lease_capacity.py) instead of the full path, whose row
lock would queue the renewal, and one of the few full-path threads, behind the holder.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from sqlalchemy import BigInteger, ColumnElement, Connection, String, select, tuple_, update

from gpucloud.core.models import LeaseRequest, LeaseResponse
from gpucloud.core.phases import NodeStatus
from gpucloud.db.models import NodeModel
from gpucloud.services import lease_ttl, row_sources
from gpucloud.services.context import ServiceContext, hash_secret, secret_matches

#: Renewals per statement: (hash, token) pairs stay well under SQLite's 32,766 parameters.
CHUNK = 1000


@dataclass(frozen=True)
class Renewal:
    token: str
    request: LeaseRequest
    #: when the server received it (its clock): the new expiry counts from there, not
    #: from when a busy server got round to it (None: from the statement's ``now``)
    received_at: datetime | None = None
    #: when it first found its row held by another transaction (``time.monotonic``;
    #: None: not yet): how long it has been sent again (api/lease_capacity.py)
    busy_since: float | None = None


class Busy:
    """``renew_many``'s answer for a renewal whose row another transaction held while
    its guard matched: not renewed, not refused; send it again."""

    def __repr__(self) -> str:
        return "BUSY"


BUSY: Final = Busy()
#: A renewal's answer: renewed, ``BUSY`` (send it again), or None (the full path).
Outcome = LeaseResponse | Busy | None


def eligible(token: str | None, request: LeaseRequest) -> bool:
    """Whether the hot path may renew it (else only the full path can answer it)."""
    return bool(token) and request.fencing_token is not None and (
        request.gpu_health is None and request.node_fault is None
        and not request.gpu_actions)


def renew_many(ctx: ServiceContext, renewals: list[Renewal]) -> list[Outcome]:
    """Each renewal's response, ``BUSY`` where its row was held by another transaction
    (PostgreSQL), or None where the full path must answer."""
    out: list[Outcome] = [None] * len(renewals)
    groups: dict[bool, list[int]] = defaultdict(list)
    for i, renewal in enumerate(renewals):
        groups[renewal.request.auto_uncordon].append(i)
    for auto_uncordon, indices in groups.items():
        for start in range(0, len(indices), CHUNK):
            _renew_chunk(ctx, renewals, indices[start:start + CHUNK], auto_uncordon, out)
    return out


def _pairs_in(connection: Connection, pairs: set[tuple[str, int | None]]
              ) -> tuple[ColumnElement[bool], dict[str, list[object]]]:
    """``(token_hash, fencing_token) IN pairs`` and its parameters: on PostgreSQL two
    arrays read back by ``unnest`` (services/row_sources.py: one statement text, cached,
    whatever the batch's size, instead of two placeholders per renewal rendered and
    adapted in Python every time, twice a statement); SQLite keeps the plain list."""
    ordered = sorted(pairs, key=lambda p: (p[0], p[1] or 0))
    if not row_sources.arrays(connection):
        return tuple_(NodeModel.token_hash, NodeModel.fencing_token).in_(ordered), {}
    source = row_sources.unnest("lease", [("hash", String), ("fencing", BigInteger)])
    clause = tuple_(NodeModel.token_hash, NodeModel.fencing_token).in_(
        select(source.c.hash, source.c.fencing))
    return clause, {"lease_hash": [h for h, _ in ordered],
                    "lease_fencing": [f for _, f in ordered]}


def _guard(pairs_in: ColumnElement[bool], now: datetime,
           auto_uncordon: bool) -> list[ColumnElement[bool]]:
    """The single renewal's guard, per row: its (token hash, fencing token) pair
    (``pairs_in``), the grant current (``Ready``, not lapsed) and, to renew without
    uncordoning, no cordon reason (else: uncordon, the full path)."""
    guard = [pairs_in,
             NodeModel.status == NodeStatus.READY.value, NodeModel.lease_expires_at > now]
    if auto_uncordon:
        guard.append(NodeModel.cordon_reason.is_(None))
    return guard


def _renew_chunk(ctx: ServiceContext, renewals: list[Renewal], indices: list[int],
                 auto_uncordon: bool, out: list[Outcome]) -> None:
    now = ctx.clock.now()
    ttl = lease_ttl.current(ctx)
    expires = min([now, *(r.received_at for i in indices
                          if (r := renewals[i]).received_at is not None)]
                  ) + timedelta(seconds=ttl)
    by_hash: dict[str, list[int]] = defaultdict(list)
    for i in indices:
        by_hash[hash_secret(renewals[i].token)].append(i)
    pairs = {(h, renewals[i].request.fencing_token) for h, ii in by_hash.items() for i in ii}
    held: list[tuple[str, int]] = []
    with ctx.db.engine.connect() as connection:
        pairs_in, params = _pairs_in(connection, pairs)
        guard = _guard(pairs_in, now, auto_uncordon)
        # A row another transaction holds (a scheduling pass claiming its node) is
        # skipped, not waited for: one statement locking many rows never waits in a cycle
        # with another (PostgreSQL; SQLite has one writer), nor behind a bind that holds
        # its node.
        free = select(NodeModel.id).where(*guard).with_for_update(skip_locked=True)
        statement = (update(NodeModel).where(NodeModel.id.in_(free.scalar_subquery()), *guard)
                     .values(lease_expires_at=expires, lease_renewed_at=now)
                     .returning(NodeModel.token_hash, NodeModel.fencing_token))
        if ctx.db.is_sqlite:
            with connection.begin():
                rows = connection.execute(statement).all()
        else:  # one statement: autocommit, a single round trip
            auto = connection.execution_options(isolation_level="AUTOCOMMIT")
            rows = auto.execute(statement, params).all()
            missed = pairs - {(h, f) for h, f in rows}
            if missed:  # of those not renewed, the rows skipped while their guard held
                missed_in, missed_params = _pairs_in(connection, missed)
                held = [(h, f) for h, f in auto.execute(  # (no lock: it never waits)
                    select(NodeModel.token_hash, NodeModel.fencing_token)
                    .where(*_guard(missed_in, now, auto_uncordon)), missed_params)]
    _answer(renewals, by_hash, rows, lambda f: LeaseResponse(
        fencing_token=f, lease_expires_at=expires, lease_ttl_seconds=ttl, new_grant=False),
        out)
    _answer(renewals, by_hash, held, lambda _: BUSY, out)


def _answer(renewals: list[Renewal], by_hash: dict[str, list[int]],
            rows: Iterable[tuple[str, int]], answer: Callable[[int], Outcome],
            out: list[Outcome]) -> None:
    """``answer(fencing token)`` for each renewal whose row came back: its token (the hash
    matched; compared as ``secret_matches`` does) and its fencing token."""
    for token_hash, fencing_token in rows:
        for i in by_hash.get(token_hash, []):
            renewal = renewals[i]
            if out[i] is None and renewal.request.fencing_token == fencing_token \
                    and secret_matches(renewal.token, token_hash):
                out[i] = answer(fencing_token)
