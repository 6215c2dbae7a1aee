"""``FetchScheduler``: demand before prefetch, promotion, cancellation, range merging,
the read deadline.

Driven by hand (``threads=False``: ``take``/``finish``/``run_one`` in the test's thread) with a
controllable clock, against a source that records the requests it would send.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future

import pytest

from gpucloud.images.lazy.scheduler import (
    Deliver,
    FetchScheduler,
    Item,
    Priority,
    ReadDeadlineExceeded,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """A source whose 'blob' byte at offset i is i % 251; records each merged request."""

    def __init__(self) -> None:
        self.requests: list[tuple[Priority, int, int, list[str]]] = []

    def fetch_span(self, items: list[Item], priority: Priority) -> bytes:
        start, end = items[0].start, max(i.end for i in items)
        self.requests.append((priority, start, end, [i.key for i in items]))
        return bytes(b % 251 for b in range(start, end))

    def decode_items(self, items: list[Item], blob: bytes, deliver: Deliver) -> None:
        for item in items:
            deliver(item.key, blob[item.start - items[0].start : item.end - items[0].start])

    def fetch_items(self, items: list[Item], priority: Priority) -> dict[str, bytes]:
        """Both steps, for tests that finish a taken batch by hand."""
        got: dict[str, bytes] = {}
        self.decode_items(items, self.fetch_span(items, priority), got.__setitem__)
        return got


def _items(*extents: tuple[int, int]) -> list[Item]:
    return [Item(f"c{start}", start, end) for start, end in extents]


def _scheduler(clock: Clock, workers: int = 0, **kwargs: int | float) -> FetchScheduler:
    """``workers``: the demand concurrency (no threads: the test runs every batch itself)."""
    options: dict[str, int | float] = {"gap": 100, "max_request": 10_000,
                                       "prefetch_request": 1_000, "bulk_quiet": 1.0}
    options.update(kwargs)
    return FetchScheduler(workers or 4, 1, clock=clock, threads=False, **options)  # type: ignore[arg-type]


def _drain(scheduler: FetchScheduler) -> None:
    while scheduler.run_one():
        pass


def test_demand_runs_before_queued_prefetch_and_bulk_waits_for_quiet() -> None:
    clock, src = Clock(), Recorder()
    sched = _scheduler(clock)
    bulk = sched.submit(src, _items((5000, 5400)), Priority.BULK)
    prio = sched.submit(src, _items((0, 300)), Priority.PRIORITY)
    demand = sched.submit(src, _items((9000, 9100)), Priority.DEMAND)
    assert sched.run_one()
    assert demand[0].done() and not prio[0].done()
    assert sched.run_one()
    assert [r[0] for r in src.requests] == [Priority.DEMAND, Priority.PRIORITY]
    assert prio[0].result() == bytes(
        b % 251 for b in range(300))
    # Demand ended just now: the bulk waits for bulk_quiet seconds of no demand.
    assert not sched.run_one() and sched.bulk_wait() == pytest.approx(1.0)
    clock.now += 1.0
    assert sched.run_one() and bulk[0].done()
    assert [r[0] for r in src.requests] == [Priority.DEMAND, Priority.PRIORITY, Priority.BULK]


def test_bulk_pauses_while_a_demand_fetch_is_on_the_wire() -> None:
    clock, src = Clock(), Recorder()
    sched = _scheduler(clock)
    sched.submit(src, _items((0, 100)), Priority.BULK)
    sched.submit(src, _items((4000, 4100)), Priority.DEMAND)
    running = sched.take()
    assert running is not None and running.priority is Priority.DEMAND
    clock.now += 10
    assert sched.demand_outstanding()
    assert sched.take() is None  # the bulk does not start meanwhile
    sched.finish(running, src.fetch_items(running.items, running.priority))
    assert not sched.demand_outstanding()
    assert sched.take() is None  # nor right after: demand must be quiet for a while
    clock.now += 1
    nxt = sched.take()
    assert nxt is not None and nxt.priority is Priority.BULK


def test_queued_demand_always_goes_out_before_prioritized_prefetch() -> None:
    clock, src = Clock(), Recorder()
    sched = _scheduler(clock, workers=1)
    sched.submit(src, _items((0, 100)), Priority.PRIORITY)
    sched.submit(src, _items((4000, 4100), (8000, 8100)), Priority.DEMAND)
    first = sched.take()
    assert first is not None and first.priority is Priority.DEMAND
    # Demand is queued (the one demand worker is busy): the prefetch does not go first.
    assert sched.take() is None
    sched.finish(first, src.fetch_items(first.items, first.priority))
    second = sched.take()
    assert second is not None and second.priority is Priority.DEMAND
    # With no demand queued, the prioritized files go out beside the running demand.
    third = sched.take()
    assert third is not None and third.priority is Priority.PRIORITY


def test_prefetch_concurrency_is_bounded_but_demand_is_not_held_back() -> None:
    clock, src = Clock(), Recorder()
    sched = _scheduler(clock)
    sched.submit(src, _items((0, 100), (5000, 5100)), Priority.PRIORITY)
    first = sched.take()
    assert first is not None and first.priority is Priority.PRIORITY
    assert sched.take() is None  # one prefetch fetch at a time
    sched.submit(src, _items((9000, 9100)), Priority.DEMAND)
    demand = sched.take()  # demand runs even while a prefetch is on the wire
    assert demand is not None and demand.priority is Priority.DEMAND


def test_two_prefetch_workers_overlap_prioritized_fetches_but_not_the_bulk() -> None:
    """The daemon's two prefetch fetches: a second prioritized request goes out while the
    first is still being processed; the bulk never runs beside another prefetch, nor two
    at once."""
    clock, src = Clock(), Recorder()
    sched = FetchScheduler(4, 2, gap=100, prefetch_request=1_000, bulk_quiet=1.0,
                           clock=clock, threads=False)
    sched.submit(src, _items((0, 100), (5000, 5100), (9000, 9100)), Priority.PRIORITY)
    first, second = sched.take(), sched.take()
    assert first is not None and second is not None
    assert (first.priority, second.priority) == (Priority.PRIORITY, Priority.PRIORITY)
    assert sched.take() is None  # two at a time
    sched.finish(first, src.fetch_items(first.items, first.priority))
    sched.submit(src, _items((20000, 20100), (30000, 30100)), Priority.BULK)
    clock.now += 5
    third = sched.take()
    assert third is not None and third.priority is Priority.PRIORITY
    sched.finish(second, src.fetch_items(second.items, second.priority))
    assert sched.take() is None  # a prioritized fetch still runs: no bulk beside it
    sched.finish(third, src.fetch_items(third.items, third.priority))
    bulk = sched.take()
    assert bulk is not None and bulk.priority is Priority.BULK
    assert sched.take() is None  # one bulk fetch at a time


def test_a_demand_read_promotes_a_chunk_queued_for_prefetch() -> None:
    clock, src = Clock(), Recorder()
    sched = _scheduler(clock)
    queued = sched.submit(src, _items((0, 100), (6000, 6100)), Priority.BULK)
    again = sched.submit(src, _items((6000, 6100)), Priority.DEMAND)
    assert again[0] is queued[1]  # one fetch, shared
    assert sched.run_one()
    assert src.requests == [(Priority.DEMAND, 6000, 6100, ["c6000"])]
    assert sched.stats.promoted == 1
    clock.now += 5
    _drain(sched)
    assert [r[3] for r in src.requests] == [["c6000"], ["c0"]]


def test_a_chunk_on_the_wire_is_fetched_once_for_every_reader() -> None:
    clock, src = Clock(), Recorder()
    sched = _scheduler(clock)
    first = sched.submit(src, _items((0, 100)), Priority.PRIORITY)
    batch = sched.take()
    assert batch is not None
    second = sched.submit(src, _items((0, 100)), Priority.DEMAND)  # running: shared as is
    assert second[0] is first[0] and sched.take() is None
    sched.finish(batch, src.fetch_items(batch.items, batch.priority))
    assert second[0].result() == first[0].result() and len(src.requests) == 1


def test_adjacent_and_nearby_items_merge_up_to_the_request_cap() -> None:
    clock, src = Clock(), Recorder()
    sched = _scheduler(clock, max_request=1000)
    # 0-300, 300-600 touch; 650 is within the 100-byte gap; 900-1200 would pass the cap;
    # 5000 is far.
    sched.submit(src, _items((5000, 5100), (650, 800), (0, 300), (300, 600), (900, 1200)),
                 Priority.DEMAND)
    _drain(sched)
    assert [(r[1], r[2]) for r in src.requests] == [(0, 800), (900, 1200), (5000, 5100)]


def test_prefetch_requests_are_capped_smaller_than_demand() -> None:
    clock, src = Clock(), Recorder()
    sched = _scheduler(clock, prefetch_request=500)
    sched.submit(src, _items((0, 300), (300, 600), (600, 900)), Priority.PRIORITY)
    _drain(sched)
    assert [(r[1], r[2]) for r in src.requests] == [(0, 300), (300, 600), (600, 900)]


def test_cancel_drops_queued_prefetch_of_one_source_only() -> None:
    clock, src, other = Clock(), Recorder(), Recorder()
    sched = _scheduler(clock)
    mine = sched.submit(src, _items((0, 100), (2000, 2100)), Priority.BULK)
    theirs = sched.submit(other, _items((0, 100)), Priority.BULK)
    demand = sched.submit(src, _items((8000, 8100)), Priority.DEMAND)
    assert sched.cancel(src) == 2
    assert all(f.cancelled() for f in mine)
    with pytest.raises(CancelledError):
        mine[0].result()
    _drain(sched)  # the demand
    clock.now += 5
    _drain(sched)  # the other source's bulk, once demand has been quiet
    assert demand[0].done() and theirs[0].done()
    assert src.requests == [(Priority.DEMAND, 8000, 8100, ["c8000"])]
    # The same chunk can be asked for again after its prefetch was cancelled.
    again = sched.submit(src, _items((0, 100)), Priority.DEMAND)
    assert not again[0].cancelled() and sched.run_one() and again[0].result() == bytes(range(100))


def test_a_failed_fetch_fails_its_waiters_and_not_the_others() -> None:
    clock = Clock()

    class Broken(Recorder):
        def fetch_span(self, items: list[Item], priority: Priority) -> bytes:
            raise OSError("registry gone")

    broken, fine = Broken(), Recorder()
    sched = _scheduler(clock)
    bad = sched.submit(broken, _items((0, 100)), Priority.DEMAND)
    good = sched.submit(fine, _items((0, 100)), Priority.DEMAND)
    _drain(sched)
    with pytest.raises(OSError, match="registry gone"):
        bad[0].result()
    assert good[0].result() == bytes(range(100))


class Stepwise(Recorder):
    """Calls ``during(key)`` after delivering each item, and can refuse one item."""

    def __init__(self, during: Callable[[str], None], bad: str = "") -> None:
        super().__init__()
        self.during, self.bad = during, bad

    def decode_items(self, items: list[Item], blob: bytes, deliver: Deliver) -> None:
        for item in items:
            if item.key == self.bad:
                continue
            deliver(item.key, blob[item.start - items[0].start : item.end - items[0].start])
            self.during(item.key)
        if self.bad:
            raise ValueError(f"{self.bad} is corrupt")


def test_each_chunk_is_resolved_when_verified_not_when_its_request_is() -> None:
    seen: list[tuple[bool, bool]] = []
    futures: list[Future[bytes]] = []
    src = Stepwise(lambda key: seen.append((futures[0].done(), futures[1].done())))
    sched = _scheduler(Clock())
    futures += sched.submit(src, _items((0, 100), (100, 200)), Priority.PRIORITY)
    assert sched.run_one() and len(src.requests) == 1
    assert seen == [(True, False), (True, True)]
    assert futures[1].result() == bytes(b % 251 for b in range(100, 200))


def test_a_fetch_frees_its_place_on_the_wire_before_its_chunks_are_decoded() -> None:
    """With one prefetch place: no other request goes out while the first is on the wire,
    and the next one may while the first one's chunks are decoded."""
    taken: dict[str, Priority | None] = {}
    sched = FetchScheduler(4, 1, gap=0, prefetch_request=100, clock=Clock(), threads=False)

    def next_priority() -> Priority | None:
        batch = sched.take()
        return batch.priority if batch is not None else None

    class Probe(Stepwise):
        def fetch_span(self, items: list[Item], priority: Priority) -> bytes:
            taken.setdefault("on the wire", next_priority())
            return super().fetch_span(items, priority)

    def while_decoding(key: str) -> None:
        if key == "c0":
            taken.setdefault("decoding", next_priority())

    sched.submit(Probe(while_decoding), _items((0, 100), (5000, 5100)), Priority.PRIORITY)
    assert sched.run_one()
    assert taken == {"on the wire": None, "decoding": Priority.PRIORITY}


