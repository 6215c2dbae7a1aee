"""RunPod's REST v1 (``https://rest.runpod.io/v1``, retired by RunPod on 2026-11-15) under
``/runpod/v1``, for runpodctl builds and SkyPilot releases that still call it
(``RUNPOD_API_URL``): pods listed as a bare array, created, read, deleted, started,
stopped, reset and restarted (in place), in v1's field names (``desiredStatus``,
``imageName``, ``env`` as an object, ``ports`` as a list); network volumes
(``/networkvolumes``) and registry credentials (``/containerregistryauth``) as gpucloud's
own. Errors: ``{"error": …, "status": …}``.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from gpucloud.api.deps import Ctx
from gpucloud.compat.runpod import actions, mapping
from gpucloud.compat.runpod.rest_common import (
    Failure,
    PodPricing,
    RunpodCaller,
    RunpodRoute,
    gpu_count,
    wake,
)
from gpucloud.compat.runpod.rest_v2 import (
    Env,
    Name,
    PortList,
    Short,
    Text,
    template_name,
)
from gpucloud.core.errors import InvalidInput
from gpucloud.core.models import MAX_GPUS_PER_POD, PodOut
from gpucloud.core.spec import DnsName
from gpucloud.services import pods, registry_auths, volumes

PREFIX = "/runpod/v1"


class ErrorV1Out(BaseModel):
    error: str
    status: int


def render(failure: Failure) -> JSONResponse:
    body = ErrorV1Out(error=failure.detail, status=failure.status)
    return JSONResponse(body.model_dump(), status_code=failure.status)


class V1Route(RunpodRoute):
    @staticmethod
    def render(failure: Failure) -> JSONResponse:
        return render(failure)


_TEXT = {401: "Missing or unknown API key", 403: "Not allowed", 404: "Not found",
         409: "Conflicts with the pod's state", 422: "Invalid input", 429: "Too many failures"}
#: ``{error, status}``; a 422 from the body checks of ``api.limits`` is ``ErrorOut``.
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": text, "model": ErrorV1Out} for code, text in _TEXT.items()}
_ERRORS[422] = {"description": _TEXT[422], "content": {"application/json": {"schema": {
    "anyOf": [{"$ref": "#/components/schemas/ErrorV1Out"},
              {"$ref": "#/components/schemas/ErrorOut"}]}}}}
router = APIRouter(prefix=PREFIX, tags=["runpod-v1"], route_class=V1Route, responses=_ERRORS)
PodRef = Annotated[str, Path(min_length=1, max_length=255)]
Word = Annotated[str, StringConstraints(max_length=4096)]
Words = Annotated[list[Word], Field(max_length=256)]


class CreatePodV1Request(BaseModel):
    """runpodctl's ``PodCreateRequest`` and SkyPilot's REST v1 body."""

    model_config = ConfigDict(extra="forbid")

    name: Name
    imageName: Short | None = None  # noqa: N815
    templateId: Name | None = None  # noqa: N815
    computeType: Literal["GPU", "CPU"] | None = None  # noqa: N815
    gpuTypeIds: list[Short] = Field(default_factory=list, max_length=64)  # noqa: N815
    gpuCount: int | None = Field(default=None, ge=1, le=MAX_GPUS_PER_POD)  # noqa: N815
    vcpuCount: int | None = Field(default=None, ge=1, le=4096)  # noqa: N815
    minVCPUPerGPU: int | None = Field(default=None, ge=1, le=512)  # noqa: N815
    minRAMPerGPU: int | None = Field(default=None, ge=1, le=65536)  # noqa: N815
    volumeInGb: int | None = Field(default=None, ge=0, le=1_000_000)  # noqa: N815
    containerDiskInGb: int | None = Field(default=None, ge=1, le=1_000_000)  # noqa: N815
    volumeMountPath: Short | None = None  # noqa: N815
    networkVolumeId: Short | None = None  # noqa: N815
    ports: PortList = Field(default_factory=list)
    env: Env = Field(default_factory=dict)
    dockerArgs: Text | None = None  # noqa: N815
    dockerEntrypoint: Words | None = None  # noqa: N815
    dockerStartCmd: Words | None = None  # noqa: N815
    #: Accepted and not acted on (docs/runpod.md): one cloud, no data centers here.
    cloudType: Literal["SECURE", "COMMUNITY"] | None = None  # noqa: N815
    dataCenterIds: list[Short] = Field(default_factory=list, max_length=64)  # noqa: N815
    countryCodes: list[Short] = Field(default_factory=list, max_length=64)  # noqa: N815
    supportPublicIp: bool | None = None  # noqa: N815
    globalNetworking: bool | None = None  # noqa: N815
    minCudaVersion: Annotated[str, StringConstraints(max_length=16)] | None = None  # noqa: N815
    allowedCudaVersions: list[Annotated[str, StringConstraints(max_length=16)]] = Field(  # noqa: N815
        default_factory=list, max_length=32)
    minDownloadMbps: int | None = Field(default=None, ge=0, le=1_000_000)  # noqa: N815
    minUploadMbps: int | None = Field(default=None, ge=0, le=1_000_000)  # noqa: N815
    startSsh: bool = True  # noqa: N815
    interruptible: bool = False


class PortV1Out(BaseModel):
    ip: str
    isIpPublic: bool  # noqa: N815
    privatePort: int  # noqa: N815
    publicPort: int | None  # noqa: N815
    type: str


class RuntimeV1Out(BaseModel):
    uptimeInSeconds: int  # noqa: N815
    ports: list[PortV1Out]


class MachineV1Out(BaseModel):
    podHostId: str  # noqa: N815
    gpuDisplayName: str  # noqa: N815


class PodV1Out(BaseModel):
    id: str
    name: str
    desiredStatus: Literal["CREATED", "RUNNING", "RESTARTING", "EXITED",  # noqa: N815
                           "TERMINATED"]
    createdAt: str  # noqa: N815
    lastStatusChange: str  # noqa: N815
    uptimeSeconds: int  # noqa: N815
    imageName: str  # noqa: N815
    gpuTypeId: str | None  # noqa: N815
    gpuCount: int  # noqa: N815
    vcpuCount: float  # noqa: N815
    memoryInGb: float  # noqa: N815
    volumeInGb: int  # noqa: N815
    containerDiskInGb: int  # noqa: N815
    volumeMountPath: str  # noqa: N815
    networkVolumeId: str | None  # noqa: N815
    ports: list[str]
    env: dict[str, str]
    dockerArgs: str  # noqa: N815
    costPerHr: float  # noqa: N815
    interruptible: bool
    templateId: str | None  # noqa: N815
    machineId: str  # noqa: N815
    machine: MachineV1Out
    runtime: RuntimeV1Out | None


def pod_input(body: CreatePodV1Request) -> mapping.RunpodPodInput:
    """v1's flat body, normalized. A GPU pod (the default, as on RunPod) takes the first
    of ``gpuTypeIds`` (none: any GPU) and ``gpuCount`` (default 1)."""
    cpu_pod = body.computeType == "CPU"
    if cpu_pod and body.gpuTypeIds:
        raise InvalidInput("gpuTypeIds", "a CPU pod has no GPU types")
    gpus = 0 if cpu_pod else (body.gpuCount or 1)
    entrypoint, command = mapping.parse_docker_args(body.dockerArgs)
    if body.dockerEntrypoint is not None or body.dockerStartCmd is not None:
        if body.dockerArgs:
            raise InvalidInput("dockerArgs", "give dockerArgs or dockerEntrypoint/"
                               "dockerStartCmd, not both")
        entrypoint = body.dockerEntrypoint or None
        command = list(body.dockerStartCmd or [])
    return mapping.RunpodPodInput(
        name=body.name, image=body.imageName, template_id=body.templateId,
        gpu_type_id=body.gpuTypeIds[0] if body.gpuTypeIds and gpus else None,
        gpu_count=gpus,
        vcpu=body.vcpuCount or (body.minVCPUPerGPU * gpus if body.minVCPUPerGPU and gpus
                                else None),
        memory_gb=body.minRAMPerGPU * gpus if body.minRAMPerGPU and gpus else None,
        volume_gb=body.volumeInGb or None, volume_mount_path=body.volumeMountPath,
        container_disk_gb=body.containerDiskInGb, env=dict(body.env),
        ports=list(body.ports), entrypoint=entrypoint, command=command,
        network_volume_id=body.networkVolumeId, start_ssh=False,
        spot=body.interruptible)


def pod_v1(pod: PodOut, pricing: PodPricing) -> PodV1Out:
    model = pricing.model(pod)
    shape = mapping.pod_shape(pod, model=model, cost_per_hr=pricing.cost(pod), now=pricing.now)
    runtime = shape["runtime"]
    return PodV1Out(
        id=pod.id, name=pod.name, desiredStatus=shape["desiredStatus"],
        createdAt=shape["createdAt"], lastStatusChange=shape["lastStatusChange"],
        uptimeSeconds=shape["uptimeSeconds"], imageName=pod.image,
        gpuTypeId=mapping.gpu_type_id(model) if model else None,
        gpuCount=gpu_count(pod), vcpuCount=pod.cpu, memoryInGb=shape["memoryInGb"],
        volumeInGb=shape["volumeInGb"], containerDiskInGb=shape["containerDiskInGb"],
        volumeMountPath=shape["volumeMountPath"], networkVolumeId=shape["networkVolumeId"],
        ports=pod.ports, env=pod.env, dockerArgs=shape["dockerArgs"],
        costPerHr=shape["costPerHr"], interruptible=pod.spot, templateId=pod.template,
        machineId=shape["machineId"],
        machine=MachineV1Out(podHostId=shape["machine"]["podHostId"],
                             gpuDisplayName=shape["machine"]["gpuDisplayName"]),
        runtime=RuntimeV1Out(uptimeInSeconds=runtime["uptimeInSeconds"],
                             ports=[PortV1Out(**port) for port in runtime["ports"]])
        if runtime else None)


def _json(content: str, status: int = 200) -> Response:
    return Response(content, status_code=status, media_type="application/json")


@router.get("/pods", response_model=list[PodV1Out])
def list_pods(ctx: Ctx, caller: RunpodCaller) -> Response:
    pricing = PodPricing.load(ctx)
    listed = pods.list_pods(ctx, caller, None, 10000)
    return _json("[" + ",".join(pod_v1(p, pricing).model_dump_json() for p in listed) + "]")


@router.post("/pods", status_code=201, response_model=PodV1Out)
def create_pod(body: CreatePodV1Request, ctx: Ctx, caller: RunpodCaller,
               request: Request) -> Response:
    spec = pod_input(body)
    spec.template_id = template_name(ctx, caller, spec.template_id)
    pod = pods.create_pod(ctx, caller, mapping.create_request(spec))
    wake(request)
    return _json(pod_v1(pod, PodPricing.load(ctx)).model_dump_json(), 201)


@router.get("/pods/{podId}", response_model=PodV1Out)
def get_pod(podId: PodRef, ctx: Ctx, caller: RunpodCaller,  # noqa: N803 - RunPod's name
            includeMachine: bool = False,  # noqa: N803
            includeNetworkVolume: bool = False) -> Response:  # noqa: N803
    """``includeMachine``/``includeNetworkVolume``: accepted; ``machine`` and
    ``networkVolumeId`` are always there."""
    del includeMachine, includeNetworkVolume
    return _json(pod_v1(pods.get_pod(ctx, caller, podId), PodPricing.load(ctx))
                 .model_dump_json())


@router.delete("/pods/{podId}", status_code=204)
def delete_pod(podId: PodRef, ctx: Ctx, caller: RunpodCaller) -> Response:  # noqa: N803
    pods.delete_pod(ctx, caller, podId)
    return Response(status_code=204)


def _action_route(action: str) -> None:
    def act(podId: PodRef, ctx: Ctx, caller: RunpodCaller,  # noqa: N803
            request: Request) -> Response:
        pod = actions.run_action(ctx, caller, podId, action, partial(wake, request))
        assert pod is not None
        return _json(pod_v1(pod, PodPricing.load(ctx)).model_dump_json())

    act.__doc__ = f"``{action}`` the pod (restart and reset: stop, then start, in place)."
    router.add_api_route(f"/pods/{{podId}}/{action}", act, methods=["POST"],
                         response_model=PodV1Out, name=f"runpod_v1_{action}_pod")


for _action in ("start", "stop", "reset", "restart"):
    _action_route(_action)


# ---------------------------------------------------------------- network volumes


VolumeRef = Annotated[str, Path(min_length=1, max_length=255)]
#: RunPod's data center ids (``US-TX-3``) are DNS labels but for case: the zone, lower-cased.
DataCenter = Annotated[str, StringConstraints(max_length=63,
                                              pattern=r"^[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?$")]


class CreateNetworkVolumeV1Request(BaseModel):
    """runpodctl's ``NetworkVolumeCreateInput``: a gpucloud network volume."""

    model_config = ConfigDict(extra="forbid")

    name: DnsName
    size: int = Field(ge=1, le=1024**2)  # GB, up to the 1 PiB a volume may have
    dataCenterId: DataCenter | None = None  # noqa: N815


