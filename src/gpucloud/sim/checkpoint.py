"""``gpucloud sim checkpoint``: how much work a checkpointing job loses to Poisson
interruptions, for Daly's interval against the analytic optimum and fixed intervals.

Model (Daly 2006's): a job needs ``work`` seconds of computation. It computes ``τ``, then
writes a checkpoint for ``δ``; an interruption (exponential inter-arrival times, mean
``M``, on a virtual clock) may strike at any moment — computing, checkpointing, or
restarting — and throws away everything since the last *completed* checkpoint; a restart
costs ``R`` (and may itself be interrupted). The job's last segment ends the job and needs
no checkpoint. The lost-work fraction is ``(wall − work) / wall``: checkpoint overhead,
recomputed work and restarts, as a share of the wall-clock time.

The analytic expectation for the same model (every segment checkpointed) is
``T(τ) = M·e^{R/M}·(e^{(τ+δ)/M} − 1) · work/τ``; its minimum over τ (found numerically) is
the optimum Daly's formula approximates.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpucloud.core.checkpoint_interval import daly_interval

MINUTE, HOUR = 60.0, 3600.0
#: Fixed intervals compared with Daly's.
FIXED_INTERVALS = (5 * MINUTE, 30 * MINUTE, 2 * HOUR)
#: (δ, M) settings of the default experiment; R and the work are shared.
DEFAULT_SETTINGS = ((5 * MINUTE, 24 * HOUR), (5 * MINUTE, 6 * HOUR), (1 * MINUTE, 1 * HOUR),
                    (30.0, 4 * HOUR), (5 * MINUTE, 2 * HOUR))
DEFAULT_RESTART = 10 * MINUTE
DEFAULT_WORK = 1000 * HOUR
#: A run whose wall clock passes this many times the work stops (its loss is "≥").
WALL_CAP = 20.0


@dataclass(frozen=True)
class RunOutcome:
    wall_seconds: float
    interruptions: int
    capped: bool

    def lost_fraction(self, work: float) -> float:
        return (self.wall_seconds - work) / self.wall_seconds


def simulate(work: float, tau: float, delta: float, mtbf: float, restart: float,
             seed: int) -> RunOutcome:
    """One job on a virtual clock (see the module docstring)."""
    rng = random.Random(seed)
    clock, done, interruptions = 0.0, 0.0, 0
    next_failure = rng.expovariate(1.0 / mtbf)
    while done < work:
        if clock > WALL_CAP * work:
            return RunOutcome(clock, interruptions, True)
        segment = min(tau, work - done)
        needed = segment + (delta if done + segment < work else 0.0)
        if clock + needed <= next_failure:
            clock += needed
            done += segment
            continue
        clock = next_failure  # the segment (and its checkpoint) is lost
        interruptions += 1
        next_failure = clock + rng.expovariate(1.0 / mtbf)
        while clock + restart > next_failure:  # the restart is interrupted too
            clock = next_failure
            interruptions += 1
            next_failure = clock + rng.expovariate(1.0 / mtbf)
        clock += restart
    return RunOutcome(clock, interruptions, False)


def expected_wall(work: float, tau: float, delta: float, mtbf: float, restart: float) -> float:
    """Daly's expected wall-clock time for interval ``tau`` (every segment checkpointed)."""
    exponent = (tau + delta) / mtbf
    if exponent + restart / mtbf > 700:  # beyond float range: hopeless interval
        return math.inf
    return mtbf * math.exp(restart / mtbf) * math.expm1(exponent) * work / tau


def expected_lost_fraction(work: float, tau: float, delta: float, mtbf: float,
                           restart: float) -> float:
    wall = expected_wall(work, tau, delta, mtbf, restart)
    return 1.0 if math.isinf(wall) else (wall - work) / wall


def optimal_interval(delta: float, mtbf: float, restart: float, work: float) -> float:
    """The τ minimizing ``expected_wall`` (golden-section search on log τ)."""
    low, high = math.log(1e-3 * min(delta, mtbf)), math.log(10 * mtbf)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a = high - ratio * (high - low)
        b = low + ratio * (high - low)
        if (expected_wall(work, math.exp(a), delta, mtbf, restart)
                < expected_wall(work, math.exp(b), delta, mtbf, restart)):
            high = b
        else:
            low = a
    return math.exp((low + high) / 2)


@dataclass(frozen=True)
class IntervalResult:
    """One interval of one setting over all seeds."""

    label: str
    tau: float
    lost: tuple[float, ...]
    capped: bool
    expected: float

    @property
    def mean(self) -> float:
        return statistics.fmean(self.lost)

    @property
    def spread(self) -> float:
        return statistics.pstdev(self.lost) if len(self.lost) > 1 else 0.0


@dataclass(frozen=True)
class SettingResult:
    delta: float
    mtbf: float
    restart: float
    work: float
    optimum_tau: float
    optimum_lost: float
    intervals: tuple[IntervalResult, ...] = field(default_factory=tuple)

    @property
    def daly(self) -> IntervalResult:
        return self.intervals[0]

    @property
    def daly_vs_optimum(self) -> float:
        """Relative excess of Daly's simulated loss over the analytic optimum's."""
        return self.daly.mean / self.optimum_lost - 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "delta_seconds": self.delta, "mtbf_seconds": self.mtbf,
            "restart_seconds": self.restart, "work_seconds": self.work,
            "optimum_interval_seconds": round(self.optimum_tau, 3),
            "optimum_lost_fraction": round(self.optimum_lost, 6),
            "daly_vs_optimum": round(self.daly_vs_optimum, 6),
            "intervals": [{"interval": r.label, "tau_seconds": round(r.tau, 3),
                           "lost_fraction_mean": round(r.mean, 6),
                           "lost_fraction_std": round(r.spread, 6),
                           "expected_lost_fraction": round(r.expected, 6),
                           "capped": r.capped, "seeds": len(r.lost)}
                          for r in self.intervals],
        }


def run_setting(delta: float, mtbf: float, seeds: Sequence[int], *,
                restart: float = DEFAULT_RESTART, work: float = DEFAULT_WORK,
                fixed: Sequence[float] = FIXED_INTERVALS) -> SettingResult:
    """Daly's τ (first) and each fixed interval, simulated over ``seeds``."""
    candidates = [("daly", daly_interval(delta, mtbf))]
    candidates += [(_label(tau), tau) for tau in fixed]
    results = []
    for label, tau in candidates:
        outcomes = [simulate(work, tau, delta, mtbf, restart, seed) for seed in seeds]
        results.append(IntervalResult(
            label, tau, tuple(o.lost_fraction(work) for o in outcomes),
            any(o.capped for o in outcomes),
            expected_lost_fraction(work, tau, delta, mtbf, restart)))
    best = optimal_interval(delta, mtbf, restart, work)
    return SettingResult(delta, mtbf, restart, work, best,
                         expected_lost_fraction(work, best, delta, mtbf, restart),
                         tuple(results))


def _label(seconds: float) -> str:
    return f"{seconds / HOUR:g}h" if seconds >= HOUR else f"{seconds / MINUTE:g}m"
