"""``ClusterState.reloaded`` and ``Scheduler``'s reuse of it: a state rebuilt row by row
for the nodes that changed is the state a fresh build gives, and a schedule on it decides
as one on a fresh state does."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpucloud.scheduler import GpuState, NodeState, Scheduler
from gpucloud.scheduler.framework.cluster import ClusterState
from tests.unit.scheduler.builders import node, pod


def _assert_same(a: ClusterState, b: ClusterState) -> None:
    for key, value in a.__dict__.items():
        if isinstance(value, np.ndarray):
            assert np.array_equal(value, b.__dict__[key]), key
    assert (a.names, a.labels, a.gpu_index, a.loads) == (b.names, b.labels, b.gpu_index,
                                                          b.loads)
    assert a.num_classes == b.num_classes
    assert [a.model_names[m] if m >= 0 else None for m in a.node_model] == [
        b.model_names[m] if m >= 0 else None for m in b.node_model]


def _fleet(count: int) -> list[NodeState]:
    return [node(f"n{i:02d}").gpus(8 if i % 3 else 4, "A100-80GB" if i % 2 else "H100-80GB")
            .build() for i in range(count)]


_CHANGES = st.sampled_from(["used", "cordon", "not_ready", "fewer_gpus", "mig", "labels",
                            "cpu", "same_object", "equal_copy"])


def _changed(state: NodeState, change: str) -> NodeState:
    gpus = state.gpus
    if change == "used":
        return replace(state, gpus=(replace(gpus[0], used_milli=1000), *gpus[1:]))
    if change == "cordon":
        return replace(state, cordoned=True)
    if change == "not_ready":
        return replace(state, ready=False)
    if change == "fewer_gpus":  # a GPU failed its health check: it leaves the snapshot
        return replace(state, gpus=gpus[:-1])
    if change == "mig":
        return replace(state, gpus=(GpuState(**{**gpus[0].__dict__, "mig_mode": True,
                                                "mig_used": (0, 1)}), *gpus[1:]))
    if change == "labels":
        return replace(state, labels={"zone": "b"})
    if change == "cpu":
        return replace(state, cpu_used_milli=state.cpu_milli // 2)
    if change == "equal_copy":  # a new object equal to the old one: reloaded, same rows
        return replace(state)
    return state


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 11), _CHANGES), max_size=6))  # up to half
def test_a_state_reloaded_for_changed_nodes_is_the_state_built_afresh(
    changes: list[tuple[int, str]],
) -> None:
    old = _fleet(12)
    new = list(old)
    for i, change in changes:
        new[i] = _changed(new[i], change)
    reloaded = ClusterState.from_nodes(old).reloaded(old, new)
    assert reloaded is not None
    _assert_same(reloaded, ClusterState.from_nodes(new))


def test_rows_that_do_not_line_up_or_a_used_state_are_built_afresh() -> None:
    old = _fleet(4)
    base = ClusterState.from_nodes(old)
    assert base.reloaded(old, old[:3]) is None  # a node removed
    assert base.reloaded(old, [old[1], old[0], *old[2:]]) is None  # another order
    wider = node("n00").gpus(16).build()
    assert base.reloaded(old, [wider, *old[1:]]) is None  # more GPUs than columns
    assert base.reloaded(old, [replace(n) for n in old]) is None  # all new: build afresh
    committed = base.copy()
    committed.version = 1
    assert committed.reloaded(old, old) is None  # a working copy, not a built state


def test_the_scheduler_decides_on_a_reused_state_as_on_a_fresh_one() -> None:
    nodes = _fleet(6)
    pods = [pod(f"p{i}").gpus(4).build() for i in range(5)]
    warm = Scheduler("default")
    warm.schedule(nodes, pods)  # builds and keeps the state of ``nodes``
    nodes[2] = _changed(nodes[2], "cordon")
    nodes[4] = _changed(nodes[4], "used")
    assert warm.schedule(nodes, pods) == Scheduler("default").schedule(nodes, pods)
    # what a schedule commits to its working copy never leaks into the next one
    assert warm.schedule(nodes, pods) == Scheduler("default").schedule(nodes, pods)
    other = [replace(n) for n in nodes]  # another caller's snapshot (preemption's) between
    other[0] = _changed(other[0], "not_ready")
    for snapshot in (other, nodes, other, nodes):
        assert warm.schedule(snapshot, pods) == Scheduler("default").schedule(snapshot, pods)
