"""The node lease TTL a fleet gets: the configured one, longer for a large fleet.

An agent renews every TTL/3, so a fleet of N nodes sends 3N/TTL renewals a second: at
10,000 nodes and the 10 s default that is 3,000 a second, each an HTTP request through a
replica, whatever the batching of their statements does. As Nomad scales its heartbeat
TTL with the cluster (``max_heartbeats_per_second``), the TTL a renewal is granted here
is the configured one (``GPUCLOUD_LEASE_TTL``) or, for a fleet too large for it, the one
that keeps the fleet's renewals within ``RATE`` a second (``GPUCLOUD_LEASE_RATE``,
default 1,000: the issue's budget for 10,000 agents): ``max(ttl, 3 N / RATE)``, whole
seconds. Below ``RATE × TTL / 3`` Ready nodes (3,333 at the defaults) nothing changes.

Every answer that grants or renews a lease carries this TTL (``lease_ttl_seconds``) and
the agent adopts it (agent/connection.py), renewing at a third of it; each expiry is
written with the TTL it was granted with, so a node that dies is found ``Lost`` within its
own TTL (+ the leader's tick) as before, only a longer one. What waits a TTL on the
controllers' side (the fresh TTL after a leader change, its grace and catch-up, a clock
jump's rebase) uses the same figure.

N is the count of ``Ready`` nodes, read at most every ``RECOUNT_S`` per process and
database URL (one ``count(*)``, by whichever thread asks first when it is due; the others
use the last count meanwhile, and a failed count keeps the last one; the lease path's own
pool shares the request pool's count). ``cached`` never queries, for the event loop.

The long polls grow the same way. Each agent has one assignments poll out at all times,
and one that ends on an unchanged revision at its ``wait`` is sent again at once: N / wait
polls a second (10,000 agents polling 30 s each: 333 a second, ~3.4 ms of replica CPU
each, more than the renewals). How soon an agent sees a change does not depend on that
wait (a change wakes its poll), so a fleet past ``POLL_RATE × BASE_POLL_WAIT`` nodes
(``GPUCLOUD_POLL_RATE``, default 200 a second: 6,000 nodes) is asked to wait ``N /
POLL_RATE`` seconds, at most ``MAX_POLL_WAIT`` (the route's bound, within the proxies'
documented read timeouts: docs/replicas.md); every answer carries it
(``poll_wait_seconds``, None below that) and the agent polls with the longer of its own
wait and this one (agent/agent.py). From the cached count: no query.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from sqlalchemy import func, select

from gpucloud.core.models import DEFAULT_POLL_WAIT_SECONDS, MAX_POLL_WAIT_SECONDS
from gpucloud.core.phases import NodeStatus
from gpucloud.core.tunables import number_from_env
from gpucloud.db.models import NodeModel
from gpucloud.db.session import Database
from gpucloud.services.context import ServiceContext

#: The renewals a second the fleet may send at most (its TTL grows past that).
RATE = number_from_env("GPUCLOUD_LEASE_RATE", 1000.0, 1.0, 1_000_000.0)
#: Renewals per TTL an agent sends (agent/agent.py: every TTL/3).
RENEWALS_PER_TTL = 3
#: How often a process counts the Ready nodes again (s).
RECOUNT_S = 10.0
#: The long polls a second that end unchanged the fleet may send before its waits grow.
POLL_RATE = number_from_env("GPUCLOUD_POLL_RATE", 200.0, 1.0, 1_000_000.0)
#: The agent's own default wait: the server asks for a longer one only past it.
BASE_POLL_WAIT = DEFAULT_POLL_WAIT_SECONDS
#: The longest wait asked for: the route's bound.
MAX_POLL_WAIT = MAX_POLL_WAIT_SECONDS


def fleet_ttl(base: float, nodes: int, rate: float = RATE) -> float:
    """The TTL for ``nodes`` Ready nodes: ``base``, or longer (whole seconds) so that they
    renew at most ``rate`` times a second."""
    scaled = math.ceil(RENEWALS_PER_TTL * nodes / rate)
    return float(scaled) if scaled > base else base


def fleet_poll_wait(nodes: int, rate: float = POLL_RATE) -> float | None:
    """The long-poll wait (whole seconds, at most ``MAX_POLL_WAIT``) that keeps ``nodes``
    agents' polls within ``rate`` a second; None while ``BASE_POLL_WAIT`` already does."""
    scaled = math.ceil(nodes / rate)
    return min(float(scaled), MAX_POLL_WAIT) if scaled > BASE_POLL_WAIT else None


@dataclass
class _Count:
    nodes: int = 0
    #: when it was read (``time.monotonic``); None: never
    at: float | None = None
    counting: bool = False


#: per database URL (a handful per process: the server's, a test's)
_COUNTS: dict[str, _Count] = {}
_LOCK = threading.Lock()


def _count_of(db: Database) -> _Count:
    with _LOCK:
        found = _COUNTS.get(db.url)
        if found is None:
            found = _COUNTS[db.url] = _Count()
        return found


def current(ctx: ServiceContext) -> float:
    """The TTL to grant now (blocking: counts the Ready nodes when the count is due)."""
    count = _count_of(ctx.db)
    now = time.monotonic()
    with _LOCK:
        due = not count.counting and (count.at is None or now - count.at >= RECOUNT_S)
        if due:
            count.counting = True
    if due:
        try:
            with ctx.db.read() as session:
                nodes = int(session.scalar(select(func.count()).select_from(NodeModel).where(
                    NodeModel.status == NodeStatus.READY.value)) or 0)
            with _LOCK:
                count.nodes, count.at = nodes, time.monotonic()
        except Exception:  # noqa: BLE001 - the last count stands; the next call retries
            pass
        finally:
            with _LOCK:
                count.counting = False
    return fleet_ttl(ctx.settings.lease_ttl_seconds, count.nodes, RATE)


def cached(ctx: ServiceContext) -> float:
    """The TTL from the last count, without a query (the configured one before any)."""
    return fleet_ttl(ctx.settings.lease_ttl_seconds, _count_of(ctx.db).nodes, RATE)


def poll_wait(ctx: ServiceContext) -> float | None:
    """The long-poll wait to ask of the agents now (``fleet_poll_wait`` of the last
    count, without a query)."""
    return fleet_poll_wait(_count_of(ctx.db).nodes, POLL_RATE)


def forget(db: Database) -> None:
    """Drop ``db``'s count: the next ``current`` counts (tests that change the fleet)."""
    with _LOCK:
        _COUNTS.pop(db.url, None)
