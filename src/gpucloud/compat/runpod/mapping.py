"""gpucloud pods and templates ↔ RunPod's shapes, shared by the GraphQL and REST layers.

Only translation lives here: no database writes, no rules. Everything a RunPod request
asks for becomes a gpucloud ``PodCreateRequest`` / ``TemplateCreateRequest`` that the
ordinary services validate, admit, price and record; everything they return is rendered
in RunPod's field names (``desiredStatus``, ``env`` as ``"K=V"`` strings,
``machine.podHostId``, ``runtime.ports`` with the private entry, GPU ids such as
``NVIDIA H100 80GB HBM3``, ``costPerHr`` from the price catalog).
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gpucloud.core.access import PortMapping
from gpucloud.core.billing import PriceClass, Resource
from gpucloud.core.errors import InvalidInput
from gpucloud.core.gpu_models import lookup
from gpucloud.core.models import PodCreateRequest, PodOut
from gpucloud.core.phases import RESTARTING, PodPhase
from gpucloud.core.spec import TemplateCreateRequest, TemplateOut
from gpucloud.services.prices import PriceBook

#: Canonical gpucloud model → (RunPod's GPU type id, RunPod's display name).
RUNPOD_GPU_IDS: dict[str, tuple[str, str]] = {
    "H200-141GB": ("NVIDIA H200", "H200 SXM"),
    "H100-80GB": ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    "H800-80GB": ("NVIDIA H800", "H800"),
    "A100-80GB": ("NVIDIA A100-SXM4-80GB", "A100 SXM"),
    "A100-40GB": ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
    "L40S": ("NVIDIA L40S", "L40S"),
    "L4": ("NVIDIA L4", "L4"),
    "A10": ("NVIDIA A10", "A10"),
    "A10G": ("NVIDIA A10G", "A10G"),
    "RTX4090": ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    "T4": ("Tesla T4", "T4"),
    "V100-32GB": ("Tesla V100-SXM2-32GB", "V100 SXM2 32GB"),
    "V100-16GB": ("Tesla V100-SXM2-16GB", "V100 SXM2"),
    "P100": ("Tesla P100-PCIE-16GB", "P100"),
}
_BY_RUNPOD_ID = {ids[0].lower(): model for model, ids in RUNPOD_GPU_IDS.items()}
#: RunPod's public templates (``runpod-ubuntu``, the SDK's CPU default): they do not exist
#: here, so a request that also names its image runs that image (docs/runpod.md).
RUNPOD_PUBLIC_TEMPLATE_PREFIX = "runpod-"
DEFAULT_VOLUME_PATH = "/workspace"
_M = TypeVar("_M", bound=BaseModel)


def gpu_type_id(model: str) -> str:
    """RunPod's id of a gpucloud model (the model itself when RunPod has no such GPU)."""
    return RUNPOD_GPU_IDS.get(model, (model, model))[0]


def gpu_display_name(model: str) -> str:
    return RUNPOD_GPU_IDS.get(model, (model, model))[1]


def gpu_model(type_id: str, field_name: str = "gpuTypeId") -> str:
    """The canonical gpucloud model of a RunPod GPU id, display name or gpucloud name."""
    key = type_id.strip().lower()
    if key in _BY_RUNPOD_ID:
        return _BY_RUNPOD_ID[key]
    for model, (_, display) in RUNPOD_GPU_IDS.items():
        if display.lower() == key:
            return model
    known = lookup(type_id)
    if known is not None:
        return known.name
    if not type_id.strip():
        raise InvalidInput(field_name, "must name a GPU type")
    return type_id.strip()  # a model only some node has: the service decides


def pod_host_id(pod_id: str) -> str:
    """``machine.podHostId``: ``{pod-id}-{8 hex}``, the SSH gateway's user name form."""
    return f"{pod_id}-{hashlib.sha256(pod_id.encode()).hexdigest()[:8]}"


