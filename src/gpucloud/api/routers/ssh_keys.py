"""/v1/ssh-keys: the SSH public keys of the caller's project."""

from __future__ import annotations

from fastapi import APIRouter

from gpucloud.api.deps import Caller, Ctx
from gpucloud.core.access import SshKeyAddRequest, SshKeyOut
from gpucloud.services import ssh_keys

router = APIRouter(prefix="/v1/ssh-keys", tags=["ssh-keys"])


@router.post("", status_code=201)
def add_key(body: SshKeyAddRequest, ctx: Ctx, caller: Caller) -> SshKeyOut:
    return ssh_keys.add_key(ctx, caller, body)


@router.get("")
def list_keys(ctx: Ctx, caller: Caller) -> list[SshKeyOut]:
    return ssh_keys.list_keys(ctx, caller)


@router.delete("/{ref}")
def remove_key(ref: str, ctx: Ctx, caller: Caller) -> SshKeyOut:
    return ssh_keys.remove_key(ctx, caller, ref)
