"""RunPod's REST v2 (``https://api.runpod.io/v2``) under ``/runpod/v2``: pods with cursor
pagination and actions, templates, registries (gpucloud registry credentials), the GPU
catalog from the live fleet, and the account's SSH keys (the project's keys).

Shapes follow runpod/docs ``api-reference-v2/openapi.json``; every request becomes a
gpucloud request that the ordinary services validate, admit and record (docs/runpod.md).
"""

from __future__ import annotations

import base64
import binascii
from functools import partial
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from gpucloud.api.deps import Ctx
from gpucloud.compat.runpod import actions, catalog, mapping
from gpucloud.compat.runpod.rest_common import (
    Failure,
    PodPricing,
    RunpodCaller,
    RunpodRoute,
    gateway_endpoint,
    gpu_count,
    ssh_direct,
    title_of,
    wake,
)
from gpucloud.core.errors import Conflict, InvalidInput, NotFound
from gpucloud.core.models import MAX_GPUS_PER_POD, PodOut
from gpucloud.core.phases import PodPhase
from gpucloud.core.spec import TemplateOut
from gpucloud.services import pods, registry_auths, ssh_keys, templates
from gpucloud.services.context import ServiceContext
from gpucloud.services.projects import Principal

PREFIX = "/runpod/v2"
PROBLEM = "application/problem+json"
MAX_PAGE = 1000

Short = Annotated[str, StringConstraints(max_length=255)]
Name = Annotated[str, StringConstraints(min_length=1, max_length=255)]
Text = Annotated[str, StringConstraints(max_length=16384)]
EnvValue = Annotated[str, StringConstraints(max_length=32768)]
Env = Annotated[dict[Short, EnvValue], Field(max_length=256)]
PortList = Annotated[list[Annotated[str, StringConstraints(max_length=32)]],
                     Field(max_length=64)]


class ProblemOut(BaseModel):
    """RunPod v2's error body (RFC 9457)."""

    title: str
    status: int
    detail: str
    errors: list[str] = Field(default_factory=list)


def render(failure: Failure) -> JSONResponse:
    errors = [] if not failure.field else [
        failure.detail if failure.detail.startswith(failure.field)
        else f"{failure.field}: {failure.detail}"]
    body = ProblemOut(title=title_of(failure.status), status=failure.status,
                      detail=failure.detail, errors=errors)
    return JSONResponse(body.model_dump(), status_code=failure.status, media_type=PROBLEM)


class V2Route(RunpodRoute):
    @staticmethod
    def render(failure: Failure) -> JSONResponse:
        return render(failure)


