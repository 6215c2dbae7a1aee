"""Network volumes: a project's named directories that pods on any node mount.

The embedded store is a directory per volume on the server's machine,
``Settings.home/volumes/<volume id>``. A node mounts it by ``hostpath`` (a bind mount: the
agent runs on the server's machine) or by ``nfs`` (the server's volumes directory exported
by ``nfs-kernel-server``; docs/volumes.md). Which one a node uses is its own registration
(``NodeOut.volume_mode``). A volume is deleted only while no live pod mounts it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from sqlalchemy import bindparam, delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpucloud.core.access import (
    NetworkVolumeMount,
    VolumeCreateRequest,
    VolumeOut,
)
from gpucloud.core.errors import Conflict, InvalidInput, NotFound
from gpucloud.core.models import MAX_DISK_BYTES
from gpucloud.core.names import check_dns_label
from gpucloud.core.phases import ACTIVE_PHASE_VALUES, PodPhase
from gpucloud.core.quantities import format_memory, parse_memory
from gpucloud.db.models import PodModel, VolumeModel
from gpucloud.services.context import ServiceContext, new_id
from gpucloud.services.projects import Principal

FIELD = "network_volumes"
HOSTPATH, NFS = "hostpath", "nfs"
#: A pod in these phases mounts its network volumes (or is about to).
_LIVE_PHASES = (*ACTIVE_PHASE_VALUES, PodPhase.PENDING.value)


def volumes_root(ctx: ServiceContext) -> Path:
    return ctx.settings.home / "volumes"


def volume_dir(ctx: ServiceContext, volume_id: str) -> Path:
    return volumes_root(ctx) / volume_id


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=not path.exists())


def _size(request: VolumeCreateRequest) -> int:
    size = parse_memory("size", request.size)
    if not 1024**2 <= size <= MAX_DISK_BYTES:
        raise InvalidInput("size", "must be between 1Mi and 1Pi")
    return size


def create_volume(ctx: ServiceContext, caller: Principal,
                  request: VolumeCreateRequest) -> VolumeOut:
    """Make the volume's directory, then its row; a taken name removes the directory."""
    check_dns_label("name", request.name)
    if request.zone is not None:
        check_dns_label("zone", request.zone)
    size = _size(request)
    row = VolumeModel(id=new_id(), project_id=caller.project_id, name=request.name,
                      size_bytes=size, zone=request.zone, created_at=ctx.clock.now())
    if _find_or_none(ctx, caller, request.name) is not None:
        raise InvalidInput("name", f"a volume named {request.name!r} already exists")
    path = volume_dir(ctx, row.id)
    path.mkdir(parents=True)
    os.chmod(path, 0o777)  # pods run as their image's user, often not root
    try:
        with ctx.db.transaction() as session:
            session.add(row)
            session.flush()
            return _out(row, caller.project_name, [])
    except IntegrityError:
        remove_tree(path)
        raise InvalidInput("name", f"a volume named {request.name!r} already exists") from None


def _find_or_none(ctx: ServiceContext, caller: Principal, ref: str) -> VolumeModel | None:
    with ctx.db.read() as session:
        return _lookup(session, caller.project_id, ref)


def _lookup(session: Session, project_id: str, ref: str) -> VolumeModel | None:
    return session.scalar(select(VolumeModel).where(
        VolumeModel.project_id == project_id,
        (VolumeModel.id == ref) | (VolumeModel.name == ref)))


def _out(row: VolumeModel, project: str, mounted_by: list[str]) -> VolumeOut:
    return VolumeOut(id=row.id, name=row.name, project=project, size_bytes=row.size_bytes,
                     size=format_memory(row.size_bytes), zone=row.zone,
                     mounted_by=mounted_by, created_at=row.created_at)


def _mounters(session: Session, project_id: str) -> dict[str, list[str]]:
    """Volume name -> names of the project's live pods that mount it."""
    rows = session.execute(select(PodModel.name, PodModel.network_volumes).where(
        PodModel.project_id == project_id, PodModel.deleted_at.is_(None),
        PodModel.phase.in_(_LIVE_PHASES), PodModel.network_volumes.is_not(None))).all()
    users: dict[str, list[str]] = {}
    for name, mounts in rows:
        for mount in mounts or []:
            users.setdefault(str(mount.get("name")), []).append(name)
    return users


