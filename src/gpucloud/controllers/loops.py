"""Background controllers. Each ``tick()`` is one step, callable directly from tests with a
manual clock; ``ControllerRunner`` drives them on a thread in the server process."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timedelta

from sqlalchemy.exc import OperationalError

from gpucloud.core.clock import real_time
from gpucloud.core.trace import mark
from gpucloud.scheduler import Scheduler
from gpucloud.services import (
    assignment_answers,
    autoscale,
    drain,
    gangs,
    leadership,
    lease_ttl,
    max_duration,
    metrics,
    nodes,
    preemption,
    scheduling,
    serverless_queue,
    spend,
    usage_retention,
    wakeups,
)
from gpucloud.services.context import ServiceContext

log = logging.getLogger(__name__)
LEADER_TTL_SECONDS = 15.0
MIN_GAP_SECONDS = 0.1
#: The disruption brake (NodeLeaseController): Kubernetes' unhealthyZoneThreshold.
DISRUPTION_FRACTION = 0.55
#: Below this many Ready nodes the brake is off: many of a few nodes failing together is
#: as likely real, and rescheduling them is cheap.
DISRUPTION_MIN_NODES = 10
#: While braked, at most one node is marked Lost per this long.
SLOW_EVICTION_SECONDS = 30.0
#: How often the leader looks for lapsed node leases (on its own thread).
LEASE_TICK_SECONDS = 0.5
#: After a leader change the fresh TTL lasts while the fleet is still coming back (a
#: lapsed node renewed within ``CATCH_UP_QUIET_TTLS`` TTLs), at most this many TTLs.
CATCH_UP_MAX_TTLS = 6.0
CATCH_UP_QUIET_TTLS = 0.5


#: A standby (a replica that does not lead) brings the scheduler's snapshot cache and
#: arrays up to date this often, so that a takeover's first pass reloads only the nodes
#: changed since, not all of them (7-14 s to a new leader's first bind at 10,000 nodes on
#: a 2-core machine, docs/replicas.md); a read of the node keys every 10 s is its cost.
STANDBY_WARM_SECONDS = 10.0


#: A pass that bound pods to at most this many nodes builds the answers of their polls
#: waiting in this process before waking them (``SchedulingController.announce``).
PRIME_MAX_NODES = 8


class SchedulingController:
    name = "scheduler"

    def __init__(self, ctx: ServiceContext, scheduler: Scheduler | None = None) -> None:
        self.ctx = ctx
        self.scheduler = scheduler or Scheduler(ctx.settings.scheduler_profile)
        #: Passes rebuild only the nodes that changed since the last one.
        self.snapshots = scheduling.SnapshotCache()

    def announce(self, node_ids: list[str]) -> None:
        """Wake the polls of the nodes a bind claimed; for a few nodes, their answers are
        built first, here (``assignment_answers.AnswerCache.prime``): in line, before the
        periodic controllers run beside the poll's own build, and the woken poll serves
        them with no query. A large pass only wakes (its agents' polls build their own
        answers on the request threads, in parallel with the pass)."""
        try:
            if len(node_ids) <= PRIME_MAX_NODES:
                for node_id in node_ids:
                    if wakeups.ASSIGNMENTS.listeners(node_id):
                        assignment_answers.ANSWERS.prime(self.ctx, node_id)
        finally:
            scheduling.notify_nodes(node_ids)

    def warm(self) -> None:
        """As a standby: read the cluster into the snapshot cache and build the scheduler's
        arrays from it, as a pass would, binding nothing (kube-scheduler's standbys keep
        their informers synced likewise). A pass after it reloads only what changed."""
        snap = scheduling.snapshot(self.ctx, self.snapshots)
        self.scheduler.cluster_state(snap.nodes)

    def tick(self) -> scheduling.PassResult:
        """Place pending pods; for those that fit nowhere, preempt lower-priority work."""
        started = time.perf_counter()
        mark("scheduler.pass.start")
        try:
            result = scheduling.run_pass(self.ctx, self.scheduler, cache=self.snapshots,
                                         announce=self.announce)
        except Exception:
            # Whatever broke the pass, the next one starts from a full snapshot: a cache
            # left inconsistent by it must not fail every later pass the same way.
            self.snapshots = scheduling.SnapshotCache()
            raise
        mark("scheduler.pass.end", considered=result.considered, bound=len(result.scheduled))
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
        if not gangs.has_work(self.ctx):  # one read instead of the two looks below
            return gangs.JobPassResult()
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


class UsageRetentionController:
    """Deletes raw usage samples past their retention (``services.usage_retention``), in
    batches, at most every ``period_seconds``; runs only on the leader, fenced like every
    controller write. The meter's rows are kept."""

    name = "usage-retention"

    def __init__(self, ctx: ServiceContext, period_seconds: float = 60.0) -> None:
        self.ctx = ctx
        self.period = timedelta(seconds=period_seconds)
        self._next: datetime | None = None

    def tick(self) -> int:
        now = self.ctx.clock.now()
        if self._next is not None and now < self._next:
            return 0
        self._next = now + self.period
        return usage_retention.prune(self.ctx)


