"""Checkpoints of ``--checkpoint-dir``: the agent's upload and restore protocol, retention,
chunk collection, and what users list, read and delete.

Upload, in three steps, each fenced (the node's fencing token, and the pod's attempt
must still be current):

1. ``open_upload``: the agent names every chunk its snapshot needs; the server records an
   upload row (the collector keeps those chunks while it lasts) and answers which chunks
   the store lacks.
2. ``upload_chunk``: each missing chunk in pieces (``Content-Range``), appended only at
   the end of what the server holds, so an interrupted upload resumes where it stopped;
   a complete chunk whose SHA-256 differs from its name is discarded (422).
3. ``commit``: every chunk must be in the store; the manifest is published under
   ``<key>/<attempt>-<seq>`` with an exclusive create, then the row that makes it the
   latest is inserted in a transaction that re-checks the fencing token and the attempt
   (and drops the upload row), so an old attempt waking up late never publishes over a
   newer one. Then retention keeps the last K and the collector removes unreferenced
   chunks.

Chunk collection lists the store's chunks first and reads the references (committed
rows and live uploads) after, so a chunk that an in-flight upload may reference is
never removed.
"""

from __future__ import annotations

import time
from datetime import timedelta

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from gpucloud.checkpoints import ChunkStore, ManifestExists, Staging, open_store, staging
from gpucloud.core.checkpoints import (
    MAX_CHUNK_BYTES,
    CheckpointCommitRequest,
    CheckpointMissingOut,
    CheckpointMissingRequest,
    CheckpointOut,
    CheckpointRejectRequest,
    ChunkUploadOut,
    Manifest,
    check_digest,
)
from gpucloud.core.errors import Conflict, InvalidInput, NotFound
from gpucloud.db.models import (
    CheckpointModel,
    CheckpointUploadModel,
    NodeModel,
    PodModel,
    ProjectModel,
)
from gpucloud.services.checkpoint_index import (
    COMMITTED,
    CORRUPT,
    checkpoint_key,
    checkpoint_rows,
    keeps_checkpoints,
)
from gpucloud.services.context import ServiceContext, new_id
from gpucloud.services.events import record_event
from gpucloud.services.fencing import check_fencing
from gpucloud.services.pods import bump_assignments
from gpucloud.services.projects import Principal

#: Partial uploads and multipart uploads older than this are dropped by the collector.
STALE_PARTIAL_SECONDS = 24 * 3600.0


def store_of(ctx: ServiceContext) -> ChunkStore:
    return open_store(ctx.settings.home, ctx.settings.checkpoint_store)


def _staging(ctx: ServiceContext) -> Staging:
    return staging(ctx.settings.home)


def manifest_name(key: str, attempt: int, seq: int) -> str:
    return f"{key}/{attempt:06d}-{seq:06d}"


# -- the agent's side -------------------------------------------------------------------


def _agent_pod(session: Session, node_id: str, pod_id: str, token: int, attempt: int,
               lock: bool = False) -> PodModel:
    """The pod, checked: the node's token is current, the pod is bound here, on this
    attempt, and has a checkpoint directory."""
    node = session.get_one(NodeModel, node_id, with_for_update=lock)
    check_fencing(node, token)
    # The node's row lock serializes with every change that moves the pod off this node
    # or to a new attempt (they pass through this node's row); locking the pod's row as
    # well would invert the pod-then-node order of user stops and deadlock with them.
    pod = session.get(PodModel, pod_id)
    if pod is None or pod.deleted_at is not None:
        raise NotFound(f"pod {pod_id!r} not found")
    if pod.node_id != node.id:
        raise Conflict(f"pod {pod_id!r} is not bound to node {node.name!r}")
    if attempt != pod.attempt:
        raise Conflict(f"checkpoint of attempt {attempt}; the pod is on attempt {pod.attempt}")
    if not keeps_checkpoints(pod):
        raise Conflict(f"pod {pod.name!r} has no checkpoint directory")
    return pod


