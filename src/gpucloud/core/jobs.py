"""Jobs: gangs of N member pods (rank 0..N-1) with G GPUs each, started together.

Wire types of ``/v1/jobs`` and the agent's readiness report, the job phases and
topologies, and the rendezvous environment every member gets (what ``torchrun`` and
common launchers read).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, Field

from gpucloud.core.models import ContainerRequest
from gpucloud.core.phases import PodPhase
from gpucloud.core.spec import ContainerSpecOut, _Request

MAX_JOB_NODES = 1024
MAX_GPUS_PER_NODE = 64
DEFAULT_READY_TIMEOUT_SECONDS = 600.0
#: torchrun's default rendezvous port; a job's port is this plus a value derived from its
#: id, so that two jobs whose rank 0 share a node (host network) do not collide.
BASE_MASTER_PORT = 29500
MASTER_PORT_SPREAD = 1000


class JobPhase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STOPPED = "Stopped"


JOB_FINAL_PHASES = frozenset({JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED})


class Topology(StrEnum):
    """How close the members must be: one ``block``, one ``rack`` (node labels), or any."""

    SAME_BLOCK = "same-block"
    SAME_RACK = "same-rack"
    ANY = "any"


class JobCreateRequest(ContainerRequest):
    """``gpucloud job create``: ``nodes`` members with ``gpus_per_node`` GPUs each."""

    image: str  # every member runs it
    nodes: int = Field(ge=1, le=MAX_JOB_NODES)
    gpus_per_node: int = Field(default=0, ge=0, le=MAX_GPUS_PER_NODE)
    topology: Topology = Topology.ANY
    max_restarts: int = Field(default=0, ge=0, le=1000)
    ready_timeout: float = Field(default=DEFAULT_READY_TIMEOUT_SECONDS, gt=0, le=7 * 24 * 3600)


def member_name(job_name: str, rank: int) -> str:
    return f"{job_name}-{rank}"


class JobMemberOut(BaseModel):
    rank: int
    pod: str
    pod_id: str
    phase: PodPhase
    node: str | None = None
    address: str | None = None
    reason: str | None = None
    exit_code: int | None = None
    ready: bool = False


class JobOut(ContainerSpecOut):
    id: str
    name: str
    project: str
    phase: JobPhase
    reason: str | None = None
    message: str | None = None
    nodes: int
    gpus_per_node: int
    topology: Topology = Topology.ANY
    priority_class: str | None = None
    priority: int = 100
    max_duration: float | None = None
    max_restarts: int = 0
    restarts: int = 0
    ready_timeout: float = DEFAULT_READY_TIMEOUT_SECONDS
    master_port: int = BASE_MASTER_PORT
    barrier_released: bool = False
    desired_state: str = "running"
    members: list[JobMemberOut] = Field(default_factory=list)
    #: The gang's preemptions (as a unit), the last reason and the run time they cost.
    preemptions: int = 0
    last_preemption_reason: str | None = None
    last_preempted_at: datetime | None = None
    time_lost_seconds: float = 0.0
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class JobWhyOut(BaseModel):
    job: str
    phase: JobPhase
    summary: str
    reasons: dict[str, int] = Field(default_factory=dict)


class JobLogMemberOut(BaseModel):
    """Where one member's output stands after an answer of ``/v1/jobs/{ref}/logs``."""

    rank: int
    #: The member's current attempt (a gang restart starts a new one); ``next_offset``
    #: counts UTF-8 bytes of its output handed out so far.
    attempt: int
    next_offset: int
    #: The attempt has ended: all of its output has been handed out.
    finished: bool = False


class JobLogsOut(BaseModel):
    """Members' output, each line prefixed ``[RANK] ``, and where to continue from.

    ``finished``: the job has ended and this answer holds the last of its output.
    ``offsets``: pass it back as the ``offsets`` parameter to get only what is new.
    """

    text: str
    finished: bool
    members: list[JobLogMemberOut] = Field(default_factory=list)
    offsets: str = ""


class JobEventOut(BaseModel):
    """An event of one member pod (see ``PodEventOut``), with the member's rank."""

    time: datetime
    rank: int
    pod: str
    from_phase: PodPhase | None = None
    to_phase: PodPhase | None = None
    reason: str
    message: str | None = None


class AgentPodReadyRequest(_Request):
    """A job member's container is created and waits at the start barrier."""

    fencing_token: int
    attempt: int


def master_port(job_id: str) -> int:
    return BASE_MASTER_PORT + int(job_id, 16) % MASTER_PORT_SPREAD


def rendezvous_env(rank: int, addresses: list[str], gpus_per_node: int,
                   port: int) -> dict[str, str]:
    """The environment of member ``rank`` of a job placed on nodes ``addresses`` (by rank)."""
    master, nodes = addresses[0], str(len(addresses))
    return {
        "MASTER_ADDR": master, "MASTER_PORT": str(port),
        "PET_NNODES": nodes, "PET_NODE_RANK": str(rank),
        "PET_NPROC_PER_NODE": str(max(1, gpus_per_node)),
        "PET_MASTER_ADDR": master, "PET_MASTER_PORT": str(port),
        "GPUCLOUD_NODE_RANK": str(rank), "GPUCLOUD_NUM_NODES": nodes,
        "GPUCLOUD_NODE_IPS": "\n".join(addresses),
        "GPUCLOUD_GPUS_PER_NODE": str(gpus_per_node),
    }
