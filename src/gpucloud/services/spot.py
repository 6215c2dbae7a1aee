"""Spot work, the control plane's side: preemption notices, preemption records, requeues.

- **Notice** (``give_notice``): a pod the server stops for a preemption or a drain gets a
  ``StopNotice`` (reason, deadline, attempt) with its stop; the agent writes it to the
  pod's notice file, SIGTERMs the container's process group and SIGKILLs at the deadline.
  Each notice is recorded as a pod event with reason ``Preempted`` (an *announced*
  interruption); a lost node is an unannounced one, recorded as ``NodeLost``.
- **Record**: every preemption, drain or loss counts in ``preemptions``, with the last
  reason, its time and the run time lost (the interrupted attempt's run time after its
  last committed checkpoint).
- **Requeue** (``requeue_after_stop``): once the noticed pod has ended, it goes back to
  Pending (spot pods, pods with ``--restart always``, and every drained pod) and the
  scheduler keeps it off the node it was taken from for ``preempted_avoid_seconds``.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.core.phases import RestartPolicy
from gpucloud.core.spot import DEFAULT_GRACE_SECONDS, StopNotice, StopReason
from gpucloud.db.models import CheckpointModel, JobModel, PodModel
from gpucloud.services.context import ServiceContext
from gpucloud.services.events import record_event
from gpucloud.services.pods import requeue

PREEMPTED = "Preempted"
NODE_LOST = "NodeLost"
NOTICE = "PreemptionNotice"
#: How long a preempted pod stays off the node it was preempted from.
DEFAULT_AVOID_SECONDS = 300.0


def grace_of(ctx: ServiceContext, row: PodModel | JobModel) -> float:
    """The pod's ``--grace``, else the server's preemption grace, else 30 s."""
    if row.grace_seconds is not None:
        return row.grace_seconds
    configured = ctx.settings.preemption_grace_seconds
    return DEFAULT_GRACE_SECONDS if configured is None else configured


def reason_for(pod: PodModel) -> StopReason:
    """A spot pod is taken back (``spot``); any other loses to higher priority."""
    return StopReason.SPOT if pod.spot else StopReason.PRIORITY


def give_notice(ctx: ServiceContext, session: Session, pod: PodModel, reason: StopReason,
                why: str, now: datetime) -> None:
    """Attach the notice to a pod being stopped, count the preemption and record it.

    The caller sets ``desired_state`` (and bumps the node's assignments)."""
    grace = grace_of(ctx, pod)
    notice = StopNotice(reason=reason, deadline=now + timedelta(seconds=grace),
                        attempt=pod.attempt, grace_seconds=grace)
    pod.stop_notice = notice.model_dump(mode="json")
    pod.stop_grace_seconds = grace
    count(session, pod, reason, now)
    record_event(session, pod.id, now, PREEMPTED, why)
    record_event(session, pod.id, now, NOTICE, f"reason {reason.value}, attempt "
                 f"{pod.attempt}, SIGKILL after {grace:g}s (at {notice.deadline.isoformat()})")


def count(session: Session, pod: PodModel, reason: StopReason, now: datetime) -> None:
    """One preemption of ``pod`` (and of its job, once per gang): count and time lost."""
    pod.preemptions += 1
    pod.last_preemption_reason = reason.value
    pod.last_preempted_at = now
    lost = lost_seconds(session, pod, now)
    pod.time_lost_seconds += lost
    if pod.job_id is None:
        return
    job = session.get(JobModel, pod.job_id)
    if job is not None and job.last_preempted_at != now:
        job.preemptions += 1
        job.last_preemption_reason, job.last_preempted_at = reason.value, now
        job.time_lost_seconds += lost
    elif job is not None:
        job.time_lost_seconds = max(job.time_lost_seconds, pod.time_lost_seconds)


def lost_seconds(session: Session, pod: PodModel, now: datetime) -> float:
    """Run time of the current attempt after its last committed checkpoint (all of it
    when there is none): what a restart has to do again."""
    if pod.started_at is None:
        return 0.0
    checkpoint = session.scalar(
        select(CheckpointModel.created_at).where(
            CheckpointModel.pod_id == pod.id, CheckpointModel.attempt == pod.attempt,
            CheckpointModel.state == "committed")
        .order_by(CheckpointModel.created_at.desc()).limit(1))
    since = max(pod.started_at, checkpoint) if checkpoint is not None else pod.started_at
    return max(0.0, (now - since).total_seconds())


def notice_of(pod: PodModel) -> StopNotice | None:
    """The notice of the stop under way, if it is for the pod's current attempt."""
    if pod.stop_notice is None or pod.desired_state != "stopped":
        return None
    notice = StopNotice.model_validate(pod.stop_notice)
    return notice if notice.attempt == pod.attempt else None


def restarts_after_preemption(pod: PodModel, reason: StopReason) -> bool:
    """Spot pods and ``--restart always`` pods come back; a drained pod always does; a pod
    stopped because its project's credit ran out never does."""
    if reason is StopReason.CREDIT:
        return False
    return reason is StopReason.DRAIN or pod.spot or (
        RestartPolicy(pod.restart_policy) is RestartPolicy.ALWAYS)


def requeue_after_stop(ctx: ServiceContext, session: Session, pod: PodModel,
                       now: datetime) -> bool:
    """A standalone pod that ended after a notice: back to Pending, off its node for a
    while. False (nothing done) for any other end."""
    notice = notice_of(pod)
    if notice is None or pod.job_id is not None or pod.deleted_at is not None:
        return False
    pod.stop_notice = None
    if not restarts_after_preemption(pod, notice.reason):
        return False
    node_id = pod.node_id
    requeue(session, pod, now, "Requeued",
            f"preempted ({notice.reason.value}); placed again, not on the same node")
    avoid(ctx, pod, node_id, now)
    return True


def avoid(ctx: ServiceContext, pod: PodModel, node_id: str | None, now: datetime) -> None:
    """Keep the scheduler off ``node_id`` for this pod for a while."""
    pod.avoid_node_id = node_id
    pod.avoid_until = now + timedelta(seconds=ctx.settings.preempted_avoid_seconds)


def restarts_after_loss(pod: PodModel) -> bool:
    """A pod lost with its node restarts elsewhere when it is spot work."""
    return pod.spot
