"""Snapshot and result types of the scheduler: what goes in, what comes out.

All are frozen dataclasses: the scheduler never mutates its inputs. ``NodeState`` and
``GpuState`` describe a cluster snapshot; ``PodRequest`` one unit of pending work;
``Decision`` the outcome for one pod (a ``Placement`` or an ``Explanation``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpucloud.scheduler.framework.status import Code, Status

FULL_GPU_MILLI = 1000


@dataclass(frozen=True)
class GpuState:
    """One GPU of a node; ``used_milli`` (0..1000) is already taken by running pods.

    ``mig_used`` lists the memory slices (0..7) taken by MIG instances on this GPU; a GPU
    with MIG instances takes no time-sliced shares, and the reverse.
    """

    index: int
    uuid: str
    model: str
    memory_mib: int
    numa_node: int = 0
    nvlink_peers: tuple[int, ...] = ()
    used_milli: int = 0
    pcie_switch: int = 0
    mig_used: tuple[int, ...] = ()


@dataclass(frozen=True)
class NodeState:
    """A node as the scheduler sees it: capacity, what is used, GPUs, labels, condition."""

    name: str
    cpu_milli: int
    memory_bytes: int
    gpus: tuple[GpuState, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    cordoned: bool = False
    ready: bool = True
    cpu_used_milli: int = 0
    memory_used_bytes: int = 0


@dataclass(frozen=True)
class PodRequest:
    """Pending work: ``gpus`` whole GPUs, or ``gpu_milli`` (1..999) of one GPU, or a MIG slice.

    ``gpu_model`` may list alternatives separated by ``|`` (as the Alibaba trace does);
    ``node_selector`` labels must all match the node's labels; ``required_node``, when set,
    is the only node the pod may go to (a stopped pod's volume disk lives there).
    """

    key: str
    gpus: int = 0
    gpu_milli: int = 0
    gpu_model: str | None = None
    cpu_milli: int = 0
    memory_bytes: int = 0
    mig_profile: str | None = None
    min_gpu_memory_mib: int | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    required_node: str | None = None

    @property
    def gpu_request_milli(self) -> int:
        """GPU milli this pod takes in total (a MIG slice counts as its share of the GPU)."""
        return self.gpus * FULL_GPU_MILLI + self.gpu_milli


@dataclass(frozen=True)
class Placement:
    """Where a pod goes: node name and GPU index -> milli taken (1000 for a whole GPU).

    ``mig`` maps a GPU index to (profile, start slot) for a MIG placement.
    """

    node: str
    gpu_milli: dict[int, int]
    mig: dict[int, tuple[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Explanation:
    """Why a pod could not be placed: reason -> number of nodes rejected for it."""

    reasons: dict[str, int]

    def summary(self) -> str:
        """``3 nodes: not enough free GPUs; 1 node: cordoned`` — most nodes first."""
        if not self.reasons:
            return "no nodes in the cluster"
        ordered = sorted(self.reasons.items(), key=lambda item: (-item[1], item[0]))
        return "; ".join(f"{n} node{'' if n == 1 else 's'}: {reason}" for reason, n in ordered)


@dataclass(frozen=True)
class Decision:
    """The outcome for one pod: a placement, or an explanation of why there is none."""

    pod_key: str
    placement: Placement | None
    explanation: Explanation | None
    status: Status = field(default_factory=lambda: Status(Code.SUCCESS))
