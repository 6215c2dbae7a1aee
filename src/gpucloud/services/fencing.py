"""The fencing check every agent write goes through (its own module: services that agents
write to import it without importing the node service and its scheduling imports)."""

from __future__ import annotations

from gpucloud.core.errors import StaleFencingToken
from gpucloud.db.models import NodeModel


def check_fencing(node: NodeModel, token: int) -> None:
    """Refuse (409) a write carrying a token other than the node's current grant."""
    check_token(node.fencing_token, token)


def check_token(current: int, token: int) -> None:
    """``check_fencing`` against the node's current token read without loading the node."""
    if token != current:
        raise StaleFencingToken(
            f"stale fencing token {token} (current {current}); renew the lease"
        )
