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
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from gpucloud.core.trace import mark


class Wakeups:
    """Waiters per key, each an ``asyncio.Event`` set (thread-safely) by ``notify``."""

    def __init__(self) -> None:
        #: Also tells the other replicas (services/notify.py sets it on PostgreSQL).
        self.publisher: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = (
            defaultdict(set))

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
        """Wake every current listener of ``key``, here and (a hint) on other replicas;
        callable from any thread."""
        self.notify_local(key)
        publisher = self.publisher
        if publisher is not None:
            publisher(key)

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

#: Pod id -> the waiting reads of its log in this process (api/routers/pods.py).
LOGS = Wakeups()
