"""Phase changes of pods: checked against the transition table, each leaving an event."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import insert
from sqlalchemy.orm import Session

from gpucloud.core.phases import PodPhase, check_transition
from gpucloud.db.models import Base, PodEventModel, PodModel
from gpucloud.services import meter


def record_event(session: Session, pod_id: str, now: datetime, reason: str,
                 message: str | None = None, from_phase: str | None = None,
                 to_phase: str | None = None) -> None:
    session.add(PodEventModel(pod_id=pod_id, time=now, from_phase=from_phase,
                              to_phase=to_phase, reason=reason, message=message))


def record_events(session: Session, events: list[dict[str, object]]) -> None:
    """Insert many events in one executemany (keys: pod_id, time, reason, message)."""
    if events:
        rows = [{"from_phase": None, "to_phase": None, **event} for event in events]
        session.connection().execute(_INSERT_EVENT, rows)


_INSERT_EVENT = insert(Base.metadata.tables[PodEventModel.__tablename__])


def transition(session: Session, pod: PodModel, target: PodPhase, now: datetime, reason: str,
               message: str | None = None) -> None:
    """Move ``pod`` to ``target`` (InvalidTransition if the table forbids it) and log it;
    entering or leaving ``Running`` opens or closes the attempt's meter row."""
    current = PodPhase(pod.phase)
    check_transition(current, target)
    meter.on_transition(session, pod, current, target, now, reason)
    pod.phase = target.value
    pod.reason = reason
    pod.message = message
    pod.updated_at = now
    pod.version += 1
    record_event(session, pod.id, now, reason, message, current.value, target.value)
