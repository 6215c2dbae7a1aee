"""Typed outcome of a plugin or of a scheduling attempt (after the Kubernetes framework).

Expected outcomes are values, not exceptions: the code says what happens next.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Code(enum.Enum):
    """What the caller should do with the pod next."""

    SUCCESS = "Success"
    # No node fits now; capacity may free up later: keep the pod pending and retry.
    UNSCHEDULABLE = "Unschedulable"
    # No node can ever fit as the cluster is built (e.g. a GPU model nobody has).
    UNSCHEDULABLE_AND_UNRESOLVABLE = "UnschedulableAndUnresolvable"
    # The pod request itself is invalid (e.g. unknown MIG profile).
    ERROR = "Error"


@dataclass(frozen=True)
class Status:
    """A ``Code`` plus human-readable reasons."""

    code: Code
    reasons: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.code is Code.SUCCESS

    def message(self) -> str:
        return "; ".join(self.reasons) if self.reasons else self.code.value
