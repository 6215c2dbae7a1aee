"""Resolvers of the RunPod GraphQL schema: each one calls gpucloud's own services (the
same validation, quotas, spend limits, events) and renders the result with ``mapping``."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from graphql import GraphQLObjectType, GraphQLResolveInfo, GraphQLSchema
from sqlalchemy import select

from gpucloud.compat.runpod import mapping
from gpucloud.core.access import SshKeyAddRequest
from gpucloud.core.errors import InvalidInput
from gpucloud.core.gpu_models import lookup
from gpucloud.core.models import NodeOut, PodOut
from gpucloud.core.phases import NodeStatus
from gpucloud.db.models import NodeModel
from gpucloud.services import nodes, pods, prices, ssh_keys, templates, volumes
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


def _node_models(ctx: ServiceContext) -> dict[str, str]:
    """GPU UUID → canonical model, over every registered node."""
    with ctx.db.read() as session:
        rows = session.scalars(select(NodeModel.gpus)).all()
    return {str(g["uuid"]): mapping.gpu_model(str(g.get("model", "")) or "?")
            for gpus in rows for g in gpus}


def _pod_model(pod: PodOut, models: dict[str, str]) -> str | None:
    for uuid in pod.gpu_uuids:
        if uuid in models:
            return models[uuid]
    return mapping.gpu_model(pod.gpu_type) if pod.gpu_type else None


def shapes(ctx: ServiceContext, items: list[PodOut], terminated: bool = False
           ) -> list[dict[str, Any]]:
    """Pods in RunPod's shape, priced from the catalog (one price book per call)."""
    now = ctx.clock.now()
    models = _node_models(ctx) if any(p.gpus for p in items) else {}
    with ctx.db.read() as session:
        book = prices.load_book(session)
    out = []
    for pod in items:
        model = _pod_model(pod, models)
        cost = mapping.hourly_price(book, model, pod.gpus, pod.cpu, pod.spot, now)
        out.append(mapping.pod_shape(pod, model=model, cost_per_hr=cost, now=now,
                                     terminated=terminated))
    return out


def _one(gc: GqlContext, pod: PodOut) -> dict[str, Any]:
    return shapes(gc.ctx, [pod])[0]


# ---------------------------------------------------------------- queries


def myself(_root: Any, info: Info) -> dict[str, Any]:
    gc = _gc(info)
    with gc.ctx.db.read() as session:
        keys = ssh_keys.project_key_lines(session, gc.caller.project_id)
    return {"id": gc.caller.project_id, "email": None, "pubKey": "\n".join(keys)}


def user_pods(_user: Any, info: Info) -> list[dict[str, Any]]:
    gc = _gc(info)
    return shapes(gc.ctx, pods.list_pods(gc.ctx, gc.caller, None, 10000))


def user_volumes(_user: Any, info: Info) -> list[dict[str, Any]]:
    gc = _gc(info)
    return [{"id": v.name, "name": v.name, "size": mapping.gib(v.size_bytes),
             "dataCenterId": v.zone} for v in volumes.list_volumes(gc.ctx, gc.caller)]


def user_templates(_user: Any, info: Info) -> list[dict[str, Any]]:
    gc = _gc(info)
    return [mapping.template_shape(t) for t in templates.list_templates(gc.ctx, gc.caller)]


def pod(_root: Any, info: Info, input: Args) -> dict[str, Any]:  # noqa: A002
    gc = _gc(info)
    return _one(gc, pods.get_pod(gc.ctx, gc.caller, input["podId"]))


@dataclass
class _Stock:
    """One GPU model across the live fleet."""

    memory_mib: int = 0
    total: int = 0
    free: int = 0
    max_free_on_a_node: int = 0


