"""agent/backoff.py: a server's Retry-After is a floor, bounded, jittered upwards only."""

from __future__ import annotations

import threading

import pytest

from gpucloud.agent.backoff import MAX_RETRY_AFTER_S, RETRY_AFTER_JITTER, Backoff


@pytest.mark.parametrize(("retry_after", "low", "high"), [
    (None, 0.1, 0.2),  # the first back-off alone: 0.2 s jittered down to half
    (0.0, 0.1, 0.2),  # "now": the back-off still paces it
    (2.0, 2.0, 2.0 * (1 + RETRY_AFTER_JITTER)),
    (30.0, 30.0, 30.0 * (1 + RETRY_AFTER_JITTER)),
    (3600.0, MAX_RETRY_AFTER_S, MAX_RETRY_AFTER_S * (1 + RETRY_AFTER_JITTER)),
])
def test_retry_after_is_a_bounded_floor(retry_after: float | None, low: float,
                                        high: float) -> None:
    delays = [Backoff().next_delay(retry_after) for _ in range(200)]
    assert all(low <= d <= high for d in delays), (min(delays), max(delays))
    assert max(delays) - min(delays) > (high - low) / 4  # spread, not one instant


def test_a_later_back_off_above_retry_after_wins() -> None:
    backoff = Backoff(base=1.0, cap=8.0)
    for _ in range(5):
        backoff.next_delay()
    assert all(backoff.next_delay(0.5) >= 4.0 for _ in range(20))  # 8 s, down to half


def test_wait_sleeps_through_the_injected_sleep() -> None:
    asked: list[float] = []

    def sleep(stop: threading.Event, seconds: float) -> bool:
        asked.append(seconds)
        return stop.is_set()

    backoff, stop = Backoff(sleep=sleep), threading.Event()
    assert not backoff.wait(stop, 3.0)
    stop.set()
    assert backoff.wait(stop)
    assert asked[0] >= 3.0 and len(asked) == 2
