"""The container spec between the wire and the database, one mapping for every row that
carries it (pods, jobs and their members, templates): ``spec_columns`` gives a row's
values from a request, ``spec_out`` the fields every ``…Out`` shows, ``copy_columns`` one
row's spec for another (a job's members), ``spec_request`` a row back in request form
(what a pod created from a template starts from).

Named references of a spec (registry credentials) are checked here too, so that every
create path refuses an unknown one the same way.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.core.access import DEFAULT_VOLUME_PATH
from gpucloud.core.errors import InvalidInput
from gpucloud.core.gpu_models import CATALOG, lookup
from gpucloud.core.image_ref import DOCKER_HUB, DOCKER_HUB_API, parse_reference
from gpucloud.core.quantities import format_memory
from gpucloud.core.spec import ContainerSpec
from gpucloud.db.models import ContainerSpecColumns, NodeModel, RegistryAuthModel
from gpucloud.scheduler.mig import MIG_PROFILES, geometry
from gpucloud.services import volumes
from gpucloud.services.context import ServiceContext

#: The columns of ``ContainerSpecColumns``, in the order the mixin declares them.
SPEC_COLUMNS = ("image", "command", "env", "gpu_type", "cpu_milli", "memory_bytes",
                "entrypoint", "volume_bytes", "volume_path", "container_disk_bytes",
                "network_volumes", "registry_auth", "checkpoint_dir", "checkpoint_signal",
                "checkpoint_mode", "spot", "bid", "grace_seconds", "mig_profile",
                "gpu_memory_bytes")


def spec_columns(spec: ContainerSpec) -> dict[str, Any]:
    """The row values of a validated spec (``image`` must be set by now)."""
    if spec.image is None:
        raise InvalidInput("image", "field required (or name a template)")
    return {
        "image": spec.image, "command": list(spec.command), "env": dict(spec.env),
        "gpu_type": spec.gpu_type, "cpu_milli": spec.cpu_milli,
        "memory_bytes": spec.memory_bytes,
        "entrypoint": None if spec.entrypoint is None else list(spec.entrypoint),
        "volume_bytes": spec.volume_bytes,
        "volume_path": spec.volume_path or (DEFAULT_VOLUME_PATH if spec.volume_bytes else None),
        "container_disk_bytes": spec.container_disk_bytes,
        "network_volumes": [_mount(item) for item in spec.network_volumes] or None,
        "registry_auth": spec.registry_auth, "checkpoint_dir": spec.checkpoint_dir,
        "checkpoint_signal": spec.checkpoint_signal, "checkpoint_mode": spec.checkpoint,
        "spot": spec.spot, "bid": spec.bid, "grace_seconds": spec.grace,
        "mig_profile": spec.mig, "gpu_memory_bytes": spec.gpu_memory_bytes,
    }


def _mount(item: str) -> dict[str, str]:
    name, _, path = item.partition(":")  # normalized by the validator: always NAME:/path
    return {"name": name, "path": path}


def _mounts(row: ContainerSpecColumns) -> list[str]:
    return [f"{m['name']}:{m['path']}" for m in row.network_volumes or []]


def copy_columns(row: ContainerSpecColumns) -> dict[str, Any]:
    """The spec of ``row`` as values for another row (copies: JSON values are mutable)."""
    values = {name: getattr(row, name) for name in SPEC_COLUMNS}
    values["command"], values["env"] = list(row.command), dict(row.env)
    if row.entrypoint is not None:
        values["entrypoint"] = list(row.entrypoint)
    if row.network_volumes is not None:
        values["network_volumes"] = [dict(mount) for mount in row.network_volumes]
    return values


def spec_out(row: ContainerSpecColumns) -> dict[str, Any]:
    """The ``ContainerSpecOut`` fields of a row."""
    return {
        "image": row.image, "command": row.command, "env": row.env,
        "gpu_type": row.gpu_type, "cpu": row.cpu_milli / 1000,
        "memory": format_memory(row.memory_bytes), "memory_bytes": row.memory_bytes,
        "entrypoint": row.entrypoint, "volume_size": row.volume_bytes,
        "volume_path": row.volume_path, "container_disk": row.container_disk_bytes,
        "network_volumes": _mounts(row), "registry_auth": row.registry_auth,
        "checkpoint_dir": row.checkpoint_dir,
        "checkpoint_signal": row.checkpoint_signal, "checkpoint": row.checkpoint_mode,
        "spot": row.spot, "bid": row.bid, "grace": row.grace_seconds,
        "mig": row.mig_profile, "gpu_memory": row.gpu_memory_bytes,
    }


def spec_request(row: ContainerSpecColumns) -> dict[str, Any]:
    """A row's spec as request fields (the inverse of ``spec_columns``)."""
    values = {
        "image": row.image, "command": list(row.command), "env": dict(row.env),
        "gpu_type": row.gpu_type, "cpu": f"{row.cpu_milli}m", "memory": row.memory_bytes,
        "entrypoint": row.entrypoint, "volume_size": row.volume_bytes,
        "volume_path": row.volume_path, "container_disk": row.container_disk_bytes,
        "network_volumes": _mounts(row), "registry_auth": row.registry_auth,
        "checkpoint_dir": row.checkpoint_dir,
        "checkpoint_signal": row.checkpoint_signal, "checkpoint": row.checkpoint_mode,
        "spot": row.spot, "bid": row.bid, "grace": row.grace_seconds,
        "mig": row.mig_profile, "gpu_memory": row.gpu_memory_bytes,
    }
    return {key: value for key, value in values.items() if value is not None}


