"""Controller leases: one server replica at a time runs the controllers (docs/replicas.md).

A lease is a row of ``controller_leases``: its holder, when it expires and a fencing token
(the *epoch*), which moves on only when the holder changes. Three rules from the anchors:

- Time is the database's (``now()`` on PostgreSQL), never a replica's, so replicas with
  skewed clocks agree on when a lease lapsed. A test that drives a manual clock, and
  SQLite (one host), use the service clock instead.
- The lease is renewed on its own connection, outside the request pool, so a starved pool
  never makes the leader lose its lease (SkyPilot saw leaders flap that way).
- Every write the leader makes checks its epoch inside the same transaction
  (``Leader.fence``): on PostgreSQL the check takes a share lock on the lease row, so a
  follower's takeover waits until the old leader's write has committed or rolled back,
  and a write begun after a takeover is refused. Commands to agents are such writes (the
  assignments the agents long-poll), so a deposed leader cannot send any.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import (
    Engine,
    Select,
    bindparam,
    case,
    create_engine,
    func,
    insert,
    literal,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from gpucloud.core.clock import real_time
from gpucloud.db.models import ControllerLeaseModel, UTCDateTime
from gpucloud.services.context import ServiceContext

log = logging.getLogger(__name__)
LEASE = ControllerLeaseModel


class LeaderLostError(RuntimeError):
    """This replica's epoch is no longer the lease's: the write was rolled back."""


def new_holder() -> str:
    """A holder id naming the host and process (what an operator looks for) and unique."""
    return f"{socket.gethostname()[:30]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def uses_database_clock(ctx: ServiceContext) -> bool:
    """PostgreSQL's ``now()`` unless a test drives the service clock (or on SQLite)."""
    return not ctx.db.is_sqlite and real_time(ctx.clock)


def _now(ctx: ServiceContext, db_clock: bool) -> object:
    return func.now() if db_clock else literal(ctx.clock.now(), UTCDateTime)


_LEASES = ControllerLeaseModel.__table__


def fence_query(db_clock: bool, share_lock: bool) -> Select[tuple[int]]:
    """The fence's check, built once per leader: the lease row, if it is still this
    holder's in this epoch and unexpired (``now`` by the database's clock, else the bound
    ``now``). ``share_lock`` (PostgreSQL): hold the row share-locked to the end of the
    transaction, so a takeover waits for the fenced write."""
    now = func.now() if db_clock else bindparam("now", type_=UTCDateTime)
    query = select(_LEASES.c.token).where(
        _LEASES.c.name == bindparam("name"), _LEASES.c.holder == bindparam("holder"),
        _LEASES.c.token == bindparam("epoch"), _LEASES.c.expires_at > now)
    return query.with_for_update(read=True) if share_lock else query


def try_acquire(ctx: ServiceContext, engine: Engine, name: str, holder: str,
                ttl_seconds: float) -> int | None:
    """Take or renew lease ``name`` for ``holder`` in one statement; its epoch, or None
    while another replica holds it unexpired."""
    db_clock = uses_database_clock(ctx)
    now = _now(ctx, db_clock)
    ttl = timedelta(seconds=ttl_seconds)
    expires = func.now() + ttl if db_clock else literal(ctx.clock.now() + ttl, UTCDateTime)
    with engine.begin() as connection:
        token = connection.execute(
            update(LEASE)
            .where(LEASE.name == name, (LEASE.holder == holder) | (LEASE.expires_at <= now))
            .values(token=case((LEASE.holder == holder, LEASE.token), else_=LEASE.token + 1),
                    holder=holder, expires_at=expires)
            .returning(LEASE.token)
        ).scalar()
        if token is not None:
            return int(token)
        if connection.scalar(select(LEASE.name).where(LEASE.name == name)) is not None:
            return None
    try:
        with engine.begin() as connection:
            connection.execute(insert(LEASE).values(name=name, holder=holder, token=1,
                                                    expires_at=expires))
    except IntegrityError:
        return None
    return 1


def acquire(ctx: ServiceContext, name: str, holder: str, ttl_seconds: float) -> bool:
    """Whether ``holder`` now holds lease ``name`` (on the request pool: for tools)."""
    return try_acquire(ctx, ctx.db.engine, name, holder, ttl_seconds) is not None


def remaining_seconds(ctx: ServiceContext, engine: Engine, name: str) -> float | None:
    """Seconds until lease ``name`` lapses by the lease clock (None: no such lease)."""
    db_clock = uses_database_clock(ctx)
    with engine.connect() as connection:
        expires: datetime | None = connection.scalar(
            select(LEASE.expires_at).where(LEASE.name == name))
        if expires is None:
            return None
        now: datetime | None = (connection.scalar(select(func.now())) if db_clock
                                else ctx.clock.now())
    return None if now is None else (expires - now).total_seconds()