def _fleet(ctx: ServiceContext) -> dict[str, _Stock]:
    """Per model: GPUs on Ready, uncordoned nodes, and how many of them are free now
    (a node's allocated GPUs are taken from its own model's count)."""
    stock: dict[str, _Stock] = {}
    for node in nodes.list_nodes(ctx):
        counts = Counter(mapping.gpu_model(g.model) for g in node.gpus)
        free_here = _free_on(node, counts)
        for model, count in counts.items():
            entry = stock.setdefault(model, _Stock())
            entry.memory_mib = max(entry.memory_mib, _memory(node, model))
            entry.total += count
            entry.free += free_here.get(model, 0)
            entry.max_free_on_a_node = max(entry.max_free_on_a_node, free_here.get(model, 0))
    return stock


def _memory(node: NodeOut, model: str) -> int:
    return max((g.memory_mib for g in node.gpus if mapping.gpu_model(g.model) == model),
               default=0)


def _free_on(node: NodeOut, counts: Counter[str]) -> dict[str, int]:
    if node.status is not NodeStatus.READY or node.cordoned:
        return {}
    left = node.gpus_allocated
    free: dict[str, int] = {}
    for model, count in sorted(counts.items()):
        used = min(left, count)
        left -= used
        free[model] = count - used
    return free


def gpu_types(_root: Any, info: Info, input: Args | None = None  # noqa: A002
              ) -> list[dict[str, Any]]:
    """``gpuTypes``: every model the live fleet has (``input.id``: that one, by RunPod id,
    display name or gpucloud name; an unknown one gives an empty list, as on RunPod)."""
    gc = _gc(info)
    fleet = _fleet(gc.ctx)
    wanted = _wanted_models(input or {})
    with gc.ctx.db.read() as session:
        book = prices.load_book(session)
    now = gc.ctx.clock.now()
    return [_gpu_type(model, entry, book, now) for model, entry in sorted(fleet.items())
            if wanted is None or model in wanted]


def _wanted_models(filt: Args) -> set[str] | None:
    ids = [*(filt.get("ids") or []), *([filt["id"]] if filt.get("id") else [])]
    return {mapping.gpu_model(i, "input.id") for i in ids} if ids else None


def _gpu_type(model: str, entry: _Stock, book: prices.PriceBook, now: Any
              ) -> dict[str, Any]:
    on_demand = float(mapping.hourly_price(book, model, 1, 0, False, now))
    spot = float(mapping.hourly_price(book, model, 1, 0, True, now))
    known = lookup(model)
    memory = entry.memory_mib or (known.memory_mib if known else 0)
    return {
        "id": mapping.gpu_type_id(model), "displayName": mapping.gpu_display_name(model),
        "manufacturer": "Nvidia", "memoryInGb": round(memory / 1024), "cudaCores": 0,
        "secureCloud": True, "communityCloud": False,
        "securePrice": on_demand, "communityPrice": None, "oneMonthPrice": None,
        "threeMonthPrice": None, "oneWeekPrice": None, "communitySpotPrice": None,
        "secureSpotPrice": spot, "maxGpuCount": entry.max_free_on_a_node,
        "maxGpuCountSecureCloud": entry.max_free_on_a_node, "maxGpuCountCommunityCloud": 0,
        "_model": model, "_stock": entry, "_prices": (on_demand, spot),
    }