_PROBLEM_SCHEMA = {"$ref": "#/components/schemas/ProblemOut"}
_ERROR_TEXT = {401: "Missing or unknown API key", 403: "Not allowed",
               404: "Not found", 409: "Conflicts with the pod's state",
               422: "Invalid input; `errors` names the field", 429: "Too many failures"}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """Documented error responses: RunPod's problem body (a 422 from the body checks of
    ``api.limits``, before the route, is gpucloud's ``ErrorOut``)."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in (401, 403, 429, *codes):
        content: dict[str, Any] = {PROBLEM: {"schema": _PROBLEM_SCHEMA}}
        if code == 422:
            content["application/json"] = {"schema": {"$ref": "#/components/schemas/ErrorOut"}}
        out[code] = {"description": _ERROR_TEXT[code], "content": content}
    out[401]["model"] = ProblemOut  # puts ProblemOut in the document's components
    return out


#: Every route documents the problem body for each error it may answer (``api.openapi``
#: keeps a route's own descriptions).
router = APIRouter(prefix=PREFIX, tags=["runpod-v2"], route_class=V2Route,
                   responses=_errors(404, 409, 422))
#: A pod, template, registry or GPU type id.
Ref = Annotated[str, Path(min_length=1, max_length=255)]


# ---------------------------------------------------------------- request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuRequest(_Body):
    id: Name
    count: int = Field(default=1, ge=1, le=MAX_GPUS_PER_POD)
    #: Accepted and not enforced (docs/runpod.md): nodes report no CUDA version here.
    allowedCudaVersions: list[Annotated[str, StringConstraints(max_length=16)]] | None = (  # noqa: N815
        Field(default=None, max_length=32))
    minCudaVersion: Annotated[str, StringConstraints(max_length=16)] | None = None  # noqa: N815


class CpuRequest(_Body):
    id: Name
    vcpuCount: int = Field(ge=1, le=4096)  # noqa: N815


class PersistentMount(_Body):
    size: int = Field(ge=1, le=1_000_000)
    path: Short


class NetworkMount(_Body):
    volumeId: Name  # noqa: N815
    path: Short


class Mounts(_Body):
    persistent: PersistentMount | None = None
    network: list[NetworkMount] = Field(default_factory=list, max_length=1)


class CreatePodRequest(_Body):
    name: Name
    image: Short | None = None
    templateId: Name | None = None  # noqa: N815
    args: Text | None = None
    disk: int | None = Field(default=None, ge=1, le=1_000_000)
    env: Env = Field(default_factory=dict)
    ports: PortList = Field(default_factory=list)
    registry: Short | None = None
    cloud: Literal["SECURE", "COMMUNITY"] | None = None
    dataCenterIds: list[Short] = Field(default_factory=list, max_length=64)  # noqa: N815
    globalNetworking: bool = False  # noqa: N815
    startSsh: bool = False  # noqa: N815
    startJupyter: bool = False  # noqa: N815
    gpu: GpuRequest | None = None
    cpu: CpuRequest | None = None
    mounts: Mounts | None = None


class UpdatePodRequest(_Body):
    name: Name | None = None
    image: Short | None = None
    args: Text | None = None
    disk: int | None = Field(default=None, ge=1, le=1_000_000)
    env: Env | None = None
    ports: PortList | None = None
    registry: Short | None = None
    locked: bool | None = None
    globalNetworking: bool | None = None  # noqa: N815
    templateId: Name | None = None  # noqa: N815
    mounts: Mounts | None = None


class PodActionRequest(_Body):
    action: Literal["start", "stop", "restart", "terminate"]


class CreateTemplateRequest(_Body):
    name: Name
    image: Short
    args: Text | None = None
    disk: int | None = Field(default=None, ge=1, le=1_000_000)
    env: Env = Field(default_factory=dict)
    ports: PortList = Field(default_factory=list)
    registry: Short | None = None
    mounts: Mounts | None = None
    category: Literal["NVIDIA", "AMD", "CPU"] | None = None
    public: bool = False
    serverless: bool = False
    startSsh: bool = True  # noqa: N815
    startJupyter: bool = False  # noqa: N815
    allowedCudaVersions: list[Annotated[str, StringConstraints(max_length=16)]] = (  # noqa: N815
        Field(default_factory=list, max_length=32))


class CreateRegistryRequest(_Body):
    name: Name
    username: Name
    password: Annotated[str, StringConstraints(min_length=1, max_length=16384)]


SshKeyLine = Annotated[str, StringConstraints(min_length=1, max_length=16384)]


class UpdateSshKeysRequest(_Body):
    keys: list[SshKeyLine] = Field(max_length=256)


# ---------------------------------------------------------------- response shapes


class RuntimePortOut(BaseModel):
    private: int
    public: int | None = None
    type: str
    ip: str | None = None
    #: Not in RunPod's v2 schema: tells the pod's own address (false) from the node's.
    isIpPublic: bool  # noqa: N815


class RuntimeOut(BaseModel):
    uptime: int
    ports: list[RuntimePortOut]


class SshEndpointOut(BaseModel):
    host: str
    port: int
    username: str
    command: str


class SshOut(BaseModel):
    proxy: SshEndpointOut | None
    direct: SshEndpointOut | None


class GpuOut(BaseModel):
    id: str
    count: int


class CpuOut(BaseModel):
    id: str
    vcpuCount: int  # noqa: N815
    memory: int


class ContainerV2Out(BaseModel):
    """What a v2 pod and template both show of their container."""

    id: str
    name: str
    image: str
    args: str
    disk: int
    mounts: dict[str, Any]
    ports: list[str]
    env: dict[str, str]
    registry: str | None


class PodV2Out(ContainerV2Out):
    status: Literal["PROVISIONING", "STARTING", "RUNNING", "EXITED", "ERROR", "TERMINATED"]
    actions: list[str]
    cloud: str
    dataCenterId: str | None  # noqa: N815
    cudaVersion: str | None  # noqa: N815
    ssh: SshOut
    template: str | None
    cost: float
    locked: bool
    globalNetworking: dict[str, bool]  # noqa: N815
    runtime: RuntimeOut | None
    createdAt: str  # noqa: N815
    startedAt: str | None  # noqa: N815
    gpu: GpuOut | None = None
    cpu: CpuOut | None = None


class PaginationOut(BaseModel):
    hasNextPage: bool  # noqa: N815
    nextCursor: str | None  # noqa: N815


class ListPodsOut(BaseModel):
    pods: list[PodV2Out]
    pagination: PaginationOut


class TemplateV2Out(ContainerV2Out):
    serverless: bool
    public: bool
    category: str
    startSsh: bool  # noqa: N815
    startJupyter: bool  # noqa: N815
    allowedCudaVersions: list[str]  # noqa: N815


class ListTemplatesOut(BaseModel):
    templates: list[TemplateV2Out]


class RegistryOut(BaseModel):
    id: str
    name: str


class ListRegistriesOut(BaseModel):
    registries: list[RegistryOut]


class GpuPriceOut(BaseModel):
    secure: float
    community: float


class GpuMaxCountOut(BaseModel):
    secure: int
    community: int


class GpuTypeOut(BaseModel):
    id: str
    name: str
    pool: str | None
    manufacturer: str
    memory: int
    secure: bool
    community: bool
    price: GpuPriceOut
    maxCount: GpuMaxCountOut  # noqa: N815


class ListGpuTypesOut(BaseModel):
    gpuTypes: list[GpuTypeOut]  # noqa: N815


class SshKeysOut(BaseModel):
    keys: list[str]


# ---------------------------------------------------------------- rendering

_ACTIONS = {"RUNNING": ["stop", "terminate"], "PROVISIONING": ["stop", "terminate"],
            "STARTING": ["stop", "terminate"], "EXITED": ["start", "restart", "terminate"],
            "ERROR": ["start", "restart", "terminate"], "TERMINATED": []}


def _runtime_ports(pod: PodOut) -> list[RuntimePortOut]:
    return [RuntimePortOut(private=port["privatePort"],
                           public=port["publicPort"] if port["isIpPublic"] else None,
                           type=port["type"], ip=port["ip"], isIpPublic=port["isIpPublic"])
            for port in mapping.runtime_ports(pod)]


def _ssh(pod: PodOut, request: Request) -> SshOut:
    direct = ssh_direct(pod) if pod.phase is PodPhase.RUNNING else None
    gateway = gateway_endpoint(request)
    user = mapping.pod_host_id(pod.id)
    return SshOut(
        proxy=SshEndpointOut(host=gateway[0], port=gateway[1], username=user,
                             command=f"ssh {user}@{gateway[0]} -p {gateway[1]}")
        if gateway else None,
        direct=SshEndpointOut(host=direct[0], port=direct[1], username="root",
                              command=f"ssh root@{direct[0]} -p {direct[1]}")
        if direct else None)


def _mounts(volume_size: int | None, volume_path: str | None,
            network_volumes: list[str]) -> dict[str, Any]:
    if network_volumes:
        return {"network": [{"volumeId": name, "path": path or mapping.DEFAULT_VOLUME_PATH}
                            for name, _, path in (m.partition(":") for m in network_volumes)]}
    if volume_size:
        return {"persistent": {"size": mapping.gib(volume_size),
                               "path": volume_path or mapping.DEFAULT_VOLUME_PATH}}
    return {}


def pod_v2(pod: PodOut, pricing: PodPricing, request: Request,
           terminated: bool = False) -> PodV2Out:
    status = mapping.v2_status(pod, terminated)
    running = status == "RUNNING"
    count = gpu_count(pod)
    return PodV2Out(
        id=pod.id, name=pod.name, status=status, actions=_ACTIONS[status],
        image=pod.image, args=mapping.docker_args_of(pod.entrypoint, pod.command),
        disk=mapping.gib(pod.container_disk),
        mounts=_mounts(pod.volume_size, pod.volume_path, pod.network_volumes),
        ports=pod.ports, env=pod.env, registry=pod.registry_auth, cloud="SECURE",
        dataCenterId=pod.node, cudaVersion=None, ssh=_ssh(pod, request),
        template=pod.template, cost=float(pricing.cost(pod)) if running else 0.0,
        locked=False, globalNetworking={"enabled": False},
        runtime=RuntimeOut(uptime=mapping.uptime_seconds(pod, pricing.now),
                           ports=_runtime_ports(pod)) if running else None,
        createdAt=pod.created_at.isoformat(),
        startedAt=pod.started_at.isoformat() if pod.started_at else None,
        gpu=GpuOut(id=mapping.gpu_type_id(model) if (model := pricing.model(pod)) else "",
                   count=count)
        if count else None,
        cpu=None if count else CpuOut(id="cpu", vcpuCount=max(1, round(pod.cpu)),
                                      memory=max(1, mapping.gib(pod.memory_bytes))))


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


# ---------------------------------------------------------------- pods


def pod_input(body: CreatePodRequest) -> mapping.RunpodPodInput:
    """RunPod's v2 create body, normalized; exactly one of ``gpu`` and ``cpu``."""
    if body.gpu and body.cpu:
        raise InvalidInput("cpu", "give either gpu or cpu, not both")
    mounts = body.mounts or Mounts()
    if mounts.persistent and mounts.network:
        raise InvalidInput("mounts", "give either mounts.persistent or mounts.network")
    entrypoint, command = mapping.parse_docker_args(body.args, "args")
    network = mounts.network[0] if mounts.network else None
    return mapping.RunpodPodInput(
        name=body.name, image=body.image, template_id=body.templateId,
        gpu_type_id=body.gpu.id if body.gpu else None,
        gpu_count=body.gpu.count if body.gpu else 0,
        vcpu=body.cpu.vcpuCount if body.cpu else None,
        volume_gb=mounts.persistent.size if mounts.persistent else None,
        volume_mount_path=(mounts.persistent.path if mounts.persistent
                           else network.path if network else None),
        container_disk_gb=body.disk, env=dict(body.env), ports=list(body.ports),
        entrypoint=entrypoint, command=command,
        network_volume_id=network.volumeId if network else None, start_ssh=body.startSsh)


