"""SSH pieces shared by the control plane's gateway (``access/``) and the agent's access
server (``agent/access``): how their keys are made, which logins they accept, and which of
a client's environment variables reach a pod.

Key files are made once (mode 0600), safely when several processes start at once (server
``--workers``, an agent restarting): a key is written to a private temporary file and
hard-linked into place, so exactly one of them wins and the others read its key.
"""

from __future__ import annotations

import os
from pathlib import Path

import asyncssh

#: The client environment that reaches a pod's process (as OpenSSH's default AcceptEnv).
PASSED_ENV = frozenset({"TERM", "LANG"})
PASSED_ENV_PREFIXES = ("LC_",)


def env_passes(name: str) -> bool:
    """Whether a client's ``env`` request for ``name`` is passed on to the pod."""
    return name in PASSED_ENV or name.startswith(PASSED_ENV_PREFIXES)


def load_or_create_key(path: Path, comment: str | None = None) -> asyncssh.SSHKey:
    """The ed25519 private key at ``path``, generated (0600) if it does not exist yet."""
    if not path.exists():
        _create_key(path, comment)
    return asyncssh.read_private_key(path)


def _create_key(path: Path, comment: str | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    key = asyncssh.generate_private_key("ssh-ed25519", comment=comment)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key.export_private_key())
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process made it first: use theirs
    finally:
        tmp.unlink()


class PublicKeyOnlyServer(asyncssh.SSHServer):
    """An SSH server that always asks for authentication, and only by public key
    (subclasses decide which keys in ``validate_public_key``)."""

    def begin_auth(self, username: str) -> bool:
        del username
        return True

    def password_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True
