"""Summaries over seeds, the published reference numbers, and JSON shapes of results."""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpucloud.sim.data import trace_dir
from gpucloud.sim.engine import HEADLINE_PCT, RunResult

PUBLISHED_NAMES = {
    "random": "01-Random", "dotprod": "02-DotProd", "clustering": "03-GpuClustering",
    "packing": "04-GpuPacking", "bestfit": "05-BestFit", "fgd": "06-FGD",
}
FIRST_SEED = 42  # the published runs use seeds 42..51


def seeds(count: int) -> list[int]:
    return list(range(FIRST_SEED, FIRST_SEED + count))


@dataclass(frozen=True)
class Summary:
    """One policy over several seeds."""

    policy: str
    workload: str
    runs: tuple[RunResult, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(r.unallocated_pct_at_100 for r in self.runs)

    @property
    def spread(self) -> float:
        values = [r.unallocated_pct_at_100 for r in self.runs]
        return statistics.pstdev(values) if len(values) > 1 else 0.0

    @property
    def frag_mean(self) -> float:
        return statistics.fmean(r.frag_pct_of_idle_at_100 for r in self.runs)

    def curve(self) -> list[float]:
        curves = [r.allocated_curve for r in self.runs]
        return [statistics.fmean(points) for points in zip(*curves, strict=True)]

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "workload": self.workload,
            "seeds": [r.seed for r in self.runs],
            "unallocated_pct_at_100": round(self.mean, 4),
            "unallocated_pct_at_100_std": round(self.spread, 4),
            "frag_pct_of_idle_at_100": round(self.frag_mean, 4),
            "published_unallocated_pct_at_100": published_mean(self.workload, self.policy),
            "per_seed": [
                {"seed": r.seed, "unallocated_pct_at_100": round(r.unallocated_pct_at_100, 4),
                 "frag_pct_of_idle_at_100": round(r.frag_pct_of_idle_at_100, 4),
                 "arrived": r.arrived, "placed": r.placed, "seconds": round(r.seconds, 3)}
                for r in self.runs
            ],
            "allocated_pct_curve": [round(v, 3) for v in self.curve()],
        }


def published_file() -> Path:
    return trace_dir() / "fgd_expected_results" / "analysis_allo_discrete.csv"


_PUBLISHED: dict[tuple[str, str], list[float]] = {}


def published() -> dict[tuple[str, str], list[float]]:
    """(workload, policy) -> published unallocated GPU % at arrived = 100 %, per seed."""
    if not _PUBLISHED and published_file().is_file():
        table: dict[tuple[str, str], list[float]] = defaultdict(list)
        with published_file().open(newline="") as handle:
            for row in csv.DictReader(handle):
                workload = row["workload"].removeprefix("openb_pod_list_")
                table[(workload, row["sc_policy"])].append(100.0 - float(row[str(HEADLINE_PCT)]))
        _PUBLISHED.update(table)
    return _PUBLISHED


def published_mean(workload: str, policy: str) -> float | None:
    values = published().get((workload, PUBLISHED_NAMES.get(policy, "")))
    return round(statistics.fmean(values), 4) if values else None


def published_workloads() -> list[str]:
    return sorted({w for w, _ in published()})


def summarize(policy: str, workload: str, runs: Sequence[RunResult]) -> Summary:
    return Summary(policy, workload, tuple(runs))
