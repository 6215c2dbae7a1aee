"""RunPod operations that GraphQL and REST (v1, v2) share, each made of gpucloud's own
service calls: pod actions with the in-place restart, a spot pod's bid resume, the
account's SSH keys replaced as a set, network volumes and registry credentials.

Only ``record_bid`` writes by itself: ``bidPerGpu`` is a recorded value (docs/spot.md),
which no service changes after creation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy import update

from gpucloud.compat.runpod import mapping
from gpucloud.core.access import SshKeyAddRequest, VolumeCreateRequest, VolumeOut
from gpucloud.core.errors import Conflict, InvalidInput, NotFound
from gpucloud.core.models import PodOut
from gpucloud.core.phases import TERMINAL_PHASES, PodPhase
from gpucloud.core.spec import RegistryAuthAddRequest, RegistryAuthOut
from gpucloud.db.models import PodModel
from gpucloud.services import pods, registry_auths, ssh_keys, volumes
from gpucloud.services.context import ServiceContext
from gpucloud.services.events import record_event
from gpucloud.services.projects import Principal

#: A restart's stop gives the container this long after SIGTERM (``docker restart``'s 10 s).
RESTART_GRACE_SECONDS = 10.0
_R = TypeVar("_R", bound=BaseModel)


# ---------------------------------------------------------------- pods


def run_action(ctx: ServiceContext, caller: Principal, ref: str, action: str,
               wake: Callable[[], None]) -> PodOut | None:
    """``start``, ``stop``, ``restart``/``reset`` (in place, answered at once:
    :func:`restart_pod`), ``terminate`` (None: deleted)."""
    if action == "stop":
        return pods.stop_pod(ctx, caller, ref)
    if action == "terminate":
        pods.delete_pod(ctx, caller, ref)
        return None
    if action in {"restart", "reset"}:
        return restart_pod(ctx, caller, ref, wake)
    started = pods.start_pod(ctx, caller, ref)
    wake()
    return started


def restart_pod(ctx: ServiceContext, caller: Principal, ref: str,
                wake: Callable[[], None]) -> PodOut:
    """Restart in place (services/pods.restart_pod), answering at once with the pod as it
    is: a running one is ``RESTARTING`` while its agent stops it (SIGTERM,
    :data:`RESTART_GRACE_SECONDS`, SIGKILL); the server starts the same pod again when
    the agent reports it stopped (its volume disk kept on its node, where it is placed
    again, and its network volumes). An ended or not yet placed pod just starts."""
    pod = pods.restart_pod(ctx, caller, ref, grace_seconds=RESTART_GRACE_SECONDS)
    if pod.phase is PodPhase.PENDING:
        wake()
    return pod


def bid_resume(ctx: ServiceContext, caller: Principal, ref: str, bid: float,
               gpus: float | None, wake: Callable[[], None]) -> PodOut:
    """``podBidResume``: a stopped spot pod started again with ``bidPerGpu`` as its bid
    from now on (checked, recorded with an event, then started)."""
    if not bid > 0:
        raise InvalidInput("bidPerGpu", "must be a positive price per GPU-hour")
    pod = pods.get_pod(ctx, caller, ref)
    if not pod.spot:
        raise InvalidInput("podId", f"pod {pod.name!r} is not a spot pod "
                                    "(podRentInterruptable); resume it with podResume")
    if pod.phase not in TERMINAL_PHASES:
        raise Conflict(f"pod {pod.name!r} is {pod.phase}; only an ended pod can be resumed")
    if pod.bid != bid:
        record_bid(ctx, pod, bid)
    started = pods.start_pod(ctx, caller, pod.id, gpus=gpus)
    wake()
    return started


def record_bid(ctx: ServiceContext, pod: PodOut, bid: float) -> None:
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        changed = session.execute(update(PodModel).where(
            PodModel.id == pod.id, PodModel.deleted_at.is_(None)).values(bid=bid))
        if not getattr(changed, "rowcount", 1):
            raise NotFound(f"pod {pod.name!r} not found")
        record_event(session, pod.id, now, "BidChanged",
                     f"bid {pod.bid:g} → {bid:g} per GPU-hour" if pod.bid
                     else f"bid {bid:g} per GPU-hour")


# ---------------------------------------------------------------- account


def replace_ssh_keys(ctx: ServiceContext, caller: Principal, lines: list[str],
                     field: str) -> None:
    """The project's SSH keys become exactly ``lines`` (blank ones skipped). Every line
    is parsed first: a bad one is a 422 on ``field[index]`` and nothing changes."""
    wanted: dict[str, str] = {}
    for index, line in enumerate(x.strip() for x in lines):
        if not line:
            continue
        try:
            parsed = ssh_keys.parse_public_key(line)
        except InvalidInput as error:
            raise InvalidInput(f"{field}[{index}]",
                               error.message.split(": ", 1)[-1]) from None
        wanted.setdefault(parsed.fingerprint, line)
    current = ssh_keys.list_keys(ctx, caller)
    for key in current:
        if key.fingerprint not in wanted:
            ssh_keys.remove_key(ctx, caller, key.id)
    have = {key.fingerprint for key in current}
    for fingerprint, line in wanted.items():
        if fingerprint not in have:
            ssh_keys.add_key(ctx, caller, SshKeyAddRequest(public_key=line))


# ---------------------------------------------------------------- network volumes


def volume_shape(volume: VolumeOut) -> dict[str, Any]:
    """A network volume as RunPod shows it; its RunPod id is its gpucloud name (what a
    pod's ``networkVolumeId`` names)."""
    return {"id": volume.name, "name": volume.name, "size": mapping.gib(volume.size_bytes),
            "dataCenterId": volume.zone}


def create_network_volume(ctx: ServiceContext, caller: Principal, name: str, size_gb: int,
                          data_center: str | None) -> VolumeOut:
    """``size`` GB; ``dataCenterId`` becomes the volume's zone, lower-cased (RunPod's
    ``US-TX-3`` is zone ``us-tx-3``)."""
    zone = data_center.strip().lower() if data_center and data_center.strip() else None
    request = mapping.validated(VolumeCreateRequest, {
        "name": name, "size": f"{size_gb}Gi", "zone": zone})
    try:
        return volumes.create_volume(ctx, caller, request)
    except InvalidInput as error:
        if error.field == "zone":
            raise InvalidInput("dataCenterId", error.message.split(": ", 1)[-1]) from None
        raise


# ---------------------------------------------------------------- registry credentials


def registry_auth(ctx: ServiceContext, caller: Principal, ref: str) -> RegistryAuthOut:
    """The project's registry credentials by RunPod id (gpucloud's id) or name."""
    for auth in registry_auths.list_registry_auths(ctx, caller):
        if ref in (auth.id, auth.name):
            return auth
    raise NotFound(f"registry credentials {ref!r} not found")


def add_registry_auth(ctx: ServiceContext, caller: Principal, name: str, username: str,
                      password: str) -> RegistryAuthOut:
    request = mapping.validated(RegistryAuthAddRequest, {
        "name": name, "username": username, "password": password})
    return registry_auths.add_registry_auth(ctx, caller, request)


def with_registry(ctx: ServiceContext, caller: Principal, request: _R, ref: str | None,
                  field: str) -> _R:
    """A pod or template request pulling with the credentials ``ref`` names (RunPod's
    ``containerRegistryAuthId`` / ``registry``); blank: unchanged."""
    if not ref:
        return request
    try:
        auth = registry_auth(ctx, caller, ref)
    except NotFound:
        raise InvalidInput(field, f"registry credentials {ref!r} not found") from None
    return request.model_copy(update={"registry_auth": auth.name})

