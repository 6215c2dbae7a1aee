"""Transparent checkpoints end to end: a counter that keeps its state only in memory runs
with ``--checkpoint transparent`` on a node whose CRIU canary passed; its node is drained,
the agent dumps the container on the notice (``runc checkpoint``), uploads the dump to the
checkpoint store, and the next attempt on another node is ``runc restore``d from it: the
new attempt's log counts on from exactly where the dump was taken.

Runs only where CRIU works on this machine (the canary of ``runtime/criu`` decides, as the
agent does); elsewhere it is skipped with the canary's reason, never passed unrun.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpucloud.runtime import criu
from tests.e2e.cluster import Cloud, wait_for
from tests.e2e.conftest import PushedImages

#: State only in memory: nothing but a restored process can continue the count.
COUNTER = ["sh", "-c", "i=0; while :; do i=$((i+1)); echo \"count $i\"; sleep 0.1; done"]


@pytest.fixture(scope="module")
def criu_works(tmp_path_factory: pytest.TempPathFactory) -> None:
    capability = criu.probe(tmp_path_factory.mktemp("canary"))
    if not capability.criu:
        pytest.skip(f"transparent checkpoints not run: {capability.criu_reason}")


def _counts(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^count (\d+)$", text, re.M)]


def test_a_drained_transparent_pod_is_restored_from_its_dump_on_another_node(
        criu_works: None, cloud: Cloud, images: PushedImages, tmp_path: Path) -> None:
    cloud.agent("tr-a", address="127.0.0.2")
    assert cloud.client.get_node("tr-a").capabilities.criu
    cloud.create_pod("mem", images.busybox, COUNTER, checkpoint="transparent")
    first = cloud.wait_pod("mem", "Running")
    assert first.node == "tr-a"
    cloud.wait_log("mem", "count 10")
    attempt = cloud.client.pod_logs("mem").attempt
    cloud.agent("tr-b", address="127.0.0.3")
    cloud.client.drain("tr-a", "60s")

    def moved() -> bool:
        pod = cloud.client.get_pod("mem")
        return pod.phase == "Running" and pod.node == "tr-b"

    wait_for(moved, 60, "the pod to run on tr-b")
    dumped = _counts(cloud.client.pod_logs(first.id, attempt=attempt).text)

    def counting() -> list[int] | None:
        after = _counts(cloud.client.pod_logs("mem").text)
        return after if len(after) >= 5 else None

    after = wait_for(counting, 30, "the restored counter to count on")
    assert after[0] == dumped[-1] + 1, (dumped[-3:], after[:3])
    assert after == list(range(after[0], after[0] + len(after)))
    reasons = [e.reason for e in cloud.client.pod_events("mem")]
    assert "CheckpointRestored" in reasons and "Checkpointed" in reasons
    assert cloud.client.list_checkpoints("mem")
