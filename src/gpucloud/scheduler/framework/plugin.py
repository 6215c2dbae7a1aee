"""Extension points of the scheduling framework (after the Kubernetes scheduling framework).

A scheduling attempt for one pod runs, in order:

* **pre-filter** — compute per-pod state once (``Cycle``): the GPUs the pod may use, its
  resolved MIG geometry; may reject the pod outright with a ``Status``;
* **filter** — vectorised feasibility over candidate nodes (all of them, or a random
  sample on a large cluster): each plugin returns, per reason, the mask of the candidates
  it rejects (every rejection carries a reason);
* **score** — rank the feasible candidates (higher is better), weighted by the profile;
* **reserve** — choose the GPUs on the winning node and return the ``Allocation`` to commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from gpucloud.scheduler.framework.cluster import (
    Allocation,
    BoolArray,
    ClusterState,
    FloatArray,
    IntArray,
)
from gpucloud.scheduler.framework.status import Status
from gpucloud.scheduler.mig import MigGeometry
from gpucloud.scheduler.types import PodRequest

Rejections = list[tuple[str, BoolArray]]


@dataclass
class Cycle:
    """Per-pod state, computed once by pre-filter and read by every later plugin."""

    pod: PodRequest
    whole: int
    milli: int
    cpu_milli: int
    memory_bytes: int
    eligible: BoolArray  # [N, G] GPUs this pod may use (exists, model, memory)
    eligible_count: IntArray  # [N] how many GPUs of each node the pod may use
    eligible_nodes: BoolArray  # [N] nodes with at least one such GPU
    rng: np.random.Generator
    mig: MigGeometry | None = None  # set when the pod asks for a MIG instance
    mig_by_model: dict[int, MigGeometry] = field(default_factory=dict)  # model id -> shape
    model_label: str = ""
    scratch: dict[str, object] = field(default_factory=dict)

    @property
    def wants_gpu(self) -> bool:
        return self.whole > 0 or self.milli > 0 or self.mig is not None

    @property
    def gpu_request_milli(self) -> int:
        return self.whole * 1000 + self.milli


class Plugin(Protocol):
    name: str


class PreFilterPlugin(Plugin, Protocol):
    def pre_filter(self, cycle: Cycle, state: ClusterState) -> Status: ...


class FilterPlugin(Plugin, Protocol):
    def filter(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> Rejections: ...


class ScorePlugin(Plugin, Protocol):
    def score(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> FloatArray: ...


class ReservePlugin(Plugin, Protocol):
    def reserve(self, cycle: Cycle, state: ClusterState, node: int) -> Allocation | None: ...


@runtime_checkable
class CommitListener(Protocol):
    """Optional hook: told about every committed allocation (to keep plugin bookkeeping)."""

    def committed(self, cycle: Cycle, state: ClusterState, allocation: Allocation) -> None: ...
