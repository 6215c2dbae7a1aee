"""The server's time as the agent reckons it: what usage samples are stamped with.

The node's wall clock is not trusted. NTP may step it, or it may simply be wrong: a sample
stamped an hour ahead is refused by the server (``core.usage.MAX_FUTURE_SKEW_SECONDS``)
and an hour behind it falls out of the scheduler's load window. Every lease answer carries
the server's time of that renewal (``served_at``); paired with the monotonic clock around
the request it is an *anchor* of an ``AnchoredClock`` (core/clock.py: the anchor at the
middle of the round trip, uncertain by half of it; a renewal answered late by a busy
server does not drag the time back), and the server's time later is the anchor's plus the
monotonic time since. A step of the node's wall clock changes nothing, as it changes
nothing for the lease itself (agent/renewal.py). Before the first anchor: the wall clock.
A wall clock found more than ``core.clock.SKEW_REPORT_SECONDS`` off the server's is
logged (a warning: fix the node's time sync), and so is its return.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gpucloud.core.clock import AnchoredClock
from gpucloud.core.models import LeaseResponse


def served_at(lease: LeaseResponse) -> datetime:
    """The server's time of a renewal: its new expiry less the TTL (services/nodes.py and
    lease_batch.py count the expiry from when the renewal arrived, or was handled)."""
    expires = lease.lease_expires_at
    if expires.tzinfo is None:
        expires = expires.replace(tzinfo=UTC)
    return expires - timedelta(seconds=lease.lease_ttl_seconds)


class ServerClock(AnchoredClock):
    """Thread-safe: the lease thread anchors it, the usage thread reads it."""

    here, there, host = "this node", "the server", "the node"
    consequence = "usage is stamped with the server's time"