def lowest_price(gpu_type: dict[str, Any], _info: Info,
                 input: Args | None = None) -> dict[str, Any]:  # noqa: A002
    """Prices of ``gpuCount`` GPUs of this type; null prices when no node has that many
    free now (RunPod's way of saying "out of stock")."""
    count = int((input or {}).get("gpuCount") or 1)
    if count < 1:
        raise InvalidInput("lowestPrice.input.gpuCount", "must be at least 1")
    entry: _Stock = gpu_type["_stock"]
    on_demand, spot = gpu_type["_prices"]
    available = entry.max_free_on_a_node >= count
    return {
        "gpuName": gpu_type["displayName"], "gpuTypeId": gpu_type["id"],
        "minimumBidPrice": spot * count if available else None,
        "uninterruptablePrice": on_demand * count if available else None,
        "minMemory": None, "minVcpu": None,
        "stockStatus": _stock_status(entry.free) if available else None,
        "maxUnreservedGpuCount": entry.max_free_on_a_node,
        "availableGpuCounts": list(range(1, entry.max_free_on_a_node + 1)),
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


def _create(info: Info, spec: mapping.RunpodPodInput) -> dict[str, Any]:
    gc = _gc(info)
    created = pods.create_pod(gc.ctx, gc.caller, mapping.create_request(spec))
    gc.wake()
    return _one(gc, created)


def deploy_on_demand(_root: Any, info: Info, input: Args | None = None  # noqa: A002
                     ) -> dict[str, Any]:
    return _create(info, _pod_input(input or {}, gpu=True))


def deploy_cpu(_root: Any, info: Info, input: Args | None = None  # noqa: A002
               ) -> dict[str, Any]:
    return _create(info, _pod_input(input or {}, gpu=False))


def rent_interruptable(_root: Any, info: Info, input: Args  # noqa: A002
                       ) -> dict[str, Any]:
    """Spot (``--spot``): preempted with a notice, ``bidPerGpu`` recorded as the bid."""
    return _create(info, _pod_input(input, gpu=True, spot=True))


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
    """``podBidResume``: a spot pod's resume (the bid is not changed: gpucloud records the
    bid at creation)."""
    return pod_resume(_root, info, input)


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
    wanted = _parsed_lines(text)
    current = ssh_keys.list_keys(gc.ctx, gc.caller)
    have = {k.fingerprint for k in current}
    for key in current:
        if key.fingerprint not in wanted:
            ssh_keys.remove_key(gc.ctx, gc.caller, key.id)
    for fingerprint, line in wanted.items():
        if fingerprint not in have:
            ssh_keys.add_key(gc.ctx, gc.caller, SshKeyAddRequest(public_key=line))
    return myself(None, info)


def _parsed_lines(text: str) -> dict[str, str]:
    """Fingerprint → key line, for every non-empty line (InvalidInput on a bad one)."""
    out: dict[str, str] = {}
    for index, line in enumerate(x.strip() for x in text.splitlines()):
        if not line:
            continue
        try:
            parsed = ssh_keys.parse_public_key(line)
        except InvalidInput as error:
            raise InvalidInput(f"pubKey[{index}]", error.message.split(": ", 1)[-1]) from None
        out.setdefault(parsed.fingerprint, line)
    return out


def save_template(_root: Any, info: Info, input: Args  # noqa: A002
                  ) -> dict[str, Any]:
    gc = _gc(info)
    if input.get("isServerless"):
        raise InvalidInput("isServerless", "serverless templates are not supported here; "
                                           "create a pod template (isServerless: false)")
    entrypoint, command = mapping.parse_docker_args(input.get("dockerArgs"))
    spec = mapping.RunpodTemplateInput(
        name=input["name"], image=input["imageName"], entrypoint=entrypoint, command=command,
        container_disk_gb=input.get("containerDiskInGb"), volume_gb=input.get("volumeInGb"),
        volume_mount_path=input.get("volumeMountPath"),
        ports=mapping.parse_ports(input.get("ports")),
        env=mapping.env_from_pairs(input.get("env")), start_ssh=bool(input.get("startSsh")))
    created = templates.create_template(gc.ctx, gc.caller, mapping.template_request(spec))
    return mapping.template_shape(created)


# ---------------------------------------------------------------- binding


ROOT: dict[str, dict[str, Callable[..., Any]]] = {
    "Query": {"myself": myself, "gpuTypes": gpu_types, "pod": pod},
    "Mutation": {
        "podFindAndDeployOnDemand": deploy_on_demand, "deployCpuPod": deploy_cpu,
        "podRentInterruptable": rent_interruptable, "podStop": pod_stop,
        "podResume": pod_resume, "podBidResume": pod_bid_resume,
        "podTerminate": pod_terminate, "updateUserSettings": update_user_settings,
        "saveTemplate": save_template,
    },
    "User": {"pods": user_pods, "networkVolumes": user_volumes,
             "podTemplates": user_templates},
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