def test_a_corrupt_chunk_fails_its_waiter_after_the_good_ones_are_served() -> None:
    src = Stepwise(lambda key: None, bad="c100")
    sched = _scheduler(Clock())
    good, bad, later = sched.submit(src, _items((0, 100), (100, 200), (200, 300)),
                                    Priority.DEMAND)
    assert sched.run_one()
    assert good.result() == bytes(range(100)) and later.result()[:1] == bytes([200])
    with pytest.raises(ValueError, match="c100 is corrupt"):
        bad.result()
    again = sched.submit(src, _items((100, 200)), Priority.DEMAND)  # asked again: refetched
    assert again[0] is not bad and not again[0].done()


def test_a_demand_reader_waiting_on_a_prefetch_wakes_when_its_chunk_lands() -> None:
    """A reader sharing a chunk of a running prefetch request returns once that chunk is
    verified, while the request's later chunks are still being decoded."""
    released = threading.Event()
    reader_done = threading.Event()

    def hold_after_first(key: str) -> None:
        if key == "c0":
            assert reader_done.wait(5), "the reader was not woken by its chunk"
        released.set()

    src = Stepwise(hold_after_first)
    sched = _scheduler(Clock())
    sched.submit(src, _items((0, 100), (100, 200)), Priority.PRIORITY)
    batch = sched.take()
    assert batch is not None

    submitted = threading.Event()

    def reader() -> None:
        # ``fetch``'s two steps, with the submit known to come before the batch runs.
        futures = sched.submit(src, _items((0, 100)), Priority.DEMAND)  # shared: running
        submitted.set()
        sched._help_until_done(futures)
        assert futures[0].result() == bytes(range(100))
        reader_done.set()

    thread = threading.Thread(target=reader)
    thread.start()
    assert submitted.wait(5)
    sched._run(batch)  # the reader returns inside the decode, after c0 and before c100
    thread.join(5)
    assert reader_done.is_set() and released.is_set() and not thread.is_alive()


