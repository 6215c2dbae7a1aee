"""Per-policy results of a job replay: completion time, queueing delay, utilisation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class JobRecord:
    """One finished job: when it arrived, started and ended, and the GPUs it held."""

    key: str
    arrival: float
    start: float
    end: float
    gpus: int
    duration: float


@dataclass(frozen=True)
class JobsResult:
    policy: str
    jobs: int
    dropped: int
    mean_jct_s: float
    p99_jct_s: float
    mean_queue_s: float
    p99_queue_s: float
    utilization_pct: float
    makespan_s: float

    def to_json(self) -> dict[str, float | int | str]:
        return {"policy": self.policy, "jobs": self.jobs, "dropped": self.dropped,
                "mean_jct_s": round(self.mean_jct_s, 1), "p99_jct_s": round(self.p99_jct_s, 1),
                "mean_queue_s": round(self.mean_queue_s, 1),
                "p99_queue_s": round(self.p99_queue_s, 1),
                "utilization_pct": round(self.utilization_pct, 2),
                "makespan_s": round(self.makespan_s, 1)}


def summarize(policy: str, records: list[JobRecord], total_gpus: int,
              dropped: int) -> JobsResult:
    """JCT = end - arrival; queueing delay = start - arrival; utilisation = GPU-seconds
    held / (cluster GPUs x makespan); makespan = last end - first arrival."""
    if not records:
        return JobsResult(policy, 0, dropped, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    arrival = np.array([r.arrival for r in records])
    start = np.array([r.start for r in records])
    end = np.array([r.end for r in records])
    held = np.array([r.gpus * r.duration for r in records])
    jct, wait = end - arrival, start - arrival
    makespan = float(end.max() - arrival.min())
    busy = 100.0 * float(held.sum()) / (total_gpus * makespan) if makespan > 0 else 0.0
    return JobsResult(policy, len(records), dropped, float(jct.mean()),
                      float(np.percentile(jct, 99)), float(wait.mean()),
                      float(np.percentile(wait, 99)), busy, makespan)
