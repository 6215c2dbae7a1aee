"""The long polls' fallback, batched: one query per server process and period, not one
per waiting agent.

An assignment long poll waits on its node's wake-up (``wakeups.ASSIGNMENTS``), which a
change committed in this process sets at once and one committed on another replica sets
through its ``LISTEN/NOTIFY`` hint (services/notify.py). A hint can be lost (a restart,
PgBouncer in transaction mode), so every ``period`` seconds one thread reads the
``assignments_revision`` of every node with a waiting poll in a single ``SELECT … IN``
and wakes the nodes whose revision moved since it last looked; a node it sees for the
first time is woken too (its poll re-reads its own revision: one query), so that a change
between that poll's own read and the watcher's first look is never missed. With 10,000
agents long-polling this is a few queries per period instead of 10,000.

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
