"""The agent's pure pieces, without a cloud: the reconcile plan, how an ended container is
reported, container ids, UTF-8 cuts in log chunks, labels, back-off."""

from __future__ import annotations

import threading

import pytest

from gpucloud.agent.backoff import Backoff
from gpucloud.agent.config import parse_labels
from gpucloud.agent.logship import complete_utf8_prefix
from gpucloud.agent.plan import plan
from gpucloud.agent.podworker import outcome_of, parse_container_id, reason_line
from gpucloud.core.errors import InvalidInput
from gpucloud.core.models import AssignmentOut
from gpucloud.core.phases import PodPhase
from gpucloud.runtime.driver import ContainerState, ContainerStatus, ExitInfo


def assignment(pod_id: str, attempt: int = 1, desired: str = "running") -> AssignmentOut:
    return AssignmentOut(pod_id=pod_id, name=f"pod-{pod_id}", project="p", attempt=attempt,
                         desired_state=desired, phase=PodPhase.SCHEDULED, image="busybox",
                         command=[], env={}, ports=[], cpu_milli=1000,
                         memory_bytes=1 << 30, gpu_uuids=[])


def test_plan_starts_new_updates_known_abandons_gone_and_reaps_orphans() -> None:
    assigned = [assignment("a"), assignment("b"), assignment("c", attempt=2),
                assignment("d")]
    steps = plan(assigned, workers={"b-1", "x-1"},
                 containers={"b-1", "c-1", "x-1", "y-3", "d-1"}, finished={"d-1"})
    assert [a.pod_id for a in steps.start] == ["a", "c"]  # c is a new attempt
    assert [a.pod_id for a in steps.update] == ["b"]
    assert steps.abandon == ["x-1"]  # its pod is no longer assigned here
    assert sorted(steps.reap) == ["c-1", "y-3"]  # no worker, not wanted
    # d-1 finished: a stale snapshot listing it must not run it again
    assert "d" not in [a.pod_id for a in steps.start + steps.update]


def _ended(**fields: object) -> ContainerStatus:
    info = ExitInfo(**{"exit_code": 0, "started_at": 1.0, **fields})  # type: ignore[arg-type]
    return ContainerStatus("c", ContainerState.EXITED, exit=info)


@pytest.mark.parametrize(("status", "phase", "code", "reason"), [
    (_ended(), PodPhase.SUCCEEDED, 0, "Completed"),
    (_ended(exit_code=3), PodPhase.FAILED, 3, None),
    (_ended(exit_code=137, signal=9, oom_killed=True), PodPhase.FAILED, 137, "OOMKilled"),
    (_ended(exit_code=143, signal=15, stop_requested=True), PodPhase.STOPPED, 143, "Stopped"),
    (_ended(exit_code=None, started_at=None, error="container failed: no such dir"),
     PodPhase.FAILED, None, "container failed: no such dir"),
    (ContainerStatus("c", ContainerState.LOST), PodPhase.FAILED, None, "ContainerLost"),
])
def test_outcome_of_an_ended_container(status: ContainerStatus, phase: PodPhase,
                                       code: int | None, reason: str | None) -> None:
    outcome = outcome_of(status, 64 << 20)
    assert (outcome.phase, outcome.exit_code, outcome.reason) == (phase, code, reason)
    if reason == "OOMKilled":
        assert "64Mi" in (outcome.message or "")


def test_container_ids_and_reasons() -> None:
    assert parse_container_id("01a22aba0338000000000000000000ff-12") == (
        "01a22aba0338000000000000000000ff", 12)
    assert parse_container_id("not-an-attempt") is None
    assert parse_container_id("12") is None
    assert reason_line("first\nsecond") == "first"
    assert len(reason_line("x" * 500)) == 200


def test_log_chunks_never_cut_a_character() -> None:
    data = "héllo €𝄞".encode()
    cuts = [complete_utf8_prefix(data[:n]) for n in range(len(data) + 1)]
    for n, cut in enumerate(cuts):
        assert cut <= n
        data[:cut].decode()  # always decodable
    assert cuts[-1] == len(data)
    assert complete_utf8_prefix(b"\xff\xfe") == 2  # invalid bytes go as they are


def test_labels() -> None:
    assert parse_labels(["zone=z1", "rack = r7", "empty="]) == {
        "zone": "z1", "rack": "r7", "empty": ""}
    with pytest.raises(InvalidInput, match="KEY=VALUE"):
        parse_labels(["zone"])


def test_backoff_grows_to_its_cap_and_stops_early() -> None:
    backoff = Backoff(base=0.1, cap=1.0)
    delays = [backoff.next_delay() for _ in range(8)]
    assert 0.05 <= delays[0] <= 0.1 and all(d <= 1.0 for d in delays)
    assert delays[-1] >= 0.5
    stop = threading.Event()
    stop.set()
    assert backoff.wait(stop)