def template_name(ctx: ServiceContext, caller: Principal, ref: str | None) -> str | None:
    """RunPod names a template by id; gpucloud's pod request by name."""
    if not ref or ref.startswith(mapping.RUNPOD_PUBLIC_TEMPLATE_PREFIX):
        return ref
    try:
        return templates.get_template(ctx, caller, ref).name
    except NotFound:
        raise InvalidInput("templateId", f"no template {ref!r} in this project") from None


@router.get("/pods", response_model=ListPodsOut)
def list_pods(ctx: Ctx, caller: RunpodCaller, request: Request,
              limit: int | None = Query(default=None, ge=1, le=MAX_PAGE),
              cursor: str | None = Query(default=None, min_length=1, max_length=128),
              includeClusterPods: bool = False,  # noqa: N803 - RunPod's name
              ) -> Response:
    """Oldest first. ``limit`` and ``cursor`` page through them: ``pagination.nextCursor``
    is the ``cursor`` of the next page (no ``limit``: every pod, in one page).
    ``includeClusterPods`` is accepted; a job's members are always listed."""
    del includeClusterPods
    listed = sorted(pods.list_pods(ctx, caller, None, 10000),
                    key=lambda pod: (pod.created_at, pod.id))
    start = _cursor_start(listed, cursor)
    page = listed[start:start + limit] if limit else listed[start:]
    more = start + len(page) < len(listed)
    pricing = PodPricing.load(ctx)
    return _json(ListPodsOut(
        pods=[pod_v2(pod, pricing, request) for pod in page],
        pagination=PaginationOut(hasNextPage=more,
                                 nextCursor=_encode_cursor(page[-1].id) if more else None)))


