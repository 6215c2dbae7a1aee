"""The server's own SSH keys under ``GPUCLOUD_HOME``, each made once (mode 0600):

- ``gateway_client_key``: the gateway logs in to agents' access servers with it; its public
  line goes into every ``NodeRegisterResponse.gateway_public_keys``;
- ``ssh_host_ed25519_key``: the host key users' SSH clients see on the gateway.

Several server processes may start at once (``--workers``): a key is written to a private
temporary file and hard-linked into place, so exactly one of them wins and the others read
its key.
"""

from __future__ import annotations

import os
from pathlib import Path

import asyncssh

CLIENT_KEY_FILE = "gateway_client_key"
HOST_KEY_FILE = "ssh_host_ed25519_key"


def load_or_create(path: Path) -> asyncssh.SSHKey:
    """The ed25519 private key at ``path``, generated (0600) if it does not exist yet."""
    if not path.exists():
        _create(path)
    return asyncssh.read_private_key(path)


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    key = asyncssh.generate_private_key("ssh-ed25519", comment=f"gpucloud {path.name}")
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


def client_key(home: Path) -> asyncssh.SSHKey:
    return load_or_create(home / CLIENT_KEY_FILE)


def host_key(home: Path) -> asyncssh.SSHKey:
    return load_or_create(home / HOST_KEY_FILE)


def public_line(key: asyncssh.SSHKey) -> str:
    """``ssh-ed25519 AAAA… comment`` without the trailing newline."""
    return key.export_public_key().decode().strip()


def gateway_public_keys(home: Path) -> list[str]:
    """What agents must authorize: the gateway's client key."""
    return [public_line(client_key(home))]
