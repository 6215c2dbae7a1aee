"""``gpucloud sim jobs``: trace loading, the four queueing policies, metrics and CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpucloud.cli.main import app
from gpucloud.core.errors import InvalidInput
from gpucloud.sim.data import shared_data_dir
from gpucloud.sim.jobs.engine import POLICIES, replay, run_jobs
from gpucloud.sim.jobs.metrics import JobRecord
from gpucloud.sim.jobs.trace import TraceJob, load_trace

TIRESIAS = shared_data_dir() / "tiresias-60job" / "60_job.csv"
PHILLY = shared_data_dir() / "philly-pollux" / "philly.csv"


def job(key: str, arrival: float, duration: float, gpus: int, project: str = "p") -> TraceJob:
    return TraceJob(key, arrival, duration, gpus, project)


def by_key(records: list[JobRecord]) -> dict[str, JobRecord]:
    return {r.key: r for r in records}


# Two 4-GPU nodes. "wide" (a 2-node gang) is blocked by "first" until t=100.
BLOCKED = [job("first", 0, 100, 4), job("wide", 1, 10, 8)]


@pytest.mark.parametrize(("later", "backfilled"), [
    (job("short", 2, 50, 2), True),     # ends at 52 <= 100: may use the reserved node
    (job("long", 2, 500, 2), False),    # would end after 100: waits behind the gang
])
def test_backfill_starts_only_what_cannot_delay_the_gang(later: TraceJob,
                                                         backfilled: bool) -> None:
    fifo = by_key(replay([*BLOCKED, later], "fifo", 2, 4))
    easy = by_key(replay([*BLOCKED, later], "backfill", 2, 4))
    assert fifo["wide"].start == easy["wide"].start == 100
    assert fifo[later.key].start == 110
    assert easy[later.key].start == (2 if backfilled else 110)


def test_priority_lets_small_jobs_pass_and_fifo_does_not() -> None:
    jobs = [job("a", 0, 100, 3), job("b", 1, 10, 4), job("c", 2, 10, 1)]
    fifo = by_key(replay(jobs, "fifo", 1, 4))
    prio = by_key(replay(jobs, "priority", 1, 4))
    assert fifo["c"].start == 110 and prio["c"].start == 2 and prio["b"].start == 100


def test_drf_serves_the_project_with_the_lowest_share() -> None:
    jobs = [job("big-1", 0, 1000, 4, "big"), job("big-2", 1, 100, 4, "big"),
            job("big-3", 2, 10, 4, "big"), job("small-1", 3, 10, 4, "small")]
    fifo = by_key(replay(jobs, "fifo", 2, 4))
    drf = by_key(replay(jobs, "drf", 2, 4))
    # At t=101 "big" still holds half the cluster, "small" nothing: small goes first.
    assert fifo["big-3"].start == 101 and fifo["small-1"].start == 111
    assert drf["small-1"].start == 101 and drf["big-3"].start == 111


def test_metrics_and_dropped_jobs() -> None:
    result = run_jobs([job("a", 0, 100, 4), job("b", 0, 100, 4), job("huge", 0, 1, 64)],
                      "fifo", 1, 4)
    assert (result.jobs, result.dropped) == (2, 1)
    assert result.makespan_s == 200 and result.utilization_pct == pytest.approx(100.0)
    assert result.mean_queue_s == 50 and result.mean_jct_s == 150


@pytest.mark.parametrize("policy", POLICIES)
def test_tiresias_fixture_runs_every_job(policy: str) -> None:
    jobs = load_trace(TIRESIAS)
    records = replay(jobs, policy, 4, 4)
    assert len(records) == len(jobs) == 60
    assert all(r.start >= r.arrival and r.end == r.start + r.duration for r in records)
    # No over-commit: at every start, the GPUs held never exceed the cluster's.
    for r in records:
        held = sum(o.gpus for o in records if o.start <= r.start < o.end)
        assert held <= 16


def test_philly_trace_loads_projects_and_rebased_arrivals() -> None:
    jobs = load_trace(PHILLY, limit=500)
    assert len(jobs) == 500 and jobs[0].arrival == 0
    assert all(a.arrival <= b.arrival for a, b in zip(jobs, jobs[1:], strict=False))
    assert len({j.project for j in jobs}) > 1 and all(j.gpus >= 1 for j in jobs)


def test_unknown_columns_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(InvalidInput):
        load_trace(bad)


def test_cli_json_and_errors() -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["sim", "jobs", "--trace", str(TIRESIAS), "--nodes", "4",
                             "--gpus-per-node", "4", "--policy", "fifo,backfill",
                             "--output", "json"])
    assert ok.exit_code == 0, ok.output
    payload = json.loads(ok.output)
    assert [r["policy"] for r in payload] == ["fifo", "backfill"]
    assert {"mean_jct_s", "p99_jct_s", "mean_queue_s", "p99_queue_s", "utilization_pct",
            "makespan_s"} <= set(payload[0])
    bad = runner.invoke(app, ["sim", "jobs", "--trace", str(TIRESIAS), "--policy", "lifo"])
    assert bad.exit_code == 1 and "unknown policy" in bad.output
