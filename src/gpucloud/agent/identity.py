"""The node's identity, persisted in the state directory so that a restarted agent can
renew its lease with the node token even after the join token expired."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Identity:
    server: str
    node_id: str
    name: str
    node_token: str


class IdentityFile:
    """``<state-dir>/node.json``, readable by root only (it holds the node token)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "node.json"

    def load(self, server: str, name: str) -> Identity | None:
        """The saved identity for this server and node name, if any."""
        try:
            data = json.loads(self.path.read_text())
            identity = Identity(**data)
        except (OSError, ValueError, TypeError):
            return None
        return identity if (identity.server, identity.name) == (server, name) else None

    def save(self, identity: Identity) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(asdict(identity), handle, indent=2)
        tmp.replace(self.path)
