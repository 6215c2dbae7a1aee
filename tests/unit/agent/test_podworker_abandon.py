"""``PodWorker.abandon``: the container of a pod no longer assigned here is killed at once,
from the caller's (the poll's) thread, whatever the worker's own thread is held up in (a
write the server does not answer: tests/faults/test_asymmetric_partition.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import cast

from gpucloud.agent.podworker import NodeRuntime, PodWorker
from gpucloud.runtime.driver import ContainerState, ContainerStatus
from tests.unit.agent.test_agent_pieces import assignment

CID = "pod-1"


@dataclass
class FakeDriver:
    """What ``abandon`` asks of the runtime; ``stops`` records each stop asked."""

    root: Path
    state: ContainerState = ContainerState.RUNNING
    failure: OSError | None = None
    stops: list[tuple[str, float]] = field(default_factory=list)

    def paths(self, cid: str) -> SimpleNamespace:
        return SimpleNamespace(supervisor_pid=self.root / cid / "supervisor.pid")

    def status(self, cid: str) -> ContainerStatus:
        return ContainerStatus(cid, self.state)

    def stop(self, cid: str, grace_seconds: float) -> None:
        if self.failure is not None:
            raise self.failure
        self.stops.append((cid, grace_seconds))

    def started(self) -> FakeDriver:
        """The container's supervisor has started it (its pid file is written)."""
        (self.root / CID).mkdir()
        (self.root / CID / "supervisor.pid").write_text("1")
        return self


def worker(driver: FakeDriver) -> PodWorker:
    """A worker whose thread never runs: as one held up in a write all along."""
    return PodWorker(cast(NodeRuntime, SimpleNamespace(driver=driver)), CID,
                     assignment("pod"))


def test_abandoning_kills_the_started_container_at_once_and_once(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path).started()
    held_up = worker(driver)
    held_up.abandon()
    assert driver.stops == [(CID, 0.0)]  # no grace: the pod runs elsewhere, or is deleted
    assert held_up.current is None  # and the worker will clean up without reporting
    held_up.abandon()  # every later answer that omits the pod abandons it again
    assert driver.stops == [(CID, 0.0)]


def test_abandoning_leaves_what_is_not_running_to_the_worker(tmp_path: Path) -> None:
    not_started = FakeDriver(tmp_path)  # the worker's own start checks abandonment
    worker(not_started).abandon()
    ended = FakeDriver(tmp_path, ContainerState.EXITED).started()
    worker(ended).abandon()
    assert not_started.stops == ended.stops == []


def test_a_stop_signalled_already_keeps_its_grace(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path).started()
    stopping = worker(driver)
    stopping._stop_signalled = True  # the watch loop sent SIGTERM with the pod's grace
    stopping.abandon()
    assert driver.stops == []


def test_a_container_removed_meanwhile_is_no_error(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path, failure=FileNotFoundError("stop.json")).started()
    worker(driver).abandon()  # the poll thread goes on
