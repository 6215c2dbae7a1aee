"""Issue 10's "done when", end to end with real agents, runc and busybox sh.

A two-member ``--spot`` job counts, each member committing its counter to ``/ckpt`` (its
rank's own checkpoint directory) every few values. An on-demand pod that needs one of its
nodes preempts it: every member gets the notice (SIGTERM to its process group plus the
notice file) and commits the value it reached, which acknowledges the notice: the agent
stops it at once instead of waiting out the grace (it would exit 75 otherwise). The gang
is requeued as a unit and, kept off the nodes it was taken from, restarts on two other
simulated nodes, each member restored from its rank's last committed checkpoint. ``job
logs`` then shows each rank counting on from that value: none before it repeated, none
skipped. On SQLite and on PostgreSQL.

A second test shows the periodic checkpoint request firing in a running agent: with τ
clamped to about a second, the pod's SIGUSR1 trap commits a checkpoint each time it is
asked, and ``pod get`` shows the measured δ, M and τ.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucloud.core.jobs import JobOut
from tests.e2e.cluster import Cloud, running_cloud, wait_for
from tests.e2e.conftest import PushedImages

CKPT = "/run/gpucloud/bin/gpucloud-ckpt"
#: Counts every 0.1 s and commits every 5th value. SIGTERM only sets a flag: the loop
#: then commits the value it printed last and exits 75 ("requeue me"), so a value is never
#: printed without being part of what the next attempt resumes from (a trap that commits
#: by itself could run between the increment and the echo).
COUNTER = ["sh", "-c", f"""trap 'stop=1' TERM
n=0
if [ -f /ckpt/n ]; then n=$(cat /ckpt/n); echo "resumed $n"; fi
while true; do
  n=$((n + 1)); echo "count $n"
  if [ $((n % 5)) = 0 ]; then
    echo "$n" > /ckpt/n; {CKPT} commit > /dev/null && echo "committed $n"
  fi
  if [ -n "$stop" ]; then
    echo "$n" > /ckpt/n; {CKPT} commit > /dev/null && echo "noticed $n"; exit 75
  fi
  sleep 0.1
