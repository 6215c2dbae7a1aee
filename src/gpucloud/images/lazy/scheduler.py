"""The node's fetch scheduler: on-demand reads first, background prefetch behind them.

Every chunk the lazyfs daemon fetches goes through one ``FetchScheduler`` (shared by all
layers of the node, so a pod's page faults in one layer pause the prefetch of every other
layer). A request is a set of chunks (``Item``: a key, a compressed extent of a blob) of one
``Source`` (a layer) at a ``Priority``:

* ``DEMAND``: a FUSE read is waiting for it. Up to ``workers`` demand fetches run at once.
* ``PRIORITY``: the layer's prioritized files (before ``.prefetch.landmark``): what the
  start is about to read (a recording of it). Fetched right after the mount, requests of
  at most ``prefetch_request`` bytes (``prefetch_workers`` at a time), never while a demand
  request is queued:
  a demand read always goes out next. It may be on the wire beside demand fetches (it is
  the start's own predicted reads: pausing it whenever a read is outstanding would turn a
  start that reads 900 small files into 900 sequential round trips).
* ``BULK``: the rest of the layer. Only while no demand is outstanding *and* demand reads
  have been quiet for ``bulk_quiet`` seconds (a starting program reads in bursts; the rest
  of the layer must not share the link or the CPU with them).

At most ``prefetch_workers`` prefetch fetches are on the wire at once (``BULK``: one, and
only when no other prefetch runs), each at most ``prefetch_request`` bytes, so a demand
read that arrives while they are on the wire shares the link with little. The daemon runs
two. A fetch is two steps (``Source.fetch_span``: the request; ``Source.decode_items``:
each chunk decompressed, hashed and cached) and frees its place on the wire after the
first: each place has two threads, so the next request goes out while the last one's
chunks are decoded (a 2 MiB request of small files took longer to decode than to
transfer, and the link idled meanwhile). Each chunk's future is resolved as soon as that
chunk is verified, not when its whole request is: a reader waiting for one small file of a
prefetch request reads it while the rest is decoded. Queued prefetch is preempted
outright: a demand read of a chunk queued for prefetch promotes it to ``DEMAND``, and
nothing of lower priority is dispatched while demand work exists. A chunk is fetched once
however many readers want it (single flight). Queued items of one source and priority that
are adjacent or nearby in the blob (``gap``) are merged into one Range request of at most
``max_request`` bytes.

A demand reader waits at most ``read_deadline`` seconds for its chunks, then gets
``ReadDeadlineExceeded`` (the FUSE layer answers ``EIO``): a hung fetch must not hang every
process that reads the file. The fetch itself goes on and fills the cache for later readers
(single flight is kept: the chunk stays in flight, shared); the reader that gave up has
had its answer, so a late result is never handed to it. Its chunks still queued that no
other reader waits for drop to ``BULK`` (no demand queue left behind to hold the prefetch
back forever). A batch a reader runs in its own thread is bounded by its ``Source``
(``RangeFetcher`` gives up at the same deadline).

The scheduling is a pure state machine (``take`` / ``finish``) driven by worker threads;
tests drive it by hand (``threads=False`` and ``run_one``) with an injectable clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol


class Priority(IntEnum):
    """Lower runs first."""

    DEMAND = 0
    PRIORITY = 1
    BULK = 2


@dataclass(frozen=True)
class Item:
    """One chunk to fetch: ``key`` (its digest) and its compressed extent ``[start, end)``."""

    key: str
    start: int
    end: int


Deliver = Callable[[str, bytes], None]
"""Called with (key, verified bytes) for each item of a fetch as soon as it is verified."""


class ReadDeadlineExceeded(TimeoutError):
    """A demand reader waited longer than the read deadline for its chunks (an ``OSError``:
    ``EIO`` to the reader, like any failed read)."""


class Source(Protocol):
    """Where items come from (a layer): fetches merged items in one request, then
    decodes them (two steps, so the request's place on the wire is freed in between)."""

    def fetch_span(self, items: list[Item], priority: Priority) -> bytes:
        """The compressed bytes ``[items[0].start, max end)`` in one request (raises when
        the fetch fails)."""
        ...

    def decode_items(self, items: list[Item], blob: bytes, deliver: Deliver) -> None:
        """Verify every item's bytes in ``blob`` (which begins at ``items[0].start``) and
        hand each to ``deliver`` as soon as it is verified; raise, after the others, when
        one is bad."""
        ...


@dataclass
class _Entry:
    item: Item
    source: Source
    priority: Priority
    future: Future[bytes] = field(default_factory=Future)
    running: bool = False
    readers: int = 0  # demand readers (``fetch``) waiting for it now


@dataclass
class Batch:
    """Items of one source fetched together (one Range request)."""

    source: Source
    priority: Priority
    entries: list[_Entry]

    @property
    def items(self) -> list[Item]:
        return [e.item for e in self.entries]

    @property
    def span(self) -> tuple[int, int]:
        return self.entries[0].item.start, max(e.item.end for e in self.entries)


MERGE_GAP = 128 << 10
MAX_REQUEST = 8 << 20
PREFETCH_REQUEST = 2 << 20
BULK_QUIET = 3.0
"""Seconds of no demand (and since the last mount) before the bulk prefetch may run. A cold
start has gaps with no page faults (bundle, runc, a program reading files the prioritized
prefetch already brought): at 1 s the bulk began inside those gaps and then shared the
node's CPU (decompress, hash, write) with the rest of the start."""


@dataclass
class SchedulerStats:
    batches: dict[str, int] = field(default_factory=lambda: {p.name: 0 for p in Priority})
    promoted: int = 0
    cancelled: int = 0


class FetchScheduler:
    """Priority queue of chunk fetches with bounded concurrency (see the module doc)."""

    def __init__(
        self,
        workers: int = 6,
        prefetch_workers: int = 1,
        *,
        gap: int = MERGE_GAP,
        max_request: int = MAX_REQUEST,
        prefetch_request: int = PREFETCH_REQUEST,
        bulk_quiet: float = BULK_QUIET,
        clock: Callable[[], float] = time.monotonic,
        threads: bool = True,
        read_deadline: float | None = None,
    ) -> None:
        """``workers`` demand fetches (run by the reading threads) and ``prefetch_workers``
        prefetch fetches (on twice as many threads: one decodes while the other is on the
        wire) at once; ``threads=False`` starts no thread (the caller runs ``run_one``).
        ``read_deadline``: seconds a demand reader waits for its chunks (None: no limit)."""
        self._workers = max(1, workers)
        self._prefetch_workers = prefetch_workers
        self._gap = gap
        self._max_request = max_request
        self._prefetch_request = prefetch_request
        self._bulk_quiet = bulk_quiet
        self._clock = clock
        self._read_deadline = read_deadline
        lock = threading.RLock()
        # Two conditions on one lock: the prefetch threads wait for work or a free place
        # on the wire (``_cond``); demand readers wait for their chunks or for demand work
        # they may run (``_done``), and are woken for every chunk verified, which would
        # wake every prefetch thread hundreds of times per request if they shared one.
        self._cond = threading.Condition(lock)
        self._done = threading.Condition(lock)
        self._entries: dict[tuple[int, str], _Entry] = {}
        self._queued: dict[Priority, list[_Entry]] = {p: [] for p in Priority}
        self._running = {p: 0 for p in Priority}
        self._last_demand = clock()
        self._closed = False
        self.stats = SchedulerStats()
        count = 2 * prefetch_workers if threads else 0
        self._threads = [threading.Thread(target=self._work, daemon=True,
                                          name=f"lazy-fetch-{n}") for n in range(count)]
        for thread in self._threads:
            thread.start()

    # -- requests ------------------------------------------------------------------------

    def submit(self, source: Source, items: Iterable[Item], priority: Priority
               ) -> list[Future[bytes]]:
        """Futures of the items' bytes. An item already queued or running is shared; one
        queued at a lower priority is raised to ``priority``."""
        with self._cond:
            return [entry.future for entry in self._submit_locked(source, items, priority)]

    def _submit_locked(self, source: Source, items: Iterable[Item], priority: Priority
                       ) -> list[_Entry]:
        if self._closed:
            raise RuntimeError("the fetch scheduler is closed")
        entries = []
        for item in items:
            key = (id(source), item.key)
            entry = self._entries.get(key)
            if entry is None:
                entry = _Entry(item, source, priority)
                self._entries[key] = entry
                self._queued[priority].append(entry)
            elif not entry.running and priority < entry.priority:
                self._requeue(entry, priority)
                self.stats.promoted += 1
            entries.append(entry)
        if priority is Priority.DEMAND:
            self._last_demand = self._clock()
            self._done.notify_all()
        self._cond.notify_all()
        return entries

    def _requeue(self, entry: _Entry, priority: Priority) -> None:
        """Move a queued (not running) entry to ``priority``'s queue."""
        self._queued[entry.priority].remove(entry)
        entry.priority = priority
        self._queued[priority].append(entry)

    def fetch(self, source: Source, items: list[Item], priority: Priority) -> dict[str, bytes]:
        """Submit and wait: the items' bytes by key (the first failure is raised).

        A ``DEMAND`` caller runs demand batches itself (its own, or any queued one while it
        waits) instead of handing them to a worker thread: a FUSE read is then one thread
        from request to reply, with no wake-up of another thread on the way (each such
        hand-over can cost a GIL switch interval). It waits at most ``read_deadline``
        (``ReadDeadlineExceeded``; see the module doc)."""
        if priority is not Priority.DEMAND:
            futures = self.submit(source, items, priority)
            return {item.key: future.result() for item, future in zip(items, futures, strict=True)}
        with self._cond:
            entries = self._submit_locked(source, items, priority)
            for entry in entries:
                entry.readers += 1
        try:
            self._help_until_done([e.future for e in entries], self._give_up_at())
        finally:
            self._leave(entries)
        return {e.item.key: e.future.result() for e in entries}

    def _give_up_at(self) -> float | None:
        """When a demand read that starts now stops waiting (None: never)."""
        return None if self._read_deadline is None else self._clock() + self._read_deadline

    def _help_until_done(self, futures: list[Future[bytes]],
                         give_up_at: float | None = None) -> None:
        """Run queued demand batches (while there is time left) or wait, until every one
        of ``futures`` is done; ``ReadDeadlineExceeded`` at ``give_up_at``."""
        while True:
            with self._cond:
                batch = None
                while not all(f.done() for f in futures):
                    left = None if give_up_at is None else give_up_at - self._clock()
                    if left is not None and left <= 0:
                        raise ReadDeadlineExceeded(
                            f"no chunk data within the read deadline of {self._read_deadline} s")
                    if self._queued[Priority.DEMAND] and \
                            self._running[Priority.DEMAND] < self._workers:
                        batch = self._batch(Priority.DEMAND, self._max_request)
                        break
                    if self._closed:
                        return
                    self._done.wait(left)
                if batch is None:
                    return
            self._run(batch)

    def _leave(self, entries: list[_Entry]) -> None:
        """A demand reader stops waiting for ``entries`` (done, failed or out of time).
        Those still queued that no other reader waits for drop to ``BULK``: fetched in the
        background later (into the cache), and no longer holding every prefetch back as
        queued demand nobody runs (demand batches are run by their readers)."""
        with self._cond:
            dropped = False
            for entry in entries:
                entry.readers -= 1
                if entry.readers == 0 and not entry.running and not entry.future.done() \
                        and entry.priority is Priority.DEMAND \
                        and self._entries.get((id(entry.source), entry.item.key)) is entry:
                    self._requeue(entry, Priority.BULK)
                    dropped = True
            if dropped:  # not on every read: it wakes every prefetch thread
                self._cond.notify_all()

    def cancel(self, source: Source, below: Priority = Priority.DEMAND) -> int:
        """Drop the queued (not running) items of ``source`` with a priority lower than
        ``below`` (default: all prefetch); their futures are cancelled. Returns how many."""
        dropped = 0
        with self._cond:
            for priority in Priority:
                if priority <= below:
                    continue
                keep = []
                for entry in self._queued[priority]:
                    if entry.source is source:
                        del self._entries[(id(source), entry.item.key)]
                        entry.future.cancel()
                        dropped += 1
                    else:
                        keep.append(entry)
                self._queued[priority] = keep
            self.stats.cancelled += dropped
        return dropped

    def close(self) -> None:
        """Stop the workers; queued work is cancelled."""
        with self._cond:
            self._closed = True
            for queue in self._queued.values():
                for entry in queue:
                    entry.future.cancel()
                queue.clear()
            self._entries.clear()
            self._cond.notify_all()
            self._done.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)

    def touch(self) -> None:
        """Count now as demand activity (a layer is being mounted: a start is under way,
        its reads are about to come), so the bulk prefetch waits ``bulk_quiet`` more."""
        with self._cond:
            self._last_demand = max(self._last_demand, self._clock())
            self._cond.notify_all()

    def demand_outstanding(self) -> bool:
        with self._cond:
            return bool(self._queued[Priority.DEMAND] or self._running[Priority.DEMAND])

    # -- the state machine -------------------------------------------------------------

    def take(self) -> Batch | None:
        """The next batch to run (marked running), or None when nothing may run now."""
        with self._cond:
            return self._take_locked()

    def finish(self, batch: Batch, got: dict[str, bytes] | None,
               error: BaseException | None = None) -> None:
        """The batch is off the wire: resolve its futures with ``got`` (missing keys fail
        with ``error``)."""
        self._off_wire(batch)
        self._settle(batch.entries, got or {}, error)

    def _off_wire(self, batch: Batch) -> None:
        """The batch's request is done: its place on the wire is free."""
        with self._cond:
            self._running[batch.priority] -= 1
            if batch.priority is Priority.DEMAND:
                self._last_demand = self._clock()
                self._done.notify_all()
            self._cond.notify_all()

    def _settle(self, entries: Iterable[_Entry], got: dict[str, bytes],
                error: BaseException | None) -> None:
        """Resolve ``entries`` (with ``got``, else ``error``) and wake the demand readers.
        Under the lock, so a reader woken here finds its future done (resolved after the
        wake-up, a reader could go back to waiting for a notification that never came)."""
        with self._cond:
            for entry in entries:
                key = (id(entry.source), entry.item.key)
                if self._entries.get(key) is entry:
                    del self._entries[key]
                if entry.future.done():
                    continue
                data = got.get(entry.item.key)
                if data is not None:
                    entry.future.set_result(data)
                else:
                    entry.future.set_exception(error or RuntimeError(
                        f"chunk {entry.item.key} missing from its fetch"))
            self._done.notify_all()

    def run_one(self) -> bool:
        """Take one batch and run it in this thread; False when none may run now."""
        batch = self.take()
        if batch is None:
            return False
        self._run(batch)
        return True

    def _run(self, batch: Batch) -> None:
        """Fetch, free the place on the wire, decode: each chunk resolved when verified."""
        try:
            blob = batch.source.fetch_span(batch.items, batch.priority)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            self.finish(batch, None, exc)
            return
        self._off_wire(batch)
        pending = {entry.item.key: entry for entry in batch.entries}

        def deliver(key: str, data: bytes) -> None:
            entry = pending.pop(key, None)
            if entry is not None:
                self._settle([entry], {key: data}, None)

        error: BaseException | None = None
        try:
            batch.source.decode_items(batch.items, blob, deliver)
        except BaseException as exc:  # noqa: BLE001 - handed to the chunks' waiters
            error = exc
        if pending:
            self._settle(pending.values(), {}, error)

    def _take_locked(self, prefetch_only: bool = False) -> Batch | None:
        """``prefetch_only``: for the worker threads (demand is run by its callers, see
        ``fetch``); queued demand still holds the prefetch back."""
        demand = self._queued[Priority.DEMAND]
        if demand:
            if prefetch_only:
                return None
            if self._running[Priority.DEMAND] >= self._workers:
                return None
            return self._batch(Priority.DEMAND, self._max_request)
        prefetching = self._running[Priority.PRIORITY] + self._running[Priority.BULK]
        if prefetching >= self._prefetch_workers:
            return None
        if self._queued[Priority.PRIORITY]:
            return self._batch(Priority.PRIORITY, self._prefetch_request)
        if self._running[Priority.DEMAND]:
            return None  # the bulk waits while a demand fetch is on the wire
        if self._queued[Priority.BULK] and not prefetching and self.bulk_wait() <= 0:
            return self._batch(Priority.BULK, self._prefetch_request)  # one at a time
        return None

    def bulk_wait(self) -> float:
        """Seconds until bulk prefetch may run (demand quiet long enough); 0: now."""
        return max(0.0, self._last_demand + self._bulk_quiet - self._clock())

    def _batch(self, priority: Priority, limit: int) -> Batch:
        """The queue's first entry (lowest offset of the first source) and the entries of
        the same source that extend it within ``gap``, up to ``limit`` bytes."""
        queue = self._queued[priority]
        first = min(queue, key=lambda e: e.item.start) if priority is Priority.DEMAND \
            else queue[0]
        source = first.source
        mine = sorted((e for e in queue if e.source is source), key=lambda e: e.item.start)
        start_at = mine.index(first)
        taken = [first]
        end = first.item.end
        for entry in mine[start_at + 1:]:
            if entry.item.start - end > self._gap or \
                    max(end, entry.item.end) - first.item.start > limit:
                break
            taken.append(entry)
            end = max(end, entry.item.end)
        chosen = {id(e) for e in taken}
        self._queued[priority] = [e for e in queue if id(e) not in chosen]
        for entry in taken:
            entry.running = True
        self._running[priority] += 1
        self.stats.batches[priority.name] += 1
        return Batch(source, priority, taken)

    def _work(self) -> None:
        while True:
            with self._cond:
                batch = None
                while not self._closed:
                    batch = self._take_locked(prefetch_only=True)
                    if batch is not None:
                        break
                    wait = None
                    if self._queued[Priority.BULK] and not self._queued[Priority.DEMAND]:
                        wait = self.bulk_wait() or None
                    self._cond.wait(wait)
                if batch is None:
                    return
            self._run(batch)


def wait_all(futures: Iterable[Future[bytes]]) -> None:
    """Wait for every future; cancelled ones are ignored (their source was unmounted)."""
    for future in futures:
        try:
            future.result()
        except CancelledError:
            continue
