"""Phase changes of pods: checked against the transition table, each leaving an event."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from gpucloud.core.phases import PodPhase, check_transition
from gpucloud.db.models import PodEventModel, PodModel


def record_event(session: Session, pod: PodModel, now: datetime, reason: str,
                 message: str | None = None, from_phase: str | None = None,
                 to_phase: str | None = None) -> None:
    session.add(PodEventModel(pod_id=pod.id, time=now, from_phase=from_phase,
                              to_phase=to_phase, reason=reason, message=message))


def transition(session: Session, pod: PodModel, target: PodPhase, now: datetime, reason: str,
               message: str | None = None) -> None:
    """Move ``pod`` to ``target`` (InvalidTransition if the table forbids it) and log it."""
    current = PodPhase(pod.phase)
    check_transition(current, target)
    pod.phase = target.value
    pod.reason = reason
    pod.message = message
    pod.updated_at = now
    pod.version += 1
    record_event(session, pod, now, reason, message, current.value, target.value)