def open_upload(ctx: ServiceContext, node_id: str, pod_id: str,
                request: CheckpointMissingRequest) -> CheckpointMissingOut:
    now = ctx.clock.now()
    ttl = timedelta(seconds=ctx.settings.checkpoint_upload_ttl_seconds)
    with ctx.db.transaction() as session:
        pod = _agent_pod(session, node_id, pod_id, request.fencing_token, request.attempt)
        upload = CheckpointUploadModel(id=new_id(), project_id=pod.project_id,
                                       key=checkpoint_key(pod), pod_id=pod.id,
                                       attempt=pod.attempt, digests=sorted(set(request.digests)),
                                       created_at=now, expires_at=now + ttl)
        session.add(upload)
        project_id, upload_id = pod.project_id, upload.id
    return CheckpointMissingOut(upload_id=upload_id,
                                missing=store_of(ctx).missing(project_id, request.digests))


def _project_of(ctx: ServiceContext, node_id: str, pod_id: str, token: int,
                attempt: int) -> str:
    with ctx.db.read() as session:
        return _agent_pod(session, node_id, pod_id, token, attempt).project_id


def chunk_status(ctx: ServiceContext, node_id: str, pod_id: str, digest: str, token: int,
                 attempt: int) -> ChunkUploadOut:
    """How much of the chunk the server holds (all of it once it is in the store)."""
    digest = _digest(digest)
    project = _project_of(ctx, node_id, pod_id, token, attempt)
    if not store_of(ctx).missing(project, [digest]):
        return ChunkUploadOut(digest=digest, received=0, complete=True)
    return ChunkUploadOut(digest=digest, received=_staging(ctx).received(project, digest),
                          complete=False)


def _digest(value: str) -> str:
    try:
        return check_digest(value)
    except ValueError as error:
        raise InvalidInput("digest", str(error)) from None


def parse_content_range(header: str | None, length: int) -> tuple[int, int]:
    """``bytes START-END/TOTAL`` → (start, total); the piece must be ``length`` long."""
    if not header:
        raise InvalidInput("Content-Range", "required: bytes START-END/TOTAL")
    unit, _, spec = header.strip().partition(" ")
    span, _, total_text = spec.partition("/")
    first, _, last = span.partition("-")
    try:
        start, end, total = int(first), int(last), int(total_text)
    except ValueError:
        raise InvalidInput("Content-Range", f"{header!r} is not bytes START-END/TOTAL") from None
    if unit != "bytes" or start < 0 or end < start or end >= total or end - start + 1 != length:
        raise InvalidInput("Content-Range", f"{header!r} does not describe the {length} bytes "
                           "sent")
    if total > MAX_CHUNK_BYTES:
        raise InvalidInput("Content-Range", f"a chunk is at most {MAX_CHUNK_BYTES} bytes")
    return start, total


def upload_chunk(ctx: ServiceContext, node_id: str, pod_id: str, digest: str, token: int,
                 attempt: int, content_range: str | None, data: bytes) -> ChunkUploadOut:
    """Append one piece of a chunk; the last piece checks the digest and stores it."""
    digest = _digest(digest)
    start, total = parse_content_range(content_range, len(data))
    project = _project_of(ctx, node_id, pod_id, token, attempt)
    store, stage = store_of(ctx), _staging(ctx)
    with stage.locked(digest):  # another sender of this chunk may be appending now
        if not store.missing(project, [digest]):
            return ChunkUploadOut(digest=digest, received=total, complete=True)
        received = stage.append(project, digest, start, data)
        if received < total:
            return ChunkUploadOut(digest=digest, received=received, complete=False)
        if received > total:
            stage.path(project, digest).unlink(missing_ok=True)
            raise InvalidInput("Content-Range",
                               f"the chunk grew past its total of {total} bytes")
        store.put_chunk(project, digest, stage.finish(project, digest))
    return ChunkUploadOut(digest=digest, received=total, complete=True)


