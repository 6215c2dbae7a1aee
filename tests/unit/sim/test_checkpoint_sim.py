"""``sim checkpoint``: the simulated loss agrees with Daly's analytic expectation, Daly's τ
is within 10 % of the analytic optimum, and beats the fixed intervals."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from gpucloud.cli.main import app
from gpucloud.sim.checkpoint import (
    DEFAULT_SETTINGS,
    HOUR,
    MINUTE,
    expected_lost_fraction,
    optimal_interval,
    run_setting,
    simulate,
)

SEEDS = range(42, 62)


@pytest.mark.parametrize(("delta", "mtbf"), DEFAULT_SETTINGS)
def test_daly_is_within_ten_percent_of_the_optimum_and_beats_fixed(delta: float,
                                                                    mtbf: float) -> None:
    result = run_setting(delta, mtbf, SEEDS)
    assert abs(result.daly_vs_optimum) <= 0.10
    for fixed in result.intervals[1:]:
        assert result.daly.expected <= fixed.expected + 1e-12


def test_simulation_matches_the_analytic_expectation() -> None:
    """Mean over seeds within 4 standard errors of T(τ) for a fixed interval."""
    result = run_setting(5 * MINUTE, 2 * HOUR, range(40), fixed=(30 * MINUTE,))
    fixed = result.intervals[1]
    error = fixed.spread / math.sqrt(len(fixed.lost))
    assert abs(fixed.mean - fixed.expected) <= 4 * error + 1e-4


def test_optimum_is_daly_s_117_minutes_for_his_example() -> None:
    assert optimal_interval(5 * MINUTE, 24 * HOUR, 10 * MINUTE, 500 * HOUR) / MINUTE == \
        pytest.approx(116.7, abs=0.5)


def test_no_interruptions_lose_only_the_checkpoints() -> None:
    outcome = simulate(10 * HOUR, HOUR, 60.0, 1e12, 600.0, seed=1)
    assert outcome.interruptions == 0
    assert outcome.wall_seconds == pytest.approx(10 * HOUR + 9 * 60.0)  # no last checkpoint
    assert expected_lost_fraction(10 * HOUR, HOUR, 60.0, 1e12, 600.0) == pytest.approx(
        60 / (HOUR + 60), rel=1e-6)


def test_cli_prints_json_and_refuses_a_bad_setting() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["sim", "checkpoint", "--setting", "5m:6h", "--seeds", "3",
                                 "--work", "200h", "--output", "json"])
    assert result.exit_code == 0, result.output
    (setting,) = json.loads(result.output)
    assert setting["delta_seconds"] == 300 and setting["mtbf_seconds"] == 6 * HOUR
    assert [i["interval"] for i in setting["intervals"]] == ["daly", "5m", "30m", "2h"]
    bad = runner.invoke(app, ["sim", "checkpoint", "--setting", "5m"])
    assert bad.exit_code == 1 and "DELTA:M" in bad.output
