"""``Scheduler``: the entry point of the library for the control plane.

A snapshot (``NodeState``s) and pending pods in, one ``Decision`` per pod out. Pods are
placed in the given order, each seeing the effect of the earlier ones; inputs are never
mutated (the scheduler works on its own ``ClusterState`` copy of the snapshot).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gpucloud.scheduler.framework.cluster import Allocation, ClusterState
from gpucloud.scheduler.framework.registry import ProfileConfig, Registry
from gpucloud.scheduler.framework.runner import Framework, Outcome
from gpucloud.scheduler.mig import MIG_COMPUTE_SLICES, models_with_profile
from gpucloud.scheduler.registry import default_registry, profile_configs
from gpucloud.scheduler.types import (
    FULL_GPU_MILLI,
    Decision,
    Explanation,
    NodeState,
    Placement,
    PodRequest,
)


class Scheduler:
    """Places pods with the plugins of a named profile.

    ``config`` adds or replaces profiles (name -> mapping, as in a YAML config file);
    ``workload`` is the pod mix that fragmentation-aware scores measure against (by default
    the pods of each ``schedule`` call); ``seed`` makes random tie-breaks reproducible.
    """

    def __init__(self, profile: str = "default", *,
                 config: Mapping[str, Mapping[str, Any]] | None = None,
                 workload: Sequence[PodRequest] | None = None, seed: int = 0,
                 registry: Registry | None = None, shape_tables: bool = True) -> None:
        configs = profile_configs(config)
        if profile not in configs:
            known = ", ".join(sorted(configs))
            raise ValueError(f"unknown scheduler profile {profile!r} (known: {known})")
        self.profile_name = profile
        self._config: ProfileConfig = configs[profile]
        self._registry = registry or default_registry()
        self._workload = list(workload) if workload is not None else None
        self._seed = seed
        #: False: every plugin runs on every pod's candidates (framework/tables.py).
        self._shape_tables = shape_tables
        self._registry.build(self._config, {"workload": ()})  # fail fast on bad plugin names
        #: The last snapshots and the states built from them (never committed to): the
        #: next ``schedule`` reloads only the nodes that are new objects
        #: (``ClusterState.reloaded``). Two, as the pass and preemption alternate.
        self._built: deque[tuple[tuple[NodeState, ...], ClusterState]] = deque(maxlen=2)
        self._lock = threading.Lock()

    def framework(self, state: ClusterState, workload: Sequence[PodRequest]) -> Framework:
        """A framework running this profile on ``state`` (used by the simulator too)."""
        profile = self._registry.build(self._config, {"workload": workload})
        return Framework(profile, state, self._seed, self._shape_tables)

    def schedule(self, nodes: Sequence[NodeState], pods: Sequence[PodRequest]) -> list[Decision]:
        return list(self.decisions(nodes, pods))

    def decisions(self, nodes: Sequence[NodeState], pods: Sequence[PodRequest],
                  ) -> Iterator[Decision]:
        """``schedule``'s decisions one at a time, as they are made: a caller may act on
        the first ones (bind them) while the later ones are still to be decided."""
        state = self.cluster_state(nodes)
        workload = self._workload if self._workload is not None else pods
        framework = self.framework(state, workload)
        for pod in pods:
            yield _decision(pod, framework.schedule(pod), state)

    def cluster_state(self, nodes: Sequence[NodeState]) -> ClusterState:
        """A fresh working state for ``nodes``, reusing the rows of the last one built for
        the nodes passed again as the same (immutable) objects."""
        snapshot = tuple(nodes)
        with self._lock:
            built = list(self._built)
        base = None
        for old, state in reversed(built):  # the newest first
            base = state.reloaded(old, snapshot)
            if base is not None:
                break
        if base is None:
            base = ClusterState.from_nodes(snapshot)
        with self._lock:
            self._built.append((snapshot, base))
        return base.copy()


def _decision(pod: PodRequest, outcome: Outcome, state: ClusterState) -> Decision:
    if outcome.allocation is None:
        return Decision(pod.key, None, Explanation(dict(outcome.reasons)), outcome.status)
    return Decision(pod.key, to_placement(pod, outcome.allocation, state), None, outcome.status)


def to_placement(pod: PodRequest, allocation: Allocation, state: ClusterState) -> Placement:
    """The user-facing placement: node name, GPU index -> milli, MIG (profile, start)."""
    index = state.gpu_index[allocation.node]
    gpu_milli = {index[col]: milli for col, milli in allocation.gpu_milli.items()}
    mig: dict[int, tuple[str, int]] = {}
    for col, mask in (allocation.mig_slices or {}).items():
        start = (mask & -mask).bit_length() - 1
        mig[index[col]] = (str(pod.mig_profile), start)
        gpu_milli[index[col]] = _mig_milli(pod)
    return Placement(state.names[allocation.node], gpu_milli, mig)


def _mig_milli(pod: PodRequest) -> int:
    """A MIG instance's share of its GPU in milli-GPU (compute slices out of seven)."""
    compute = int(str(pod.mig_profile).split("g.", 1)[0]) if models_with_profile(
        str(pod.mig_profile)) else 0
    return compute * FULL_GPU_MILLI // MIG_COMPUTE_SLICES