class DrainController:
    """Drains nodes (``services.drain``): notices, requeues, deadlines, ``Drained``."""

    name = "drain"

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def tick(self) -> list[str]:
        return drain.tick(self.ctx)


class NodeLeaseController:
    """Marks nodes whose lease lapsed Lost, with the two brakes the anchors learned to need.

    - A fresh TTL first (Nomad): for ``startup_grace_seconds`` (by default one node lease
      TTL) after its first tick, and again after each leader change (``on_new_epoch``), it
      marks nothing. At a leader change every Ready lease is also extended to one TTL
      from then (``nodes.refresh_leases``): an agent that could not reach a server during
      the failover renews on the hot path and keeps its grant. Then, while the
      fleet is still coming back (a node that looked lapsed renewed within the last
      ``CATCH_UP_QUIET_TTLS`` TTLs), it keeps waiting, up to ``CATCH_UP_MAX_TTLS`` TTLs
      from the change: the one replica left after a failover, at once the new leader and
      the server of every agent, can be too busy to answer some agents for longer than a
      TTL (bench/fleet.py found 49–77 healthy nodes Lost that way). A node that is really
      gone stops looking lapsed only by being marked: once nothing has come back for that
      long, the rest are marked. Real losses outside a failover are not delayed.
    - Slowed evictions (Kubernetes): when more than ``DISRUPTION_FRACTION`` of at least
      ``DISRUPTION_MIN_NODES`` Ready nodes look lost at once, the likelier cause is the
      server side (a stall, a network event), not that many machines: it marks at most one
      node per ``SLOW_EVICTION_SECONDS`` instead of rescheduling the fleet.
    - Clock jumps: between two ticks the service clock should move as the monotonic one
      does. When it moves more than half a TTL more (set forward, or a suspended VM) or
      less (set back), every lease live before the jump gets one TTL from the new time
      (``nodes.rebase_leases``) and the brakes' deadlines move with the clock: forwards no
      healthy node is declared Lost, backwards no lease nor brake lasts until the old
      time comes round again. ``monotonic`` defaults to ``time.monotonic`` on a clock in
      real time and to none (no detection) on a clock a test sets by hand. On PostgreSQL
      the service clock is the database's (db/clock.py): carried by the monotonic clock
      between its readings, each reading corrects it by milliseconds, far below half a
      TTL: only a step of the database server's own clock shows, or a suspension of this
      host (the monotonic clock stops with it), each at the next reading.
    """

    name = "node-leases"

    def __init__(self, ctx: ServiceContext, startup_grace_seconds: float | None = None,
                 monotonic: Callable[[], float] | None = None) -> None:
        self.ctx = ctx
        self._monotonic = monotonic or (time.monotonic if real_time(ctx.clock)
                                        else None)
        self._last_look: tuple[datetime, float] | None = None
        self._lock = threading.Lock()  # on_new_epoch comes from the leadership thread
        self.startup_grace = timedelta(seconds=ctx.settings.lease_ttl_seconds
                                       if startup_grace_seconds is None
                                       else startup_grace_seconds)
        self.slow_eviction = timedelta(seconds=SLOW_EVICTION_SECONDS)
        self._active_since: datetime | None = None
        self._next_slow_eviction: datetime | None = None
        #: a new epoch's fresh TTL is yet to be written
        self._refresh = False
        #: while catching up after a new epoch's grace: the lapsed count at the last look
        #: and when a lapsed node last came back (None: not started); done until the next
        self._catch_up: tuple[int, datetime] | None = None
        self._caught_up = True

    def on_new_epoch(self) -> None:
        """This replica just became the leader: every lease gets a fresh TTL from now."""
        with self._lock:
            self._active_since = self.ctx.clock.now()
            self._last_look = None
            self._refresh = True
            self.startup_grace = max(self.startup_grace,  # the fleet's (lease_ttl.py)
                                     timedelta(seconds=lease_ttl.current(self.ctx)))

    def tick(self) -> list[str]:
        with self._lock:
            return self._tick()

    def _tick(self) -> list[str]:
        now = self.ctx.clock.now()
        self._watch_clock(now)
        if self._active_since is None:
            self._active_since = now
        if self._refresh:
            moved = nodes.refresh_leases(self.ctx, now)
            # The grace counts from the fresh TTL itself, not from the epoch's callback
            # (up to a tick earlier): ended before the fresh leases can lapse, the catch-up
            # would find none lapsed, call the fleet caught up, and mark the stragglers.
            self._active_since = max(self._active_since, now)
            self._refresh = False
            self._catch_up, self._caught_up = None, False
            log.info("a fresh TTL for %d node leases (leader change)", moved)
        if now < self._active_since + self.startup_grace:
            return []
        if self._catching_up(now):
            return []
        lost = nodes.expire_leases(self.ctx, self._eviction_limit(now))
        metrics.LEASES_EXPIRED.inc(len(lost))
        for name in lost:
            log.warning("node %s lost: its lease expired", name)
        return lost

    def _catching_up(self, now: datetime) -> bool:
        """After the grace: whether lapsed nodes are still coming back (see the class)."""
        assert self._active_since is not None
        ttl = lease_ttl.current(self.ctx)
        if self._caught_up or now >= self._active_since + timedelta(
                seconds=ttl * CATCH_UP_MAX_TTLS):
            self._caught_up = True
            return False
        lapsed, _ = nodes.lease_health(self.ctx)
        if self._catch_up is None:  # the grace just ended: the count to fall from
            self._catch_up = (lapsed, now)
            return lapsed > 0
        before, back_at = self._catch_up
        if lapsed < before:
            back_at = now
        self._catch_up = (lapsed, back_at)
        if lapsed and now < back_at + timedelta(seconds=ttl * CATCH_UP_QUIET_TTLS):
            return True
        self._caught_up = True
        return False

    def _watch_clock(self, now: datetime) -> None:
        """Detect a clock jump since the last tick and rebase the leases (see the class)."""
        if self._monotonic is None:
            return
        last, self._last_look = self._last_look, (now, self._monotonic())
        if last is None:
            return
        jump = (now - last[0]).total_seconds() - (self._last_look[1] - last[1])
        if abs(jump) <= lease_ttl.current(self.ctx) / 2:
            return
        shift = timedelta(seconds=jump)
        if self._active_since is not None:
            self._active_since += shift
        if self._next_slow_eviction is not None:
            self._next_slow_eviction += shift
        if self._catch_up is not None:
            self._catch_up = (self._catch_up[0], self._catch_up[1] + shift)
        moved = nodes.rebase_leases(self.ctx, alive_at=last[0])
        log.warning("the clock jumped %+.1f s since the last look: %d node leases now "
                    "expire one TTL from now", jump, moved)

    def _eviction_limit(self, now: datetime) -> int | None:
        """None (no limit) in normal times; 0 or 1 while the disruption brake holds."""
        lapsed, ready = nodes.lease_health(self.ctx)
        engaged = self._next_slow_eviction is not None  # stays on as Ready nodes drop
        if lapsed <= DISRUPTION_FRACTION * ready or (
                not engaged and ready < DISRUPTION_MIN_NODES):
            self._next_slow_eviction = None
            return None
        if self._next_slow_eviction is None:
            log.warning("%d of %d nodes look lost at once: evictions slowed to one per %s",
                        lapsed, ready, self.slow_eviction)
            self._next_slow_eviction = now + self.slow_eviction
            return 0
        if now < self._next_slow_eviction:
            return 0
        self._next_slow_eviction = now + self.slow_eviction
        return 1


