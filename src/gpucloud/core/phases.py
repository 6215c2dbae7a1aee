"""Pod and node phases, and the one transition table every phase change is checked against."""

from __future__ import annotations

from enum import StrEnum

from gpucloud.core.errors import InvalidTransition


class PodPhase(StrEnum):
    PENDING = "Pending"
    SCHEDULED = "Scheduled"
    PULLING = "Pulling"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STOPPED = "Stopped"
    LOST = "Lost"


class NodeStatus(StrEnum):
    READY = "Ready"
    LOST = "Lost"
    #: ``node drain``: shown from the drain's state; the lease status stays Ready/Lost.
    DRAINING = "Draining"
    DRAINED = "Drained"


class RestartPolicy(StrEnum):
    NEVER = "never"
    ON_FAILURE = "on-failure"
    ALWAYS = "always"


P = PodPhase

POD_TRANSITIONS: dict[PodPhase, frozenset[PodPhase]] = {
    P.PENDING: frozenset({P.SCHEDULED, P.STOPPED}),
    # Pending again: the node refused the bind (e.g. it was cordoned mid-flight).
    P.SCHEDULED: frozenset({P.PULLING, P.RUNNING, P.FAILED, P.STOPPED, P.LOST, P.SUCCEEDED}),
    P.PULLING: frozenset({P.RUNNING, P.FAILED, P.STOPPED, P.LOST}),
    P.RUNNING: frozenset({P.SUCCEEDED, P.FAILED, P.STOPPED, P.LOST}),
    # Terminal phases go back to Pending on a restart (policy or `pod start`).
    P.SUCCEEDED: frozenset({P.PENDING}),
    P.FAILED: frozenset({P.PENDING}),
    P.STOPPED: frozenset({P.PENDING}),
    P.LOST: frozenset({P.PENDING, P.STOPPED}),
}

#: Phases in which a pod holds resources on its node.
ACTIVE_PHASES: frozenset[PodPhase] = frozenset({P.SCHEDULED, P.PULLING, P.RUNNING})
#: The same, as the strings stored in the database (for ``phase IN (...)`` queries).
ACTIVE_PHASE_VALUES: tuple[str, ...] = tuple(sorted(p.value for p in ACTIVE_PHASES))
#: Phases after which nothing runs until a restart.
TERMINAL_PHASES: frozenset[PodPhase] = frozenset({P.SUCCEEDED, P.FAILED, P.STOPPED, P.LOST})

#: ``desired_state`` of a pod restarting in place (RunPod's ``podRestart``): its agent is
#: told ``stopped``, and the server starts the pod again once it has ended
#: (services/pods.restart_pod, complete_restart).
RESTARTING = "restarting"


def can_transition(current: PodPhase, target: PodPhase) -> bool:
    return target in POD_TRANSITIONS[current]


def check_transition(current: PodPhase, target: PodPhase) -> None:
    """Raise InvalidTransition unless the table allows ``current -> target``."""
    if not can_transition(current, target):
        raise InvalidTransition(f"a pod cannot go from {current} to {target}")


def should_restart(policy: RestartPolicy, phase: PodPhase) -> bool:
    """Whether a pod that ended in ``phase`` is started again under ``policy``."""
    if policy is RestartPolicy.ALWAYS:
        return phase in {P.SUCCEEDED, P.FAILED, P.LOST}
    if policy is RestartPolicy.ON_FAILURE:
        return phase in {P.FAILED, P.LOST}
    return False