_WAITING = {PodPhase.PENDING, PodPhase.SCHEDULED, PodPhase.PULLING}


def desired_status(pod: PodOut, terminated: bool = False) -> str:
    """GraphQL/REST v1 ``desiredStatus``: CREATED, RUNNING, RESTARTING, EXITED, TERMINATED."""
    if terminated or pod.desired_state == "deleted":
        return "TERMINATED"
    if pod.desired_state == RESTARTING:
        return "RESTARTING"  # its agent stops it; the server starts it again
    if pod.desired_state == "stopped":
        return "EXITED"  # desired: even while its agent is still stopping it
    if pod.phase is PodPhase.RUNNING:
        return "RUNNING"
    if pod.phase in _WAITING:
        return "RESTARTING" if pod.restart_count or pod.preemptions else "CREATED"
    return "EXITED"


def v2_status(pod: PodOut, terminated: bool = False) -> str:
    """REST v2 ``status``: PROVISIONING, STARTING, RUNNING, EXITED, ERROR, TERMINATED."""
    if terminated:
        return "TERMINATED"
    phase = pod.phase
    if phase is PodPhase.RUNNING:
        return "RUNNING"
    if pod.desired_state == "running" and phase in {PodPhase.PENDING, PodPhase.SCHEDULED}:
        return "PROVISIONING"
    if pod.desired_state == "running" and phase is PodPhase.PULLING:
        return "STARTING"
    if phase in {PodPhase.FAILED, PodPhase.LOST}:
        return "ERROR"
    return "EXITED"


def env_strings(env: dict[str, str]) -> list[str]:
    """A pod's ``env``: ``["K=V", …]``."""
    return [f"{key}={value}" for key, value in env.items()]


def env_pairs(env: dict[str, str]) -> list[dict[str, str]]:
    """A template's (and endpoint's) ``env``: ``[{key, value}, …]``."""
    return [{"key": key, "value": value} for key, value in env.items()]


def env_from_pairs(pairs: list[dict[str, Any]] | None, field_name: str = "env"
                   ) -> dict[str, str]:
    """``[{key, value}]`` (GraphQL) → a dict; a missing key is a named error."""
    env: dict[str, str] = {}
    for index, pair in enumerate(pairs or []):
        key = pair.get("key")
        if not isinstance(key, str) or not key:
            raise InvalidInput(f"{field_name}[{index}].key", "must be a non-empty string")
        value = pair.get("value")
        env[key] = "" if value is None else str(value)
    return env


def parse_ports(text: str | None, field_name: str = "ports") -> list[str]:
    """``"8888/http,22/tcp"`` → ``["8888/http", "22/tcp"]`` (spaces, empties dropped);
    the spec validator checks each entry."""
    if text is None:
        return []
    if not isinstance(text, str):
        raise InvalidInput(field_name, "must be a string such as '8888/http,22/tcp'")
    return [part.strip() for part in text.split(",") if part.strip()]


def ports_string(ports: list[str]) -> str:
    return ",".join(ports)


def with_ssh_port(ports: list[str]) -> list[str]:
    """``startSsh``: the pod also gets 22/tcp published (the gateway answers SSH anyway)."""
    if any(p.split("/")[0] == "22" for p in ports):
        return ports
    return [*ports, "22/tcp"]


def parse_docker_args(text: str | None, field_name: str = "dockerArgs"
                      ) -> tuple[list[str] | None, list[str]]:
    """RunPod's ``dockerArgs`` → (entrypoint or None to keep the image's, command).

    As RunPod's backend does: a JSON object ``{"cmd": [...], "entrypoint": [...]}`` is used
    as given, anything else is split like a shell would (quotes kept intact, so
    ``bash -c 'echo "hi"'`` stays three words). Blank → the image's own command.
    """
    if text is None or not text.strip():
        return None, []
    stripped = text.strip()
    if stripped.startswith("{"):
        return _json_docker_args(stripped, field_name)
    try:
        return None, shlex.split(stripped)
    except ValueError as error:
        raise InvalidInput(field_name, f"cannot be split into words: {error}") from None


