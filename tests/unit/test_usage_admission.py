"""The usage ingest gate (api/usage_admission.py) on a clock the test moves: quiet, batches
run side by side up to the limit plus the queue; busy (an API call within the quiet
window, in this worker or another), one at a time, paced to a share of the time, and
refused past a short queue; the stamp is shared by the workers through a file."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpucloud.api.usage_admission import ApiActivity, IngestAdmission


class Seconds:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _gate(seconds: Seconds, **options: float) -> tuple[IngestAdmission, list[float]]:
    waits: list[float] = []

    async def sleep(delay: float) -> None:
        waits.append(delay)
        seconds.now += delay

    gate = IngestAdmission(ApiActivity(None, clock=seconds), clock=seconds, sleep=sleep,
                           **options)  # type: ignore[arg-type]
    return gate, waits


def test_busy_batches_are_paced_to_their_share_of_the_time() -> None:
    seconds = Seconds()
    gate, waits = _gate(seconds, busy_share=0.25, defer_seconds=0)
    gate.activity.touch()

    async def batch() -> float:
        started = seconds.now
        seconds.now += 0.1  # the batch takes 100 ms
        return started

    async def two() -> list[float | None]:
        return [await gate.run(batch), await gate.run(batch)]

    first, second = asyncio.run(two())
    assert first == 1000.0 and abs(sum(waits) - 0.3) < 1e-9  # 100 ms of work, 300 ms off
    assert second is not None and abs(second - 1000.4) < 1e-9


def test_a_burst_of_api_calls_defers_ingest_until_it_is_over() -> None:
    seconds = Seconds()
    gate, waits = _gate(seconds, defer_seconds=10)
    gate.activity.touch()

    async def batch() -> float:
        return seconds.now

    # the calls stop: the batch runs once the quiet window has passed, not before
    ran_at = asyncio.run(gate.run(batch))
    assert ran_at is not None and ran_at >= 1000 + gate.quiet_seconds
    assert 0 < sum(waits) < 1


def test_api_calls_that_go_on_defer_ingest_no_longer_than_the_limit() -> None:
    seconds = Seconds()
    gate, waits = _gate(seconds, defer_seconds=10)

    async def calls_go_on(delay: float) -> None:
        seconds.now += delay
        gate.activity.touch()

    gate.sleep = calls_go_on
    gate.activity.touch()

    async def batch() -> float:
        return seconds.now

    ran_at = asyncio.run(gate.run(batch))
    assert ran_at is not None and 1010 <= ran_at < 1010.1  # deferred 10 s, then run


def test_quiet_batches_are_not_paced() -> None:
    seconds = Seconds()
    gate, waits = _gate(seconds)

    async def batch() -> int:
        seconds.now += 0.1
        return 1

    async def two() -> list[int | None]:
        return [await gate.run(batch), await gate.run(batch)]

    assert asyncio.run(two()) == [1, 1] and waits == []


def test_the_queue_is_bounded_and_shorter_while_busy() -> None:
    seconds = Seconds()
    gate, _ = _gate(seconds, limit=2, queue=1, busy_queue=1, defer_seconds=0)
    release = asyncio.Event

    async def fill(count: int) -> list[int | None]:
        done = release()

        async def batch() -> int:
            await done.wait()
            return 1

        tasks = [asyncio.create_task(gate.run(batch)) for _ in range(count)]
        await asyncio.sleep(0)
        refused = gate.run(batch)  # one more than there is room for
        extra = await refused
        done.set()
        return [extra, *await asyncio.gather(*tasks)]

    assert asyncio.run(fill(3)) == [None, 1, 1, 1] and gate.shed == 1  # quiet: 2 + 1
    gate.activity.touch()
    assert asyncio.run(fill(2)) == [None, 1, 1] and gate.shed == 2  # busy: 1 + 1
    seconds.now += gate.quiet_seconds  # quiet again
    assert gate.admit()


def test_workers_share_the_stamp(tmp_path: Path) -> None:
    seconds = Seconds()
    path = tmp_path / "run" / "api-activity"
    creates, ingests = ApiActivity(path, clock=seconds), ApiActivity(path, clock=seconds)
    gate = IngestAdmission(ingests, clock=seconds)
    assert not gate.busy()
    creates.touch()  # an API call in the other worker
    assert gate.busy()
    seconds.now += gate.quiet_seconds
    assert not gate.busy()
