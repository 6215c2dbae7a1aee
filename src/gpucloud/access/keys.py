"""The server's own SSH keys under ``GPUCLOUD_HOME``, each made once (mode 0600):

- ``gateway_client_key``: the gateway logs in to agents' access servers with it; its public
  line goes into every ``NodeRegisterResponse.gateway_public_keys``;
- ``ssh_host_ed25519_key``: the host key users' SSH clients see on the gateway.

Several server processes may start at once (``--workers``): ``core.sshutil`` makes each key
so that exactly one of them wins and the others read its key.
"""

from __future__ import annotations

from pathlib import Path

import asyncssh

from gpucloud.core.sshutil import load_or_create_key

CLIENT_KEY_FILE = "gateway_client_key"
HOST_KEY_FILE = "ssh_host_ed25519_key"


def load_or_create(path: Path) -> asyncssh.SSHKey:
    """The ed25519 private key at ``path``, generated (0600) if it does not exist yet."""
    return load_or_create_key(path, comment=f"gpucloud {path.name}")


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