def _json_docker_args(text: str, field_name: str) -> tuple[list[str] | None, list[str]]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidInput(field_name, f"is not valid JSON: {error.msg}") from None
    if not isinstance(value, dict) or set(value) - {"cmd", "entrypoint"}:
        raise InvalidInput(field_name, "a JSON dockerArgs has only 'cmd' and 'entrypoint'")
    cmd, entrypoint = value.get("cmd", []), value.get("entrypoint")
    for name, words in (("cmd", cmd), ("entrypoint", entrypoint or [])):
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise InvalidInput(f"{field_name}.{name}", "must be a list of strings")
    return entrypoint, list(cmd)


def docker_args_of(entrypoint: list[str] | None, command: list[str]) -> str:
    """The reverse, for output: the shell form, or JSON when the entrypoint is replaced."""
    if entrypoint is not None:
        return json.dumps({"cmd": command, "entrypoint": entrypoint})
    return shlex.join(command)


def gib(value: int | None) -> int:
    """Bytes → whole GB as RunPod shows them (GiB here)."""
    return 0 if not value else round(value / 1024**3)


@dataclass
class RunpodPodInput:
    """A pod as RunPod's create calls describe it, normalized (GraphQL and REST)."""

    name: str
    image: str | None = None
    gpu_type_id: str | None = None
    gpu_count: int = 0
    vcpu: float | None = None
    memory_gb: float | None = None
    volume_gb: int | None = None
    volume_mount_path: str | None = None
    container_disk_gb: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    ports: list[str] = field(default_factory=list)
    entrypoint: list[str] | None = None
    command: list[str] = field(default_factory=list)
    template_id: str | None = None
    network_volume_id: str | None = None
    start_ssh: bool = False
    spot: bool = False
    bid_per_gpu: float | None = None


def _template_ref(template_id: str | None, image: str | None) -> str | None:
    if not template_id:
        return None
    if template_id.startswith(RUNPOD_PUBLIC_TEMPLATE_PREFIX) and image:
        return None  # RunPod's public template: the given image is what runs
    return template_id


def create_request(spec: RunpodPodInput) -> PodCreateRequest:
    """The gpucloud request for a RunPod pod; only fields RunPod set are passed, so a
    template's values stay where the request is silent."""
    values: dict[str, Any] = {"name": spec.name}
    template = _template_ref(spec.template_id, spec.image)
    _put(values, template=template, image=spec.image or None)
    if spec.gpu_count:
        values["gpus"] = spec.gpu_count
        if spec.gpu_type_id:
            values["gpu_type"] = gpu_model(spec.gpu_type_id)
    _put(values, cpu=spec.vcpu or None,
         memory=f"{spec.memory_gb}Gi" if spec.memory_gb else None,
         container_disk=f"{spec.container_disk_gb}Gi" if spec.container_disk_gb else None)
    _storage(values, spec)
    ports = with_ssh_port(spec.ports) if spec.start_ssh else spec.ports
    _put(values, env=spec.env or None, ports=ports or None,
         command=spec.command or None, entrypoint=spec.entrypoint)
    if spec.spot:
        values["spot"] = True
        _put(values, bid=spec.bid_per_gpu)
    return validated(PodCreateRequest, values)


def _storage(values: dict[str, Any], spec: RunpodPodInput) -> None:
    """Volume disk at ``volumeMountPath``; a network volume replaces it there (RunPod)."""
    path = spec.volume_mount_path or None
    if spec.network_volume_id:
        values["network_volumes"] = [f"{spec.network_volume_id}:{path or DEFAULT_VOLUME_PATH}"]
        return
    if spec.volume_gb:
        values["volume_size"] = f"{spec.volume_gb}Gi"
        values["volume_path"] = path or DEFAULT_VOLUME_PATH