def release(ctx: ServiceContext, engine: Engine, name: str, holder: str) -> None:
    """Give the lease up at once (a clean shutdown): a follower need not wait a TTL."""
    with engine.begin() as connection:
        connection.execute(update(LEASE).where(LEASE.name == name, LEASE.holder == holder)
                           .values(expires_at=_now(ctx, uses_database_clock(ctx))))


def lease_engine(ctx: ServiceContext) -> Engine:
    """The lease's own connection: a pool of one, apart from the request pool (SQLite: a
    single host's file, the same engine)."""
    if ctx.db.is_sqlite:
        return ctx.db.engine
    return create_engine(ctx.db.url, pool_size=1, max_overflow=0, pool_pre_ping=True,
                         pool_timeout=5, connect_args={"connect_timeout": 5})


class Leader:
    """This replica's claim on one lease: renewed every TTL/3 (``renew``, by a thread in a
    server, inline in tests), and the fence every leader write runs (``fence``).

    ``on_epoch(token)`` is called when this replica starts a new epoch (it took the lease
    over); ``on_change()`` whenever it gains or loses leadership.
    """

    def __init__(self, ctx: ServiceContext, name: str, ttl_seconds: float,
                 holder: str | None = None,
                 on_epoch: Callable[[int], None] | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        self.ctx = ctx
        self.name = name
        self.ttl = ttl_seconds
        self.holder = holder or new_holder()
        self.engine = lease_engine(ctx)
        self.on_epoch = on_epoch
        self.on_change = on_change
        self._epoch: int | None = None
        self._renew_at: datetime | None = None
        self._valid_until: datetime | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: The fence's statement, one object for every check: compiled once (its cache
        #: key too), executed on the transaction's connection (no ORM step).
        self._db_clock = uses_database_clock(ctx)
        self._fence = fence_query(self._db_clock, share_lock=not ctx.db.is_sqlite)

    @property
    def epoch(self) -> int | None:
        """The epoch this replica leads in, or None; renews when half the TTL has run."""
        now = self.ctx.clock.now()
        with self._lock:
            if self._renew_at is not None and now < self._renew_at:
                return self._epoch
        return self.renew()

    def renew(self) -> int | None:
        """One attempt to take or renew the lease; the epoch held after it."""
        started = self.ctx.clock.now()
        with self._lock:
            try:
                token = try_acquire(self.ctx, self.engine, self.name, self.holder, self.ttl)
            except SQLAlchemyError as error:
                log.warning("lease %s: renewal failed: %s", self.name, error)
                if self._valid_until is not None and started < self._valid_until:
                    return self._epoch  # within the TTL granted last time: keep leading
                token = None
            previous, self._epoch = self._epoch, token
            if token is None:
                self._renew_at = self._valid_until = None
            else:
                self._renew_at = started + timedelta(seconds=self.ttl / 2)
                self._valid_until = started + timedelta(seconds=self.ttl)
        if token != previous:
            log.warning("lease %s: %s", self.name,
                        f"leading in epoch {token}" if token else "no longer the leader")
            if token is not None and self.on_epoch is not None:
                self.on_epoch(token)
            if self.on_change is not None:
                self.on_change()
        return token

    def fence(self, session: Session) -> None:
        """Refuse this transaction unless this replica still leads in its epoch (and, on
        PostgreSQL, hold the lease row share-locked until the transaction ends)."""
        epoch = self._epoch
        if epoch is None:
            raise LeaderLostError(f"not the holder of lease {self.name}")
        params: dict[str, object] = {"name": self.name, "holder": self.holder, "epoch": epoch}
        if not self._db_clock:
            params["now"] = self.ctx.clock.now()
        if session.connection().execute(self._fence, params).first() is None:
            with self._lock:
                if self._epoch == epoch:
                    self._epoch = self._renew_at = self._valid_until = None
            raise LeaderLostError(f"lease {self.name}: epoch {epoch} has ended")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"lease-{self.name}",
                                        daemon=True)
        self._thread.start()

    def stop(self, release_lease: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if release_lease and self._epoch is not None:
            try:
                release(self.ctx, self.engine, self.name, self.holder)
            except SQLAlchemyError as error:
                log.warning("lease %s: release failed: %s", self.name, error)
        if self.engine is not self.ctx.db.engine:
            self.engine.dispose()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.renew()
            self._stop.wait(self._pause())

    def _pause(self) -> float:
        """A leader renews every TTL/3; a follower retries just after the lease lapses."""
        if self._epoch is not None:
            return self.ttl / 3
        try:
            left = remaining_seconds(self.ctx, self.engine, self.name)
        except SQLAlchemyError:
            return 1.0
        if left is None:
            return 0.0
        return min(max(left + 0.05, 0.05), self.ttl / 3)
