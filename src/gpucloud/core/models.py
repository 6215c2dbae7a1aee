"""Wire types of the REST API, shared by the server (api/) and the SDK (client/).

Versioned pydantic JSON; new fields always get a default so old peers keep working.
Request bodies end in ``Request``; they forbid unknown fields so a typo is a 422.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from gpucloud.core.access import NetworkVolumeMount, PodNetwork, PortMapping
from gpucloud.core.capabilities import NodeCapabilities
from gpucloud.core.checkpoints import CheckpointSummary
from gpucloud.core.errors import InvalidInput
from gpucloud.core.phases import NodeStatus, PodPhase, RestartPolicy
from gpucloud.core.quantities import parse_duration
from gpucloud.core.spec import (
    MAX_COMMAND_ARGS,
    MAX_CPU_MILLI,
    MAX_DISK_BYTES,
    MAX_ENV_VARS,
    MAX_GPUS_PER_POD,
    MAX_MEMORY_BYTES,
    ContainerSpec,
    ContainerSpecOut,
    DnsName,
    Gpus,
    Ports,
    _Request,
    _reraise,
)
from gpucloud.core.spot import NodeDrainOut, StopNotice

#: The container spec's limits (``core.spec``) stay importable from here.
__all__ = ["MAX_COMMAND_ARGS", "MAX_CPU_MILLI", "MAX_DISK_BYTES", "MAX_ENV_VARS",
           "MAX_GPUS_PER_POD", "MAX_MEMORY_BYTES", "ContainerRequest", "PodCreateRequest"]
MAX_DURATION_SECONDS = 365 * 86400.0


class ContainerRequest(ContainerSpec):
    """What pods and jobs are created with: a name, the container spec, and how the
    scheduler treats the work (priority class, maximum duration)."""

    name: DnsName
    #: A priority class (``gpucloud priority-class list``); checked by the server.
    priority_class: DnsName | None = None
    #: Seconds (or ``30m``, ``2h``) after which running work is stopped
    #: (``MaxDurationExceeded``); work that declares it may backfill (docs/jobs.md).
    max_duration: float | None = None

    @field_validator("max_duration", mode="before")
    @classmethod
    def _max_duration(cls, value: str | float | None) -> float | None:
        if value is None:
            return None
        try:
            seconds = parse_duration("max_duration", value)
        except InvalidInput as error:
            raise _reraise("max_duration", error) from None
        if seconds > MAX_DURATION_SECONDS:
            raise ValueError("must be at most 365 days")
        return seconds


class PodCreateRequest(ContainerRequest):
    """``gpucloud pod create``. With ``template``, the template's spec is the base and
    only the fields given here (``model_fields_set``) override it; without one, ``image``
    is required (checked by the service, which knows whether the template exists)."""

    gpus: Gpus = 0
    ports: Ports = Field(default_factory=list)
    restart: RestartPolicy = RestartPolicy.NEVER
    #: A template of the project (``gpucloud template``) to start from.
    template: DnsName | None = None

    @property
    def whole_gpus(self) -> int:
        return int(self.gpus) if self.gpus >= 1 else 0

    @property
    def gpu_milli(self) -> int:
        """The share of one GPU, in milli-GPU, for a fractional request; 0 otherwise."""
        return round(self.gpus * 1000) if 0 < self.gpus < 1 else 0


class MigDevice(BaseModel):
    """A MIG device a pod runs on: its parent GPU, its own UUID (``MIG-…``), the profile
    and the start slot of its GPU instance (the slot the scheduler chose)."""

    gpu_uuid: str = Field(min_length=1, max_length=128)
    mig_uuid: str = Field(min_length=1, max_length=128)
    profile: str = Field(min_length=1, max_length=16)
    slot: int = Field(ge=0, le=7)


class PodOut(ContainerSpecOut):
    id: str
    name: str
    project: str
    phase: PodPhase
    reason: str | None = None
    message: str | None = None
    node: str | None = None
    gpu_uuids: list[str] = Field(default_factory=list)
    exit_code: int | None = None
    restart_count: int = 0
    desired_state: str = "running"
    gpus: float = 0
    ports: list[str] = Field(default_factory=list)
    restart: RestartPolicy = RestartPolicy.NEVER
    #: Set on the members of a job (``gpucloud job``): the job's id and the member's rank.
    job_id: str | None = None
    rank: int | None = None
    priority_class: str | None = None
    priority: int = 100
    max_duration: float | None = None
    template: str | None = None
    #: The node that holds the pod's volume disk (a restart goes back there).
    volume_node: str | None = None
    #: The pod's address and ports (RunPod's ``runtime.ports``), once it has run.
    ip: str | None = None
    ports_runtime: list[PortMapping] = Field(default_factory=list)
    #: Preemptions, drains and node losses it went through, the last one's reason
    #: (``spot``, ``priority``, ``drain``, ``node-lost``) and time, and the run time they
    #: cost (after the last committed checkpoint of each interrupted attempt).
    preemptions: int = 0
    last_preemption_reason: str | None = None
    last_preempted_at: datetime | None = None
    time_lost_seconds: float = 0.0
    #: A MIG pod's start slot (as scheduled) and the MIG device its node made there.
    mig_slot: int | None = None
    mig_device: MigDevice | None = None
    #: Set for a share of a GPU: one pod's fatal GPU fault can end its neighbours (gpu/mps).
    gpu_sharing_warning: str | None = None
    #: The latest committed checkpoint of its ``--checkpoint-dir`` (``pod get`` only).
    last_checkpoint: CheckpointSummary | None = None
    #: The checkpoint interval (docs/checkpoints.md, pods with a checkpoint dir): δ the
    #: measured checkpoint cost, M the mean time between unannounced interruptions of its
    #: priority class and node pool (per gang for a job's members), τ Daly's optimum.
    checkpoint_cost_seconds: float | None = None
    interruption_mtbf_seconds: float | None = None
    checkpoint_interval_seconds: float | None = None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class PodEventOut(BaseModel):
    time: datetime
    from_phase: PodPhase | None
    to_phase: PodPhase | None
    reason: str
    message: str | None = None


class PodWhyOut(BaseModel):
    pod: str
    phase: PodPhase
    summary: str
    reasons: dict[str, int] = Field(default_factory=dict)


class PodLogsOut(BaseModel):
    """A piece of a pod's output. Offsets count UTF-8 bytes of ``attempt``'s output; a
    follower passes ``next_offset`` and ``attempt`` back."""

    text: str
    offset: int
    next_offset: int
    finished: bool
    attempt: int = 0


class GpuInventory(_Request):
    uuid: str = Field(min_length=1, max_length=128)
    model: str = Field(min_length=1, max_length=64)
    memory_mib: int = Field(ge=0, le=10_000_000)
    numa_node: int = Field(default=0, ge=0, le=1024)
    nvlink_peers: list[int] = Field(default_factory=list)
    index: int | None = Field(default=None, ge=0, le=1024)
    pci_bus_id: str | None = None
    mig_mode: bool = False
    #: The GPU supports MIG; ``mig_instances``: the MIG devices it has now (fixed mode: the
    #: layout the node advertises).
    mig_capable: bool = False
    mig_instances: list[MigDevice] = Field(default_factory=list, max_length=8)
    #: Topology for placement and, later, VFIO passthrough (gpu/pci; None: unknown).
    pcie_switch: int | None = None
    iommu_group: int | None = None
    #: What the node's health checks last said (set by the server, not registered).
    healthy: bool = True
    health_reason: str | None = None
    #: The last admin reset or diag of this GPU (``node gpu-reset`` / ``node diag``; set by
    #: the server, not registered).
    maintenance: GpuMaintenance | None = None


class NodeRegisterRequest(_Request):
    join_token: str
    name: DnsName
    cpu_cores: float = Field(gt=0, le=100_000)
    memory_bytes: int = Field(gt=0)
    gpus: list[GpuInventory] = Field(default_factory=list, max_length=1024)
    labels: dict[str, str] = Field(default_factory=dict)
    address: str | None = None
    provider: str | None = None
    agent_version: str | None = None
    #: The agent's access server (SSH to pods, port relay): ``host:port`` and its host key.
    access_endpoint: str | None = Field(default=None, max_length=255)
    access_host_key: str | None = Field(default=None, max_length=16384)
    #: ``bridge`` (a network namespace per pod) or ``host``.
    network_mode: str | None = Field(default=None, pattern="^(bridge|host)$")
    #: How network volumes are mounted here: ``hostpath`` or ``nfs``.
    volume_mode: str | None = Field(default=None, pattern="^(hostpath|nfs)$")
    #: What the agent's canaries found (CRIU dump and restore …); defaults: none.
    capabilities: NodeCapabilities = Field(default_factory=NodeCapabilities)


class NodeRegisterResponse(BaseModel):
    node_id: str
    name: str
    node_token: str
    fencing_token: int
    lease_ttl_seconds: float
    #: The public keys (OpenSSH lines) the server's gateway logs in to the access server with.
    gateway_public_keys: list[str] = Field(default_factory=list)


#: ``mig-on`` / ``mig-off``: switch the GPU's MIG mode (``node mig-mode``), at drain time.
GpuActionKind = Literal["reset", "diag", "mig-on", "mig-off"]


class GpuMaintenance(BaseModel):
    """An admin's reset (then diag) or diag of one GPU, run by its node's agent (gpu/health:
    ``nvidia-smi --gpu-reset`` and ``dcgmi diag`` on real GPUs, the simulated provider's
    equivalents otherwise). ``state``: requested (the agent has not answered yet), passed
    (the GPU is back in service), failed (it stays out); ``output`` what the tools said."""

    id: str
    action: GpuActionKind
    level: int = 1
    state: Literal["requested", "passed", "failed"] = "requested"
    requested_at: datetime
    finished_at: datetime | None = None
    output: str | None = None
    #: A MIG mode switch waiting for the pods on the GPU to end (none placed there
    #: meanwhile) until this time; then it fails. None: the GPU was idle when asked.
    drain_until: datetime | None = None


class GpuAction(BaseModel):
    """One GPU action for the agent (in its assignments) while the server awaits it."""

    id: str
    gpu_uuid: str
    gpu_index: int
    action: GpuActionKind
    level: int = 1


class GpuActionResult(_Request):
    """How a GPU action went, reported with the lease renewal until the server has it."""

    id: str = Field(min_length=1, max_length=64)
    passed: bool
    output: str | None = Field(default=None, max_length=4000)


class NodeGpuActionRequest(_Request):
    """``gpucloud node gpu-reset NODE GPU`` / ``node diag NODE [--gpu N]``: ``gpu`` is the
    GPU index (None: every GPU, diag only); ``level`` the diag level (1 quick, 2 medium)."""

    action: GpuActionKind
    gpu: int | None = Field(default=None, ge=0, le=1024)
    level: int = Field(default=1, ge=1, le=3)
    #: ``mig-on`` / ``mig-off``: how long the switch may wait for the GPU's pods to end
    #: (0: refuse with 409 while pods hold it).
    wait_seconds: float = Field(default=0, ge=0, le=86_400)


class GpuHealthIn(_Request):
    """One GPU's health as the agent's checks found it (gpu/health)."""

    uuid: str = Field(min_length=1, max_length=128)
    healthy: bool = True
    reason: str | None = Field(default=None, max_length=500)


class LeaseRequest(_Request):
    fencing_token: int | None = None
    #: The GPUs' health (None: not checked): an unhealthy GPU is out of scheduling.
    gpu_health: list[GpuHealthIn] | None = Field(default=None, max_length=1024)
    #: A node-level fault (XID 79, NVLink): the node is cordoned with this reason; once
    #: it is None again and ``auto_uncordon``, a node cordoned by its checks is uncordoned.
    node_fault: str | None = Field(default=None, max_length=500)
    auto_uncordon: bool = True
    #: Results of the GPU actions the assignments asked for (until the server has them).
    gpu_actions: list[GpuActionResult] = Field(default_factory=list, max_length=1024)


class LeaseResponse(BaseModel):
    fencing_token: int
    lease_expires_at: datetime
    lease_ttl_seconds: float
    new_grant: bool


class VolumeSource(BaseModel):
    """Where a migrating pod's volume disk is fetched from (``pod start --migrate``): the
    source node's access server, pinned to its host key. The destination logs in as
    ``volume-<pod id>`` with its own access host key."""

    node: str
    endpoint: str
    host_key: str


class VolumeExport(BaseModel):
    """A volume disk on this node that one other node may fetch: that node's access host
    key (an OpenSSH line) is the only key its ``volume-<pod id>`` login accepts."""

    pod_id: str
    peer_node: str
    peer_key: str


class VolumeMigrationReport(_Request):
    """How fetching a migrating pod's volume disk went: its size and the sha256 of the
    stream both ends computed, or why it failed."""

    source_node: str = Field(max_length=200)
    size_bytes: int | None = Field(default=None, ge=0)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    error: str | None = Field(default=None, max_length=1000)


class AgentPodStatusRequest(_Request):
    fencing_token: int
    phase: PodPhase
    exit_code: int | None = None
    reason: str | None = Field(default=None, max_length=200)
    message: str | None = Field(default=None, max_length=4000)
    log_tail: str | None = Field(default=None, max_length=65536)
    attempt: int | None = None
    #: The pod's address and ports, sent with ``Running``.
    network: PodNetwork | None = None
    #: The outcome of fetching a migrating pod's volume disk (before its container starts).
    volume_migration: VolumeMigrationReport | None = None
    #: The MIG device the agent made (or adopted) for a MIG pod, sent with ``Running``.
    mig_device: MigDevice | None = None


class AgentLogChunkRequest(_Request):
    fencing_token: int
    attempt: int | None = None
    offset: int = Field(ge=0)
    data: str = Field(max_length=1024 * 1024)


class AssignmentOut(BaseModel):
    pod_id: str
    name: str
    project: str
    attempt: int
    desired_state: str
    phase: PodPhase
    image: str
    command: list[str]
    env: dict[str, str]
    ports: list[str]
    cpu_milli: int
    memory_bytes: int
    gpu_uuids: list[str]
    gpu_milli: int = 0
    #: A share's device memory limit (``--gpu-memory``); None: the GPU's memory.
    gpu_memory_bytes: int | None = None
    #: SIGTERM-to-SIGKILL grace asked for by `pod stop --grace`; None: the agent's default.
    stop_grace_seconds: float | None = None
    #: Share the host's network namespace (members of a job: rendezvous between nodes).
    host_network: bool = False
    #: Start barrier (job members): create the container, report it ready
    #: (``POST /v1/agent/pods/{id}/ready``) and start its command only once released.
    barrier: bool = False
    barrier_released: bool = False
    entrypoint: list[str] | None = None
    #: The pod's volume disk: kept on this node across stop/start, deleted with the pod.
    volume_bytes: int | None = None
    volume_path: str | None = None
    container_disk_bytes: int | None = None
    #: Set while the volume disk is still on another node (``pod start --migrate``): fetch
    #: it from there before the container is built.
    volume_source: VolumeSource | None = None
    network_volumes: list[NetworkVolumeMount] = Field(default_factory=list)
    #: Credentials for the image's registry (``registry-auth``): username and password.
    registry_username: str | None = None
    registry_password: str | None = Field(default=None, repr=False)
    #: Set when the server stops the pod for a preemption or a drain: the agent writes it
    #: to /run/gpucloud/preempt, SIGTERMs the process group, SIGKILLs at the deadline.
    stop_notice: StopNotice | None = None
    #: ``--checkpoint-dir``: where the kept directory is mounted, what the store files its
    #: checkpoints under (the pod id; ``<job id>-<rank>`` for a job's members) and the
    #: checkpoint to restore before the command starts (None: none committed yet).
    checkpoint_dir: str | None = None
    checkpoint_key: str | None = None
    restore_checkpoint: str | None = None
    #: Send ``checkpoint_signal`` to the container every ``checkpoint_interval_seconds``
    #: (Daly's τ); None: no periodic checkpoint request.
    checkpoint_interval_seconds: float | None = None
    checkpoint_signal: str | None = None
    #: ``transparent``: the agent dumps the container with runc/CRIU (``--checkpoint``).
    checkpoint_mode: str | None = None
    #: A MIG pod: the profile, the start slot the scheduler chose on ``gpu_uuids[0]`` and
    #: the node's MIG policy (``dynamic``: create the instance there; ``fixed``: use the
    #: existing one at that slot).
    mig_profile: str | None = None
    mig_slot: int | None = None
    mig_policy: str = "dynamic"


#: An agent's assignments long-poll wait unless it is started with another (s).
DEFAULT_POLL_WAIT_SECONDS = 30.0
#: The longest assignments long poll (s): the route's ``wait`` bound, the most a server
#: asks of a large fleet (``AssignmentsOut.poll_wait_seconds``) and an agent takes from it,
#: the one the proxies' read timeouts are documented for (docs/replicas.md).
MAX_POLL_WAIT_SECONDS = 60.0


class AssignmentsOut(BaseModel):
    revision: int
    fencing_token: int
    pods: list[AssignmentOut]
    #: The pods whose volume disks live on this node (bound here, or stopped with their
    #: volume here); the agent deletes every other volume directory. None (an older
    #: server): unknown, the agent deletes none.
    volume_pods: list[str] | None = None
    #: Volume disks here that a migration's destination node may fetch now.
    volume_exports: list[VolumeExport] = Field(default_factory=list)
    #: GPU resets and diags an admin asked for that the agent has not answered yet.
    gpu_actions: list[GpuAction] = Field(default_factory=list)
    #: The long-poll wait this server asks of a large fleet (services/lease_ttl.py: its
    #: polls a second bounded as its renewals are); the agent polls with the longer of
    #: this and its own. None: the agent's own.
    poll_wait_seconds: float | None = Field(default=None, ge=0, le=MAX_POLL_WAIT_SECONDS)


class NodeOut(BaseModel):
    id: str
    name: str
    status: NodeStatus
    cordoned: bool
    cpu_cores: float
    memory_bytes: int
    gpus: list[GpuInventory]
    gpus_allocated: int = 0
    labels: dict[str, str] = Field(default_factory=dict)
    address: str | None = None
    provider: str | None = None
    fencing_token: int
    lease_expires_at: datetime | None = None
    registered_at: datetime
    network_mode: str | None = None
    volume_mode: str | None = None
    access_endpoint: str | None = None
    capabilities: NodeCapabilities = Field(default_factory=NodeCapabilities)
    #: ``node drain``: its progress (None: not draining).
    drain: NodeDrainOut | None = None
    #: ``gpucloud node mig NODE --mode dynamic|fixed|off``.
    mig_policy: str = "dynamic"
    #: Why the node's health checks cordoned it (None: not them).
    cordon_reason: str | None = None


class ProjectCreateRequest(_Request):
    name: DnsName


class ProjectOut(BaseModel):
    id: str
    name: str
    is_admin: bool
    created_at: datetime


class KeyCreateRequest(_Request):
    name: DnsName = "default"


class KeyOut(BaseModel):
    id: str
    name: str
    project: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None = None


class KeyCreatedOut(KeyOut):
    key: str


class ProjectCreatedOut(BaseModel):
    project: ProjectOut
    key: KeyCreatedOut


class JoinTokenRequest(BaseModel):
    """``POST /v1/nodes/join-tokens``: how many registrations and how long (both optional:
    any number of registrations, the server's TTL)."""

    model_config = {"extra": "forbid"}
    uses: int | None = Field(default=None, ge=1, le=100_000)
    ttl_seconds: float | None = Field(default=None, ge=60, le=366 * 86400)


class JoinTokenInfoOut(BaseModel):
    """A join token as listed: never its value (only the server's hash of it is kept)."""

    id: str = ""
    prefix: str | None = None
    created_at: datetime | None = None
    expires_at: datetime
    max_uses: int | None = None
    uses: int = 0
    revoked_at: datetime | None = None


class JoinTokenOut(JoinTokenInfoOut):
    """A new join token: its value is shown this once."""

    token: str


class NodeMigRequest(_Request):
    """``gpucloud node mig NODE --mode``: create MIG instances as pods are placed
    (``dynamic``), use only the instances the node has (``fixed``), or no MIG (``off``)."""

    mode: Literal["dynamic", "fixed", "off"]


class ErrorOut(BaseModel):
    detail: str
    field: str | None = None


def jsonable(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
