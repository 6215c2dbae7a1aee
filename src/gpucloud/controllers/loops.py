"""Background controllers. Each ``tick()`` is one step, callable directly from tests with a
manual clock; ``ControllerRunner`` drives them on a thread in the server process."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import datetime, timedelta

from sqlalchemy.exc import OperationalError

from gpucloud.scheduler import Scheduler
from gpucloud.services import (
    drain,
    gangs,
    leadership,
    max_duration,
    metrics,
    nodes,
    preemption,
    scheduling,
    spend,
)
from gpucloud.services.context import ServiceContext

log = logging.getLogger(__name__)
LEADER_TTL_SECONDS = 15.0
LEADER_RENEW_BEFORE = timedelta(seconds=LEADER_TTL_SECONDS / 2)
MIN_GAP_SECONDS = 0.1


class SchedulingController:
    name = "scheduler"

    def __init__(self, ctx: ServiceContext, scheduler: Scheduler | None = None) -> None:
        self.ctx = ctx
        self.scheduler = scheduler or Scheduler(ctx.settings.scheduler_profile)

    def tick(self) -> scheduling.PassResult:
        """Place pending pods; for those that fit nowhere, preempt lower-priority work."""
        started = time.perf_counter()
        result = scheduling.run_pass(self.ctx, self.scheduler)
        metrics.observe_pass(time.perf_counter() - started,
                             {k: len(getattr(result, k)) for k in metrics.PASS_OUTCOMES})
        if result.unschedulable:
            preemption.preempt_for_pods(self.ctx, self.scheduler, result.unschedulable)
        return result


class JobController:
    """Jobs as gangs: reconcile the started ones (barrier, failures, restarts), then place
    queued ones whole (see ``services.gangs``)."""

    name = "jobs"

    def __init__(self, ctx: ServiceContext, scheduler: Scheduler | None = None) -> None:
        self.ctx = ctx
        self.scheduler = scheduler or Scheduler(ctx.settings.scheduler_profile)

    def tick(self) -> gangs.JobPassResult:
        gangs.reconcile(self.ctx)
        result = gangs.run_pass(self.ctx, self.scheduler)
        if result.unschedulable:
            preemption.preempt_for_jobs(self.ctx, self.scheduler, result.unschedulable)
        return result


class MaxDurationController:
    """Stops running pods and jobs that have exceeded their declared max duration."""

    name = "max-duration"

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def tick(self) -> list[str]:
        return max_duration.enforce(self.ctx)


class CreditController:
    """Stops, with a notice, the pods of projects whose prepaid credit ran out
    (``services.spend``); at most every ``period_seconds``, as pricing reads the meter."""

    name = "credit"

    def __init__(self, ctx: ServiceContext, period_seconds: float = 10.0) -> None:
        self.ctx = ctx
        self.period = timedelta(seconds=period_seconds)
        self._next: datetime | None = None

    def tick(self) -> list[str]:
        now = self.ctx.clock.now()
        if self._next is not None and now < self._next:
            return []
        self._next = now + self.period
        stopped = spend.enforce_credit(self.ctx)
        for name in stopped:
            log.warning("pod %s stopped: its project's prepaid credit ran out", name)
        return stopped


class DrainController:
    """Drains nodes (``services.drain``): notices, requeues, deadlines, ``Drained``."""

    name = "drain"

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def tick(self) -> list[str]:
        return drain.tick(self.ctx)


class NodeLeaseController:
    """Marks nodes whose lease lapsed Lost.

    For ``startup_grace_seconds`` after its first tick (by default one lease TTL) it marks
    nothing: after a server outage longer than the TTL every lease looks lapsed, and the
    agents need one renewal period to come back before their nodes are declared lost.
    """

    name = "node-leases"

    def __init__(self, ctx: ServiceContext, startup_grace_seconds: float | None = None) -> None:
        self.ctx = ctx
        self.startup_grace = timedelta(seconds=ctx.settings.lease_ttl_seconds
                                       if startup_grace_seconds is None
                                       else startup_grace_seconds)
        self._active_since: datetime | None = None

    def tick(self) -> list[str]:
        now = self.ctx.clock.now()
        if self._active_since is None:
            self._active_since = now
        if now < self._active_since + self.startup_grace:
            return []
        lost = nodes.expire_leases(self.ctx)
        metrics.LEASES_EXPIRED.inc(len(lost))
        for name in lost:
            log.warning("node %s lost: its lease expired", name)
        return lost


class ControllerRunner:
    """Runs the controllers on one thread while this replica holds their leases."""

    def __init__(self, ctx: ServiceContext, interval_seconds: float | None = None) -> None:
        self.ctx = ctx
        self.holder = uuid.uuid4().hex
        self.interval = interval_seconds or ctx.settings.scheduler_interval_seconds
        self.scheduling = SchedulingController(ctx)
        self.leases = NodeLeaseController(ctx)
        self.deadlines = MaxDurationController(ctx)
        self.jobs = JobController(ctx, self.scheduling.scheduler)
        self.drains = DrainController(ctx)
        self.credit = CreditController(ctx)
        self._leader_until: datetime | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="controllers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Run the next pass now (a pod was created or a node changed)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def run_once(self) -> None:
        if self._is_leader():
            self.leases.tick()
            self.deadlines.tick()
            self.drains.tick()
            self.credit.tick()
            self.jobs.tick()
            self.scheduling.tick()

    def _is_leader(self) -> bool:
        """Hold the controllers' lease, renewing it once half of it has run out (not on
        every pass: passes come every 0.1 s while pods arrive)."""
        now = self.ctx.clock.now()
        if self._leader_until is not None and now < self._leader_until - LEADER_RENEW_BEFORE:
            return True
        if leadership.acquire(self.ctx, "controllers", self.holder, LEADER_TTL_SECONDS):
            self._leader_until = now + timedelta(seconds=LEADER_TTL_SECONDS)
            return True
        self._leader_until = None
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except OperationalError as error:
                log.warning("controller pass failed on the database, retrying: %s", error)
            except Exception:  # noqa: BLE001 - a bug in one pass must not stop every loop
                log.exception("controller pass failed")
            # Passes run at most every MIN_GAP seconds, so a burst of creates is placed in
            # batches instead of one pass per request; idle, they run every interval.
            self._stop.wait(MIN_GAP_SECONDS)
            self._wake.wait(self.interval)
            self._wake.clear()
