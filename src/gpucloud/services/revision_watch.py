"""The long polls' fallback, batched: one query per server process and period, not one
per waiting agent.

An assignment long poll waits on its node's wake-up (``wakeups.ASSIGNMENTS``), which a
change committed in this process sets at once and one committed on another replica sets
through its ``LISTEN/NOTIFY`` hint (services/notify.py). A hint can be lost (a restart,
PgBouncer in transaction mode), so every ``period`` seconds one thread reads the
``assignments_revision`` of every node with a waiting poll in a single ``SELECT … IN``
and wakes the nodes whose revision moved since it last looked. Each poll, listening
already, tells the watcher the revision it read (``saw``), so a change between that read
and the watcher's next look is seen as a move and wakes it; a node it knows nothing of
(a poll that did not say) is woken too (its poll re-reads its own revision: one query).
Before ``saw``, every node was new to the watcher once per replica, and its woken poll
built its full answer for nothing: a booting fleet's every node, 10,000 builds. With
10,000 agents long-polling this is a few queries per period instead of 10,000.

The thread starts with the first long poll and ends once no poll has waited for a while.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy import select

from gpucloud.db.models import NodeModel
from gpucloud.services import wakeups
from gpucloud.services.context import ServiceContext

log = logging.getLogger(__name__)
#: Node ids per ``IN (…)`` query.
CHUNK = 1000
#: Periods without a waiting poll after which the thread ends.
IDLE_PERIODS = 5


class RevisionWatcher:
    """Wakes the long polls of nodes whose revision changed (see the module docstring)."""

    def __init__(self, ctx: ServiceContext, period: Callable[[], float]) -> None:
        self.ctx = ctx
        self.period = period
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def ensure_running(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="revision-watch",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        idle = 0
        stop = threading.Event()
        while idle < IDLE_PERIODS:
            stop.wait(self.period())
            waiting = wakeups.ASSIGNMENTS.keys()
            idle = 0 if waiting else idle + 1
            if not waiting:
                continue
            try:
                self.check(waiting)
            except Exception as error:  # noqa: BLE001 - the database is down: next period
                log.debug("revision watch failed: %s", error)

    def saw(self, node_id: str, revision: int) -> None:
        """A poll of ``node_id``, listening for its wake-up, read ``revision``: the
        watcher wakes it if its next look finds another (never later than it would
        have). An older value than the watcher's own only costs an extra wake-up."""
        self._seen[node_id] = revision

    def check(self, node_ids: list[str]) -> list[str]:
        """Read the revisions of ``node_ids``; wake (and return) those that moved or are
        new to the watcher."""
        moved = []
        for start in range(0, len(node_ids), CHUNK):
            chunk = node_ids[start:start + CHUNK]
            with self.ctx.db.read() as session:
                rows = session.execute(
                    select(NodeModel.id, NodeModel.assignments_revision)
                    .where(NodeModel.id.in_(chunk))).all()
            for node_id, revision in rows:
                if self._seen.get(node_id) != revision:
                    self._seen[node_id] = revision
                    moved.append(node_id)
        for node_id in moved:
            wakeups.ASSIGNMENTS.notify_local(node_id)
        return moved


_WATCHERS: dict[int, RevisionWatcher] = {}
_WATCHERS_LOCK = threading.Lock()


def watcher(ctx: ServiceContext, period: Callable[[], float]) -> RevisionWatcher:
    """The running watcher of ``ctx``'s database (one per service context)."""
    with _WATCHERS_LOCK:
        found = _WATCHERS.get(id(ctx))
        if found is None or found.ctx is not ctx:
            found = _WATCHERS[id(ctx)] = RevisionWatcher(ctx, period)
    found.ensure_running()
    return found