class AutoscaleController:
    """Serverless endpoints: the queue's pass (``serverless_queue.expire``: lapsed leases,
    timeouts, retention), then the workers' sizes (``services.autoscale``). Webhooks are
    POSTed on a thread of their own, one delivery pass at a time, so that a slow receiver
    never holds up scheduling."""

    name = "autoscale"

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self._webhooks = ThreadPoolExecutor(1, thread_name_prefix="webhooks")
        self._delivering: Future[int] | None = None

    def tick(self) -> list[str]:
        if not serverless_queue.has_work(self.ctx):  # no endpoint, no request: one read
            return []
        serverless_queue.expire(self.ctx)
        done = autoscale.autoscale(self.ctx)
        if self._delivering is None or self._delivering.done():
            self._delivering = self._webhooks.submit(serverless_queue.deliver_webhooks,
                                                     self.ctx)
            self._delivering.add_done_callback(_log_failure)
        return done

    def stop(self) -> None:
        self._webhooks.shutdown(wait=False, cancel_futures=True)


def _log_failure(future: Future[int]) -> None:
    """A pass run on a thread of its own: its failure is logged as the runner's are."""
    if not future.cancelled() and (error := future.exception()) is not None:
        log.warning("webhook delivery pass failed: %s", error)


class ControllerRunner:
    """Runs the controllers on one thread while this replica leads (services/leadership).

    The controllers get a context whose every write transaction is fenced by the lease's
    epoch, so a deposed leader's late writes roll back instead of landing.
    """

    def __init__(self, ctx: ServiceContext, interval_seconds: float | None = None,
                 leader_ttl_seconds: float | None = None) -> None:
        self.interval = interval_seconds or ctx.settings.scheduler_interval_seconds
        ttl = leader_ttl_seconds or ctx.settings.leader_ttl_seconds or LEADER_TTL_SECONDS
        self.leader = leadership.Leader(ctx, "controllers", ttl, on_epoch=self._new_epoch,
                                        on_change=self.wake)
        self.holder = self.leader.holder
        self.ctx = fenced = replace(ctx, db=ctx.db.guarded(self.leader.fence))
        self.scheduling = SchedulingController(fenced)
        self.leases = NodeLeaseController(fenced)
        self.deadlines = MaxDurationController(fenced)
        self.jobs = JobController(fenced, self.scheduling.scheduler)
        self.drains = DrainController(fenced)
        self.credit = CreditController(fenced)
        self.retention = UsageRetentionController(fenced)
        self.autoscale = AutoscaleController(fenced)
        self._stop = threading.Event()
        self._wake = threading.Event()
        #: When this replica, as a standby, last warmed the scheduler (``_keep_warm``).
        self._warmed_at: datetime | None = None
        self._thread = threading.Thread(target=self._run, name="controllers", daemon=True)
        #: Node leases on a thread of their own: a long scheduling pass (a backlog, a slow
        #: database) must neither delay a real loss past TTL + a tick nor stall the brakes.
        self._lease_thread = threading.Thread(target=self._run_leases, name="node-leases",
                                              daemon=True)

    def start(self) -> None:
        self.leader.start()
        self._thread.start()
        self._lease_thread.start()

    def wake(self) -> None:
        """Run the next pass now (a pod was created or a node changed)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self._lease_thread.join(timeout=10)
        self.autoscale.stop()
        self.leader.stop()

    def run_once(self, *, woken: bool = False) -> bool:
        """One pass of every controller; True when the scheduler left pods it did not
        get to (its pass was full), so the next pass should not wait.

        ``woken``: a create (or a node's change) asked for this pass, so jobs and the
        scheduler go first and the periodic controllers (deadlines, drains, credit,
        retention, autoscale: tens of milliseconds together) run after them in the same
        pass instead of in front of a pod's placement. What they change (a drained or
        stopped pod pending again, a new worker pod) is placed by the next pass."""
        if not self._is_leader():
            self._keep_warm()
            return False
        if woken:
            backlog = self._place()
            self._periodic()
            return backlog
        self._periodic()
        return self._place()

    def _keep_warm(self) -> None:
        """A standby's ``SchedulingController.warm``, at most every
        ``STANDBY_WARM_SECONDS`` (by the context's clock); a failure waits for the next."""
        now = self.ctx.clock.now()
        if self._warmed_at is not None and (
                0 <= (now - self._warmed_at).total_seconds() < STANDBY_WARM_SECONDS):
            return  # (a clock that jumped back does not hold the next warm-up off)
        self._warmed_at = now
        try:
            self.scheduling.warm()
        except Exception as error:  # noqa: BLE001 - a standby's warm-up is only a head start
            log.debug("standby warm-up failed: %s", error)
            self.scheduling.snapshots = scheduling.SnapshotCache()

    def _periodic(self) -> None:
        self.deadlines.tick()
        self.drains.tick()
        self.credit.tick()
        self.retention.tick()
        self.autoscale.tick()

    def _place(self) -> bool:
        mark("controllers.place")
        self.jobs.tick()
        return self.scheduling.tick().considered >= scheduling.PASS_LIMIT

    def _is_leader(self) -> bool:
        """Whether this replica leads; the lease is renewed once half of it has run out
        (by the lease thread in a server; here when a test drives the clock)."""
        return self.leader.epoch is not None

    def _new_epoch(self, _epoch: int) -> None:
        self.leases.on_new_epoch()

    def _run_leases(self) -> None:
        """``NodeLeaseController.tick`` every ``LEASE_TICK_SECONDS`` while this replica leads."""
        while not self._stop.wait(min(self.interval, LEASE_TICK_SECONDS)):
            try:
                if self._is_leader():
                    self.leases.tick()
            except leadership.LeaderLostError as error:
                log.warning("node lease pass stopped: %s", error)
            except OperationalError as error:
                log.warning("node lease pass failed on the database, retrying: %s", error)
            except Exception:  # noqa: BLE001 - a bug in one pass must not stop the loop
                log.exception("node lease pass failed")

    def _run(self) -> None:
        woken = False
        while not self._stop.is_set():
            backlog = False
            started = time.monotonic()
            try:
                backlog = self.run_once(woken=woken)
            except leadership.LeaderLostError as error:
                log.warning("controller pass stopped: %s", error)
            except OperationalError as error:
                log.warning("controller pass failed on the database, retrying: %s", error)
            except Exception:  # noqa: BLE001 - a bug in one pass must not stop every loop
                log.exception("controller pass failed")
            # Passes asked for run at most every MIN_GAP seconds (start to start), so a
            # burst of creates is placed in batches instead of one pass per request;
            # idle, they run every interval. After a periodic pass a request's pass
            # starts at once.
            if woken or backlog:
                self._stop.wait(max(0.0, MIN_GAP_SECONDS - (time.monotonic() - started)))
            # A full pass left pending pods: go on at once.
            woken = self._wake.is_set() if backlog else self._wake.wait(self.interval)
            self._wake.clear()
            mark("controllers.woken", woken=woken)
