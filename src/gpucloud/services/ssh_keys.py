"""SSH public keys of a project: the keys the gateway lets into the project's pods, and the
``PUBLIC_KEY`` every pod of the project gets in its environment (as on RunPod)."""

from __future__ import annotations

from dataclasses import dataclass

import asyncssh
from sqlalchemy import bindparam, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpucloud.core.access import SshKeyAddRequest, SshKeyOut
from gpucloud.core.errors import InvalidInput, NotFound
from gpucloud.db.models import SshKeyModel
from gpucloud.services.context import ServiceContext, new_id
from gpucloud.services.pods import bump_project_nodes
from gpucloud.services.projects import Principal

#: Key types accepted, as OpenSSH names them; certificates and DSA are refused.
KEY_TYPES = frozenset({
    "ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521",
    "ssh-rsa", "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com",
})
MIN_RSA_BITS = 2048
_FIELD = "public_key"


@dataclass(frozen=True)
class ParsedKey:
    """One validated OpenSSH public key: its type, canonical line and SHA256 fingerprint."""

    key_type: str
    line: str
    fingerprint: str
    comment: str


def parse_public_key(text: str) -> ParsedKey:
    """The one key in ``text`` (an OpenSSH ``TYPE BASE64 [COMMENT]`` line); InvalidInput
    naming ``public_key`` for anything else."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) != 1:
        raise InvalidInput(_FIELD, "give exactly one OpenSSH public key line "
                                   "(TYPE BASE64 [COMMENT])")
    parts = lines[0].split(None, 2)
    if len(parts) < 2 or parts[0] not in KEY_TYPES:
        shown = parts[0][:40] if parts else ""
        raise InvalidInput(_FIELD, f"unsupported key type {shown!r}; use ssh-ed25519, "
                                   "ecdsa-sha2-nistp256/384/521 or ssh-rsa (>= 2048 bits)")
    key_type, blob = parts[0], parts[1]
    try:
        key = asyncssh.import_public_key(f"{key_type} {blob}")
    except (asyncssh.KeyImportError, ValueError):
        raise InvalidInput(_FIELD, f"not a valid {key_type} public key") from None
    if key.get_algorithm() != key_type:
        raise InvalidInput(_FIELD, f"the key data is {key.get_algorithm()}, not {key_type}")
    _check_strength(key, key_type)
    return ParsedKey(key_type=key_type, line=f"{key_type} {blob}",
                     fingerprint=key.get_fingerprint("sha256"),
                     comment=parts[2].strip() if len(parts) > 2 else "")


def _check_strength(key: asyncssh.SSHKey, key_type: str) -> None:
    if key_type != "ssh-rsa":
        return
    bits = int(getattr(key.pyca_key, "key_size", 0))
    if bits < MIN_RSA_BITS:
        raise InvalidInput(_FIELD, f"RSA keys need at least {MIN_RSA_BITS} bits; this one "
                                   f"has {bits}")


def _out(row: SshKeyModel) -> SshKeyOut:
    return SshKeyOut(id=row.id, name=row.name, key_type=row.key_type,
                     fingerprint=row.fingerprint, public_key=row.public_key,
                     created_at=row.created_at)


def _duplicate(session: Session, project_id: str, fingerprint: str) -> SshKeyModel | None:
    return session.scalar(select(SshKeyModel).where(SshKeyModel.project_id == project_id,
                                                    SshKeyModel.fingerprint == fingerprint))


def _duplicate_error(existing_name: str, fingerprint: str) -> InvalidInput:
    return InvalidInput(_FIELD, f"key {fingerprint} is already in this project "
                                f"(as {existing_name!r})")


def add_key(ctx: ServiceContext, caller: Principal, request: SshKeyAddRequest) -> SshKeyOut:
    """Add a key to the caller's project; the same key twice is a 422 naming it."""
    parsed = parse_public_key(request.public_key)
    name = (request.name or parsed.comment or parsed.fingerprint)[:255]
    row = SshKeyModel(id=new_id(), project_id=caller.project_id, name=name,
                      key_type=parsed.key_type, public_key=parsed.line,
                      fingerprint=parsed.fingerprint, created_at=ctx.clock.now())
    try:
        with ctx.db.transaction() as session:
            existing = _duplicate(session, caller.project_id, parsed.fingerprint)
            if existing is not None:
                raise _duplicate_error(existing.name, parsed.fingerprint)
            session.add(row)
            bump_project_nodes(session, caller.project_id)  # their PUBLIC_KEY changed
    except IntegrityError:  # a concurrent add of the same key won the unique index
        raise _duplicate_error(name, parsed.fingerprint) from None
    return _out(row)


def list_keys(ctx: ServiceContext, caller: Principal) -> list[SshKeyOut]:
    with ctx.db.read() as session:
        rows = session.scalars(select(SshKeyModel)
                               .where(SshKeyModel.project_id == caller.project_id)
                               .order_by(SshKeyModel.created_at, SshKeyModel.id))
        return [_out(row) for row in rows]


def remove_key(ctx: ServiceContext, caller: Principal, ref: str) -> SshKeyOut:
    """Remove a key by id, name or fingerprint; another project's key is not found."""
    with ctx.db.transaction() as session:
        row = session.scalar(select(SshKeyModel).where(
            SshKeyModel.project_id == caller.project_id,
            (SshKeyModel.id == ref) | (SshKeyModel.name == ref)
            | (SshKeyModel.fingerprint == ref)).limit(1))
        if row is None:
            raise NotFound(f"ssh key {ref!r} not found")
        out = _out(row)
        session.delete(row)
        bump_project_nodes(session, caller.project_id)
        return out


def project_key_lines(session: Session, project_id: str) -> list[str]:
    """The project's keys as OpenSSH lines, oldest first (``PUBLIC_KEY``, gateway auth)."""
    return list(session.scalars(select(SshKeyModel.public_key)
                                .where(SshKeyModel.project_id == project_id)
                                .order_by(SshKeyModel.created_at, SshKeyModel.id)))


#: ``public_keys``' query, built once (every assignments answer runs it).
_PUBLIC_KEYS = (select(SshKeyModel.project_id, SshKeyModel.public_key)
                .where(SshKeyModel.project_id.in_(bindparam("projects", expanding=True)))
                .order_by(SshKeyModel.created_at, SshKeyModel.id))


def public_keys(session: Session, project_ids: set[str]) -> dict[str, str]:
    """``PUBLIC_KEY`` of each project that has keys: its lines joined by newlines."""
    if not project_ids:
        return {}
    rows = session.execute(_PUBLIC_KEYS, {"projects": sorted(project_ids)})
    lines: dict[str, list[str]] = {}
    for project_id, line in rows:
        lines.setdefault(project_id, []).append(line)
    return {project_id: "\n".join(found) for project_id, found in lines.items()}
