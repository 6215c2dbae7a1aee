"""The autoscaler's sizing, a pure function: desired workers from the queue's load and an
endpoint's settings at a given moment (a manual clock)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from gpucloud.core.clock import ManualClock
from gpucloud.core.phases import PodPhase
from gpucloud.services.autoscale import Load, Sizing, Worker, desired_workers, idle_workers

DELAY = Sizing(min_workers=0, max_workers=5, scaler="queue-delay", scaler_value=4)
COUNT = Sizing(min_workers=0, max_workers=5, scaler="request-count", scaler_value=3)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def queued(clock: ManualClock, waited: float, in_queue: int = 1, in_progress: int = 0,
           busy: int = 0) -> Load:
    return Load(in_queue, in_progress, busy, clock.now() - timedelta(seconds=waited))


@pytest.mark.parametrize(("load", "current", "want"), [
    ((0, 0), 0, 0),     # nothing queued, nothing runs: zero
    ((1, 0), 0, 1),     # scale from zero at once
    ((3, 0), 0, 1),     # 3 queued: ceil(3/3)
    ((4, 0), 1, 2),     # 4 queued: ceil(4/3)
    ((10, 6), 2, 5),    # 16 → 6, clamped to max 5
    ((0, 2), 3, 1),     # 2 in flight: one worker's worth
])
def test_request_count(clock: ManualClock, load: tuple[int, int], current: int,
                       want: int) -> None:
    in_queue, in_progress = load
    assert desired_workers(COUNT, Load(in_queue, in_progress), current, clock.now()) == want


def test_queue_delay_scales_from_zero_at_once(clock: ManualClock) -> None:
    assert desired_workers(DELAY, queued(clock, 0), 0, clock.now()) == 1


def test_queue_delay_adds_a_worker_only_once_requests_wait(clock: ManualClock) -> None:
    load = queued(clock, 0, in_queue=5, in_progress=1, busy=1)
    assert desired_workers(DELAY, load, 1, clock.now()) == 1
    assert desired_workers(DELAY, load, 1, clock.advance(3.9)) == 1
    assert desired_workers(DELAY, load, 1, clock.advance(0.1)) == 2  # waited 4 s


def test_queue_delay_keeps_busy_workers_and_lets_idle_ones_go(clock: ManualClock) -> None:
    assert desired_workers(DELAY, Load(0, 2, 2), 4, clock.now()) == 2
    assert desired_workers(DELAY, Load(), 3, clock.now()) == 0
    # queued work the current workers will take keeps them
    assert desired_workers(DELAY, queued(clock, 1, in_queue=2, busy=1), 3, clock.now()) == 3


def test_min_and_max_clamp(clock: ManualClock) -> None:
    warm = Sizing(min_workers=2, max_workers=3, scaler="queue-delay", scaler_value=1)
    assert desired_workers(warm, Load(), 0, clock.now()) == 2
    assert desired_workers(warm, queued(clock, 60, in_queue=50, busy=3), 3, clock.now()) == 3


def test_idle_workers_are_those_idle_past_the_timeout(clock: ManualClock) -> None:
    start = clock.now()
    workers = [
        Worker("a", "e-w-1", PodPhase.RUNNING, start, 0),
        Worker("b", "e-w-2", PodPhase.RUNNING, start + timedelta(seconds=3), 0),
        Worker("c", "e-w-3", PodPhase.RUNNING, None, 1),          # busy
        Worker("d", "e-w-4", PodPhase.RUNNING, start, 2),          # idle_since stale, busy
    ]
    assert idle_workers(workers, 5, clock.advance(4.9)) == []
    assert [w.id for w in idle_workers(workers, 5, clock.advance(0.1))] == ["a"]
    assert [w.id for w in idle_workers(workers, 5, clock.advance(3))] == ["a", "b"]
