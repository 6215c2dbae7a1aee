"""The assignment long poll's cheap answers: "nothing changed" from the revision alone.

A node's full answer (``agent.assignments``: its pods, their volumes, credentials, keys,
checkpoint plans, the volume pods and exports, GPU actions) costs three or four queries. An
agent long-polls with the revision it holds, and most polls end at their ``wait`` with
that revision unchanged; rebuilding the same answer for each of them was most of what a
fleet's polls cost the server. Every change an agent must act on moves the node's
``assignments_revision`` (a bind, a stop, a new grant — its fencing token too), so the
answer built for a revision is served again to a poll that ended on that revision.

Changes to what the answer derives from bump the revision of the nodes they concern
too: a committed checkpoint (its pod's interval is re-planned on the new cost, its
restore target moves: services/checkpoints), a project's SSH keys edited (``PUBLIC_KEY``:
services/ssh_keys) or a registry login added or removed (services/registry_auths), so
the agent sees them on its next poll. What drifts without any event, the interruption
statistics an interval's M comes from (running time accumulating), is bounded instead:
a kept answer is served for at most ``MAX_AGE_S`` seconds, after which the next one is
built afresh. Per process, bounded in size; a restart forgets it.
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
#: The longest a primed answer (``AnswerCache.prime``) waits for the poll it was built for.
PRIMED_MAX_AGE_S = 1.0


@dataclass(frozen=True)
class _Kept:
    revision: int
    built_at: float
    out: AssignmentsOut
    #: Built by ``prime`` for the poll about to be woken, and not served to it yet.
    primed: bool = False


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

    def keep(self, node_id: str, out: AssignmentsOut, primed: bool = False) -> None:
        with self._lock:
            if len(self._kept) >= MAX_ENTRIES and node_id not in self._kept:
                oldest = sorted(self._kept, key=lambda k: self._kept[k].built_at)
                for key in oldest[:MAX_ENTRIES // 2]:
                    del self._kept[key]
            self._kept[node_id] = _Kept(out.revision, self.clock(), out, primed)
            self.built += 1

    def prime(self, ctx: ServiceContext, node_id: str) -> None:
        """Build the node's answer now: a change to it has just committed and the poll
        waiting for it is about to be woken (a scheduling pass's bind, on the controller
        thread, before the periodic controllers run). The woken poll then serves it
        without a query (``answer``), once: it is the answer that poll would build, read
        a moment earlier. A change committed in between has its own wake-up, or the poll
        after this one finds the revision moved."""
        self.keep(node_id, agent.assignments(ctx, node_id), primed=True)

    def _primed(self, node_id: str) -> AssignmentsOut | None:
        """The node's primed answer if it is fresh, now no longer primed."""
        with self._lock:
            found = self._kept.get(node_id)
            if (found is None or not found.primed
                    or self.clock() - found.built_at > PRIMED_MAX_AGE_S):
                return None
            self._kept[node_id] = _Kept(found.revision, found.built_at, found.out)
            self.served += 1
            return found.out

    def answer(self, ctx: ServiceContext, node_id: str, unchanged: int | None) -> AssignmentsOut:
        """The node's answer: the one kept for revision ``unchanged`` when the poll ended
        on it (the caller read it), else the one primed for this poll, else built afresh
        (and kept)."""
        found = (self.kept(node_id, unchanged) if unchanged is not None
                 else self._primed(node_id))
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
