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


class NodeCapabilities(BaseModel):
    """Reported at registration; an older agent sends none (every capability False)."""

    criu: bool = False
    criu_reason: str | None = Field(default=None, max_length=2000)
    criu_version: str | None = Field(default=None, max_length=200)
    #: NVIDIA's ``cuda-checkpoint`` utility is on the node's PATH (GPU transparent
    #: checkpoints would need it; not used yet).
    cuda_checkpoint: bool = False
