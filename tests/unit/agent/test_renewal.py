"""The agent's lease renewals run at a fixed rate from when each was sent."""

from __future__ import annotations

from gpucloud.agent.renewal import RenewalSchedule


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_slow_answer_does_not_push_the_next_renewal_later() -> None:
    clock = Clock()
    schedule = RenewalSchedule(lambda: 3.0, now=clock)
    assert schedule.wait_seconds() == 3.0
    clock.t += 3.0
    sent = schedule.sending()
    clock.t += 2.5  # the server took 2.5 s to answer
    schedule.renewed(sent)
    # due 3 s after it was sent, not after the answer
    assert abs(schedule.wait_seconds() - 0.5) < 1e-9
    clock.t += 0.5
    sent = schedule.sending()
    clock.t += 4.0  # longer than the period: the next goes out at once
    schedule.renewed(sent)
    assert schedule.wait_seconds() == 0.0


def test_a_failure_retries_after_the_given_delay_from_now() -> None:
    clock = Clock()
    schedule = RenewalSchedule(lambda: 3.0, now=clock)
    clock.t += 3.0
    schedule.sending()
    clock.t += 1.0
    schedule.retry_in(0.4)
    assert abs(schedule.wait_seconds() - 0.4) < 1e-9
