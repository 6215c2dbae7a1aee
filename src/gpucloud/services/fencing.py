"""The fencing check every agent write goes through (its own module: services that agents
write to import it without importing the node service and its scheduling imports)."""

from __future__ import annotations

from gpucloud.core.errors import StaleFencingToken
from gpucloud.db.models import NodeModel


def check_fencing(node: NodeModel, token: int) -> None:
    """Refuse (409) a write carrying a token other than the node's current grant."""
    if token != node.fencing_token:
        raise StaleFencingToken(
            f"stale fencing token {token} (current {node.fencing_token}); renew the lease"
        )
