"""The checkpoint interval: Young's and Daly's optimum from the checkpoint cost δ and the
mean time between interruptions M, and the estimators of δ and M the control plane uses.

Pure functions (no DB, no clock): the server and ``gpucloud sim checkpoint`` share them.

* Young (CACM 17(9), 1974), first order: τ = √(2δM).
* Daly (FGCS 22(3), 2006, eq. 37), higher order:
  τ = √(2δM)·[1 + ⅓·√(δ/(2M)) + (1/9)·(δ/(2M))] − δ  for δ < 2M, else τ = M.
  The restart cost R changes the total run time but not the optimum interval. Both assume
  Poisson (exponential) interruptions; M is a mean *time* (1/λ), not a rate.

Estimators:

* δ is the median of the last ``COST_SAMPLES`` measured costs (robust to one slow upload);
  before any checkpoint was measured, ``DEFAULT_CHECKPOINT_COST_SECONDS``.
* M is the posterior mean of a Gamma–Poisson model with a prior worth ``PRIOR_WEIGHT``
  pseudo-observations of one interruption per ``PRIOR_MTBF_SECONDS``:
  M = (exposure + w·M0) / (interruptions + w). With no data it is M0 (24 h); each observed
  interruption pulls it toward exposure/interruptions. Only *unannounced* interruptions
  count (a lost node; a preemption with notice gets its own checkpoint).
* A gang of N members is interrupted when any member is: M_gang = M_node / N.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: δ before any checkpoint of the pod has been measured.
DEFAULT_CHECKPOINT_COST_SECONDS = 60.0
#: How many of the most recent measured costs the median is taken over.
COST_SAMPLES = 5
#: The prior of M: one interruption per 24 h, weighted as one observation.
PRIOR_MTBF_SECONDS = 24 * 3600.0
PRIOR_WEIGHT = 1.0
#: The signal a pod receives as its checkpoint request unless it names another.
DEFAULT_CHECKPOINT_SIGNAL = "SIGUSR1"
#: Signals a pod may choose (never one that stops or kills it).
CHECKPOINT_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT", "SIGWINCH", "SIGALRM",
                      "SIGIO", "SIGURG", "SIGPWR")


def young_interval(delta: float, mtbf: float) -> float:
    """Young's first-order optimum √(2δM)."""
    _check(delta, mtbf)
    return math.sqrt(2.0 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum (eq. 37); M itself once δ ≥ 2M."""
    _check(delta, mtbf)
    if delta >= 2.0 * mtbf:
        return mtbf
    ratio = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - delta


def _check(delta: float, mtbf: float) -> None:
    if not (delta > 0 and math.isfinite(delta)):
        raise ValueError(f"checkpoint cost must be positive and finite, not {delta!r}")
    if not (mtbf > 0 and math.isfinite(mtbf)):
        raise ValueError(f"mean time between interruptions must be positive, not {mtbf!r}")


def estimate_cost(costs: Sequence[float],
                  default: float = DEFAULT_CHECKPOINT_COST_SECONDS) -> float:
    """δ: the median of the last ``COST_SAMPLES`` positive costs (oldest first), else
    ``default``."""
    recent = [cost for cost in costs if cost > 0 and math.isfinite(cost)][-COST_SAMPLES:]
    return statistics.median(recent) if recent else default


def estimate_mtbf(exposure_seconds: float, interruptions: int,
                  prior_mtbf: float = PRIOR_MTBF_SECONDS,
                  prior_weight: float = PRIOR_WEIGHT) -> float:
    """M per pod: the Gamma–Poisson posterior mean of the time between interruptions,
    from ``exposure_seconds`` of running time that saw ``interruptions``."""
    if exposure_seconds < 0 or interruptions < 0:
        raise ValueError("exposure and interruptions must not be negative")
    return (exposure_seconds + prior_weight * prior_mtbf) / (interruptions + prior_weight)


def gang_mtbf(node_mtbf: float, members: int) -> float:
    """A gang stops when any member does: M_node / N."""
    return node_mtbf / max(1, members)


@dataclass(frozen=True)
class IntervalPlan:
    """What the server tells a pod and shows on ``pod get``."""

    cost_seconds: float
    mtbf_seconds: float
    interval_seconds: float


def plan_interval(costs: Sequence[float], exposure_seconds: float, interruptions: int, *,
                  members: int = 1, default_cost: float = DEFAULT_CHECKPOINT_COST_SECONDS,
                  prior_mtbf: float = PRIOR_MTBF_SECONDS, min_interval: float = 0.0,
                  max_interval: float | None = None) -> IntervalPlan:
    """δ, M and Daly's τ for one pod, with τ clamped to ``[min_interval, max_interval]``
    (the operator's bounds: no signal storm, a bounded loss)."""
    delta = estimate_cost(costs, default_cost)
    mtbf = gang_mtbf(estimate_mtbf(exposure_seconds, interruptions, prior_mtbf), members)
    tau = max(daly_interval(delta, mtbf), min_interval)
    if max_interval is not None:
        tau = min(tau, max_interval)
    return IntervalPlan(delta, mtbf, tau)
