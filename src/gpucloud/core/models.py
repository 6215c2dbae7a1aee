"""Wire types of the REST API, shared by the server (api/) and the SDK (client/).

Versioned pydantic JSON; new fields always get a default so old peers keep working.
Request bodies end in ``Request``; they forbid unknown fields so a typo is a 422.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from gpucloud.core.access import (
    DEFAULT_VOLUME_PATH,
    NetworkVolumeMount,
    PodNetwork,
    PortMapping,
    check_mount_path,
)
from gpucloud.core.errors import InvalidInput
from gpucloud.core.gpu_models import canonical_name, is_well_formed
from gpucloud.core.image_ref import parse_reference
from gpucloud.core.names import check_dns_label
from gpucloud.core.phases import NodeStatus, PodPhase, RestartPolicy
from gpucloud.core.quantities import parse_cpu_milli, parse_duration, parse_memory

MAX_GPUS_PER_POD = 64
MAX_CPU_MILLI = 1024 * 1000
MAX_DURATION_SECONDS = 365 * 86400.0
MAX_MEMORY_BYTES = 64 * 1024**4
MAX_COMMAND_ARGS = 1024
MAX_ENV_VARS = 512
MAX_DISK_BYTES = 1024**5
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PORT = re.compile(r"^(\d{1,5})(?:/(http|tcp|udp))?$")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _reraise(field: str, error: InvalidInput) -> ValueError:
    """Turn InvalidInput into the ValueError pydantic reports against ``field``."""
    return ValueError(error.message.removeprefix(f"{field}: "))


def _dns_name(value: str) -> str:
    try:
        return check_dns_label("name", value)
    except InvalidInput as error:
        raise _reraise("name", error) from None


#: A user-chosen name: a DNS label (lower-case letters, digits, '-'; at most 63).
DnsName = Annotated[str, AfterValidator(_dns_name)]


class ContainerRequest(_Request):
    """What pods and jobs share: name, image, command, resources and environment."""

    name: DnsName
    image: str
    command: list[str] = Field(default_factory=list)
    gpu_type: str | None = None
    cpu: float | str = 1
    memory: int | str = "1Gi"
    env: dict[str, str] = Field(default_factory=dict)
    #: A priority class (``gpucloud priority-class list``); checked by the server.
    priority_class: DnsName | None = None
    #: Seconds (or ``30m``, ``2h``) after which running work is stopped
    #: (``MaxDurationExceeded``); work that declares it may backfill (docs/jobs.md).
    max_duration: float | None = None
    #: Replaces the image's Entrypoint (``[]``: none, the command alone runs).
    entrypoint: list[str] | None = None
    #: The pod's volume disk (RunPod's): kept across stop and start, at ``volume_path``.
    volume_size: int | str | None = None
    volume_path: str | None = None
    #: The container's own writable layer, wiped on every stop.
    container_disk: int | str | None = None
    #: Network volumes to mount, ``NAME`` or ``NAME:/path`` (default path /workspace).
    network_volumes: list[str] = Field(default_factory=list, max_length=16)
    #: Registry credentials (``gpucloud registry-auth``) to pull the image with.
    registry_auth: DnsName | None = None

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(value) > MAX_COMMAND_ARGS:
            raise ValueError(f"at most {MAX_COMMAND_ARGS} arguments")
        return value

    @field_validator("volume_size", "container_disk")
    @classmethod
    def _disk_size(cls, value: int | str | None, info: ValidationInfo) -> int | str | None:
        if value is None:
            return None
        field = str(info.field_name)
        try:
            size = parse_memory(field, value)
        except InvalidInput as error:
            raise _reraise(field, error) from None
        if size < 1024**2:
            raise ValueError("must be at least 1Mi")
        if size > MAX_DISK_BYTES:
            raise ValueError("must be at most 1Pi")
        return value

    @field_validator("volume_path")
    @classmethod
    def _volume_path(cls, value: str | None) -> str | None:
        return None if value is None else check_mount_path(value)

    @field_validator("network_volumes")
    @classmethod
    def _network_volumes(cls, value: list[str]) -> list[str]:
        normalized, paths = [], set()
        for item in value:
            name, _, path = str(item).partition(":")
            try:
                check_dns_label("network_volumes", name)
            except InvalidInput as error:
                raise _reraise("network_volumes", error) from None
            mount = check_mount_path(path or DEFAULT_VOLUME_PATH)
            if mount in paths:
                raise ValueError(f"two volumes at {mount}")
            paths.add(mount)
            normalized.append(f"{name}:{mount}")
        return normalized

    @property
    def volume_bytes(self) -> int | None:
        return None if self.volume_size is None else parse_memory("volume_size",
                                                                  self.volume_size)

    @property
    def container_disk_bytes(self) -> int | None:
        return None if self.container_disk is None else parse_memory("container_disk",
                                                                     self.container_disk)

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        try:
            parse_reference(value)
        except InvalidInput as error:
            raise _reraise("image", error) from None
        return value

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str]) -> list[str]:
        if len(value) > MAX_COMMAND_ARGS:
            raise ValueError(f"at most {MAX_COMMAND_ARGS} arguments")
        return value

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

    @field_validator("gpu_type")
    @classmethod
    def _gpu_type(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not is_well_formed(value):
            raise ValueError(f"{value!r} is not a GPU model name")
        return canonical_name(value)

    @field_validator("cpu")
    @classmethod
    def _cpu(cls, value: float | str) -> float | str:
        try:
            milli = parse_cpu_milli("cpu", value)
        except InvalidInput as error:
            raise _reraise("cpu", error) from None
        if milli > MAX_CPU_MILLI:
            raise ValueError(f"must be at most {MAX_CPU_MILLI // 1000} cores")
        return value

    @field_validator("memory")
    @classmethod
    def _memory(cls, value: int | str) -> int | str:
        try:
            size = parse_memory("memory", value)
        except InvalidInput as error:
            raise _reraise("memory", error) from None
        if size > MAX_MEMORY_BYTES:
            raise ValueError("must be at most 64Ti")
        if size < 4 * 1024**2:
            raise ValueError("must be at least 4Mi")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > MAX_ENV_VARS:
            raise ValueError(f"at most {MAX_ENV_VARS} variables")
        for key in value:
            if not _ENV_KEY.match(key):
                raise ValueError(f"{key!r} is not a valid variable name")
        return value

    @property
    def cpu_milli(self) -> int:
        return parse_cpu_milli("cpu", self.cpu)

    @property
    def memory_bytes(self) -> int:
        return parse_memory("memory", self.memory)


class PodCreateRequest(ContainerRequest):
    gpus: float = 0
    ports: list[str] = Field(default_factory=list)
    restart: RestartPolicy = RestartPolicy.NEVER

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, value: float) -> float:
        if value < 0:
            raise ValueError("must not be negative")
        if value > MAX_GPUS_PER_POD:
            raise ValueError(f"must be at most {MAX_GPUS_PER_POD}")
        if value > 1 and value != int(value):
            raise ValueError("a fraction of a GPU is allowed only below 1 (e.g. 0.5)")
        if 0 < value < 1 and round(value * 1000) < 1:
            raise ValueError("a GPU share must be at least 0.001")
        return value

    @field_validator("ports")
    @classmethod
    def _ports(cls, value: list[str]) -> list[str]:
        normalized = []
        for port in value:
            match = _PORT.match(str(port))
            if not match or not 1 <= int(match.group(1)) <= 65535:
                raise ValueError(f"{port!r} is not PORT[/http|tcp|udp] with 1 <= PORT <= 65535")
            normalized.append(f"{int(match.group(1))}/{match.group(2) or 'tcp'}")
        return normalized

    @property
    def whole_gpus(self) -> int:
        return int(self.gpus) if self.gpus >= 1 else 0

    @property
    def gpu_milli(self) -> int:
        """The share of one GPU, in milli-GPU, for a fractional request; 0 otherwise."""
        return round(self.gpus * 1000) if 0 < self.gpus < 1 else 0


class PodOut(BaseModel):
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
    image: str
    command: list[str] = Field(default_factory=list)
    gpus: float = 0
    gpu_type: str | None = None
    cpu: float = 1
    memory: str = "1Gi"
    memory_bytes: int = 0
    env: dict[str, str] = Field(default_factory=dict)
    ports: list[str] = Field(default_factory=list)
    restart: RestartPolicy = RestartPolicy.NEVER
    #: Set on the members of a job (``gpucloud job``): the job's id and the member's rank.
    job_id: str | None = None
    rank: int | None = None
    priority_class: str | None = None
    priority: int = 100
    max_duration: float | None = None
    entrypoint: list[str] | None = None
    volume_size: int | None = None
    volume_path: str | None = None
    container_disk: int | None = None
    network_volumes: list[str] = Field(default_factory=list)
    registry_auth: str | None = None
    template: str | None = None
    #: The node that holds the pod's volume disk (a restart goes back there).
    volume_node: str | None = None
    #: The pod's address and ports (RunPod's ``runtime.ports``), once it has run.
    ip: str | None = None
    ports_runtime: list[PortMapping] = Field(default_factory=list)
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


class NodeRegisterResponse(BaseModel):
    node_id: str
    name: str
    node_token: str
    fencing_token: int
    lease_ttl_seconds: float
    #: The public keys (OpenSSH lines) the server's gateway logs in to the access server with.
    gateway_public_keys: list[str] = Field(default_factory=list)


class LeaseRequest(_Request):
    fencing_token: int | None = None


class LeaseResponse(BaseModel):
    fencing_token: int
    lease_expires_at: datetime
    lease_ttl_seconds: float
    new_grant: bool


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
    network_volumes: list[NetworkVolumeMount] = Field(default_factory=list)
    #: Credentials for the image's registry (``registry-auth``): username and password.
    registry_username: str | None = None
    registry_password: str | None = None


class AssignmentsOut(BaseModel):
    revision: int
    fencing_token: int
    pods: list[AssignmentOut]


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


class JoinTokenOut(BaseModel):
    token: str
    expires_at: datetime


class ErrorOut(BaseModel):
    detail: str
    field: str | None = None


def jsonable(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