class NetworkVolumeV1Out(BaseModel):
    id: str
    name: str
    size: int
    dataCenterId: str | None  # noqa: N815


@router.get("/networkvolumes", response_model=list[NetworkVolumeV1Out])
def list_network_volumes(ctx: Ctx, caller: RunpodCaller) -> list[dict[str, Any]]:
    return [actions.volume_shape(v) for v in volumes.list_volumes(ctx, caller)]


@router.post("/networkvolumes", status_code=201, response_model=NetworkVolumeV1Out)
def create_network_volume(body: CreateNetworkVolumeV1Request, ctx: Ctx,
                          caller: RunpodCaller) -> dict[str, Any]:
    """``size`` in GB; ``dataCenterId`` becomes the volume's zone (lower-cased)."""
    return actions.volume_shape(actions.create_network_volume(
        ctx, caller, body.name, body.size, body.dataCenterId))


@router.get("/networkvolumes/{networkVolumeId}", response_model=NetworkVolumeV1Out)
def get_network_volume(networkVolumeId: VolumeRef, ctx: Ctx,  # noqa: N803 - RunPod's name
                       caller: RunpodCaller) -> dict[str, Any]:
    return actions.volume_shape(volumes.get_volume(ctx, caller, networkVolumeId))


@router.delete("/networkvolumes/{networkVolumeId}", status_code=204)
def delete_network_volume(networkVolumeId: VolumeRef, ctx: Ctx,  # noqa: N803
                          caller: RunpodCaller) -> Response:
    """409 while a live pod mounts it."""
    volumes.delete_volume(ctx, caller, networkVolumeId)
    return Response(status_code=204)


