"""Invariant: a node's wall clock stepped an hour forward or back while its pod runs
changes nothing the cloud sees: the node stays Ready on the same grant (its lease is
renewed on the monotonic clock: no Lost, no new grant, the same fencing token), the pod
keeps running where it was (not restarted, not moved) and its log keeps flowing, and no
usage is lost: every sample the agent takes is accepted (sequence numbers without a gap),
stamped on the server's timeline, so sample times rise with the sequence and stay close
to when the server received them, however wrong the node's clock is.

The agent runs under libfaketime (tests/fixtures/faketime.py) with a relative offset read
from a file the test rewrites: ``+0``, then ``+3600`` (an hour ahead), ``-3600`` (two hours
back: an hour behind), ``+0`` (in step again), each step landing while the agent runs.
Everything the agent starts (runc, the pods' supervisors) inherits it, as a step of the
node's clock reaches every process there.

Before agent/server_time.py the agent stamped samples with its wall clock: an hour ahead,
the server refused every sample (422, "more than 120s ahead of the server's clock") and
the agent dropped them; an hour behind, they were stored an hour in the past, out of order.

A step counts once the agent itself shows it: a line it logs after the step carries the
stepped time (it warns when its clock is off the server's, agent/server_time.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.e2e.cluster import AgentProcess, wait_for
from tests.faults.cluster import COUNTER, IMAGE, FaultCloud, Postgres, running
from tests.fixtures.faketime import FakeClock, fake_clock

#: Seconds between usage samples: many samples in each phase, in little time.
INTERVAL = 0.5
#: The node's clock, step by step: an hour ahead, an hour behind, in step again.
STEPS = ("+3600", "-3600", "+0")
#: Samples accepted after the agent showed a step, before the next one.
PER_STEP = 4


@pytest.fixture
def clock(tmp_path: Path) -> Iterator[FakeClock]:
    """The node's clock (tests/fixtures/faketime.py)."""
    with fake_clock(tmp_path / "clock") as node_clock:
        yield node_clock


def _agent_saw(agent: AgentProcess, since: int, seconds: float) -> bool:
    """A line the agent logged after byte ``since`` of its log is stamped ``seconds`` off
    the test's clock (its log's times are local, as the test's ``datetime.now()``)."""
    with agent.log.open("rb") as log:
        log.seek(since)
        text = log.read().decode(errors="replace")
    now = datetime.now()
    for line in text.splitlines():
        try:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        except ValueError:
            continue
        if abs((stamp - now).total_seconds() - seconds) < 30:
            return True
    return False


def _samples(pg: Postgres, database: str, pod_id: str) -> list[tuple[int, datetime, datetime]]:
    """The pod's accepted samples: (seq, time, received_at), in sequence."""
    return [(int(seq), at, received) for seq, at, received in pg.sql(
        "SELECT seq, time, received_at FROM usage_samples WHERE pod_id = %s ORDER BY seq",
        pod_id, dbname=database)]


def _log_lines(cloud: FaultCloud) -> int:
    return cloud.client.pod_logs("ticker").text.count("\n")


def _step(cloud: FaultCloud, agent: AgentProcess, clock: FakeClock, offset: str,
          accepted: Callable[[], int]) -> None:
    """Step the node's clock to ``offset``; once the agent shows it, ``PER_STEP`` more
    samples accepted (``accepted``: the highest accepted seq) and more log lines."""
    mark = agent.log.stat().st_size
    clock.set(offset)
    wait_for(lambda: agent.alive() and _agent_saw(agent, mark, float(offset)), 15,
             f"the agent to show its clock stepped to {offset}")
    last, lines = accepted(), _log_lines(cloud)
    try:
        wait_for(lambda: accepted() >= last + PER_STEP, 15,
                 f"samples accepted after the node's clock stepped to {offset}")
    except pytest.fail.Exception as timed_out:
        refused = [line for line in agent.log.read_text(errors="replace").splitlines()
                   if "refused" in line]
        pytest.fail(f"{timed_out}; the agent's refusals: {refused[-3:]}")
    wait_for(lambda: _log_lines(cloud) > lines, 10,
             f"the pod's log to flow after the clock stepped to {offset}")


def test_a_node_clock_step_loses_no_usage_and_moves_nothing(
    clock: FakeClock, cloud: FaultCloud, pg: Postgres, database_url: str
) -> None:
    database = database_url.rsplit("/", 1)[1]
    agent = cloud.node_agent("gpu-a", prefix=clock.prefix, start=False)
    agent.args += ["--usage-interval", str(INTERVAL)]
    agent.start()
    cloud.wait_started(agent)
    token = cloud.client.get_node("gpu-a").fencing_token
    pod = cloud.create_pod("ticker", IMAGE, COUNTER, gpus=1, restart="always")
    cloud.wait_pod("ticker", "Running")
    cloud.wait_log("ticker", "line 3\n")
    wait_for(lambda: len(_samples(pg, database, pod.id)) >= PER_STEP, 20,
             "the pod's first samples")

    for offset in STEPS:
        _step(cloud, agent, clock, offset, lambda: _samples(pg, database, pod.id)[-1][0])
        node = cloud.client.get_node("gpu-a")
        assert (node.status, node.fencing_token) == ("Ready", token), offset
        now = cloud.client.get_pod("ticker")
        assert (now.phase, now.node, now.restart_count) == ("Running", "gpu-a", 0), offset

    samples = _samples(pg, database, pod.id)
    assert [seq for seq, _, _ in samples] == list(range(len(samples)))  # none dropped
    times = [at for _, at, _ in samples]
    assert times == sorted(times) and len(set(times)) == len(times), times
    for seq, at, received in samples:  # on the server's clock: taken, then sent at once
        assert received - timedelta(seconds=10) < at <= received + timedelta(seconds=1), \
            (seq, at, received)
    assert len(running(agent)) == 1
    assert "refused" not in agent.log.read_text(errors="replace")