def _encode_cursor(pod_id: str) -> str:
    return base64.urlsafe_b64encode(pod_id.encode()).decode().rstrip("=")


def _cursor_start(listed: list[PodOut], cursor: str | None) -> int:
    """The index after the pod the cursor names; a cursor of a pod since deleted is
    refused (the client starts over)."""
    if cursor is None:
        return 0
    try:
        pod_id = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise InvalidInput("cursor", "is not a cursor this server gave") from None
    for index, pod in enumerate(listed):
        if pod.id == pod_id:
            return index + 1
    raise InvalidInput("cursor", "names no pod any more; list again from the start")


@router.post("/pods", status_code=201, response_model=PodV2Out,
             )
def create_pod(body: CreatePodRequest, ctx: Ctx, caller: RunpodCaller,
               request: Request) -> Response:
    spec = pod_input(body)
    spec.template_id = template_name(ctx, caller, spec.template_id)
    gpucloud_request = actions.with_registry(ctx, caller, mapping.create_request(spec),
                                            body.registry, "registry")
    pod = pods.create_pod(ctx, caller, gpucloud_request)
    wake(request)
    return _json(pod_v2(pod, PodPricing.load(ctx), request), 201)


@router.get("/pods/{id}", response_model=PodV2Out, )
def get_pod(id: Ref,  # noqa: A002 - RunPod's name
            ctx: Ctx, caller: RunpodCaller, request: Request) -> Response:
    return _json(pod_v2(pods.get_pod(ctx, caller, id), PodPricing.load(ctx), request))