done"""]
SLEEPER = ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.2; done"]
ADDRESSES = {"sr-a": "127.0.0.2", "sr-b": "127.0.0.3", "sr-c": "127.0.0.4",
             "sr-d": "127.0.0.5"}




def _rank_lines(text: str, rank: int) -> list[str]:
    return [line.removeprefix(f"[{rank}] ") for line in text.splitlines()
            if line.startswith(f"[{rank}] ")]


def _values(lines: list[str], word: str) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := re.fullmatch(rf"{word} (\d+)", line))]


def _job(cloud: Cloud, name: str, check: str) -> JobOut:
    def done() -> JobOut | None:
        job = cloud.client.get_job(name)
        running = all(m.phase == "Running" for m in job.members)
        if check == "moved":
            running = running and all(m.node in ("sr-c", "sr-d") for m in job.members)
        return job if running else None

    return wait_for(done, 60, f"job {name} to be {check}")


def test_a_preempted_spot_job_resumes_each_rank_from_its_last_checkpoint_elsewhere(
        db_cloud: Cloud, images: PushedImages) -> None:
    cloud = db_cloud
    for name in ("sr-a", "sr-b"):
        cloud.agent(name, address=ADDRESSES[name])
    cloud.client.create_job({"name": "count", "image": images.busybox, "nodes": 2,
                             "gpus_per_node": 8, "spot": True, "grace": 20,
                             "checkpoint_dir": "/ckpt", "command": COUNTER})
    first = _job(cloud, "count", "running")
    taken = {m.node for m in first.members}
    assert taken == {"sr-a", "sr-b"}
    wait_for(lambda: cloud.client.job_logs("count").text.count("committed 10") == 2, 30,
             "both ranks to commit 10")

    cloud.create_pod("urgent", images.busybox, SLEEPER, gpus=8, priority_class="on-demand")
    urgent = cloud.wait_pod("urgent", "Running", timeout=20)  # well inside the 20 s grace
    assert urgent.node in taken
    for name in ("sr-c", "sr-d"):
        cloud.agent(name, address=ADDRESSES[name])
    moved = _job(cloud, "count", "moved")
    assert {m.node for m in moved.members} == {"sr-c", "sr-d"}

    every = ",".join(f"{m.rank}:1:0" for m in moved.members)  # from each rank's attempt 1

    def resumed_far() -> str | None:
        text = cloud.client.job_logs("count", offsets=every).text
        counts = [_values(_rank_lines(text, m.rank), "count") for m in moved.members]
        return text if all(c and c[-1] >= 25 for c in counts) else None

    text = wait_for(resumed_far, 40, "both ranks to count on past 25")
    for member in moved.members:
        _check_rank(_rank_lines(text, member.rank))
        pod = cloud.client.get_pod(member.pod)
        assert (pod.preemptions, pod.last_preemption_reason) == (1, "spot"), pod
        reasons = [e.reason for e in cloud.client.pod_events(member.pod)]
        assert "CheckpointRestored" in reasons and "CheckpointRejected" not in reasons
    assert "resumed" in cloud.client.job_logs("count").text  # the plain form: this attempt


def _check_rank(lines: list[str]) -> None:
    """Attempt 1 counts 1, 2, … up to where it was noticed; attempt 2 resumes from the last
    committed value and counts on: nothing before it again, nothing skipped."""
    split = next(i for i, line in enumerate(lines) if line.startswith("resumed "))
    before, after = lines[:split], lines[split:]
    counted = _values(before, "count")
    assert counted == list(range(1, len(counted) + 1)), before
    committed = _values(before, "committed")
    resumed = int(after[0].removeprefix("resumed "))
    # The commit after the notice acknowledged it (the agent then stopped the member at
    # once, maybe before it printed "noticed"): it covers the last value printed.
    assert committed and resumed >= max(committed), "\n".join(lines)
    # It resumes from its last committed value: the notice's own checkpoint (the last value
    # printed) when that committed, else the periodic one before it (on a loaded machine
    # the notice's commit was seen refused, or cut short by a second SIGTERM).
    assert resumed in (max(committed), counted[-1]), "\n".join(lines)
    again = _values(after, "count")
    assert again == list(range(resumed + 1, resumed + 1 + len(again))), after[:5]


#: Commits a checkpoint each time it is asked (SIGUSR1 to PID 1, runc kill), and only then.
ON_REQUEST = ["sh", "-c", f"""trap 'asked=1' USR1
trap 'exit 0' TERM
n=0
while true; do
  if [ -n "$asked" ]; then
    asked=; n=$((n + 1)); echo "$n" > /ckpt/n
    {CKPT} commit > /dev/null && echo "requested $n"
  fi
  sleep 0.1
done"""]


@pytest.fixture
def fast_interval_cloud(tmp_path: Path) -> Iterator[Cloud]:
    """τ clamped to [0.5 s, 1 s] (GPUCLOUD_CHECKPOINT_INTERVAL_MIN/MAX)."""
    with running_cloud(tmp_path, checkpoint_interval_min_seconds=0.5,
                       checkpoint_interval_max_seconds=1.0) as cloud:
        yield cloud


def test_the_periodic_checkpoint_request_fires_and_pod_get_shows_delta_m_tau(
        fast_interval_cloud: Cloud, images: PushedImages) -> None:
    cloud = fast_interval_cloud
    cloud.agent("iv-a")
    cloud.create_pod("asked", images.busybox, ON_REQUEST, checkpoint_dir="/ckpt")
    cloud.wait_pod("asked", "Running")
    text = cloud.wait_log("asked", "requested 3", timeout=30)
    assert _values(text.splitlines(), "requested")[:3] == [1, 2, 3]

    pod = cloud.client.get_pod("asked")
    assert pod.checkpoint_interval_seconds == 1.0  # Daly's τ, clamped to the maximum
    assert pod.interruption_mtbf_seconds is not None
    assert pod.interruption_mtbf_seconds >= 24 * 3600  # the prior: no interruption yet
    costs = [c.cost_seconds for c in cloud.client.list_checkpoints("asked")]
    assert pod.checkpoint_cost_seconds is not None and all(c is not None for c in costs)
    # δ is measured (the median of the commits' costs), not the 60 s default.
    assert 0 < pod.checkpoint_cost_seconds < 10
    events = [e for e in cloud.client.pod_events("asked") if e.reason == "Checkpointed"]
    assert len(events) >= 3
    gaps = [(b.time - a.time).total_seconds() for a, b in zip(events, events[1:], strict=False)]
    assert all(gap >= 0.5 for gap in gaps), gaps  # one commit per request, ≈ τ apart
