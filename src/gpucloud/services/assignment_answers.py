"""The assignment long poll's cheap answers: "nothing changed" from the revision alone.

A node's full answer (``agent.assignments``: its pods, their volumes, credentials, keys,
checkpoint plans, the volume pods and exports, GPU actions) costs about five queries. An
agent long-polls with the revision it holds, and most polls end at their ``wait`` with
that revision unchanged; rebuilding the same answer for each of them was most of what a
fleet's polls cost the server. Every change an agent must act on moves the node's
``assignments_revision`` (a bind, a stop, a new grant — its fencing token too), so the
answer built for a revision is served again to a poll that ended on that revision.

A few parts of the answer are derived without a revision bump (a checkpoint interval
re-planned, a project's SSH keys or registry login edited, which only new pods use):
a kept answer is served for at most ``MAX_AGE_S`` seconds, after which the next one
is built afresh, so such a change reaches the agent within that bound (it reached it
within one ``wait`` before). Per process, bounded in size; a restart forgets it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import select

from gpucloud.core.errors import Unauthorized
from gpucloud.core.models import AssignmentsOut
from gpucloud.db.models import NodeModel
from gpucloud.services import agent, nodes
from gpucloud.services.context import ServiceContext, hash_secret, secret_matches

#: The longest a built answer is served again while its revision holds.
MAX_AGE_S = 120.0
#: Kept answers per process (one per node; beyond it the oldest half is dropped).
MAX_ENTRIES = 50_000


@dataclass(frozen=True)
class _Kept:
    revision: int
    built_at: float
    out: AssignmentsOut


class AnswerCache:
    """The last full answer built per node (thread-safe: built on worker threads)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._kept: dict[str, _Kept] = {}
        self._lock = threading.Lock()
        self.built = 0
        self.served = 0

    def kept(self, node_id: str, revision: int) -> AssignmentsOut | None:
        """The answer kept for ``revision`` of the node, if still fresh enough."""
        with self._lock:
            found = self._kept.get(node_id)
            if (found is None or found.revision != revision
                    or self.clock() - found.built_at > MAX_AGE_S):
                return None
            self.served += 1
            return found.out

    def keep(self, node_id: str, out: AssignmentsOut) -> None:
        with self._lock:
            if len(self._kept) >= MAX_ENTRIES and node_id not in self._kept:
                oldest = sorted(self._kept, key=lambda k: self._kept[k].built_at)
                for key in oldest[:MAX_ENTRIES // 2]:
                    del self._kept[key]
            self._kept[node_id] = _Kept(out.revision, self.clock(), out)
            self.built += 1

    def answer(self, ctx: ServiceContext, node_id: str, unchanged: int | None) -> AssignmentsOut:
        """The node's answer: the one kept for revision ``unchanged`` when the poll ended
        on it (the caller read it), else built afresh (and kept)."""
        if unchanged is not None:
            found = self.kept(node_id, unchanged)
            if found is not None:
                return found
        out = agent.assignments(ctx, node_id)
        self.keep(node_id, out)
        return out


#: The server process's answers.
ANSWERS = AnswerCache()


def poll_state(ctx: ServiceContext, token: str | None) -> tuple[str, int]:
    """A long poll's node and its revision, the token authenticated in the same query
    (one primary-key-sized read by the token's unique hash); the node cache is filled
    as ``nodes.authenticate_node`` does."""
    if not token:
        raise Unauthorized("missing node token")
    with ctx.db.read() as session:
        row = session.execute(  # by hash: see secret_matches for why that is safe
            select(NodeModel.id, NodeModel.token_hash, NodeModel.assignments_revision)
            .where(NodeModel.token_hash == hash_secret(token))).first()
    if row is None or not secret_matches(token, row[1]):
        raise Unauthorized("invalid node token")
    nodes.remember_node(ctx, row[1], str(row[0]))
    return str(row[0]), int(row[2])
