"""MIG slot rules and topology-aware GPU choice."""

from __future__ import annotations

import pytest

from gpucloud.scheduler import Scheduler
from gpucloud.scheduler.mig import MIG_PROFILES, best_start, fits, geometry

from .builders import node, pod


@pytest.mark.parametrize(("profile", "limit"), [
    ("1g.10gb", 7), ("1g.20gb", 4), ("2g.20gb", 3), ("3g.40gb", 2), ("4g.40gb", 1),
    ("7g.80gb", 1),
])
def test_per_gpu_limits_on_h100(profile: str, limit: int) -> None:
    decisions = Scheduler().schedule([node("a").gpus(1).build()],
                                     [pod(f"p{i}").mig(profile).build() for i in range(limit + 1)])
    placed = [d for d in decisions if d.placement is not None]
    assert len(placed) == limit
    starts = sorted(d.placement.mig[0][1] for d in placed if d.placement)
    geom = geometry("H100-80GB", profile)
    assert geom is not None and set(starts) <= set(geom.starts)


@pytest.mark.parametrize(("model", "profile", "ok"), [
    ("A100-40GB", "1g.5gb", True), ("A100-40GB", "3g.20gb", True),
    ("A100-40GB", "7g.80gb", False),
    ("A100-80GB", "7g.80gb", True), ("H200-141GB", "3g.71gb", True),
    ("H200-141GB", "3g.40gb", False),
    ("T4", "1g.10gb", False),
])
def test_profiles_by_model(model: str, profile: str, ok: bool) -> None:
    assert (geometry(model, profile) is not None) is ok


@pytest.mark.parametrize(("used", "profile", "expected"), [
    (0, "3g.40gb", 4),            # keeps 0-3 for a 4g
    (0b00001111, "3g.40gb", 4),
    (0b11110000, "4g.40gb", 0),
    (0b00000001, "4g.40gb", None),
    (0b01111111, "1g.10gb", None),  # the small 1g cannot start at slot 7
    (0, "7g.80gb", 0),
])
def test_start_slots(used: int, profile: str, expected: int | None) -> None:
    geom = MIG_PROFILES["H100-80GB"][profile]
    assert best_start(geom, used) == expected
    assert fits(geom, used) is (expected is not None)


def test_mig_and_shares_never_mix_on_a_gpu() -> None:
    nodes = [node("a").gpus(1).build()]
    decisions = Scheduler().schedule(nodes, [pod("s").share(100).build(),
                                             pod("m").mig("1g.10gb").build()])
    assert decisions[0].placement is not None
    assert decisions[1].placement is None


def test_mig_prefers_a_gpu_already_in_mig_mode() -> None:
    nodes = [node("a").gpus(2).build()]
    decisions = Scheduler().schedule(nodes, [pod("m1").mig("1g.10gb").build(),
                                             pod("m2").mig("1g.10gb").build()])
    gpus = [next(iter(d.placement.mig)) for d in decisions if d.placement]
    assert gpus[0] == gpus[1]


def test_multi_gpu_pod_stays_in_one_nvlink_domain() -> None:
    # GPUs 0-3 and 4-7 form two NVLink domains; 0 and 5 are busy.
    peers_a, peers_b = (0, 1, 2, 3), (4, 5, 6, 7)
    builder = node("a")
    from_state = builder.gpus(8, used=(1000, 0, 0, 0, 0, 1000, 0, 0), numa_split=True).build()
    gpus = tuple(g.__class__(**{**g.__dict__, "nvlink_peers": peers_a if g.index < 4 else peers_b})
                 for g in from_state.gpus)
    state = from_state.__class__(**{**from_state.__dict__, "gpus": gpus})
    [decision] = Scheduler().schedule([state], [pod().gpus(3).build()])
    assert decision.placement is not None
    chosen = set(decision.placement.gpu_milli)
    assert chosen in ({1, 2, 3}, {4, 6, 7})


def test_topology_score_prefers_node_with_whole_domain() -> None:
    split = node("a").gpus(8, used=(1000, 0, 0, 0, 1000, 0, 0, 0), numa_split=True).build()
    whole = node("b").gpus(8, used=(1000, 1000, 0, 0, 0, 0, 0, 0), numa_split=True).build()
    [decision] = Scheduler().schedule([split, whole], [pod().gpus(4).build()])
    assert decision.placement is not None and decision.placement.node == "b"
    assert set(decision.placement.gpu_milli) == {4, 5, 6, 7}
