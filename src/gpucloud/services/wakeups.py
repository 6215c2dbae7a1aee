"""In-process wake-ups for long polls: an agent's assignment poll returns as soon as a
transaction in this process that changed its node's assignments commits, and a waiting
read of a pod's log (``GET /v1/pods/{id}/logs?wait=``) as soon as a chunk of it is stored.

The durable signal stays the node's ``assignments_revision`` column, which the long poll
still re-reads every few seconds (``api/routers/agent.POLL_SECONDS``) as the fallback. A
change committed on another server replica arrives here too, as a hint: ``notify`` also
publishes it, and that replica's ``LISTEN/NOTIFY`` bridge (services/notify.py) calls
``notify_local``. Keys are node ids (``ASSIGNMENTS``) and pod ids (``LOGS``); a log
reader's durable signal is the stored log itself, re-read every
``Settings.log_wait_recheck_seconds``.

``LOGS`` publishes only what another replica waits on: most chunks of most pods' logs
have no reader, and each NOTIFY is a commit of its own (a WAL flush, under PostgreSQL's
global notify lock) that every replica then receives. A replica with a waiting read
``follow``s the pod, which tells the others (``announcer``, at most every
``ANNOUNCE_SECONDS`` a pod); they remember it for ``INTEREST_SECONDS``
(``followed_elsewhere``) and publish that pod's chunks until then. A chunk stored before
the others heard of a fresh follow is not published: the reader re-reads once
``ANNOUNCED_WITHIN`` after announcing (api/routers/pods.py), and a lost announcement
costs only latency, as a lost hint does (the re-read every recheck).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from gpucloud.core.trace import mark

#: A replica re-announces a key it waits on at most this often; the others remember an
#: announcement this long: past the longest wait (api/routers/pods.MAX_LOG_WAIT_SECONDS,
#: 30 s) begun just before a re-announcement was due, with room to spare.
ANNOUNCE_SECONDS = 30.0
INTEREST_SECONDS = 120.0
#: How soon after a fresh announcement the others have it in practice (publisher and
#: listener threads, one NOTIFY): a waiting read re-reads then, once.
ANNOUNCED_WITHIN = 0.25
#: The remembered keys are pruned of expired ones when they grow past this (and twice the
#: size after the last prune).
PRUNE_AT = 1024


class Wakeups:
    """Waiters per key, each an ``asyncio.Event`` set (thread-safely) by ``notify``.

    ``followed_only``: publish a key only while another replica follows it (``LOGS``)."""

    def __init__(self, followed_only: bool = False,
                 now: Callable[[], float] = time.monotonic) -> None:
        #: Also tells the other replicas (services/notify.py sets it on PostgreSQL).
        self.publisher: Callable[[str], None] | None = None
        #: Tells the other replicas that this one waits on a key (``followed_only``).
        self.announcer: Callable[[str], None] | None = None
        self._followed_only = followed_only
        self._now = now
        self._lock = threading.Lock()
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = (
            defaultdict(set))
        self._announced: dict[str, float] = {}  # key -> when this replica last told
        self._followed: dict[str, float] = {}  # key -> until when another one waits on it
        self._prune_at = {"announced": PRUNE_AT, "followed": PRUNE_AT}

    @contextmanager
    def listen(self, key: str) -> Iterator[asyncio.Event]:
        """An event set by the next ``notify(key)``. Listen *before* reading the state it
        announces, so that a change between the read and the wait is not missed."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters[key].add(waiter)
        try:
            yield waiter[1]
        finally:
            with self._lock:
                waiters = self._waiters.get(key)
                if waiters is not None:
                    waiters.discard(waiter)
                    if not waiters:
                        del self._waiters[key]

    def notify(self, key: str) -> None:
        """Wake every current listener of ``key``, here and (a hint) on other replicas
        (``followed_only``: those that follow it); callable from any thread."""
        self.notify_local(key)
        publisher = self.publisher
        if publisher is not None and (not self._followed_only or self.followed(key)):
            publisher(key)

    def follow(self, key: str) -> bool:
        """A waiter here on ``key``: tell the other replicas, unless told in the last
        ``ANNOUNCE_SECONDS``. Whether it told them now (the waiter re-reads
        ``ANNOUNCED_WITHIN`` later: what was stored meanwhile may be unannounced)."""
        announcer = self.announcer
        if announcer is None:
            return False
        now = self._now()
        with self._lock:
            told = self._announced.get(key)
            if told is not None and now - told < ANNOUNCE_SECONDS:
                return False
            self._announced[key] = now
            self._prune("announced", self._announced, now - ANNOUNCE_SECONDS)
        announcer(key)
        return True

    def followed_elsewhere(self, key: str) -> None:
        """Another replica waits on ``key`` (its announcement): publish it a while."""
        now = self._now()
        with self._lock:
            self._followed[key] = now + INTEREST_SECONDS
            self._prune("followed", self._followed, now)

    def followed(self, key: str) -> bool:
        """Whether another replica announced a waiter on ``key`` recently."""
        with self._lock:
            until = self._followed.get(key)
        return until is not None and until > self._now()

    def announce_again(self) -> None:
        """A replica (re)joined, knowing none of our waiters: tell it at the next follow."""
        with self._lock:
            self._announced.clear()

    def _prune(self, which: str, entries: dict[str, float], stale: float) -> None:
        """Drop the entries at or before ``stale`` once ``entries`` outgrew its bound."""
        if len(entries) < self._prune_at[which]:
            return
        for key in [key for key, at in entries.items() if at <= stale]:
            del entries[key]
        self._prune_at[which] = max(PRUNE_AT, 2 * len(entries))

    def notify_local(self, key: str) -> None:
        """Wake the listeners of ``key`` in this process only."""
        with self._lock:
            waiters = list(self._waiters.get(key, ()))
        mark("wakeups.notify", key=key, listeners=len(waiters))
        for loop, woken in waiters:
            with suppress(RuntimeError):  # the listener's loop has closed: nothing to wake
                loop.call_soon_threadsafe(woken.set)

    def keys(self) -> list[str]:
        """The keys someone listens on now."""
        with self._lock:
            return list(self._waiters)

    def listeners(self, key: str) -> int:
        with self._lock:
            return len(self._waiters.get(key, ()))


async def wait(woken: asyncio.Event, timeout: float) -> bool:
    """Whether ``woken`` was set within ``timeout`` seconds."""
    with suppress(TimeoutError):
        await asyncio.wait_for(woken.wait(), timeout)
        return True
    return False


#: Node id -> the agent's assignment long polls in this process.
ASSIGNMENTS = Wakeups()

#: Pod id -> the waiting reads of its log in this process (api/routers/pods.py);
#: published only while another replica follows the pod.
LOGS = Wakeups(followed_only=True)