def list_volumes(ctx: ServiceContext, caller: Principal) -> list[VolumeOut]:
    with ctx.db.read() as session:
        rows = session.scalars(select(VolumeModel).where(
            VolumeModel.project_id == caller.project_id).order_by(VolumeModel.name)).all()
        users = _mounters(session, caller.project_id)
        return [_out(row, caller.project_name, users.get(row.name, [])) for row in rows]


def get_volume(ctx: ServiceContext, caller: Principal, ref: str) -> VolumeOut:
    with ctx.db.read() as session:
        row = _lookup(session, caller.project_id, ref)
        if row is None:
            raise NotFound(f"volume {ref!r} not found")
        return _out(row, caller.project_name,
                    _mounters(session, caller.project_id).get(row.name, []))


def delete_volume(ctx: ServiceContext, caller: Principal, ref: str) -> None:
    """Delete the row (refused while a live pod mounts it), then the directory."""
    with ctx.db.transaction() as session:
        row = _lookup(session, caller.project_id, ref)
        if row is None:
            raise NotFound(f"volume {ref!r} not found")
        users = _mounters(session, caller.project_id).get(row.name, [])
        if users:
            raise Conflict(f"volume {row.name!r} is mounted by pod {', '.join(sorted(users))}; "
                           "stop or delete those pods first")
        session.execute(delete(VolumeModel).where(VolumeModel.id == row.id))
        volume_id = row.id
    remove_tree(volume_dir(ctx, volume_id))


def check_names(session: Session, project_id: str, specs: list[str]) -> None:
    """Every ``NAME:/path`` (normalized by ContainerSpec) names a volume of the project;
    an unknown one is a 422 naming network_volumes."""
    for spec in specs:
        name = spec.partition(":")[0]
        if _by_name(session, project_id, name) is None:
            raise InvalidInput(FIELD, f"no volume named {name!r} in this project "
                                      "(gpucloud volume create)")


def _by_name(session: Session, project_id: str, name: str) -> VolumeModel | None:
    return session.scalar(select(VolumeModel).where(VolumeModel.project_id == project_id,
                                                    VolumeModel.name == name))


#: The volumes of some projects by name (``mounts_for_pods``), built once.
_VOLUMES_NAMED = select(VolumeModel).where(
    VolumeModel.project_id.in_(bindparam("projects", expanding=True)),
    VolumeModel.name.in_(bindparam("names", expanding=True)))


def mounts_for_pods(ctx: ServiceContext, session: Session, pods: Iterable[PodModel],
                    volume_mode: str | None) -> dict[str, list[NetworkVolumeMount]]:
    """What an agent needs to mount its pods' network volumes its way, by pod id (the
    volumes of all of them read at once). ``source`` is the volume's directory on the
    server's machine in both modes; an ``nfs`` node mounts ``<server host>:<source>``
    from the export of ``Settings.home/volumes``."""
    wanted = [(pod, mount) for pod in pods for mount in pod.network_volumes or []]
    if not wanted:
        return {}
    rows = session.scalars(_VOLUMES_NAMED, {
        "projects": sorted({pod.project_id for pod, _ in wanted}),
        "names": sorted({mount["name"] for _, mount in wanted})})
    found = {(row.project_id, row.name): row for row in rows}
    out: dict[str, list[NetworkVolumeMount]] = {}
    for pod, mount in wanted:
        row = found.get((pod.project_id, mount["name"]))
        if row is None:
            continue  # deleted under a stopped pod; start_pod refuses to start it
        out.setdefault(pod.id, []).append(NetworkVolumeMount(
            name=row.name, volume_id=row.id, path=mount["path"],
            mode=volume_mode or HOSTPATH, source=str(volume_dir(ctx, row.id)),
            size_bytes=row.size_bytes))
    return out


def check_still_there(session: Session, project_id: str,
                      mounts: list[dict[str, str]] | None) -> None:
    """Before a pod starts again: each network volume it mounts must still exist."""
    for mount in mounts or []:
        if _by_name(session, project_id, mount["name"]) is None:
            raise InvalidInput(FIELD, f"volume {mount['name']!r} no longer exists; "
                                      "create it again or delete the pod")
