"""Invariant: a node's wall clock stepped an hour forward or back while its pod runs
changes nothing the cloud sees: the node stays Ready on the same grant (its lease is
renewed on the monotonic clock: no Lost, no new grant, the same fencing token), the pod
keeps running where it was (not restarted, not moved) and its log keeps flowing, and no
usage is lost: every sample the agent takes is accepted (sequence numbers without a gap),
stamped on the server's timeline, so sample times rise with the sequence and stay close
to when the server received them, however wrong the node's clock is.

The agent runs under libfaketime (Debian's ``faketime``) with a relative offset read from
a file the test rewrites (``FAKETIME_TIMESTAMP_FILE``): ``+0``, then ``+3600`` (an hour
ahead), ``-3600`` (two hours back: an hour behind), ``+0`` (in step again).
``FAKETIME_DONT_FAKE_MONOTONIC=1``: a real step of the clock (``settimeofday``) leaves
CLOCK_MONOTONIC alone; ``FAKETIME_CACHE_DURATION=1``: the file is read again every second,
so each step lands while the agent runs. Everything the agent starts (runc, the pods'
supervisors) inherits it, as a step of the node's clock reaches every process there. A
shim preloaded ahead of it (``monotonic_sleep.c``) works around libfaketime 0.9.10's
broken monotonic sleeps.

Before agent/server_time.py the agent stamped samples with its wall clock: an hour ahead,
the server refused every sample (422, "more than 120s ahead of the server's clock") and
the agent dropped them; an hour behind, they were stored an hour in the past, out of order.

A step counts once the agent itself shows it: a line it logs after the step carries the
stepped time (it warns when its clock is off the server's, agent/server_time.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.e2e.cluster import AgentProcess, wait_for
from tests.faults.cluster import COUNTER, IMAGE, FaultCloud, Postgres, pid_alive, running

#: Debian's libfaketime (package faketime), in the machine's multiarch directory.
LIBFAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))),
                   Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"))
SHIM_SOURCE = Path(__file__).with_name("monotonic_sleep.c")
#: Where libfaketime keeps the semaphore and shared memory of each process it starts in.
SHM = Path("/dev/shm")
#: Seconds between usage samples: many samples in each phase, in little time.
INTERVAL = 0.5
#: The node's clock, step by step: an hour ahead, an hour behind, in step again.
STEPS = ("+3600", "-3600", "+0")
#: Samples accepted after the agent showed a step, before the next one.
PER_STEP = 4


class NodeClock:
    """libfaketime's offset file and the command prefix that runs a program on it."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.file = directory / "faketimerc"
        self.set("+0")
        shim = directory / "monotonic_sleep.so"
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(shim), str(SHIM_SOURCE)],
                       check=True, capture_output=True)
        self.env = {"LD_PRELOAD": f"{shim} {LIBFAKETIME}",
                    "FAKETIME_TIMESTAMP_FILE": str(self.file),
                    "FAKETIME_CACHE_DURATION": "1",
                    "FAKETIME_DONT_FAKE_MONOTONIC": "1"}

    @property
    def prefix(self) -> list[str]:
        return ["env", *(f"{name}={value}" for name, value in self.env.items())]

    def set(self, offset: str) -> None:
        """Step the clock (whole: libfaketime never reads half a file)."""
        partial = self.file.with_suffix(".new")
        partial.write_text(offset + "\n")
        os.replace(partial, self.file)


@pytest.fixture
def clock(tmp_path: Path) -> Iterator[NodeClock]:
    """The node's clock, checked on a probe: Python under it sees a step of the wall
    clock, not of the monotonic clock, and can still sleep. Afterwards the semaphore and
    shared memory libfaketime made for a process that did not exit (the agent is killed)
    are removed."""
    if not LIBFAKETIME.exists():
        pytest.skip(f"needs libfaketime ({LIBFAKETIME}: Debian package faketime)")
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the shim preloaded with libfaketime")
    clock = NodeClock(tmp_path / "clock")
    clock.set("+3600")
    probe = subprocess.run(
        [*clock.prefix, sys.executable, "-c",
         "import time; time.sleep(0.01); print(time.time(), time.monotonic())"],
        check=True, capture_output=True, text=True, timeout=30)
    wall, monotonic = map(float, probe.stdout.split())
    clock.set("+0")
    assert abs(wall - time.time() - 3600) < 60, probe.stdout
    assert abs(monotonic - time.monotonic()) < 60, probe.stdout
    before = set(SHM.glob("*faketime_*"))
    yield clock
    for path in set(SHM.glob("*faketime_*")) - before:
        pid = path.name.rsplit("_", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            path.unlink(missing_ok=True)


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


def _step(cloud: FaultCloud, agent: AgentProcess, clock: NodeClock, offset: str,
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
    clock: NodeClock, cloud: FaultCloud, pg: Postgres, database_url: str
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
