"""``--checkpoint transparent``: who may ask for it, and whether any node can serve it.

The node capability ``criu`` comes from the agent's dump-and-restore canary
(``runtime/criu``), never from ``criu check`` alone. A request is refused (422 naming
``checkpoint``) when no registered, live node has it, quoting the nodes' canary failures;
and, whatever the nodes can do, for shares of a GPU (MPS or time-slicing: cuda-checkpoint
does not support them) and for multi-node jobs (NCCL/RDMA connections between members
cannot be restored). Whole GPUs need a node that also has NVIDIA's ``cuda-checkpoint``
(runtime/cuda_checkpoint suspends the CUDA processes around the dump). Placement then keeps
such pods on capable nodes (``CRIU_LABEL``, and ``CUDA_CHECKPOINT_LABEL`` for GPU pods).
"""

from __future__ import annotations

from sqlalchemy import select

from gpucloud.core.capabilities import (
    CHECKPOINT_TRANSPARENT,
    CRIU_LABEL,
    CUDA_CHECKPOINT_LABEL,
    NodeCapabilities,
)
from gpucloud.core.errors import InvalidInput
from gpucloud.core.phases import NodeStatus
from gpucloud.core.spec import ContainerSpec
from gpucloud.db.models import NodeModel
from gpucloud.services.context import ServiceContext

MAX_REASONS_SHOWN = 3


def check_transparent(ctx: ServiceContext, spec: ContainerSpec, *, gpus: float = 0,
                      nodes: int = 1, job: bool = False) -> None:
    """Refuse ``--checkpoint transparent`` where it cannot work (see the module)."""
    if spec.checkpoint != CHECKPOINT_TRANSPARENT:
        return
    if nodes > 1:
        raise InvalidInput("checkpoint", "transparent checkpoints are not available for "
                           "multi-node jobs (connections between members cannot be restored)")
    if job:
        raise InvalidInput("checkpoint", "transparent checkpoints are for pods: a job's "
                           "members start together at a barrier, which a restored "
                           "process has passed already")
    if spec.mig is not None:
        raise InvalidInput("checkpoint", "transparent checkpoints are not available for MIG "
                           "instances (cuda-checkpoint does not support them)")
    if 0 < gpus < 1:
        raise InvalidInput("checkpoint", "transparent checkpoints are not available for a "
                           "share of a GPU (MPS or time-sliced; cuda-checkpoint does not "
                           "support them)")
    reasons = _incapable_nodes(ctx, gpus=gpus > 0)
    if reasons is not None:
        detail = "; ".join(reasons[:MAX_REASONS_SHOWN]) or "no node is registered"
        needs = "criu and cuda_checkpoint" if gpus > 0 else "criu"
        raise InvalidInput("checkpoint", f"no node can take transparent checkpoints of "
                           f"{'GPU' if gpus > 0 else 'CPU'} pods (node capability {needs} "
                           f"is false: {detail})")
    if spec.checkpoint_dir is not None:
        raise InvalidInput("checkpoint_dir", "a transparent checkpoint dumps the whole "
                           "container; --checkpoint-dir is for directory checkpoints "
                           "(--checkpoint directory), not both")


def _incapable_nodes(ctx: ServiceContext, gpus: bool) -> list[str] | None:
    """None when some live node can serve it (``criu``, and ``cuda_checkpoint`` for GPU
    pods); else why each node cannot."""
    reasons = []
    with ctx.db.read() as session:
        rows = session.execute(select(NodeModel.name, NodeModel.status,
                                      NodeModel.capabilities).order_by(NodeModel.name))
        for name, status, raw in rows:
            capabilities = NodeCapabilities.model_validate(raw or {})
            if status == NodeStatus.LOST.value:
                reasons.append(f"{name}: Lost")
            elif not capabilities.criu:
                reasons.append(f"{name}: {capabilities.criu_reason or 'not probed'}")
            elif gpus and not capabilities.cuda_checkpoint:
                reasons.append(f"{name}: cuda-checkpoint is not installed")
            else:
                return None
    return reasons


def criu_labels(node: NodeModel) -> dict[str, str]:
    """The scheduler's labels of a node: its own, plus ``CRIU_LABEL`` when capable and
    ``CUDA_CHECKPOINT_LABEL`` when it can also suspend CUDA processes."""
    labels = dict(node.labels)
    capabilities = NodeCapabilities.model_validate(node.capabilities or {})
    if capabilities.criu:
        labels[CRIU_LABEL] = "true"
        if capabilities.cuda_checkpoint:
            labels[CUDA_CHECKPOINT_LABEL] = "true"
    return labels


def transparent_selector(gpus: float) -> dict[str, str]:
    """The node labels a transparent pod asking for ``gpus`` must be placed on."""
    selector = {CRIU_LABEL: "true"}
    if gpus > 0:
        selector[CUDA_CHECKPOINT_LABEL] = "true"
    return selector