@router.patch("/pods/{id}", response_model=PodV2Out, )
def update_pod(id: Ref, body: UpdatePodRequest,  # noqa: A002
               ctx: Ctx, caller: RunpodCaller, request: Request) -> Response:
    """Editing a pod is not supported (docs/runpod.md): a body that changes nothing
    answers the pod, any change a 409."""
    pod = pods.get_pod(ctx, caller, id)
    changes = _changes(pod, body)
    if changes:
        raise Conflict(f"editing a pod ({', '.join(changes)}) is not supported; create a "
                       "new pod (its volume can be a network volume)")
    return _json(pod_v2(pod, PodPricing.load(ctx), request))


def _changes(pod: PodOut, body: UpdatePodRequest) -> list[str]:
    current = {"name": pod.name, "image": pod.image, "env": pod.env, "ports": pod.ports,
               "args": mapping.docker_args_of(pod.entrypoint, pod.command),
               "disk": mapping.gib(pod.container_disk), "locked": False,
               "globalNetworking": False}
    given = body.model_dump(exclude_none=True, exclude={"mounts", "registry", "templateId"})
    changed = [key for key, value in given.items() if current.get(key) != value]
    if body.templateId or body.registry or (body.mounts and body.mounts.model_fields_set):
        changed.append("templateId/registry/mounts")
    return changed