# ---------------------------------------------------------------- registry credentials


class CreateRegistryAuthV1Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: DnsName
    username: Name
    password: Annotated[str, StringConstraints(min_length=1, max_length=16384)]


class RegistryAuthV1Out(BaseModel):
    id: str
    name: str


AuthRef = Annotated[str, Path(min_length=1, max_length=255)]


@router.get("/containerregistryauth", response_model=list[RegistryAuthV1Out])
def list_registry_auths(ctx: Ctx, caller: RunpodCaller) -> list[dict[str, str]]:
    return [{"id": a.id, "name": a.name}
            for a in registry_auths.list_registry_auths(ctx, caller)]


@router.post("/containerregistryauth", status_code=201, response_model=RegistryAuthV1Out)
def create_registry_auth(body: CreateRegistryAuthV1Request, ctx: Ctx,
                         caller: RunpodCaller) -> dict[str, str]:
    """The password is stored for the agents and never returned."""
    auth = actions.add_registry_auth(ctx, caller, body.name, body.username, body.password)
    return {"id": auth.id, "name": auth.name}


@router.get("/containerregistryauth/{containerRegistryAuthId}",
            response_model=RegistryAuthV1Out)
def get_registry_auth(containerRegistryAuthId: AuthRef, ctx: Ctx,  # noqa: N803
                      caller: RunpodCaller) -> dict[str, str]:
    auth = actions.registry_auth(ctx, caller, containerRegistryAuthId)
    return {"id": auth.id, "name": auth.name}


@router.delete("/containerregistryauth/{containerRegistryAuthId}", status_code=204)
def delete_registry_auth(containerRegistryAuthId: AuthRef, ctx: Ctx,  # noqa: N803
                         caller: RunpodCaller) -> Response:
    registry_auths.remove_registry_auth(
        ctx, caller, actions.registry_auth(ctx, caller, containerRegistryAuthId).id)
    return Response(status_code=204)
