"""Wake-ups across server replicas: PostgreSQL ``LISTEN/NOTIFY`` as a hint only.

Every replica keeps one connection of its own that LISTENs on ``gpucloud``; a change
committed on one replica (a node's assignments, a revoked key, a node's replaced token,
a serverless request queued or finished, capacity that appeared, a chunk stored of a
pod's log that another replica follows) is published after commit from a queue by one
thread on another connection of its own, batched, never on the request or heartbeat path
(NOTIFY takes a global lock at commit). A receiver wakes the
long polls of that node (``wakeups.ASSIGNMENTS``) or the waiting reads of that pod's log
(``wakeups.LOGS``), clears its cache (``ctx.cache``), or forgets one entry of it (a
re-registered node's old token: the fleet's other cached tokens stay, so a registration
storm does not make every agent's next request a miss).

It is a hint: the long poll still re-reads the revision every ``POLL_SECONDS`` and the
cache entries expire after ``auth_cache_ttl_seconds``, so a lost notification (a
restart, PgBouncer in transaction mode, which breaks LISTEN) only costs latency.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading

import psycopg
from psycopg.conninfo import make_conninfo

from gpucloud.db.session import libpq_params
from gpucloud.services import capacity, serverless_queue, wakeups
from gpucloud.services.context import TtlCache

log = logging.getLogger(__name__)
CHANNEL = "gpucloud"
ASSIGNMENTS = "a:"
CACHE = "c:"
#: One cache key to forget (``TtlCache.forget``): ``k:node:<token hash>``.
CACHE_KEY = "k:"
#: Serverless queue wake-ups (a request queued, finished or stopped; its keys are
#: ``serverless_queue.WAKEUPS``'s): a runsync or job-take long poll held by another
#: replica answers at once instead of on its next re-check.
SERVERLESS = "s:"
#: A pod's log grew (``wakeups.LOGS``, keyed by pod id): a waiting log read held by
#: another replica answers at once instead of on its next re-check. Sent only for a pod
#: that another replica follows:
LOGS = "l:"
#: ``f:<origin>:<pod id>``: replica ``origin`` waits on the pod's log (``wakeups.LOGS
#: .follow``); the others publish its chunks for a while.
FOLLOW = "f:"
#: ``u:<origin>``: capacity appeared on replica ``origin`` (services/capacity.py): the
#: leader's next pass looks at unschedulable pods again. Its own mark is not news to the
#: replica that sent it: coming back after its pass took the mark, it would cost an
#: extra retry of every unschedulable pod.
CAPACITY = "u:"
#: ``h:<origin>``: a replica began listening, and knows no one's follows: the others
#: announce theirs again at their next follow.
HELLO = "h:"
#: A notification's payload is at most 8000 bytes: a batch holds at most this many
#: keys, and at most PAYLOAD_BYTES of them (a forgotten cache key is 71 bytes).
BATCH = 200
PAYLOAD_BYTES = 7900


def _dsn(url: str) -> str:
    """The engine's ``url`` as a libpq conninfo (``libpq_params``): a multi-host URL,
    rendered back as a URI instead, would have libpq read its last host alone, that host's
    port as part of its name."""
    return make_conninfo("", **libpq_params(url))


class NotifyBridge:
    """One replica's publisher and listener (PostgreSQL only)."""

    def __init__(self, url: str, cache: TtlCache) -> None:
        self.dsn = _dsn(url)
        self.cache = cache
        #: This replica, in its FOLLOW and HELLO items (its own are not news to it).
        self.origin = secrets.token_hex(4)
        self._outbox: queue.Queue[str | None] = queue.Queue()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._listen, name="notify-listen",
                                          daemon=True),
                         threading.Thread(target=self._publish, name="notify-publish",
                                          daemon=True)]

    def start(self) -> None:
        wakeups.ASSIGNMENTS.publisher = lambda key: self._outbox.put(ASSIGNMENTS + key)
        wakeups.LOGS.publisher = lambda key: self._outbox.put(LOGS + key)
        wakeups.LOGS.announcer = lambda key: self._outbox.put(
            f"{FOLLOW}{self.origin}:{key}")
        serverless_queue.WAKEUPS.publisher = lambda key: self._outbox.put(SERVERLESS + key)
        capacity.CAPACITY.publisher = lambda: self._outbox.put(CAPACITY + self.origin)
        self.cache.publisher = lambda: self._outbox.put(CACHE)
        self.cache.key_publisher = lambda key: self._outbox.put(CACHE_KEY + key)
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        wakeups.ASSIGNMENTS.publisher = None
        wakeups.LOGS.publisher = None
        wakeups.LOGS.announcer = None
        serverless_queue.WAKEUPS.publisher = None
        capacity.CAPACITY.publisher = None
        self.cache.publisher = None
        self.cache.key_publisher = None
        self._stop.set()
        self._outbox.put(None)
        self._wake_listener()
        for thread in self._threads:
            thread.join(timeout=5)

    def _wake_listener(self) -> None:
        """End the listener's wait for notifications now rather than at its next timeout
        (up to a second of every shutdown): an empty notification, which every listener
        reads as no keys."""
        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=1) as conn:
                conn.execute("SELECT pg_notify(%s, '')", (CHANNEL,))
        except psycopg.Error:
            pass  # the database is away: the listener ends at its timeout

    def _publish(self) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
                    self._drain(conn)
            except psycopg.Error as error:
                log.warning("notify: publishing failed, retrying: %s", error)
                self._stop.wait(1.0)

    def _drain(self, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        carried: str | None = None  # the key that did not fit in the last payload
        while not self._stop.is_set():
            first = carried if carried is not None else self._outbox.get()
            carried = None
            if first is None:
                return
            batch, size = {first}, len(first)
            while len(batch) < BATCH:
                try:
                    item = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if item is None or item in batch:
                    continue
                if size + 1 + len(item) > PAYLOAD_BYTES:
                    carried = item
                    break
                batch.add(item)
                size += 1 + len(item)
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, " ".join(sorted(batch))))

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.cache.clear_local()  # what was missed while not listening
                    self._outbox.put(HELLO + self.origin)  # and the others' follows
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            if self._stop.is_set():  # woken by stop(): not a second more
                                break
                            self._receive(note.payload)
            except psycopg.Error as error:
                log.warning("notify: listening failed, reconnecting: %s", error)
                self._stop.wait(1.0)

    def _receive(self, payload: str) -> None:
        for item in payload.split():
            if item == CACHE:
                self.cache.clear_local()
            elif item.startswith(CAPACITY):
                if item[len(CAPACITY):] != self.origin:
                    capacity.CAPACITY.mark_local()
            elif item.startswith(CACHE_KEY):
                self.cache.forget_local(item[len(CACHE_KEY):])
            elif item.startswith(ASSIGNMENTS):
                wakeups.ASSIGNMENTS.notify_local(item[len(ASSIGNMENTS):])
            elif item.startswith(LOGS):
                wakeups.LOGS.notify_local(item[len(LOGS):])
            elif item.startswith(FOLLOW):
                origin, _, key = item[len(FOLLOW):].partition(":")
                if origin != self.origin and key:
                    wakeups.LOGS.followed_elsewhere(key)
            elif item.startswith(HELLO):
                if item[len(HELLO):] != self.origin:
                    wakeups.LOGS.announce_again()
            elif item.startswith(SERVERLESS):
                serverless_queue.WAKEUPS.notify_local(item[len(SERVERLESS):])
