"""``--checkpoint transparent``: who may ask for it, and whether any node can serve it.

The node capability ``criu`` comes from the agent's dump-and-restore canary
(``runtime/criu``), never from ``criu check`` alone. A request is refused (422 naming
``checkpoint``) when no registered, live node has it, quoting the nodes' canary failures;
and, whatever the nodes can do, for GPU pods (a share of a GPU runs under MPS or
time-slicing, MIG slices and whole GPUs need cuda-checkpoint, which this platform does not
drive yet) and for multi-node jobs (NCCL/RDMA connections between members cannot be
restored). Placement then keeps such pods on capable nodes (``CRIU_LABEL``).
"""

from __future__ import annotations

from sqlalchemy import select

from gpucloud.core.capabilities import CHECKPOINT_TRANSPARENT, CRIU_LABEL, NodeCapabilities
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
    if 0 < gpus < 1:
        raise InvalidInput("checkpoint", "transparent checkpoints are not available for a "
                           "share of a GPU (MPS or time-sliced; cuda-checkpoint does not "
                           "support them)")
    if gpus > 0:
        raise InvalidInput("checkpoint", "transparent checkpoints are for CPU pods only "
                           "(GPU state needs cuda-checkpoint; node capability "
                           "cuda_checkpoint is not used yet)")
    reasons = _incapable_nodes(ctx)
    if reasons is not None:
        detail = "; ".join(reasons[:MAX_REASONS_SHOWN]) or "no node is registered"
        raise InvalidInput("checkpoint", "no node can take transparent checkpoints "
                           f"(node capability criu is false: {detail})")
    if spec.checkpoint_dir is not None:
        raise InvalidInput("checkpoint_dir", "a transparent checkpoint dumps the whole "
                           "container; --checkpoint-dir is for directory checkpoints "
                           "(--checkpoint directory), not both")


def _incapable_nodes(ctx: ServiceContext) -> list[str] | None:
    """None when some live node has ``criu``; else each node's canary failure."""
    reasons = []
    with ctx.db.read() as session:
        rows = session.execute(select(NodeModel.name, NodeModel.status,
                                      NodeModel.capabilities).order_by(NodeModel.name))
        for name, status, raw in rows:
            capabilities = NodeCapabilities.model_validate(raw or {})
            if capabilities.criu and status != NodeStatus.LOST.value:
                return None
            reasons.append(f"{name}: {capabilities.criu_reason or 'not probed'}")
    return reasons


def criu_labels(node: NodeModel) -> dict[str, str]:
    """The scheduler's labels of a node: its own, plus ``CRIU_LABEL`` when capable."""
    labels = dict(node.labels)
    if NodeCapabilities.model_validate(node.capabilities or {}).criu:
        labels[CRIU_LABEL] = "true"
    return labels
