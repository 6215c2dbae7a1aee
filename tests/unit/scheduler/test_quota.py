"""Quota accounting: guarantees, borrowing limits, protection from borrowers, DRF shares."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpucloud.scheduler.quota import CPU, MEMORY, Ledger, Quota, drf_capacity, gpu_capacity
from tests.unit.scheduler.builders import GIB, node

H100 = "H100-80GB"


def _ledger(used: dict[str, int], **quotas: Quota) -> Ledger:
    ledger = Ledger(quotas)
    for project, gpus in used.items():
        ledger.add(project, H100, gpus * 1000)
    return ledger


@pytest.mark.parametrize(("used", "quota", "ask", "admits", "borrows"), [
    (0, Quota({H100: 8}, 0), 8, True, False),
    (8, Quota({H100: 8}, 0), 1, False, True),
    (8, Quota({H100: 8}, 2), 2, True, True),
    (9, Quota({H100: 8}, 2), 2, False, True),
    (0, Quota({}, 4), 4, True, True),
    (100, Quota({}, None), 8, True, True),
])
def test_admission_within_quota_and_borrow_limit(used: int, quota: Quota, ask: int,
                                                 admits: bool, borrows: bool) -> None:
    ledger = _ledger({"a": used}, a=quota)
    assert ledger.admits("a", "nvidia h100 80gb hbm3", ask * 1000) is admits
    assert ledger.would_borrow("a", H100, ask * 1000) is borrows


def test_a_project_without_quota_is_unlimited_and_unguaranteed() -> None:
    ledger = _ledger({"free": 16})
    assert ledger.admits("free", H100, 64_000)
    assert not ledger.protected("free", H100, 16_000)


@pytest.mark.parametrize(("used", "take", "protected"), [
    (10, 2, False), (10, 3, True), (8, 1, True), (4, 1, True),
])
def test_work_within_the_quota_is_protected(used: int, take: int, protected: bool) -> None:
    ledger = _ledger({"owner": used}, owner=Quota({H100: 8}, 4))
    assert ledger.protected("owner", H100, take * 1000) is protected


def test_over_quota_message_names_usage_and_limit() -> None:
    ledger = _ledger({"team-a": 8}, **{"team-a": Quota({H100: 8}, 0)})
    assert ledger.over_quota_message("team-a", "team-a", H100, 1000) == (
        "over quota: project team-a uses 8/8 H100-80GB GPUs, borrow limit 0; "
        "it asks for 1 more")


def test_dominant_share_is_the_largest_share_of_any_model() -> None:
    nodes = [node("a").gpus(8).build(), node("b").gpus(4, model="A100-80GB").build()]
    capacity = gpu_capacity(nodes)
    ledger = Ledger({})
    ledger.add("x", H100, 2000)
    ledger.add("x", "A100-80GB", 2000)
    ledger.add("y", H100, 6000)
    assert capacity == {H100: 8000, "A100-80GB": 4000}
    assert ledger.dominant_share("x", capacity) == 0.5
    assert ledger.dominant_share("y", capacity) == 0.75
    assert ledger.dominant_share("nobody", capacity) == 0.0


def test_dominant_share_counts_cpu_and_memory_over_ready_nodes() -> None:
    ready = node("a").gpus(8).cpu(64_000).memory(512).build()
    down = node("b").gpus(8).cpu(64_000).build()
    capacity = drf_capacity([ready, replace(down, ready=False)])
    assert capacity == {H100: 8000, CPU: 64_000, MEMORY: 512 * GIB}
    ledger = Ledger({})
    ledger.add("gpus", H100, 2000)                  # 1/4 of the GPUs
    ledger.hold("gpus", 1000, GIB)
    ledger.hold("cpu-heavy", 48_000, 64 * GIB)      # no GPU, 3/4 of the CPU
    assert ledger.dominant_share("gpus", capacity) == 0.25
    assert ledger.dominant_share("cpu-heavy", capacity) == 0.75
    # GPU-only capacity keeps the GPU-only view
    assert ledger.dominant_share("cpu-heavy", gpu_capacity([ready])) == 0.0
    ledger.hold("cpu-heavy", -48_000, -64 * GIB)
    assert ledger.dominant_share("cpu-heavy", capacity) == 0.0
