"""Checkpoints: the agent's upload/restore routes (``/v1/agent/pods/{id}/checkpoint…``,
node token, fenced) and the user's (``/v1/pods/{ref}/checkpoints``, API key, own project).

A chunk is uploaded in pieces with ``PUT`` and ``Content-Range: bytes START-END/TOTAL``;
``GET …/upload`` says how many bytes the server holds, so a broken upload resumes there.
The raw-body routes take the fencing token and attempt in ``X-Gpucloud-Fencing-Token`` and
``X-Gpucloud-Attempt`` (``PUT``) or as query parameters (``GET``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from gpucloud.api.deps import Caller, Ctx, NodeId
from gpucloud.core.checkpoints import (
    MAX_CHUNK_BYTES,
    AgentCheckpointRequest,
    CheckpointCommitRequest,
    CheckpointDetailOut,
    CheckpointMissingOut,
    CheckpointMissingRequest,
    CheckpointOut,
    CheckpointRejectRequest,
    ChunkUploadOut,
    Manifest,
)
from gpucloud.core.errors import InvalidInput
from gpucloud.services import checkpoints

agent_router = APIRouter(prefix="/v1/agent/pods/{pod_id}", tags=["agent"])
router = APIRouter(prefix="/v1/pods/{ref}/checkpoints", tags=["checkpoints"])
Token = Annotated[int, Query()]
Attempt = Annotated[int, Query()]


@agent_router.post("/checkpoints/uploads", status_code=201)
def open_upload(pod_id: str, body: CheckpointMissingRequest, ctx: Ctx,
                node_id: NodeId) -> CheckpointMissingOut:
    return checkpoints.open_upload(ctx, node_id, pod_id, body)


@agent_router.get("/checkpoint-chunks/{digest}/upload")
def chunk_status(pod_id: str, digest: str, ctx: Ctx, node_id: NodeId, fencing_token: Token,
                 attempt: Attempt) -> ChunkUploadOut:
    return checkpoints.chunk_status(ctx, node_id, pod_id, digest, fencing_token, attempt)


@agent_router.put("/checkpoint-chunks/{digest}")
async def upload_chunk(
    pod_id: str, digest: str, request: Request, ctx: Ctx, node_id: NodeId,
    x_gpucloud_fencing_token: Annotated[int, Header()],
    x_gpucloud_attempt: Annotated[int, Header()],
    content_range: Annotated[str | None, Header()] = None,
) -> ChunkUploadOut:
    data = bytearray()
    async for block in request.stream():
        data += block
        if len(data) > MAX_CHUNK_BYTES:
            raise InvalidInput("body", f"a chunk is at most {MAX_CHUNK_BYTES} bytes")
    return await run_in_threadpool(checkpoints.upload_chunk, ctx, node_id, pod_id, digest,
                                   x_gpucloud_fencing_token, x_gpucloud_attempt,
                                   content_range, bytes(data))


@agent_router.get("/checkpoint-chunks/{digest}")
def download_chunk(pod_id: str, digest: str, ctx: Ctx, node_id: NodeId,
                   fencing_token: Token, attempt: Attempt) -> Response:
    data = checkpoints.agent_chunk(ctx, node_id, pod_id, digest, fencing_token, attempt)
    return Response(data, media_type="application/octet-stream")


@agent_router.post("/checkpoints", status_code=201)
def commit(pod_id: str, body: CheckpointCommitRequest, ctx: Ctx,
           node_id: NodeId) -> CheckpointOut:
    return checkpoints.commit(ctx, node_id, pod_id, body)


@agent_router.get("/checkpoints")
def agent_list(pod_id: str, ctx: Ctx, node_id: NodeId, fencing_token: Token,
               attempt: Attempt) -> list[CheckpointOut]:
    return checkpoints.agent_checkpoints(ctx, node_id, pod_id, fencing_token, attempt)


@agent_router.get("/checkpoints/{checkpoint_id}/manifest")
def agent_manifest(pod_id: str, checkpoint_id: str, ctx: Ctx, node_id: NodeId,
                   fencing_token: Token, attempt: Attempt) -> Manifest:
    return checkpoints.agent_manifest(ctx, node_id, pod_id, checkpoint_id, fencing_token,
                                      attempt)


@agent_router.post("/checkpoints/{checkpoint_id}/reject")
def reject(pod_id: str, checkpoint_id: str, body: CheckpointRejectRequest, ctx: Ctx,
           node_id: NodeId) -> dict[str, bool]:
    checkpoints.reject(ctx, node_id, pod_id, checkpoint_id, body)
    return {"rejected": True}


@agent_router.post("/checkpoints/{checkpoint_id}/restored")
def restored(pod_id: str, checkpoint_id: str, body: AgentCheckpointRequest, ctx: Ctx,
             node_id: NodeId) -> dict[str, bool]:
    checkpoints.restored(ctx, node_id, pod_id, checkpoint_id, body.fencing_token,
                         body.attempt)
    return {"restored": True}


@router.get("")
def list_checkpoints(ref: str, ctx: Ctx, caller: Caller) -> list[CheckpointOut]:
    return checkpoints.list_checkpoints(ctx, caller, ref)


@router.get("/{checkpoint_id}")
def get_checkpoint(ref: str, checkpoint_id: str, ctx: Ctx,
                   caller: Caller) -> CheckpointDetailOut:
    """``latest`` names the newest committed checkpoint."""
    wanted = None if checkpoint_id == "latest" else checkpoint_id
    out, manifest = checkpoints.get_checkpoint(ctx, caller, ref, wanted)
    return CheckpointDetailOut(**out.model_dump(), manifest=manifest)


@router.delete("")
def delete_checkpoints(ref: str, ctx: Ctx, caller: Caller) -> dict[str, int]:
    return {"deleted": checkpoints.delete_checkpoints(ctx, caller, ref)}


@router.delete("/{checkpoint_id}")
def delete_checkpoint(ref: str, checkpoint_id: str, ctx: Ctx,
                      caller: Caller) -> dict[str, int]:
    return {"deleted": checkpoints.delete_checkpoints(ctx, caller, ref, checkpoint_id)}