@router.delete("/pods/{id}", status_code=204, )
def delete_pod(id: Ref, ctx: Ctx, caller: RunpodCaller) -> Response:  # noqa: A002
    pods.delete_pod(ctx, caller, id)
    return Response(status_code=204)


@router.post("/pods/{id}/action", response_model=PodV2Out, responses={
    204: {"description": "terminated"}})
def pod_action(id: Ref, body: PodActionRequest,  # noqa: A002
               ctx: Ctx, caller: RunpodCaller, request: Request) -> Response:
    pod = actions.run_action(ctx, caller, id, body.action, partial(wake, request))
    if pod is None:
        return Response(status_code=204)
    return _json(pod_v2(pod, PodPricing.load(ctx), request))


def _action_route(action: str) -> None:
    def act(id: Ref, ctx: Ctx, caller: RunpodCaller,  # noqa: A002
            request: Request) -> Response:
        pod = actions.run_action(ctx, caller, id, action, partial(wake, request))
        assert pod is not None
        return _json(pod_v2(pod, PodPricing.load(ctx), request))

    act.__doc__ = f"``{action}`` (as ``POST /pods/{{id}}/action``, and REST v1's route)."
    router.add_api_route(f"/pods/{{id}}/{action}", act, methods=["POST"],
                         response_model=PodV2Out,
                         name=f"runpod_v2_{action}_pod")


for _action in ("start", "stop", "restart", "reset"):
    _action_route(_action)


# ---------------------------------------------------------------- templates


def template_v2(template: TemplateOut) -> TemplateV2Out:
    return TemplateV2Out(
        id=template.id, name=template.name, image=template.image,
        args=mapping.docker_args_of(template.entrypoint, template.command),
        disk=mapping.gib(template.container_disk),
        mounts=_mounts(template.volume_size, template.volume_path, template.network_volumes),
        ports=template.ports, env=template.env, registry=template.registry_auth,
        serverless=False, public=False, category="NVIDIA" if template.gpus else "CPU",
        startSsh=any(p.split("/")[0] == "22" for p in template.ports), startJupyter=False,
        allowedCudaVersions=[])


@router.get("/templates", response_model=ListTemplatesOut)
def list_templates(ctx: Ctx, caller: RunpodCaller) -> Response:
    return _json(ListTemplatesOut(
        templates=[template_v2(t) for t in templates.list_templates(ctx, caller)]))


@router.post("/templates", status_code=201, response_model=TemplateV2Out,
             )
def create_template(body: CreateTemplateRequest, ctx: Ctx, caller: RunpodCaller) -> Response:
    if body.serverless:
        raise InvalidInput("serverless", "serverless templates are not supported here")
    mounts = body.mounts or Mounts()
    if mounts.network:
        raise InvalidInput("mounts.network", "a template cannot hold a network volume")
    entrypoint, command = mapping.parse_docker_args(body.args, "args")
    spec = mapping.RunpodTemplateInput(
        name=body.name, image=body.image, entrypoint=entrypoint, command=command,
        container_disk_gb=body.disk,
        volume_gb=mounts.persistent.size if mounts.persistent else None,
        volume_mount_path=mounts.persistent.path if mounts.persistent else None,
        ports=list(body.ports), env=dict(body.env), start_ssh=body.startSsh)
    request = actions.with_registry(ctx, caller, mapping.template_request(spec),
                                   body.registry, "registry")
    return _json(template_v2(templates.create_template(ctx, caller, request)), 201)


@router.get("/templates/{id}", response_model=TemplateV2Out, )
def get_template(id: Ref, ctx: Ctx, caller: RunpodCaller) -> Response:  # noqa: A002
    return _json(template_v2(templates.get_template(ctx, caller, id)))


@router.delete("/templates/{id}", status_code=204, )
def delete_template(id: Ref, ctx: Ctx, caller: RunpodCaller) -> Response:  # noqa: A002
    templates.delete_template(ctx, caller, id)
    return Response(status_code=204)