def commit(ctx: ServiceContext, node_id: str, pod_id: str,
           request: CheckpointCommitRequest) -> CheckpointOut:
    """Publish the manifest, then move the latest pointer (fenced); see the module doc."""
    started = time.monotonic()
    with ctx.db.read() as session:
        pod = _agent_pod(session, node_id, pod_id, request.fencing_token, request.attempt)
        project_id, key = pod.project_id, checkpoint_key(pod)
        upload = session.get(CheckpointUploadModel, request.upload_id)
        if upload is None or upload.pod_id != pod.id or upload.attempt != pod.attempt:
            raise Conflict(f"upload {request.upload_id!r} is not open for this pod (it "
                           "expired or committed already); start the upload again")
        seq = _next_seq(session, project_id, key, pod.attempt)
    manifest = request.manifest
    _check_complete(ctx, project_id, manifest, upload.digests)
    name = _publish(ctx, project_id, key, request.attempt, seq, manifest)
    cost = request.cost_seconds + (time.monotonic() - started)
    try:
        row, dropped = _record(ctx, node_id, pod_id, request, name, manifest, cost)
    except Conflict:
        store_of(ctx).delete_manifest(project_id, name)  # a late writer: never the latest
        raise
    for old in dropped:
        store_of(ctx).delete_manifest(project_id, old)
    collect(ctx, project_id)
    with ctx.db.read() as session:
        return _out(session, row)


def _next_seq(session: Session, project_id: str, key: str, attempt: int) -> int:
    last = session.scalar(select(func.max(CheckpointModel.seq)).where(
        CheckpointModel.project_id == project_id, CheckpointModel.key == key,
        CheckpointModel.attempt == attempt))
    return (last or 0) + 1


def _check_complete(ctx: ServiceContext, project_id: str, manifest: Manifest,
                    opened: list[str]) -> None:
    """Every chunk is in the store and was named when the upload opened (so the collector
    kept it)."""
    digests = manifest.digests()
    unnamed = digests - set(opened)
    if unnamed:
        raise InvalidInput("manifest", f"{len(unnamed)} chunks were not named when the "
                           f"upload opened, e.g. {min(unnamed)}")
    missing = store_of(ctx).missing(project_id, digests)
    if missing:
        raise Conflict(f"{len(missing)} chunks are not in the store yet, e.g. {missing[0]}; "
                       "upload them first")


def _publish(ctx: ServiceContext, project_id: str, key: str, attempt: int, seq: int,
             manifest: Manifest) -> str:
    """The manifest under the first free sequence number from ``seq`` (exclusive create)."""
    for candidate in range(seq, seq + 8):
        name = manifest_name(key, attempt, candidate)
        document = manifest.model_copy(update={"key": key, "attempt": attempt,
                                               "seq": candidate})
        try:
            store_of(ctx).put_manifest(project_id, name, document.model_dump_json().encode())
            return name
        except ManifestExists:
            continue
    raise Conflict(f"manifests {key} attempt {attempt} from {seq} are all taken")


def _record(ctx: ServiceContext, node_id: str, pod_id: str, request: CheckpointCommitRequest,
            name: str, manifest: Manifest,
            cost: float) -> tuple[CheckpointModel, list[str]]:
    """The row that makes the manifest the latest, only while the writer is current, and
    retention in the same transaction; returns the row and the manifests it dropped."""
    now = ctx.clock.now()
    seq = int(name.rsplit("-", 1)[1])
    with ctx.db.transaction() as session:
        pod = _agent_pod(session, node_id, pod_id, request.fencing_token, request.attempt,
                         lock=True)
        row = CheckpointModel(
            id=new_id(), project_id=pod.project_id, key=checkpoint_key(pod), pod_id=pod.id,
            node_id=node_id, attempt=pod.attempt, seq=seq, manifest=name, state=COMMITTED,
            size_bytes=manifest.size_bytes, files=len(manifest.entries),
            chunks=sum(len(e.chunks) for e in manifest.entries), bytes_sent=request.bytes_sent,
            cost_seconds=round(cost, 6), digests=sorted(manifest.digests()), created_at=now)
        session.add(row)
        session.execute(delete(CheckpointUploadModel)
                        .where(CheckpointUploadModel.id == request.upload_id))
        record_event(session, pod.id, now, "Checkpointed",
                     f"checkpoint {pod.attempt}-{seq} committed: {row.size_bytes} bytes, "
                     f"{row.bytes_sent} sent, {cost:.2f}s")
        session.flush()
        dropped = _prune_rows(session, pod.project_id, row.key, ctx.settings.checkpoint_retention)
        # Its interval is re-planned on this cost and its restore target moved: the agent
        # sees both on its next poll, not the answer kept for its revision.
        bump_assignments(session, pod.node_id)
    return row, dropped


