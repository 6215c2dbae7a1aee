"""Loading job traces: the Pollux-derived Philly list and Tiresias-style job lists.

Both become ``TraceJob``s with arrival times in seconds from the first arrival:

* ``timestamp,duration,num_gpus,gpu_time,cluster`` (philly-pollux/philly.csv): the
  Philly virtual cluster (``cluster``) is the job's project;
* ``job_id,num_gpu,submit_time,…,duration`` (tiresias-60job/60_job.csv): one project
  per ``model_name`` when present.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from gpucloud.core.errors import InvalidInput, NotFound

PHILLY_COLUMNS = {"timestamp", "duration", "num_gpus", "cluster"}
TIRESIAS_COLUMNS = {"job_id", "num_gpu", "submit_time", "duration"}


@dataclass(frozen=True)
class TraceJob:
    """One job of a trace: ``gpus`` GPUs for ``duration`` seconds from ``arrival``."""

    key: str
    arrival: float
    duration: float
    gpus: int
    project: str


def load_trace(path: Path, limit: int | None = None) -> list[TraceJob]:
    """The jobs of ``path`` by arrival (the first ``limit`` of them, if given)."""
    if not path.is_file():
        raise NotFound(f"trace {path} not found")
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        columns = set(reader.fieldnames or ())
        if PHILLY_COLUMNS <= columns:
            jobs = [_philly(i, row) for i, row in enumerate(reader) if row.get("timestamp")]
        elif TIRESIAS_COLUMNS <= columns:
            jobs = [_tiresias(row) for row in reader if row.get("job_id")]
        else:
            raise InvalidInput(path.name, f"unknown trace columns {sorted(columns)}")
    jobs.sort(key=lambda job: (job.arrival, job.key))
    jobs = jobs[:limit] if limit is not None else jobs
    return _rebased(jobs)


def _philly(index: int, row: dict[str, str]) -> TraceJob:
    try:
        arrival = datetime.fromisoformat(row["timestamp"]).timestamp()
        return TraceJob(f"job-{index}", arrival, float(row["duration"]),
                        int(row["num_gpus"]), row["cluster"] or "default")
    except ValueError as exc:
        raise InvalidInput(f"row {index + 1}", f"bad value: {exc}") from exc


def _tiresias(row: dict[str, str]) -> TraceJob:
    try:
        return TraceJob(f"job-{row['job_id']}", float(row["submit_time"]),
                        float(row["duration"]), int(row["num_gpu"]),
                        row.get("model_name") or "default")
    except ValueError as exc:
        raise InvalidInput(f"job {row.get('job_id')}", f"bad value: {exc}") from exc


def _rebased(jobs: list[TraceJob]) -> list[TraceJob]:
    """Arrivals in seconds from the first one."""
    if not jobs:
        return jobs
    first = jobs[0].arrival
    return [TraceJob(j.key, j.arrival - first, j.duration, j.gpus, j.project) for j in jobs]