# ---------------------------------------------------------------- registries


@router.get("/registries", response_model=ListRegistriesOut)
def list_registries(ctx: Ctx, caller: RunpodCaller) -> Response:
    return _json(ListRegistriesOut(registries=[
        RegistryOut(id=a.id, name=a.name)
        for a in registry_auths.list_registry_auths(ctx, caller)]))


@router.post("/registries", status_code=201, response_model=RegistryOut,
             )
def create_registry(body: CreateRegistryRequest, ctx: Ctx, caller: RunpodCaller) -> Response:
    auth = actions.add_registry_auth(ctx, caller, body.name, body.username, body.password)
    return _json(RegistryOut(id=auth.id, name=auth.name), 201)


def _registry(ctx: ServiceContext, caller: Principal, ref: str) -> RegistryOut:
    auth = actions.registry_auth(ctx, caller, ref)
    return RegistryOut(id=auth.id, name=auth.name)


@router.get("/registries/{id}", response_model=RegistryOut, )
def get_registry(id: Ref, ctx: Ctx, caller: RunpodCaller) -> Response:  # noqa: A002
    return _json(_registry(ctx, caller, id))


@router.delete("/registries/{id}", status_code=204, )
def delete_registry(id: Ref, ctx: Ctx, caller: RunpodCaller) -> Response:  # noqa: A002
    registry_auths.remove_registry_auth(ctx, caller, _registry(ctx, caller, id).id)
    return Response(status_code=204)


# ---------------------------------------------------------------- GPU catalog


def gpu_type_v2(entry: catalog.GpuStock) -> GpuTypeOut:
    """A model of the live fleet: ``maxCount`` is the most of it on one node, ``price`` the
    on-demand price of one GPU-hour now."""
    return GpuTypeOut(
        id=entry.type_id, name=entry.display_name, pool=None, manufacturer="NVIDIA",
        memory=entry.memory_gb, secure=True, community=False,
        price=GpuPriceOut(secure=entry.on_demand, community=entry.on_demand),
        maxCount=GpuMaxCountOut(secure=entry.most_on_a_node, community=0))


@router.get("/catalog/gpus", response_model=ListGpuTypesOut)
def list_gpu_types(ctx: Ctx, caller: RunpodCaller) -> Response:
    del caller  # any project may read the catalog
    return _json(ListGpuTypesOut(gpuTypes=[gpu_type_v2(e) for e in catalog.gpu_catalog(ctx)]))


@router.get("/catalog/gpus/{id}", response_model=GpuTypeOut, )
def get_gpu_type(id: Ref, ctx: Ctx, caller: RunpodCaller) -> Response:  # noqa: A002
    """By RunPod's id (``NVIDIA H100 80GB HBM3``), display name or gpucloud model name."""
    del caller
    wanted = mapping.gpu_model(id, "id") if id.strip() else ""
    for entry in catalog.gpu_catalog(ctx, {wanted}):
        return _json(gpu_type_v2(entry))
    raise NotFound(f"GPU type {id!r} is not in this fleet")


# ---------------------------------------------------------------- account SSH keys


@router.get("/account/ssh-keys", response_model=SshKeysOut)
def list_ssh_keys(ctx: Ctx, caller: RunpodCaller) -> Response:
    return _json(SshKeysOut(keys=[key.public_key for key in ssh_keys.list_keys(ctx, caller)]))


@router.put("/account/ssh-keys", response_model=SshKeysOut, )
def replace_ssh_keys(body: UpdateSshKeysRequest, ctx: Ctx, caller: RunpodCaller) -> Response:
    """The full set, replacing the project's keys: every line is checked before any key
    is added or removed."""
    actions.replace_ssh_keys(ctx, caller, body.keys, "keys")
    return list_ssh_keys(ctx, caller)