def agent_checkpoints(ctx: ServiceContext, node_id: str, pod_id: str, token: int,
                      attempt: int) -> list[CheckpointOut]:
    """The pod's committed checkpoints, newest first: what a restore tries, in order."""
    with ctx.db.read() as session:
        pod = _agent_pod(session, node_id, pod_id, token, attempt)
        rows = checkpoint_rows(session, pod.project_id, checkpoint_key(pod), COMMITTED)
        return [_out(session, row) for row in rows]


def agent_manifest(ctx: ServiceContext, node_id: str, pod_id: str, checkpoint_id: str,
                   token: int, attempt: int) -> Manifest:
    with ctx.db.read() as session:
        pod = _agent_pod(session, node_id, pod_id, token, attempt)
        row = _own_row(session, pod, checkpoint_id)
        project_id, name = row.project_id, row.manifest
    return Manifest.model_validate_json(store_of(ctx).get_manifest(project_id, name))


def agent_chunk(ctx: ServiceContext, node_id: str, pod_id: str, digest: str, token: int,
                attempt: int) -> bytes:
    """A chunk of the pod's project, as stored (the agent checks its digest)."""
    digest = _digest(digest)
    project = _project_of(ctx, node_id, pod_id, token, attempt)
    return store_of(ctx).get_chunk(project, digest)


def _own_row(session: Session, pod: PodModel, checkpoint_id: str) -> CheckpointModel:
    row = session.get(CheckpointModel, checkpoint_id)
    if row is None or row.project_id != pod.project_id or row.key != checkpoint_key(pod):
        raise NotFound(f"checkpoint {checkpoint_id!r} not found")
    return row