class Hanging(Recorder):
    """A source whose requests hang until ``release`` is set (``entered``: one is hanging)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def fetch_span(self, items: list[Item], priority: Priority) -> bytes:
        self.entered.set()
        assert self.release.wait(10), "the test never released the hung fetch"
        return super().fetch_span(items, priority)


def _hung_demand_read(sched: FetchScheduler, src: Hanging, items: list[Item]
                      ) -> tuple[threading.Thread, dict[str, bytes]]:
    """A reader thread whose own demand fetch of ``items`` hangs in ``src``."""
    got: dict[str, bytes] = {}
    thread = threading.Thread(target=lambda: got.update(sched.fetch(src, items, Priority.DEMAND)))
    thread.start()
    assert src.entered.wait(5)
    return thread, got


def test_a_reader_sharing_a_hung_fetch_gets_eio_at_its_deadline() -> None:
    """Single flight with a deadline: a second reader of a chunk whose fetch hangs gives up
    after ``read_deadline`` (an ``OSError``: ``EIO``); the fetch goes on, is still shared
    (one request), and its verified bytes go to whoever still waits."""
    src = Hanging()
    sched = FetchScheduler(4, 1, gap=100, read_deadline=0.05, threads=False)
    first, got = _hung_demand_read(sched, src, _items((0, 100)))
    started = time.monotonic()
    with pytest.raises(ReadDeadlineExceeded) as exc:
        sched.fetch(src, _items((0, 100)), Priority.DEMAND)
    assert isinstance(exc.value, OSError) and time.monotonic() - started < 5
    shared = sched.submit(src, _items((0, 100)), Priority.DEMAND)  # still the one in flight
    src.release.set()
    first.join(5)
    assert got == {"c0": bytes(range(100))} and shared[0].result() == bytes(range(100))
    assert len(src.requests) == 1


def test_a_timed_out_readers_queued_chunk_drops_to_the_background() -> None:
    """A reader that gave up while its chunk was still queued (the demand places all
    taken) leaves no demand behind that nobody runs (it would hold every prefetch back):
    the chunk is fetched later as ``BULK``, into the cache for later readers."""
    src = Hanging()
    sched = FetchScheduler(1, 1, gap=100, read_deadline=0.05, bulk_quiet=0.0, threads=False)
    first, _ = _hung_demand_read(sched, src, _items((0, 100)))
    with pytest.raises(ReadDeadlineExceeded):
        sched.fetch(src, _items((5000, 5100)), Priority.DEMAND)  # queued behind the first
    src.release.set()
    first.join(5)
    assert not sched.demand_outstanding()
    assert sched.run_one() and src.requests[-1] == (Priority.BULK, 5000, 5100, ["c5000"])
    assert not sched.run_one()