def check_spec(ctx: ServiceContext, project_id: str, spec: ContainerSpec) -> None:
    """What a spec names is known: its GPU model and its registry credentials (422 naming
    the field). Queries only for a model outside the catalog or named credentials."""
    ensure_known_gpu_type(ctx, spec.gpu_type)
    check_mig(spec)
    if spec.registry_auth is not None:
        with ctx.db.read() as session:
            check_registry_auth(session, project_id, spec)
    if spec.network_volumes:
        with ctx.db.read() as session:
            volumes.check_names(session, project_id, spec.network_volumes)


def check_mig(spec: ContainerSpec, gpus: float = 0) -> None:
    """A MIG profile must be one of the requested model's (422 ``mig``), and a MIG pod
    takes one instance: no share of a GPU and no more than one GPU beside it."""
    if spec.mig is None:
        return
    if 0 < gpus < 1:
        raise InvalidInput("mig", "a MIG instance cannot be combined with a GPU share "
                           "(--gpus below 1); give one or the other")
    if gpus > 1:
        raise InvalidInput("mig", "a MIG pod takes one MIG instance; leave --gpus out")
    if spec.gpu_type is not None and geometry(spec.gpu_type, spec.mig) is None:
        offered = sorted(MIG_PROFILES.get(spec.gpu_type, {}))
        have = (f"its profiles are {', '.join(offered)}" if offered
                else "it has no MIG profiles")
        raise InvalidInput("mig", f"{spec.gpu_type} has no MIG profile {spec.mig!r}; {have}")


def check_gpu_memory(spec: ContainerSpec, gpus: float) -> None:
    """``gpu_memory`` limits a share of one GPU: only with ``--gpus`` below 1, and no more
    than the memory of the requested model (of the largest catalog GPU without one)."""
    limit = spec.gpu_memory_bytes
    if limit is None:
        return
    if not 0 < gpus < 1:
        raise InvalidInput("gpu_memory", "a GPU memory limit needs a share of a GPU "
                           "(--gpus below 1, e.g. 0.5)")
    if spec.mig is not None:
        raise InvalidInput("gpu_memory", "a MIG instance has its own memory; leave it out")
    model = lookup(spec.gpu_type) if spec.gpu_type else None
    most = (model.memory_mib if model else max(m.memory_mib for m in CATALOG)) * 1024**2
    if limit > most:
        what = model.name if model else "any GPU model"
        raise InvalidInput("gpu_memory", f"{format_memory(limit)} is more than the memory of "
                           f"{what} ({format_memory(most)})")


def ensure_known_gpu_type(ctx: ServiceContext, gpu_type: str | None) -> None:
    """A requested model must be in the catalog or on some registered node."""
    if gpu_type is None or lookup(gpu_type):
        return
    with ctx.db.read() as session:
        for (gpus,) in session.execute(select(NodeModel.gpus)):
            if any(gpu.get("model") == gpu_type for gpu in gpus):
                return
    raise InvalidInput("gpu_type", f"unknown GPU model {gpu_type!r}")


def check_registry_auth(session: Session, project_id: str, spec: ContainerSpec) -> None:
    """The named registry credentials exist in the project (422 ``registry_auth``)."""
    if spec.registry_auth is None:
        return
    found = session.scalar(select(RegistryAuthModel.id).where(
        RegistryAuthModel.project_id == project_id,
        RegistryAuthModel.name == spec.registry_auth))
    if found is None:
        raise InvalidInput("registry_auth", f"no registry credentials named "
                           f"{spec.registry_auth!r} in this project (gpucloud registry-auth)")


def pull_credentials(session: Session, row: ContainerSpecColumns,
                     project_id: str) -> tuple[str, str] | None:
    """The username and password to pull ``row.image`` with, or None: no credentials
    named, or they are for another registry than the image's (never sent elsewhere)."""
    if row.registry_auth is None:
        return None
    auth = session.scalar(select(RegistryAuthModel).where(
        RegistryAuthModel.project_id == project_id,
        RegistryAuthModel.name == row.registry_auth))
    if auth is None:
        return None
    return credentials_for(row, auth.registry_host, auth.username, auth.password)


def credentials_for(row: ContainerSpecColumns, registry_host: str | None,
                    username: str | None, password: str | None) -> tuple[str, str] | None:
    """``pull_credentials`` from the login ``row.registry_auth`` names, already read (the
    assignments join its columns to their pods; no username: no such login): None for
    none, or for another registry's."""
    if username is None or password is None:
        return None
    if registry_host is not None and (
            _canonical_host(parse_reference(row.image).registry)
            != _canonical_host(registry_host)):
        return None
    return username, password


def _canonical_host(host: str) -> str:
    """Docker Hub has several names; every other registry is its ``host[:port]``."""
    host = host.lower()
    return DOCKER_HUB if host in ("index.docker.io", DOCKER_HUB_API) else host
