"""Young's and Daly's intervals against Daly's own published checks, and the δ/M
estimators (median of recent costs, Gamma–Poisson posterior mean, gang division)."""

from __future__ import annotations

import math

import pytest

from gpucloud.core.checkpoint_interval import (
    DEFAULT_CHECKPOINT_COST_SECONDS,
    PRIOR_MTBF_SECONDS,
    daly_interval,
    estimate_cost,
    estimate_mtbf,
    gang_mtbf,
    plan_interval,
    young_interval,
)

MINUTE, HOUR = 60.0, 3600.0


@pytest.mark.parametrize(("mtbf", "minutes"), [(24 * HOUR, 117), (6 * HOUR, 57),
                                                (15 * MINUTE, 9.1)])
def test_daly_matches_his_validation_points(mtbf: float, minutes: float) -> None:
    """Daly (2006) §6: δ = 5 min (R = 10 min): M = 24 h → 117 min, 6 h → 57 min,
    15 min → 9.1 min (rounded as published)."""
    tau = daly_interval(5 * MINUTE, mtbf) / MINUTE
    assert tau == pytest.approx(minutes, abs=0.5 if minutes > 10 else 0.05)


def test_young_is_the_first_order_term_and_exceeds_daly() -> None:
    assert young_interval(5 * MINUTE, 24 * HOUR) == pytest.approx(120 * MINUTE)
    for mtbf in (15 * MINUTE, HOUR, 24 * HOUR):
        assert daly_interval(5 * MINUTE, mtbf) < young_interval(5 * MINUTE, mtbf)


def test_daly_is_m_once_the_cost_reaches_twice_m() -> None:
    assert daly_interval(2 * HOUR, HOUR) == HOUR
    assert daly_interval(3 * HOUR, HOUR) == HOUR
    just_below = daly_interval(2 * HOUR - 1, HOUR)
    assert 0 < just_below < 2 * HOUR


@pytest.mark.parametrize(("delta", "mtbf"), [(0, HOUR), (-1, HOUR), (1, 0), (1, math.inf),
                                             (math.nan, HOUR)])
def test_nonsense_inputs_are_refused(delta: float, mtbf: float) -> None:
    with pytest.raises(ValueError):
        daly_interval(delta, mtbf)


def test_cost_is_the_median_of_the_last_five_and_defaults_without_data() -> None:
    assert estimate_cost([]) == DEFAULT_CHECKPOINT_COST_SECONDS
    assert estimate_cost([], default=7.0) == 7.0
    assert estimate_cost([1000.0, 10, 11, 900, 12, 13]) == 12  # the 1000 fell out
    assert estimate_cost([5.0, 0.0, -1.0]) == 5.0  # unmeasured costs are ignored


def test_mtbf_starts_at_the_prior_and_moves_toward_the_data() -> None:
    assert estimate_mtbf(0, 0) == PRIOR_MTBF_SECONDS
    assert estimate_mtbf(10 * HOUR, 0) == PRIOR_MTBF_SECONDS + 10 * HOUR
    assert estimate_mtbf(12 * HOUR, 1) == pytest.approx((12 + 24) * HOUR / 2)
    many = estimate_mtbf(1000 * HOUR, 1000)  # a lot of data: close to the observed 1 h
    assert many == pytest.approx(HOUR, rel=0.03)
    with pytest.raises(ValueError):
        estimate_mtbf(-1, 0)


def test_a_gang_is_interrupted_n_times_as_often() -> None:
    assert gang_mtbf(8 * HOUR, 8) == HOUR
    assert gang_mtbf(8 * HOUR, 0) == 8 * HOUR


def test_plan_clamps_tau_to_the_operator_bounds() -> None:
    plan = plan_interval([300.0], 0, 0)
    assert (plan.cost_seconds, plan.mtbf_seconds) == (300.0, PRIOR_MTBF_SECONDS)
    assert plan.interval_seconds == pytest.approx(daly_interval(300, PRIOR_MTBF_SECONDS))
    assert plan_interval([0.01], 0, 0, min_interval=60).interval_seconds == 60
    assert plan_interval([300.0], 0, 0, max_interval=600).interval_seconds == 600
    gang = plan_interval([300.0], 0, 0, members=4)
    assert gang.mtbf_seconds == PRIOR_MTBF_SECONDS / 4
