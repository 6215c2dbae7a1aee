"""The container spec: what a pod, a job's members and a template all carry.

One type with one validation (``ContainerSpec``), one read-back shape
(``ContainerSpecOut``), the GPU and port fields that pods and templates share (``Gpus``,
``Ports``), and the wire types of templates and registry credentials. Requests forbid
unknown fields, so a typo is a 422 naming it.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from gpucloud.core.access import DEFAULT_VOLUME_PATH, check_mount_path
from gpucloud.core.capabilities import CHECKPOINT_MODES
from gpucloud.core.checkpoint_interval import CHECKPOINT_SIGNALS
from gpucloud.core.errors import InvalidInput
from gpucloud.core.gpu_models import canonical_name, is_well_formed
from gpucloud.core.image_ref import parse_reference
from gpucloud.core.names import check_dns_label
from gpucloud.core.quantities import parse_cpu_milli, parse_memory
from gpucloud.scheduler.mig import MIG_PROFILES, known_profile

MAX_GPUS_PER_POD = 64
#: The smallest share of a GPU (``--gpus 0.01``): 1% of its SMs under MPS.
MIN_GPU_SHARE = 0.01
MAX_CPU_MILLI = 1024 * 1000
MAX_MEMORY_BYTES = 64 * 1024**4
MAX_COMMAND_ARGS = 1024
MAX_ENV_VARS = 512
MAX_DISK_BYTES = 1024**5
MAX_PORTS = 64
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
#: The JSON schema says what ``check_dns_label`` checks (the validator keeps its messages).
DnsName = Annotated[str, AfterValidator(_dns_name),
                    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 63,
                                    "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"})]


def check_gpus(value: float) -> float:
    """Whole GPUs up to 64, or one share of a GPU below 1 (at least 0.01)."""
    if value < 0:
        raise ValueError("must not be negative")
    if value > MAX_GPUS_PER_POD:
        raise ValueError(f"must be at most {MAX_GPUS_PER_POD}")
    if value > 1 and value != int(value):
        raise ValueError("a fraction of a GPU is allowed only below 1 (e.g. 0.5)")
    if 0 < value < MIN_GPU_SHARE:
        raise ValueError(f"a GPU share must be at least {MIN_GPU_SHARE}")
    return value


def check_ports(value: list[str]) -> list[str]:
    """``PORT[/http|tcp|udp]`` normalized (default ``tcp``); a port number may appear once
    per transport (``http`` is TCP), so ``8888/http`` and ``8888/tcp`` collide."""
    if len(value) > MAX_PORTS:
        raise ValueError(f"at most {MAX_PORTS} ports")
    normalized, seen = [], set()
    for port in value:
        match = _PORT.match(str(port))
        if not match or not 1 <= int(match.group(1)) <= 65535:
            raise ValueError(f"{port!r} is not PORT[/http|tcp|udp] with 1 <= PORT <= 65535")
        number, kind = int(match.group(1)), match.group(2) or "tcp"
        transport = "udp" if kind == "udp" else "tcp"
        if (number, transport) in seen:
            raise ValueError(f"port {number}/{transport} is given twice")
        seen.add((number, transport))
        normalized.append(f"{number}/{kind}")
    return normalized


Gpus = Annotated[float, AfterValidator(check_gpus)]
Ports = Annotated[list[str], AfterValidator(check_ports)]


class ContainerSpec(_Request):
    """Image, command, resources, environment, entrypoint, disks and pull credentials.

    ``image`` is optional here only so that a pod created from a template may leave it
    out; every concrete request (and the service) requires it.
    """

    image: str | None = None
    command: list[str] = Field(default_factory=list)
    gpu_type: str | None = None
    cpu: float | str = 1
    memory: int | str = "1Gi"
    env: dict[str, str] = Field(default_factory=dict)
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
    #: Spot work (``--spot``): the ``spot`` priority class, preempted with a notice and
    #: requeued elsewhere (docs/spot.md); ``bid`` is recorded (a price per GPU-hour).
    spot: bool = False
    bid: float | None = Field(default=None, gt=0, le=1_000_000)
    #: Seconds between the preemption notice (SIGTERM) and SIGKILL (default 30).
    grace: float | None = Field(default=None, ge=0, le=3600)
    #: A directory the platform keeps (``--checkpoint-dir /ckpt``): committed checkpoints
    #: are uploaded and restored before the next start, on any node (docs/checkpoints.md).
    checkpoint_dir: str | None = None

    @field_validator("checkpoint_dir")
    @classmethod
    def _checkpoint_dir(cls, value: str | None) -> str | None:
        return None if value is None else check_mount_path(value)

    #: The checkpoint request the pod receives every τ (Young/Daly, docs/checkpoints.md):
    #: a signal name such as ``SIGUSR1`` (the default) or ``USR2``.
    checkpoint_signal: str | None = None
    #: ``directory`` (the default with a checkpoint dir: the program writes its own) or
    #: ``transparent`` (the node dumps the container with runc/CRIU; CPU pods only).
    checkpoint: str | None = None
    #: One MIG instance of this profile (``--mig 1g.10gb``), a name of the GPU model's
    #: profiles (``scheduler.mig``); not together with a share of a GPU.
    mig: str | None = None
    #: A share's device memory limit (``--gpu-memory 20Gi``; only with ``--gpus`` below 1):
    #: set on the GPU's MPS daemon and, where the node has cgroup dmem, as ``dmem.max``.
    gpu_memory: int | str | None = None

    @field_validator("gpu_memory")
    @classmethod
    def _gpu_memory(cls, value: int | str | None) -> int | str | None:
        if value is None:
            return None
        try:
            size = parse_memory("gpu_memory", value)
        except InvalidInput as error:
            raise _reraise("gpu_memory", error) from None
        if size < 1024**2:
            raise ValueError("must be at least 1Mi")
        return value

    @property
    def gpu_memory_bytes(self) -> int | None:
        return None if self.gpu_memory is None else parse_memory("gpu_memory", self.gpu_memory)

    @field_validator("mig")
    @classmethod
    def _mig(cls, value: str | None) -> str | None:
        if value is None:
            return None
        profile = value.strip().lower()
        if not known_profile(profile):
            raise ValueError(f"{value!r} is not a MIG profile of any GPU model "
                             f"(e.g. {', '.join(sorted(MIG_PROFILES['H100-80GB']))})")
        return profile

    @field_validator("checkpoint_signal")
    @classmethod
    def _checkpoint_signal(cls, value: str | None) -> str | None:
        if value is None:
            return None
        name = value.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name not in CHECKPOINT_SIGNALS:
            raise ValueError(f"{value!r} is not one of {', '.join(CHECKPOINT_SIGNALS)}")
        return name

    @field_validator("checkpoint")
    @classmethod
    def _checkpoint_mode(cls, value: str | None) -> str | None:
        if value is not None and value not in CHECKPOINT_MODES:
            raise ValueError(f"{value!r} is not one of {', '.join(CHECKPOINT_MODES)}")
        return value

    @field_validator("image")
    @classmethod
    def _image(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            parse_reference(value)
        except InvalidInput as error:
            raise _reraise("image", error) from None
        return value

    @field_validator("command", "entrypoint")
    @classmethod
    def _argv(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(value) > MAX_COMMAND_ARGS:
            raise ValueError(f"at most {MAX_COMMAND_ARGS} arguments")
        return value

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
    def cpu_milli(self) -> int:
        return parse_cpu_milli("cpu", self.cpu)

    @property
    def memory_bytes(self) -> int:
        return parse_memory("memory", self.memory)

    @property
    def volume_bytes(self) -> int | None:
        return None if self.volume_size is None else parse_memory("volume_size",
                                                                  self.volume_size)

    @property
    def container_disk_bytes(self) -> int | None:
        return None if self.container_disk is None else parse_memory("container_disk",
                                                                     self.container_disk)


class ContainerSpecOut(BaseModel):
    """The container spec as pods, jobs and templates show it (sizes in bytes)."""

    image: str
    command: list[str] = Field(default_factory=list)
    gpu_type: str | None = None
    cpu: float = 1
    memory: str = "1Gi"
    memory_bytes: int = 0
    env: dict[str, str] = Field(default_factory=dict)
    entrypoint: list[str] | None = None
    volume_size: int | None = None
    volume_path: str | None = None
    container_disk: int | None = None
    network_volumes: list[str] = Field(default_factory=list)
    registry_auth: str | None = None
    spot: bool = False
    bid: float | None = None
    grace: float | None = None
    checkpoint_dir: str | None = None
    checkpoint_signal: str | None = None
    checkpoint: str | None = None
    mig: str | None = None
    gpu_memory: int | None = None


class TemplateCreateRequest(ContainerSpec):
    """``gpucloud template create``: a named spec that pods are created from."""

    name: DnsName
    image: str  # a template always names its image
    gpus: Gpus = 0
    ports: Ports = Field(default_factory=list)


class TemplateOut(ContainerSpecOut):
    id: str
    name: str
    project: str
    gpus: float = 0
    ports: list[str] = Field(default_factory=list)
    created_at: datetime


class RegistryAuthAddRequest(_Request):
    """Credentials for a private registry; the password is stored, never shown again."""

    name: DnsName
    username: str = Field(min_length=1, max_length=255)
    password: str = Field(min_length=1, max_length=16384, repr=False)
    #: The registry host they are for (``ghcr.io``, ``127.0.0.1:5000``); None: the
    #: registry of whichever image is pulled with them.
    registry: str | None = Field(default=None, min_length=1, max_length=255,
                                 pattern=r"^[A-Za-z0-9.-]+(:[0-9]{1,5})?$")


class RegistryAuthOut(BaseModel):
    id: str
    name: str
    username: str
    registry: str | None = None
    created_at: datetime