def _put(values: dict[str, Any], **items: Any) -> None:
    values.update({key: value for key, value in items.items() if value is not None})


#: gpucloud field → RunPod's name, for error messages a RunPod client understands.
RUNPOD_FIELD = {"image": "imageName", "gpus": "gpuCount", "gpu_type": "gpuTypeId",
                "cpu": "vcpuCount", "memory": "memoryInGb", "volume_size": "volumeInGb",
                "volume_path": "volumeMountPath", "container_disk": "containerDiskInGb",
                "network_volumes": "networkVolumeId", "command": "dockerArgs",
                "entrypoint": "dockerArgs", "template": "templateId", "bid": "bidPerGpu"}


def runpod_field(name: str) -> str:
    head, _, rest = name.partition(".")
    head = head.split("[")[0]
    return RUNPOD_FIELD.get(head, head) + (f".{rest}" if rest else "")


def validated(model: type[_M], values: dict[str, Any]) -> _M:
    """``model(**values)`` with a pydantic error turned into InvalidInput on RunPod's
    field name."""
    try:
        return model(**values)
    except ValidationError as error:
        first = error.errors()[0]
        loc = ".".join(str(part) for part in first["loc"]) or "input"
        raise InvalidInput(runpod_field(loc), first["msg"]) from None


@dataclass
class RunpodTemplateInput:
    name: str
    image: str
    entrypoint: list[str] | None = None
    command: list[str] = field(default_factory=list)
    container_disk_gb: int | None = None
    volume_gb: int | None = None
    volume_mount_path: str | None = None
    ports: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    start_ssh: bool = False


def template_request(spec: RunpodTemplateInput) -> TemplateCreateRequest:
    values: dict[str, Any] = {"name": spec.name, "image": spec.image}
    _put(values, container_disk=f"{spec.container_disk_gb}Gi" if spec.container_disk_gb
         else None, command=spec.command or None, entrypoint=spec.entrypoint,
         env=spec.env or None)
    if spec.volume_gb:
        values["volume_size"] = f"{spec.volume_gb}Gi"
        values["volume_path"] = spec.volume_mount_path or DEFAULT_VOLUME_PATH
    ports = with_ssh_port(spec.ports) if spec.start_ssh else spec.ports
    _put(values, ports=ports or None)
    return validated(TemplateCreateRequest, values)


def template_shape(template: TemplateOut) -> dict[str, Any]:
    """A template as RunPod's ``saveTemplate`` / REST return it (``env`` as pairs)."""
    return {
        "id": template.id, "name": template.name, "imageName": template.image,
        "dockerArgs": docker_args_of(template.entrypoint, template.command),
        "containerDiskInGb": gib(template.container_disk),
        "volumeInGb": gib(template.volume_size),
        "volumeMountPath": template.volume_path or "",
        "ports": ports_string(template.ports), "env": env_pairs(template.env),
        "isServerless": False, "isPublic": False, "readme": "",
        "startSsh": any(p.split("/")[0] == "22" for p in template.ports),
    }


def ordered_ports(mappings: list[PortMapping]) -> list[PortMapping]:
    """Public entries first, 22 before others (the runpod CLI takes the first entry with
    private port 22), private entries (``isIpPublic`` false) last."""
    return sorted(mappings, key=lambda m: (not m.isIpPublic, m.privatePort != 22,
                                           m.privatePort))


def runtime_ports(pod: PodOut) -> list[dict[str, Any]]:
    """``runtime.ports``; a running pod always has its private entry (SkyPilot reads the
    internal address from it), even with no ports published."""
    mappings = list(pod.ports_runtime)
    if pod.ip and not any(not m.isIpPublic for m in mappings):
        mappings.append(PortMapping(ip=pod.ip, isIpPublic=False, privatePort=22,
                                    publicPort=22, type="tcp"))
    return [m.model_dump() for m in ordered_ports(mappings)]


