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

    ``mig_mode``: the GPU's MIG mode as its node reports it: on (True: MIG pods only, since
    a GPU in MIG mode runs no other CUDA work), off (False: no MIG pods), or not said (None,
    trace simulations: either kind, a free GPU may switch). ``mig_layout``: None where
    instances are made as MIG pods are placed (dynamic policy); under a fixed policy the
    (profile, start slot) of each instance the node has, and a MIG pod takes a free one.
    ``memory_used_mib``: the memory limits of the shares already on this GPU (MPS limits
    add up; a share without a limit counts none).
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
    mig_mode: bool | None = None
    mig_layout: tuple[tuple[str, int], ...] | None = None
    memory_used_mib: int = 0


@dataclass(frozen=True)
class NodeLoad:
    """What a node really uses, for load-aware placement (``plugins/loadaware.py``).

    ``cpu_milli``/``memory_bytes`` are smoothed (EWMA) use, scored; the ``*_peak`` figures
    are the max of the recent samples, filtered on. Both already count the estimates of the
    node's pods not yet reported and leave out pods ended since the sample
    (``loadaware.estimate_load`` builds it). ``requested_*`` are the requests of the pods
    counted in it, so pods placed later (in the same pass) are estimated from the growth of
    the node's requests. ``age_seconds``: age of the newest sample when the snapshot was
    taken. ``gpu_util``/``gpu_requested_milli``: GPU index -> percent / milli requested
    (shared GPUs only).
    """

    age_seconds: float
    cpu_milli: float
    memory_bytes: float
    cpu_peak_milli: float
    memory_peak_bytes: float
    requested_cpu_milli: int
    requested_memory_bytes: int
    gpu_util: dict[int, float] = field(default_factory=dict)
    gpu_requested_milli: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeState:
    """A node as the scheduler sees it: capacity, what is used, GPUs, labels, condition.

    ``load`` is its observed use (None: no metrics, load-aware plugins fail open).
    """

    name: str
    cpu_milli: int
    memory_bytes: int
    gpus: tuple[GpuState, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    cordoned: bool = False
    ready: bool = True
    cpu_used_milli: int = 0
    memory_used_bytes: int = 0
    load: NodeLoad | None = None


@dataclass(frozen=True)
class PodRequest:
    """Pending work: ``gpus`` whole GPUs, or ``gpu_milli`` (1..999) of one GPU, or a MIG slice.

    ``gpu_model`` may list alternatives separated by ``|`` (as the Alibaba trace does);
    ``node_selector`` labels must all match the node's labels; ``required_node``, when set,
    is the only node the pod may go to (a stopped pod's volume disk lives there).
    ``gpu_memory_mib``: a share's device memory limit; the share goes only to a GPU with at
    least that much memory not yet promised to other shares' limits.
    """

    key: str
    gpus: int = 0
    gpu_milli: int = 0
    gpu_model: str | None = None
    cpu_milli: int = 0
    memory_bytes: int = 0
    mig_profile: str | None = None
    min_gpu_memory_mib: int | None = None
    gpu_memory_mib: int = 0
    node_selector: dict[str, str] = field(default_factory=dict)
    required_node: str | None = None
    #: Nodes the pod must not go to (it was just preempted there).
    avoid_nodes: tuple[str, ...] = ()

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