def reject(ctx: ServiceContext, node_id: str, pod_id: str, checkpoint_id: str,
           request: CheckpointRejectRequest) -> None:
    """A restore found the checkpoint damaged: never offered again; an event says why."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        pod = _agent_pod(session, node_id, pod_id, request.fencing_token, request.attempt)
        row = _own_row(session, pod, checkpoint_id)
        row.state, row.message = CORRUPT, request.reason
        record_event(session, pod.id, now, "CheckpointRejected",
                     f"checkpoint {row.attempt}-{row.seq} refused: {request.reason}")


def restored(ctx: ServiceContext, node_id: str, pod_id: str, checkpoint_id: str, token: int,
             attempt: int) -> None:
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        pod = _agent_pod(session, node_id, pod_id, token, attempt)
        row = _own_row(session, pod, checkpoint_id)
        record_event(session, pod.id, now, "CheckpointRestored",
                     f"checkpoint {row.attempt}-{row.seq} restored ({row.size_bytes} bytes)")


# -- retention and collection -----------------------------------------------------------


def _prune_rows(session: Session, project_id: str, key: str, keep: int) -> list[str]:
    """Keep the last ``keep`` committed checkpoints of ``key``; older and corrupt ones go.
    Returns their manifests (deleted from the store after the commit)."""
    rows = checkpoint_rows(session, project_id, key)
    committed = [row for row in rows if row.state == COMMITTED]
    doomed = committed[max(1, keep):] + [row for row in rows if row.state != COMMITTED]
    for row in doomed:
        session.delete(row)
    return [row.manifest for row in doomed]


def collect(ctx: ServiceContext, project_id: str) -> int:
    """Delete the project's chunks that nothing references; returns how many.

    The store is listed before the references are read: a chunk uploaded after the
    listing is not a candidate, and one that an open upload named (or a committed row
    references) at the time of reading is kept. Expired uploads go first.
    """
    store = store_of(ctx)
    listed = store.list_chunks(project_id)
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        session.execute(delete(CheckpointUploadModel).where(
            CheckpointUploadModel.project_id == project_id,
            CheckpointUploadModel.expires_at < now))
        referenced: set[str] = set()
        for digests in session.scalars(select(CheckpointModel.digests).where(
                CheckpointModel.project_id == project_id)):
            referenced.update(digests)
        for digests in session.scalars(select(CheckpointUploadModel.digests).where(
                CheckpointUploadModel.project_id == project_id)):
            referenced.update(digests)
    unreferenced = listed - referenced
    for digest in unreferenced:
        store.delete_chunk(project_id, digest)
    _staging(ctx).discard_older(time.time() - STALE_PARTIAL_SECONDS)
    store.abort_incomplete(now - timedelta(seconds=STALE_PARTIAL_SECONDS))
    return len(unreferenced)


# -- what users see ---------------------------------------------------------------------


def _out(session: Session, row: CheckpointModel) -> CheckpointOut:
    project = session.scalar(select(ProjectModel.name).where(ProjectModel.id == row.project_id))
    pod = session.get(PodModel, row.pod_id) if row.pod_id else None
    node = session.scalar(select(NodeModel.name).where(NodeModel.id == row.node_id)) \
        if row.node_id else None
    return CheckpointOut(
        id=row.id, project=project or "", key=row.key, pod=pod.name if pod else None,
        pod_id=row.pod_id, node=node, attempt=row.attempt, seq=row.seq, state=row.state,
        size_bytes=row.size_bytes, files=row.files, chunks=row.chunks,
        bytes_sent=row.bytes_sent, cost_seconds=row.cost_seconds, created_at=row.created_at)


def _pod(session: Session, caller: Principal, ref: str) -> PodModel:
    """A live pod of the caller's project (other projects' pods are not found)."""
    pod = session.scalar(select(PodModel).where(
        PodModel.project_id == caller.project_id, PodModel.deleted_at.is_(None),
        (PodModel.id == ref) | (PodModel.name == ref)))
    if pod is None:
        raise NotFound(f"pod {ref!r} not found")
    return pod


def list_checkpoints(ctx: ServiceContext, caller: Principal, ref: str) -> list[CheckpointOut]:
    with ctx.db.read() as session:
        pod = _pod(session, caller, ref)
        return [_out(session, row) for row in checkpoint_rows(session, pod.project_id,
                                                    checkpoint_key(pod))]


def get_checkpoint(ctx: ServiceContext, caller: Principal, ref: str,
                   checkpoint_id: str | None = None) -> tuple[CheckpointOut, Manifest]:
    """One checkpoint of the pod (default: its latest committed) and its manifest."""
    with ctx.db.read() as session:
        pod = _pod(session, caller, ref)
        if checkpoint_id is None:
            rows = checkpoint_rows(session, pod.project_id, checkpoint_key(pod), COMMITTED, limit=1)
            if not rows:
                raise NotFound(f"pod {pod.name!r} has no committed checkpoint")
            row = rows[0]
        else:
            row = _own_row(session, pod, checkpoint_id)
        out = _out(session, row)
        project_id, name = row.project_id, row.manifest
    return out, Manifest.model_validate_json(store_of(ctx).get_manifest(project_id, name))


def delete_checkpoints(ctx: ServiceContext, caller: Principal, ref: str,
                       checkpoint_id: str | None = None) -> int:
    """Delete one checkpoint of the pod, or all of them; returns how many."""
    with ctx.db.transaction() as session:
        pod = _pod(session, caller, ref)
        rows = ([_own_row(session, pod, checkpoint_id)] if checkpoint_id is not None
                else checkpoint_rows(session, pod.project_id, checkpoint_key(pod)))
        names = [row.manifest for row in rows]
        for row in rows:
            session.delete(row)
        project_id = pod.project_id
    for name in names:
        store_of(ctx).delete_manifest(project_id, name)
    collect(ctx, project_id)
    return len(names)
