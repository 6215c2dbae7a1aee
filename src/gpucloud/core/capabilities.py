"""What a node can do beyond running containers, as its agent found out at start.

Decided by real canaries, never assumed: ``criu`` is True only when a tiny container was
dumped with ``runc checkpoint`` and restored with ``runc restore`` on that node (``criu
check`` alone has said "Looks good" on hosts whose dumps then failed). ``criu_reason`` says
why not (the canary's failure message), so a refused pod can name it.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

#: The checkpoint modes of the container spec (``--checkpoint``).
CHECKPOINT_DIRECTORY = "directory"
CHECKPOINT_TRANSPARENT = "transparent"
CHECKPOINT_MODES = (CHECKPOINT_DIRECTORY, CHECKPOINT_TRANSPARENT)
#: The scheduler label a node with a working CRIU canary gets (transparent pods select it).
CRIU_LABEL = "gpucloud.io/criu"
#: ... and the label of one that can also suspend CUDA processes (GPU transparent pods).
CUDA_CHECKPOINT_LABEL = "gpucloud.io/cuda-checkpoint"


class NodeCapabilities(BaseModel):
    """Reported at registration; an older agent sends none (every capability False)."""

    criu: bool = False
    criu_reason: str | None = Field(default=None, max_length=2000)
    criu_version: str | None = Field(default=None, max_length=200)
    #: NVIDIA's ``cuda-checkpoint`` utility is on the node's PATH: with ``criu``, GPU pods
    #: can take transparent checkpoints (runtime/cuda_checkpoint).
    cuda_checkpoint: bool = False
    #: How pods with a share of a GPU share it here: ``mps`` or ``time-slicing`` (gpu/mps).
    gpu_sharing: str | None = Field(default=None, pattern="^(mps|time-slicing)$")
    #: cgroup v2 ``dmem`` with a region registered for these GPUs (UUIDs): their shares'
    #: memory limits are also set as ``dmem.max`` (gpu/dmem).
    dmem_gpus: list[str] = Field(default_factory=list, max_length=1024)