def hourly_price(book: PriceBook, model: str | None, gpus: float, cpu: float,
                 spot: bool, now: datetime) -> Decimal:
    """Price per hour in effect now: GPUs × the model's price (GPU pods' CPU and memory
    are in it), else CPU cores × the core price."""
    price_class = PriceClass.SPOT if spot else PriceClass.ON_DEMAND
    until = now + timedelta(seconds=1)
    if gpus and model:
        segments = book.gpu(model, None, price_class, now, until)
        return (segments[0].price if segments else Decimal(0)) * Decimal(str(gpus))
    if gpus:
        return Decimal(0)
    segments = book.flat(Resource.CPU, price_class, now, until)
    return (segments[0].price if segments else Decimal(0)) * Decimal(str(cpu))


def uptime_seconds(pod: PodOut, now: datetime) -> int:
    if pod.phase is not PodPhase.RUNNING or pod.started_at is None:
        return 0
    started = pod.started_at if pod.started_at.tzinfo else pod.started_at.replace(tzinfo=UTC)
    return max(0, int((now - started).total_seconds()))


def volume_mount_path(pod: PodOut) -> str:
    if pod.volume_path:
        return pod.volume_path
    for mount in pod.network_volumes:
        _, _, path = mount.partition(":")
        return path or DEFAULT_VOLUME_PATH
    return ""


def network_volume_id(pod: PodOut) -> str | None:
    return pod.network_volumes[0].partition(":")[0] if pod.network_volumes else None


def pod_shape(pod: PodOut, *, model: str | None, cost_per_hr: Decimal, now: datetime,
              terminated: bool = False) -> dict[str, Any]:
    """A pod in RunPod's GraphQL / REST v1 field names. ``model`` is the GPU model it has
    (or asked for); ``cost_per_hr`` comes from :func:`hourly_price`."""
    uptime = uptime_seconds(pod, now)
    gpu_count = int(pod.gpus) if pod.gpus >= 1 else (1 if pod.gpus else 0)
    return {
        "id": pod.id, "name": pod.name,
        "desiredStatus": desired_status(pod, terminated),
        "imageName": pod.image, "env": env_strings(pod.env),
        "machineId": pod.node or "", "dockerId": pod.id,
        "dockerArgs": docker_args_of(pod.entrypoint, pod.command),
        "machine": {"podHostId": pod_host_id(pod.id),
                    "gpuDisplayName": gpu_display_name(model) if model else "",
                    "gpuTypeId": gpu_type_id(model) if model else None},
        "runtime": None if pod.phase is not PodPhase.RUNNING else {
            "uptimeInSeconds": uptime, "ports": runtime_ports(pod),
            "gpus": [{"id": uuid, "gpuUtilPercent": 0, "memoryUtilPercent": 0}
                     for uuid in pod.gpu_uuids],
            "container": {"cpuPercent": 0, "memoryPercent": 0}},
        "costPerHr": float(cost_per_hr), "adjustedCostPerHr": float(cost_per_hr),
        "gpuCount": gpu_count, "vcpuCount": pod.cpu,
        "memoryInGb": round(pod.memory_bytes / 1024**3, 2),
        "volumeInGb": gib(pod.volume_size), "containerDiskInGb": gib(pod.container_disk),
        "volumeMountPath": volume_mount_path(pod),
        "ports": ports_string(pod.ports), "port": None,
        "podType": "INTERRUPTABLE" if pod.spot else "RESERVED",
        "bidPerGpu": pod.bid, "templateId": pod.template,
        "networkVolumeId": network_volume_id(pod),
        "uptimeSeconds": uptime,
        "lastStatusChange": f"{pod.phase.value}: {pod.updated_at.isoformat()}",
        "createdAt": pod.created_at.isoformat(),
    }
