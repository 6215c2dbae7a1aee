"""The arrival protocol of the reference simulator's workload tuning."""

from __future__ import annotations

from collections import Counter

from gpucloud.scheduler import PodRequest
from gpucloud.sim.engine import draw_arrivals


def _pods(milli: list[int]) -> list[PodRequest]:
    return [PodRequest(f"p{i}", gpu_milli=m % 1000, gpus=m // 1000) for i, m in enumerate(milli)]


def test_whole_list_once_in_random_order_then_resampled_copies() -> None:
    pods = _pods([500, 1000, 2000, 250, 0])
    order = draw_arrivals(pods, capacity_milli=4000, tune=2.0, seed=3)
    assert sorted(order[:5]) == [0, 1, 2, 3, 4]
    assert order[:5] != [0, 1, 2, 3, 4] or order != draw_arrivals(pods, 4000, 2.0, 4)
    total = sum(pods[i].gpu_request_milli for i in order)
    assert total >= 8000 > total - pods[order[-1]].gpu_request_milli


def test_same_seed_same_arrivals() -> None:
    pods = _pods([300] * 40)
    assert draw_arrivals(pods, 5000, 1.3, 42) == draw_arrivals(pods, 5000, 1.3, 42)


def test_list_above_the_target_is_thinned_at_random() -> None:
    pods = _pods([1000] * 20)
    order = draw_arrivals(pods, capacity_milli=10_000, tune=1.0, seed=1)
    assert len(order) == 10
    assert max(Counter(order).values()) == 1
    assert order == sorted(order, key=draw_arrivals(pods, 10_000, 3.0, 1).index)
