"""Capacity appeared: a node registered or was granted a lease again, uncordoned, undrained,
its MIG policy or GPUs changed, a pod ended. Unschedulable pods and queued jobs (kept out
of the passes for ``scheduling.UNSCHEDULABLE_RETRY_SECONDS``) are then looked at again.

Each of those used to clear the pods' and jobs' back-off itself, two UPDATEs inside its
own transaction: 40 % of a registration's replica CPU at fleet scale, and every
registration of a fleet booting together took the same pods' row locks in turn. Now the
change only marks ``CAPACITY`` once it commits; the next scheduling pass takes the mark
and clears the back-off once (``scheduling.retry_marked``), however many changes came
since the last pass. A change committed on another replica marks this one too, as a
hint (``publisher``, services/notify.py); a lost hint costs only latency: the back-off
ends by itself. A process starts marked: what it may have missed before it listened.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class CapacitySignal:
    """A flag set by any thread, taken (read and cleared at once) by the scheduler."""

    def __init__(self) -> None:
        #: Also tells the other replicas (services/notify.py sets it on PostgreSQL).
        self.publisher: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._marked = True

    def mark(self) -> None:
        """Capacity appeared (committed): here, and as a hint on the other replicas."""
        self.mark_local()
        publisher = self.publisher
        if publisher is not None:
            publisher()

    def mark_local(self) -> None:
        with self._lock:
            self._marked = True

    def take(self) -> bool:
        """Whether capacity appeared since the last ``take``; clears the mark."""
        with self._lock:
            marked, self._marked = self._marked, False
        return marked


CAPACITY = CapacitySignal()
