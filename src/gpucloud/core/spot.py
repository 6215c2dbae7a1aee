"""Spot work and node drain: the preemption notice, drain requests and drain progress.

A preemption (``spot``: capacity taken back for other work; ``priority``: a higher priority
class took it; ``drain``: its node is being drained; ``node-lost``: its node stopped
renewing its lease) is announced to the pod with a ``StopNotice``: the agent writes it
atomically to ``/run/gpucloud/preempt`` (JSON), SIGTERMs the container's whole process
group and waits until the deadline, then SIGKILLs. A pod acknowledges early by committing a
checkpoint after the notice (``gpucloud-ckpt commit``) or by exiting with
``REQUEUE_EXIT_CODE`` (75, ``EX_TEMPFAIL``: "requeue me").
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, Field

from gpucloud.core.errors import InvalidInput
from gpucloud.core.spec import ContainerSpec, _Request

#: Exit code of a program that acknowledges a notice: "stopped cleanly, requeue me".
REQUEUE_EXIT_CODE = 75
#: Where the notice appears inside the container (the run dir is bound at /run/gpucloud).
NOTICE_PATH = "/run/gpucloud/preempt"
NOTICE_FILE = "preempt"
#: The grace of a preempted pod when neither the pod (``--grace``) nor the server sets one.
DEFAULT_GRACE_SECONDS = 30.0
MAX_GRACE_SECONDS = 3600.0
SPOT_CLASS = "spot"


class StopReason(StrEnum):
    SPOT = "spot"
    PRIORITY = "priority"
    DRAIN = "drain"
    NODE_LOST = "node-lost"
    #: The project's prepaid credit ran out (services/spend): stopped, never requeued.
    CREDIT = "credit"


class StopNotice(BaseModel):
    """What the pod is told before it is stopped (the notice file's content)."""

    reason: StopReason
    deadline: datetime
    attempt: int
    grace_seconds: float = DEFAULT_GRACE_SECONDS


class DrainState(StrEnum):
    WAITING = "waiting"  # cordoned; waits until fewer than the limit of nodes drain
    DRAINING = "draining"  # its pods were noticed and are being moved
    DRAINED = "drained"  # nothing runs on it any more


class NodeDrainRequest(_Request):
    """``gpucloud node drain NODE [--deadline 10m]``; ``deadline`` in seconds (or ``10m``,
    checked by the service): after it, what still runs there is stopped and requeued."""

    deadline: float | str | None = None


class NodeDrainOut(BaseModel):
    """A drain's progress, as ``node get`` shows it."""

    state: DrainState
    requested_at: datetime
    started_at: datetime | None = None
    deadline: datetime | None = None
    finished_at: datetime | None = None
    pods_total: int = 0
    pods_left: int = 0
    #: The pods still bound to the node, by name.
    pods: list[str] = Field(default_factory=list)


def priority_class_of(spec: ContainerSpec, priority_class: str | None) -> str | None:
    """The class a request runs in: ``--spot`` is the ``spot`` class (another class with
    it is refused); a bid without ``--spot`` is refused too."""
    if spec.spot:
        if priority_class not in (None, SPOT_CLASS):
            raise InvalidInput("priority_class", f"spot work runs in the {SPOT_CLASS!r} "
                               f"priority class, not {priority_class!r}; leave it out")
        return SPOT_CLASS
    if spec.bid is not None:
        raise InvalidInput("bid", "a bid is for spot work: add --spot")
    return priority_class
