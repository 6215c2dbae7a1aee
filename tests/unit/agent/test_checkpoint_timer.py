"""The periodic checkpoint request's timer, on a controllable clock."""

from __future__ import annotations

from gpucloud.agent.checkpoint_timer import CheckpointTimer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_due_every_interval_counted_from_the_last_request() -> None:
    clock = Clock()
    timer = CheckpointTimer(clock)
    assert not timer.due(10.0)  # the first call starts the count
    clock.now += 9.9
    assert not timer.due(10.0)
    clock.now += 0.1
    assert timer.due(10.0)
    timer.mark_sent()
    assert not timer.due(10.0)
    clock.now += 4
    assert not timer.due(10.0)
    assert timer.due(3.0)  # a shorter τ from the server counts from the last request
    assert timer.sent == 1


def test_no_interval_never_due_but_a_request_now_is() -> None:
    clock = Clock()
    timer = CheckpointTimer(clock)
    clock.now += 1e6
    assert not timer.due(None) and not timer.due(0)
    timer.request_now()
    assert timer.due(None)
    timer.mark_sent()
    assert not timer.due(None)
