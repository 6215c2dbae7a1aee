"""Serverless endpoints on the wire: the create/update requests (one container spec, as
pods and templates, plus how workers scale), the read-back shape, RunPod's request
statuses, and RunPod's GPU pools (``gpuIds``) mapped onto the fleet's GPU models.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from gpucloud.core.errors import InvalidInput
from gpucloud.core.quantities import parse_duration
from gpucloud.core.spec import ContainerSpec, ContainerSpecOut, DnsName, Gpus, Ports

MAX_WORKERS = 100
MAX_RETRIES = 10
#: A worker may be kept idle at most a day, and one request may run at most a week.
MAX_IDLE_TIMEOUT_SECONDS = 86400.0
MAX_EXECUTION_TIMEOUT_SECONDS = 7 * 86400.0


class RequestStatus(StrEnum):
    """RunPod's statuses of a request (``/status/{id}``)."""

    IN_QUEUE = "IN_QUEUE"
    IN_PROGRESS = "IN_PROGRESS"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"

    @property
    def final(self) -> bool:
        return self not in (RequestStatus.IN_QUEUE, RequestStatus.IN_PROGRESS)


class Scaler(StrEnum):
    """How the autoscaler sizes an endpoint: ``queue-delay`` (add a worker when a request
    waited ``scaler_value`` seconds) or ``request-count`` (a worker per ``scaler_value``
    requests queued or running)."""

    QUEUE_DELAY = "queue-delay"
    REQUEST_COUNT = "request-count"


#: RunPod's GPU pools (``gpuIds``) and the fleet models each stands for (core/gpu_models).
#: RunPod's pools name cards the catalog lacks (RTX A4000, A6000); each maps onto the
#: catalog models of the same memory class and generation where there is one.
GPU_POOLS: dict[str, tuple[str, ...]] = {
    "AMPERE_16": ("T4", "V100-16GB", "P100"),
    "AMPERE_24": ("A10", "A10G"),
    "ADA_24": ("L4", "RTX4090"),
    "AMPERE_48": ("A100-40GB",),
    "ADA_48_PRO": ("L40S",),
    "AMPERE_80": ("A100-80GB",),
    "ADA_80_PRO": ("H100-80GB", "H800-80GB"),
    "HOPPER_141": ("H200-141GB",),
}


def gpu_types_for_pools(gpu_ids: str) -> list[str]:
    """The fleet models of a comma-separated pool list, in preference order, each once
    (422 ``gpu_ids`` for an unknown pool)."""
    models: list[str] = []
    for raw in gpu_ids.split(","):
        pool = raw.strip().upper()
        if not pool:
            continue
        if pool not in GPU_POOLS:
            raise InvalidInput("gpu_ids", f"{raw.strip()!r} is not a GPU pool; one of "
                               f"{', '.join(GPU_POOLS)}")
        models.extend(model for model in GPU_POOLS[pool] if model not in models)
    if not models:
        raise InvalidInput("gpu_ids", "names no GPU pool")
    return models


def _gpu_ids(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError("must be a comma-separated list of GPU pools")
    try:
        gpu_types_for_pools(value)
    except InvalidInput as error:
        raise ValueError(error.message.removeprefix("gpu_ids: ")) from None
    return ",".join(part.strip().upper() for part in value.split(",") if part.strip())


def _duration(field: str, most: float) -> Any:
    def check(value: Any) -> Any:
        if value is None:
            return None
        try:
            seconds = parse_duration(field, value)
        except InvalidInput as error:
            raise ValueError(error.message.removeprefix(f"{field}: ")) from None
        if seconds > most:
            raise ValueError(f"must be at most {most:g} seconds")
        return seconds
    return BeforeValidator(check)


GpuIds = Annotated[Annotated[str, Field(max_length=255)] | None, BeforeValidator(_gpu_ids)]
IdleTimeout = Annotated[float, _duration("idle_timeout", MAX_IDLE_TIMEOUT_SECONDS)]
ExecutionTimeout = Annotated[float, _duration("execution_timeout",
                                              MAX_EXECUTION_TIMEOUT_SECONDS)]


class EndpointCreateRequest(ContainerSpec):
    """``gpucloud endpoint create``: the workers' spec and how they scale. With
    ``template`` the template's spec is the base (as ``pod create --template``);
    ``max_workers`` below ``min_workers`` is refused by the service (422)."""

    name: DnsName
    gpus: Gpus = 0
    ports: Ports = Field(default_factory=list)
    template: DnsName | None = None
    gpu_ids: GpuIds = None
    min_workers: int = Field(default=0, ge=0, le=MAX_WORKERS)
    max_workers: int = Field(default=3, ge=1, le=MAX_WORKERS)
    idle_timeout: IdleTimeout = 5.0
    scaler: Scaler = Scaler.QUEUE_DELAY
    scaler_value: int = Field(default=4, ge=1, le=100_000)
    execution_timeout: ExecutionTimeout = 600.0
    max_retries: int = Field(default=3, ge=0, le=MAX_RETRIES)


class EndpointUpdateRequest(ContainerSpec):
    """``gpucloud endpoint update``: any of the create fields; only those given
    (``model_fields_set``) change. Workers started from now on get the new spec (running
    ones keep theirs until they are replaced)."""

    gpus: Gpus | None = None
    ports: Ports | None = None
    template: DnsName | None = None
    gpu_ids: GpuIds = None
    min_workers: int | None = Field(default=None, ge=0, le=MAX_WORKERS)
    max_workers: int | None = Field(default=None, ge=1, le=MAX_WORKERS)
    idle_timeout: IdleTimeout | None = None
    scaler: Scaler | None = None
    scaler_value: int | None = Field(default=None, ge=1, le=100_000)
    execution_timeout: ExecutionTimeout | None = None
    max_retries: int | None = Field(default=None, ge=0, le=MAX_RETRIES)


class EndpointOut(ContainerSpecOut):
    id: str
    name: str
    project: str
    gpus: float = 0
    ports: list[str] = Field(default_factory=list)
    template: str | None = None
    gpu_ids: str | None = None
    min_workers: int
    max_workers: int
    idle_timeout_seconds: float
    scaler: str
    scaler_value: int
    execution_timeout_seconds: float
    max_retries: int
    #: Worker pods running now, those of them with nothing in flight, and queued requests.
    workers: int = 0
    workers_idle: int = 0
    queue: int = 0
    created_at: datetime


_POLICY_MS = Field(default=None, ge=1000, le=int(MAX_EXECUTION_TIMEOUT_SECONDS * 1000))


class RunPolicy(BaseModel):
    """RunPod's ``policy`` of a request (milliseconds); other keys are accepted, unused."""

    model_config = ConfigDict(extra="allow")

    executionTimeout: int | None = _POLICY_MS  # noqa: N815 (RunPod's name)
    ttl: int | None = _POLICY_MS


class RunRequest(BaseModel):
    """The body of ``/v2/{endpoint}/run`` and ``/runsync``: the handler's ``input`` (any
    JSON), an optional ``webhook`` POSTed with the result, and a ``policy``. Other keys
    RunPod clients send (``s3Config`` …) are accepted and not used."""

    model_config = ConfigDict(extra="allow")

    input: Any
    webhook: str | None = Field(default=None, max_length=2048, pattern=r"^https?://")
    policy: RunPolicy | None = None
