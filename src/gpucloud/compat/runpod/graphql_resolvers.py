"""Resolvers of the RunPod GraphQL schema: each one calls gpucloud's own services (the
same validation, quotas, spend limits, events) and renders the result with ``mapping``."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from graphql import GraphQLObjectType, GraphQLResolveInfo, GraphQLSchema

from gpucloud.compat.runpod import actions, catalog, mapping
from gpucloud.compat.runpod.rest_common import PodPricing
from gpucloud.core.errors import InvalidInput
from gpucloud.core.models import PodOut
from gpucloud.core.serverless import EndpointCreateRequest, EndpointOut, EndpointUpdateRequest
from gpucloud.core.spec import TemplateOut
from gpucloud.services import (
    endpoints,
    pods,
    registry_auths,
    ssh_keys,
    templates,
    volumes,
)
from gpucloud.services.context import ServiceContext
from gpucloud.services.projects import Principal

Args = dict[str, Any]
Info = GraphQLResolveInfo[Any]


@dataclass
class GqlContext:
    """What every resolver gets: the services' context, the caller, and a hook that wakes
    the scheduler after a pod was created or started."""

    ctx: ServiceContext
    caller: Principal
    wake: Callable[[], None]


def _gc(info: Info) -> GqlContext:
    context: GqlContext = info.context
    return context


# ---------------------------------------------------------------- pods, rendered


def shapes(gc: GqlContext, items: list[PodOut], terminated: bool = False
           ) -> list[dict[str, Any]]:
    """Pods in RunPod's shape, priced from the catalog (one price book per call), with
    the id of the registry credentials each pulls with."""
    pricing = PodPricing.load(gc.ctx)
    auth_ids = {a.name: a.id for a in registry_auths.list_registry_auths(gc.ctx, gc.caller)
                } if any(p.registry_auth for p in items) else {}
    out = []
    for pod in items:
        shape = mapping.pod_shape(pod, model=pricing.model(pod), cost_per_hr=pricing.cost(pod),
                                  now=pricing.now, terminated=terminated)
        shape["containerRegistryAuthId"] = auth_ids.get(pod.registry_auth or "")
        out.append(shape)
    return out


def _one(gc: GqlContext, pod: PodOut) -> dict[str, Any]:
    return shapes(gc, [pod])[0]


# ---------------------------------------------------------------- queries


def myself(_root: Any, info: Info) -> dict[str, Any]:
    gc = _gc(info)
    with gc.ctx.db.read() as session:
        keys = ssh_keys.project_key_lines(session, gc.caller.project_id)
    return {"id": gc.caller.project_id, "email": None, "pubKey": "\n".join(keys)}


def user_pods(_user: Any, info: Info) -> list[dict[str, Any]]:
    gc = _gc(info)
    return shapes(gc, pods.list_pods(gc.ctx, gc.caller, None, 10000))


def user_volumes(_user: Any, info: Info) -> list[dict[str, Any]]:
    gc = _gc(info)
    return [actions.volume_shape(v) for v in volumes.list_volumes(gc.ctx, gc.caller)]


def user_registry_auths(_user: Any, info: Info) -> list[dict[str, Any]]:
    gc = _gc(info)
    return [{"id": a.id, "name": a.name}
            for a in registry_auths.list_registry_auths(gc.ctx, gc.caller)]


def user_templates(_user: Any, info: Info) -> list[dict[str, Any]]:
    gc = _gc(info)
    return [_template(gc, t) for t in templates.list_templates(gc.ctx, gc.caller)]


def _template(gc: GqlContext, template: TemplateOut) -> dict[str, Any]:
    """``template_shape`` with the id of the registry credentials it pulls with."""
    shape = mapping.template_shape(template)
    ids = {a.name: a.id for a in registry_auths.list_registry_auths(gc.ctx, gc.caller)
           } if template.registry_auth else {}
    shape["containerRegistryAuthId"] = ids.get(template.registry_auth or "")  # None: gone
    return shape


def pod(_root: Any, info: Info, input: Args) -> dict[str, Any]:  # noqa: A002
    gc = _gc(info)
    return _one(gc, pods.get_pod(gc.ctx, gc.caller, input["podId"]))


def gpu_types(_root: Any, info: Info, input: Args | None = None  # noqa: A002
              ) -> list[dict[str, Any]]:
    """``gpuTypes``: every model the live fleet has (``input.id``: that one, by RunPod id,
    display name or gpucloud name; an unknown one gives an empty list, as on RunPod)."""
    gc = _gc(info)
    wanted = _wanted_models(input or {})
    return [_gpu_type(entry) for entry in catalog.gpu_catalog(gc.ctx, wanted)]


def _wanted_models(filt: Args) -> set[str] | None:
    ids = [*(filt.get("ids") or []), *([filt["id"]] if filt.get("id") else [])]
    return {mapping.gpu_model(i, "input.id") for i in ids} if ids else None


def _gpu_type(entry: catalog.GpuStock) -> dict[str, Any]:
    """One ``GpuType``; ``maxGpuCount`` is the most free GPUs of it on one node."""
    return {
        "id": entry.type_id, "displayName": entry.display_name,
        "manufacturer": "Nvidia", "memoryInGb": entry.memory_gb, "cudaCores": 0,
        "secureCloud": True, "communityCloud": False,
        "securePrice": entry.on_demand, "communityPrice": None, "oneMonthPrice": None,
        "threeMonthPrice": None, "oneWeekPrice": None, "communitySpotPrice": None,
        "secureSpotPrice": entry.spot, "maxGpuCount": entry.most_free_on_a_node,
        "maxGpuCountSecureCloud": entry.most_free_on_a_node, "maxGpuCountCommunityCloud": 0,
        "_stock": entry,
    }


def lowest_price(gpu_type: dict[str, Any], _info: Info,
                 input: Args | None = None) -> dict[str, Any]:  # noqa: A002
    """Prices of ``gpuCount`` GPUs of this type; null prices when no node has that many
    free now (RunPod's way of saying "out of stock")."""
    count = int((input or {}).get("gpuCount") or 1)
    if count < 1:
        raise InvalidInput("lowestPrice.input.gpuCount", "must be at least 1")
    entry: catalog.GpuStock = gpu_type["_stock"]
    most = entry.most_free_on_a_node
    available = most >= count
    return {
        "gpuName": entry.display_name, "gpuTypeId": entry.type_id,
        "minimumBidPrice": entry.spot * count if available else None,
        "uninterruptablePrice": entry.on_demand * count if available else None,
        "minMemory": None, "minVcpu": None,
        "stockStatus": _stock_status(entry.free) if available else None,
        "maxUnreservedGpuCount": most, "availableGpuCounts": list(range(1, most + 1)),
        "compliance": [], "countryCode": None, "rentalPercentage": (
            round(1 - entry.free / entry.total, 3) if entry.total else 0.0),
    }


def _stock_status(free: int) -> str:
    return "High" if free >= 8 else "Medium" if free >= 3 else "Low"


# ---------------------------------------------------------------- mutations: pods


_INSTANCE = re.compile(r"^[a-z0-9]+-(\d+)-(\d+)$")


def _cpu_instance(instance_id: str | None) -> tuple[float | None, float | None]:
    """``cpu3c-2-4`` (flavor-vCPUs-GB) → (2, 4); RunPod's CPU instance ids."""
    if not instance_id:
        return None, None
    match = _INSTANCE.match(instance_id)
    if not match:
        raise InvalidInput("instanceId", f"{instance_id!r} is not FLAVOR-VCPUS-MEMORYGB "
                                         "(e.g. cpu3c-2-4)")
    return float(match.group(1)), float(match.group(2))


def _pod_input(data: Args, gpu: bool, spot: bool = False) -> mapping.RunpodPodInput:
    entrypoint, command = mapping.parse_docker_args(data.get("dockerArgs"))
    vcpu, memory = _cpu_instance(data.get("instanceId"))
    gpu_id = data.get("gpuTypeId") or next(iter(data.get("gpuTypeIdList") or []), None)
    if gpu and not gpu_id:
        raise InvalidInput("gpuTypeId", "is required for a GPU pod (deployCpuPod for CPU)")
    name = data.get("name")
    if not name:
        raise InvalidInput("name", "is required")
    return mapping.RunpodPodInput(
        name=name, image=data.get("imageName") or None,
        gpu_type_id=gpu_id if gpu else None,
        gpu_count=(data.get("gpuCount") or 1) if gpu else 0,
        vcpu=vcpu or data.get("minVcpuCount"), memory_gb=memory or data.get("minMemoryInGb"),
        volume_gb=data.get("volumeInGb"), volume_mount_path=data.get("volumeMountPath"),
        container_disk_gb=data.get("containerDiskInGb"),
        env=mapping.env_from_pairs(data.get("env")),
        ports=mapping.parse_ports(data.get("ports")), entrypoint=entrypoint,
        command=command, template_id=data.get("templateId") or None,
        network_volume_id=data.get("networkVolumeId") or None,
        start_ssh=bool(data.get("startSsh")), spot=spot,
        bid_per_gpu=data.get("bidPerGpu") if spot else None)


def _create(info: Info, spec: mapping.RunpodPodInput, data: Args) -> dict[str, Any]:
    gc = _gc(info)
    request = actions.with_registry(gc.ctx, gc.caller, mapping.create_request(spec),
                                    data.get("containerRegistryAuthId"),
                                    "containerRegistryAuthId")
    created = pods.create_pod(gc.ctx, gc.caller, request)
    gc.wake()
    return _one(gc, created)


def deploy_on_demand(_root: Any, info: Info, input: Args | None = None  # noqa: A002
                     ) -> dict[str, Any]:
    return _create(info, _pod_input(input or {}, gpu=True), input or {})


def deploy_cpu(_root: Any, info: Info, input: Args | None = None  # noqa: A002
               ) -> dict[str, Any]:
    return _create(info, _pod_input(input or {}, gpu=False), input or {})


def rent_interruptable(_root: Any, info: Info, input: Args  # noqa: A002
                       ) -> dict[str, Any]:
    """Spot (``--spot``): preempted with a notice, ``bidPerGpu`` recorded as the bid."""
    return _create(info, _pod_input(input, gpu=True, spot=True), input)


def pod_stop(_root: Any, info: Info, input: Args) -> dict[str, Any]:  # noqa: A002
    gc = _gc(info)
    return _one(gc, pods.stop_pod(gc.ctx, gc.caller, input["podId"]))


def pod_resume(_root: Any, info: Info, input: Args) -> dict[str, Any]:  # noqa: A002
    """``podResume``: start the stopped pod again; ``gpuCount`` 0 starts it without GPUs
    (RunPod's zero-GPU pod, for its volume)."""
    gc = _gc(info)
    count = input.get("gpuCount")
    started = pods.start_pod(gc.ctx, gc.caller, input["podId"],
                             gpus=None if count is None else float(count))
    gc.wake()
    return _one(gc, started)


def pod_bid_resume(_root: Any, info: Info, input: Args  # noqa: A002
                   ) -> dict[str, Any]:
    """``podBidResume``: a stopped spot pod started again, ``bidPerGpu`` its bid from now."""
    gc = _gc(info)
    count = input.get("gpuCount")
    started = actions.bid_resume(gc.ctx, gc.caller, input["podId"], float(input["bidPerGpu"]),
                                 None if count is None else float(count), gc.wake)
    return _one(gc, started)


def pod_restart(_root: Any, info: Info, input: Args) -> dict[str, Any]:  # noqa: A002
    """``podRestart``: stop, then start the same pod in place (its volume kept)."""
    gc = _gc(info)
    return _one(gc, actions.restart_pod(gc.ctx, gc.caller, input["podId"], gc.wake))


def pod_terminate(_root: Any, info: Info, input: Args) -> None:  # noqa: A002
    gc = _gc(info)
    pods.delete_pod(gc.ctx, gc.caller, input["podId"])


# ---------------------------------------------------------------- mutations: account


def update_user_settings(_root: Any, info: Info, input: Args  # noqa: A002
                         ) -> dict[str, Any]:
    """``pubKey``: the project's SSH keys, replaced as a whole (newline-separated). All
    lines are checked before any key changes."""
    gc = _gc(info)
    text = input.get("pubKey")
    if text is None:
        return myself(None, info)
    actions.replace_ssh_keys(gc.ctx, gc.caller, text.splitlines(), "pubKey")
    return myself(None, info)


def save_template(_root: Any, info: Info, input: Args  # noqa: A002
                  ) -> dict[str, Any]:
    gc = _gc(info)
    # A serverless template (isServerless: true) is an ordinary template here: endpoints
    # (saveEndpoint) are created from templates as pods are.
    entrypoint, command = mapping.parse_docker_args(input.get("dockerArgs"))
    spec = mapping.RunpodTemplateInput(
        name=input["name"], image=input["imageName"], entrypoint=entrypoint, command=command,
        container_disk_gb=input.get("containerDiskInGb"), volume_gb=input.get("volumeInGb"),
        volume_mount_path=input.get("volumeMountPath"),
        ports=mapping.parse_ports(input.get("ports")),
        env=mapping.env_from_pairs(input.get("env")), start_ssh=bool(input.get("startSsh")))
    request = actions.with_registry(gc.ctx, gc.caller, mapping.template_request(spec),
                                    input.get("containerRegistryAuthId"),
                                    "containerRegistryAuthId")
    return _template(gc, templates.create_template(gc.ctx, gc.caller, request))


def delete_template(_root: Any, info: Info, templateName: str  # noqa: N803
                    ) -> None:
    """``deleteTemplate(templateName)`` (SkyPilot's teardown): by name (or id)."""
    gc = _gc(info)
    templates.delete_template(gc.ctx, gc.caller, templateName)


# ---------------------------------------------------------------- mutations: storage


def create_network_volume(_root: Any, info: Info, input: Args  # noqa: A002
                          ) -> dict[str, Any]:
    """A gpucloud network volume of ``size`` GB; its RunPod id is its name."""
    gc = _gc(info)
    return actions.volume_shape(actions.create_network_volume(
        gc.ctx, gc.caller, input["name"], input["size"], input.get("dataCenterId")))


def delete_network_volume(_root: Any, info: Info, input: Args) -> None:  # noqa: A002
    gc = _gc(info)
    volumes.delete_volume(gc.ctx, gc.caller, input["id"])


def save_registry_auth(_root: Any, info: Info, input: Args  # noqa: A002
                       ) -> dict[str, Any]:
    gc = _gc(info)
    auth = actions.add_registry_auth(gc.ctx, gc.caller, input["name"], input["username"],
                                     input["password"])
    return {"id": auth.id, "name": auth.name}


def delete_registry_auth(_root: Any, info: Info, registryAuthId: str  # noqa: N803
                         ) -> None:
    gc = _gc(info)
    registry_auths.remove_registry_auth(
        gc.ctx, gc.caller, actions.registry_auth(gc.ctx, gc.caller, registryAuthId).id)


# ---------------------------------------------------------------- serverless endpoints

_SCALERS = {"QUEUE_DELAY": "queue-delay", "REQUEST_COUNT": "request-count"}


def _endpoint_shape(endpoint: EndpointOut, template_ids: dict[str, str]) -> dict[str, Any]:
    """An endpoint as RunPod's ``saveEndpoint`` / ``myself { endpoints }`` show it."""
    volume = endpoint.network_volumes[0].split(":")[0] if endpoint.network_volumes else None
    return {
        "id": endpoint.id, "name": endpoint.name,
        "templateId": template_ids.get(endpoint.template or "", endpoint.template),
        "gpuIds": endpoint.gpu_ids or "", "networkVolumeId": volume or "",
        "networkVolume": {"id": volume, "name": volume} if volume else None,
        "locations": "", "idleTimeout": round(endpoint.idle_timeout_seconds),
        "scalerType": endpoint.scaler.upper().replace("-", "_"),
        "scalerValue": endpoint.scaler_value, "workersMin": endpoint.min_workers,
        "workersMax": endpoint.max_workers, "workersStandby": endpoint.workers_idle,
        "allowedCudaVersions": "", "gpuCount": int(endpoint.gpus),
        "flashBootType": "OFF",
        "executionTimeoutMs": round(endpoint.execution_timeout_seconds * 1000),
        "aiKey": None, "type": "QUEUE", "userId": endpoint.project, "version": 0,
        "env": mapping.env_pairs(endpoint.env), "createdAt": endpoint.created_at.isoformat(),
    }


def _template_ids(gc: GqlContext) -> dict[str, str]:
    return {t.name: t.id for t in templates.list_templates(gc.ctx, gc.caller)}


def user_endpoints(_user: Any, info: Info) -> list[dict[str, Any]]:
    gc = _gc(info)
    ids = _template_ids(gc)
    return [_endpoint_shape(e, ids) for e in endpoints.list_endpoints(gc.ctx, gc.caller)]


def _endpoint_fields(gc: GqlContext, data: Args) -> dict[str, Any]:
    """RunPod's endpoint input as gpucloud's request fields (those given)."""
    fields: dict[str, Any] = {}
    if data.get("templateId"):
        fields["template"] = templates.get_template(gc.ctx, gc.caller, data["templateId"]).name
    scaler = data.get("scalerType")
    if scaler is not None:
        if scaler not in _SCALERS:
            raise InvalidInput("scalerType", f"{scaler!r} is not QUEUE_DELAY or REQUEST_COUNT")
        fields["scaler"] = _SCALERS[scaler]
    if data.get("networkVolumeId"):
        fields["network_volumes"] = [data["networkVolumeId"]]
    if data.get("executionTimeoutMs") is not None:
        fields["execution_timeout"] = data["executionTimeoutMs"] / 1000
    for key, field in (("gpuIds", "gpu_ids"), ("idleTimeout", "idle_timeout"),
                       ("scalerValue", "scaler_value"), ("workersMin", "min_workers"),
                       ("workersMax", "max_workers"), ("gpuCount", "gpus")):
        if data.get(key) is not None and data.get(key) != "":
            fields[field] = data[key]
    return fields


def save_endpoint(_root: Any, info: Info, input: Args  # noqa: A002
                  ) -> dict[str, Any]:
    """Create an endpoint from a template (``templateId``), or change one (``id``)."""
    gc = _gc(info)
    fields = _endpoint_fields(gc, input)
    if input.get("id"):
        # an endpoint keeps its name (RunPod's clients resend it on a change)
        saved = endpoints.update_endpoint(gc.ctx, gc.caller, input["id"],
                                          templates.merge_over(EndpointUpdateRequest, {},
                                                               fields))
    else:
        if "template" not in fields:
            raise InvalidInput("templateId", "field required: the template of the workers")
        saved = endpoints.create_endpoint(gc.ctx, gc.caller, templates.merge_over(
            EndpointCreateRequest, {}, {"name": input.get("name"), **fields}))
    return _endpoint_shape(saved, _template_ids(gc))


def update_endpoint_template(_root: Any, info: Info, input: Args  # noqa: A002
                             ) -> dict[str, Any]:
    gc = _gc(info)
    name = templates.get_template(gc.ctx, gc.caller, input["templateId"]).name
    saved = endpoints.update_endpoint(gc.ctx, gc.caller, input["endpointId"],
                                      EndpointUpdateRequest(template=name))
    return _endpoint_shape(saved, _template_ids(gc))


def delete_endpoint(_root: Any, info: Info, id: str) -> None:  # noqa: A002
    gc = _gc(info)
    endpoints.delete_endpoint(gc.ctx, gc.caller, id)


# ---------------------------------------------------------------- binding


ROOT: dict[str, dict[str, Callable[..., Any]]] = {
    "Query": {"myself": myself, "gpuTypes": gpu_types, "pod": pod},
    "Mutation": {
        "podFindAndDeployOnDemand": deploy_on_demand, "deployCpuPod": deploy_cpu,
        "podRentInterruptable": rent_interruptable, "podStop": pod_stop,
        "podResume": pod_resume, "podBidResume": pod_bid_resume, "podRestart": pod_restart,
        "createNetworkVolume": create_network_volume,
        "deleteNetworkVolume": delete_network_volume,
        "saveRegistryAuth": save_registry_auth, "deleteRegistryAuth": delete_registry_auth,
        "deleteTemplate": delete_template,
        "podTerminate": pod_terminate, "updateUserSettings": update_user_settings,
        "saveTemplate": save_template, "saveEndpoint": save_endpoint,
        "updateEndpointTemplate": update_endpoint_template, "deleteEndpoint": delete_endpoint,
    },
    "User": {"pods": user_pods, "networkVolumes": user_volumes,
             "containerRegistryCreds": user_registry_auths,
             "podTemplates": user_templates, "endpoints": user_endpoints},
    "GpuType": {"lowestPrice": lowest_price},
}


def bind(schema: GraphQLSchema) -> GraphQLSchema:
    """Attach the resolvers to the SDL-built schema's fields."""
    for type_name, fields in ROOT.items():
        graphql_type = schema.get_type(type_name)
        assert isinstance(graphql_type, GraphQLObjectType)
        for field_name, resolver in fields.items():
            graphql_type.fields[field_name].resolve = resolver
    return schema

