"""The agent's side of the control-plane protocol: registration, the lease, and writes.

Every write (pod status, log chunk) carries the node's current fencing token. The token
changes only when the server makes a new grant (registration, a lapsed lease, or an
explicit re-acquire after a 409), and the server refuses writes with an older one, so an
agent that was cut off for longer than its lease cannot overwrite what happened since.

A server that cannot be reached, or answers 5xx or 429, is retried with back-off until the
agent stops: a restarting server costs the agent nothing but time. A refusal that says when
to come back (503 or 429 with ``Retry-After``: registrations beyond the server's capacity,
the database unavailable) is retried no sooner than that (agent/backoff.py: bounded, and
jittered upwards, so a fleet refused together does not come back together).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from gpucloud.agent.backoff import Backoff, stop_wait
from gpucloud.agent.identity import Identity, IdentityFile
from gpucloud.agent.server_time import ServerClock, served_at
from gpucloud.client.sdk import AgentClient, ApiError
from gpucloud.core.errors import (
    Conflict,
    GpucloudError,
    InvalidInput,
    NotFound,
    StaleFencingToken,
    Unauthorized,
)
from gpucloud.core.models import LeaseResponse, NodeRegisterRequest, NodeRegisterResponse

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_STALE_RETRIES = 3


class AgentStopped(Exception):
    """Raised out of a retry loop once the agent is asked to stop."""


class AgentFailure(GpucloudError):
    """The agent cannot go on (e.g. the join token is refused and no identity is saved)."""


def is_transient(error: GpucloudError) -> bool:
    """Whether retrying later may succeed: no answer, a server-side error, or too many
    requests (429: the server's limits, which say when to come back)."""
    return isinstance(error, ApiError) and (error.status in (0, 429) or error.status >= 500)


def retry_after(error: GpucloudError) -> float | None:
    """The server's ``Retry-After`` (seconds) on a refusal, None when it sent none."""
    return error.retry_after if isinstance(error, ApiError) else None


class Connection:
    """Holds the node token and fencing token; thread-safe."""

    def __init__(self, server: str, registration: NodeRegisterRequest, identity: IdentityFile,
                 stop: threading.Event, transport: httpx.BaseTransport | None = None,
                 on_registered: Callable[[NodeRegisterResponse], None] | None = None,
                 sleep: Callable[[threading.Event, float], bool] = stop_wait,
                 server_clock: ServerClock | None = None) -> None:
        self.server = server.rstrip("/")
        self._registration = registration
        #: Called with every registration response (the access server takes the gateway
        #: keys from it); not on a resume with the saved token, which gets no response.
        self._on_registered = on_registered
        self._identity = identity
        self._stop = stop
        #: How the retry loops wait (``Backoff``'s ``sleep``; tests record the delays).
        self._sleep = sleep
        self._bootstrap = AgentClient(self.server, None, transport=transport)
        self._client: AgentClient | None = None
        self._token = 0
        self._lock = threading.Lock()
        self.node_id: str | None = None
        self.lease_ttl_seconds = 10.0
        #: The server's time, anchored by every lease answer (what usage is stamped with).
        self.server_clock = server_clock if server_clock is not None else ServerClock()

    # -- state ---------------------------------------------------------------------------

    @property
    def fencing_token(self) -> int:
        with self._lock:
            return self._token

    @property
    def client(self) -> AgentClient:
        with self._lock:
            if self._client is None:
                raise AgentFailure("the agent is not registered yet")
            return self._client

    @property
    def lease_timeout(self) -> float:
        """How long a renewal may take: half the TTL. Longer than the server's worst
        answer (its lease statements are cut at 2 s, api/lease_capacity.py), so a slow
        server still renews; shorter than the lease, so a request lost on the way (a
        dead replica behind the balancer) is sent again while the lease still holds,
        not after 30 s, when the node is Lost already."""
        return self.lease_ttl_seconds / 2

    def renewal_period(self) -> float:
        """The time from one renewal's send to the next: a third of the TTL (the server's
        latest, which grows with the fleet: services/lease_ttl.py), less up to a tenth at
        random, so that a fleet that registered or came back together spreads out instead
        of renewing in lockstep; never later than TTL/3."""
        return self.lease_ttl_seconds / 3 * random.uniform(0.9, 1.0)

    def _adopt(self, client: AgentClient, token: int, ttl: float) -> None:
        with self._lock:
            old = self._client
            self._client, self._token = client, token
            self.lease_ttl_seconds = ttl
        if old is not None and old is not client:
            old.close()

    def _set_token(self, lease: LeaseResponse) -> None:
        with self._lock:
            changed = lease.fencing_token != self._token
            self._token = lease.fencing_token
            self.lease_ttl_seconds = lease.lease_ttl_seconds
        if changed:
            log.info("lease granted anew: fencing token %d", lease.fencing_token)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
        self._bootstrap.close()

    # -- registration --------------------------------------------------------------------

    def connect(self) -> None:
        """Register, or resume with the saved node token; retries until it works or stop
        (no sooner than a refusal's ``Retry-After``)."""
        backoff = Backoff(sleep=self._sleep)
        while True:
            try:
                self._connect_once()
                return
            except GpucloudError as error:
                if not is_transient(error):
                    raise
                log.warning("cannot register yet: %s", error.message)
                wait_at_least = retry_after(error)
            if backoff.wait(self._stop, wait_at_least):
                raise AgentStopped

    def _connect_once(self) -> None:
        """Registration first, so the server sees this start's inventory and labels; the
        saved identity when the join token is no longer accepted (they expire)."""
        name = self._registration.name
        try:
            response = self._bootstrap.register(self._registration)
        except Unauthorized as refused:
            saved = self._identity.load(self.server, name)
            if saved is None:
                raise AgentFailure(f"registration refused: {refused.message}") from None
            self._resume(saved)
            return
        self.node_id = response.node_id
        self._identity.save(Identity(self.server, response.node_id, name, response.node_token))
        if self._on_registered is not None:
            self._on_registered(response)
        client = self._bootstrap.with_token(response.node_token)
        self._adopt(client, response.fencing_token, response.lease_ttl_seconds)
        log.info("registered node %s (%s) with fencing token %d", name, response.node_id,
                 response.fencing_token)

    def _resume(self, saved: Identity) -> None:
        client = self._bootstrap.with_token(saved.node_token)
        try:
            lease = self._lease(client, None)
        except Unauthorized as refused:
            client.close()
            raise AgentFailure(
                f"the join token and the saved node token were both refused: {refused.message}"
            ) from None
        self.node_id = saved.node_id
        self._adopt(client, lease.fencing_token, lease.lease_ttl_seconds)
        log.info("resumed node %s with its saved token; fencing token %d", saved.name,
                 lease.fencing_token)

    # -- the lease -----------------------------------------------------------------------

    def renew(self, health: dict[str, Any] | None = None) -> None:
        """Renew the current grant; take a new one when ours is stale; re-register on 401.
        ``health`` rides along (gpu/health: the GPUs' health, a node-level fault)."""
        try:
            self._set_token(self._lease(self.client, self.fencing_token, health))
        except StaleFencingToken:
            self.reacquire()
        except Unauthorized:
            self.connect()

    def reacquire(self) -> None:
        """A new grant (fencing token + 1): what an agent does after it learns it is stale."""
        self._set_token(self._lease(self.client, None))

    def _lease(self, client: AgentClient, fencing_token: int | None,
               health: dict[str, Any] | None = None) -> LeaseResponse:
        """One lease request; its answer anchors ``server_clock``."""
        sent = self.server_clock.monotonic()
        lease = client.lease(fencing_token, health, timeout=self.lease_timeout)
        self.server_clock.observe(served_at(lease), sent, self.server_clock.monotonic())
        return lease

    # -- writes --------------------------------------------------------------------------

    def write(self, what: str, call: Callable[[AgentClient, int], T]) -> T | None:
        """``call(client, fencing_token)`` until it lands; None when refused for good.

        Transient failures are retried with back-off, no sooner than a refusal's
        ``Retry-After`` (AgentStopped ends that); a stale token is refreshed and the write
        retried a few times; a conflict (the pod moved on, or is not ours any more) or
        invalid input is logged and dropped.
        """
        backoff, stale = Backoff(sleep=self._sleep), 0
        while True:
            token = self.fencing_token
            wait_at_least: float | None = None
            try:
                return call(self.client, token)
            except StaleFencingToken as error:
                stale += 1
                if stale > MAX_STALE_RETRIES:
                    log.warning("%s refused: %s", what, error.message)
                    return None
                self._refresh_after_stale(token)
                continue
            except Unauthorized:
                self.connect()
                continue
            except (Conflict, NotFound, InvalidInput) as error:
                log.info("%s refused: %s", what, error.message)
                return None
            except ApiError as error:
                if not is_transient(error):
                    log.warning("%s failed: %s", what, error.message)
                    return None
                log.debug("%s: %s; retrying", what, error.message)
                wait_at_least = error.retry_after
            if backoff.wait(self._stop, wait_at_least):
                raise AgentStopped

    def _refresh_after_stale(self, used: int) -> None:
        """Take a new grant unless the lease thread already did since ``used`` was read."""
        if self.fencing_token != used:
            return
        try:
            self.reacquire()
        except ApiError as error:
            log.debug("re-acquiring the lease failed: %s", error.message)
