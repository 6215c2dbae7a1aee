"""The reconcile step, as a pure function: what to start, update, abandon and reap.

Keys are container ids (``<pod id>-<attempt>``): a restarted pod is a new attempt and so a
new container, never the old one run again. ``finished`` holds the containers whose
workers already reported their end: an assignments snapshot older than that report may
still list them, and they must not run twice.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from gpucloud.agent.podworker import container_id
from gpucloud.core.models import AssignmentOut


@dataclass(frozen=True)
class Plan:
    start: list[AssignmentOut] = field(default_factory=list)
    update: list[AssignmentOut] = field(default_factory=list)
    abandon: list[str] = field(default_factory=list)
    reap: list[str] = field(default_factory=list)


def plan(assigned: Sequence[AssignmentOut], workers: Collection[str],
         containers: Collection[str], finished: Collection[str]) -> Plan:
    """``workers``: ids with a live worker; ``containers``: ids with a directory on disk."""
    wanted = {container_id(a.pod_id, a.attempt): a for a in assigned}
    result = Plan()
    for cid, assignment in wanted.items():
        if cid in workers:
            result.update.append(assignment)
        elif cid not in finished:
            result.start.append(assignment)
    result.abandon.extend(cid for cid in workers if cid not in wanted)
    result.reap.extend(
        cid for cid in containers if cid not in wanted and cid not in workers
    )
    return result
