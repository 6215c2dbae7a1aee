"""Event-driven replay of a job trace under a queueing policy, on a virtual clock.

Events are arrivals and completions; at each event time (all events of that instant
applied first) the policy runs one scheduling pass over the queue. Nothing is preempted:
a started job holds its GPUs for its whole duration.

Policies (``POLICIES``):

* ``fifo`` — strict arrival order; a job that does not fit blocks every later one.
* ``backfill`` — FIFO with EASY backfill (``scheduler.backfill``): the blocked head gets a
  reservation on specific nodes; later jobs start if they keep off those nodes, or if they
  end by the reserved start. Every job declares its trace duration as its max duration
  (an exact estimate: the best case for backfill).
* ``priority`` — priority order, then arrival; jobs that do not fit are skipped (no
  reservation). Priorities come from the job's size (``priority_of``).
* ``drf`` — per-project FIFO queues; the next job comes from the project with the lowest
  dominant share (its GPUs held / the cluster's GPUs — GPUs are the only resource the
  trace records); a project whose head does not fit waits for the next pass.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpucloud.scheduler.backfill import GangNeed, Holding, Resources, Work, ends_in_time, reserve
from gpucloud.scheduler.framework.cluster import Allocation
from gpucloud.scheduler.scheduler import Scheduler
from gpucloud.sim.jobs.cluster import Shape, SimCluster, member_pod, shape_of
from gpucloud.sim.jobs.metrics import JobRecord, JobsResult, summarize
from gpucloud.sim.jobs.trace import TraceJob

POLICIES = ("fifo", "backfill", "priority", "drf")
#: The default priority classes of the control plane (issue 5), by name.
PRIORITY_CLASSES = {"spot": 0, "batch": 100, "on-demand": 1000}
#: Later jobs a backfill pass looks at behind the blocked head (as Slurm's bf_max_job_test).
BACKFILL_DEPTH = 256


def priority_of(job: TraceJob, gpus_per_node: int) -> int:
    """Philly records no priorities: single-GPU jobs (mostly short debugging and
    interactive work) are ``on-demand``, jobs within one node ``batch``, multi-node
    training ``spot``."""
    if job.gpus <= 1:
        return PRIORITY_CLASSES["on-demand"]
    if job.gpus <= gpus_per_node:
        return PRIORITY_CLASSES["batch"]
    return PRIORITY_CLASSES["spot"]


@dataclass
class _Running:
    job: TraceJob
    start: float
    allocations: list[Allocation]

    @property
    def end(self) -> float:
        return self.start + self.job.duration


@dataclass
class _Misses:
    """Shapes known not to fit in this pass: a larger one of the same kind cannot either."""

    pod: int = 1 << 30
    gang: int = 1 << 30

    def hopeless(self, shape: Shape) -> bool:
        return shape.members >= self.gang if shape.is_gang else shape.gpus >= self.pod

    def record(self, shape: Shape) -> None:
        if shape.is_gang:
            self.gang = min(self.gang, shape.members)
        else:
            self.pod = min(self.pod, shape.gpus)


@dataclass
class JobsSim:
    """One replay: the cluster, the queue(s), the running jobs and the finished records."""

    cluster: SimCluster
    policy: str
    gpus_per_node: int
    now: float = 0.0
    queue: list[TraceJob] = field(default_factory=list)
    running: dict[str, _Running] = field(default_factory=dict)
    records: list[JobRecord] = field(default_factory=list)
    held: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    shapes: dict[str, Shape] = field(default_factory=dict)
    ends: list[tuple[float, str]] = field(default_factory=list)

    def shape(self, job: TraceJob) -> Shape:
        found = self.shapes.get(job.key)
        if found is None:
            found = self.shapes[job.key] = shape_of(job, self.gpus_per_node)
        return found

    def start(self, job: TraceJob, allocations: list[Allocation]) -> None:
        run = self.running[job.key] = _Running(job, self.now, allocations)
        heapq.heappush(self.ends, (run.end, job.key))
        self.held[job.project] += self.shape(job).allocated

    def try_start(self, job: TraceJob) -> bool:
        allocations = self.cluster.place(job.key, self.shape(job))
        if allocations is None:
            return False
        self.start(job, allocations)
        return True

    def finish(self, key: str) -> None:
        run = self.running.pop(key)
        self.cluster.release(run.allocations)
        self.held[run.job.project] -= self.shape(run.job).allocated
        self.records.append(JobRecord(key, run.job.arrival, run.start, run.end,
                                      self.shape(run.job).allocated, run.job.duration))


# --- passes -------------------------------------------------------------------------


def fifo_pass(sim: JobsSim) -> None:
    started = 0
    while started < len(sim.queue) and sim.try_start(sim.queue[started]):
        started += 1
    del sim.queue[:started]


def greedy_pass(sim: JobsSim) -> None:
    """Queue order, skipping what does not fit (the queue is kept in priority order)."""
    misses = _Misses()
    kept: list[TraceJob] = []
    for position, job in enumerate(sim.queue):
        if misses.pod <= 1:  # not even one GPU is free: nothing else can start
            kept.extend(sim.queue[position:])
            break
        shape = sim.shape(job)
        if misses.hopeless(shape) or not sim.try_start(job):
            misses.record(shape)
            kept.append(job)
    sim.queue = kept


def backfill_pass(sim: JobsSim) -> None:
    fifo_pass(sim)
    if len(sim.queue) < 2 or not sim.cluster.could_fit(Shape(1, 1)):
        return
    head = sim.shape(sim.queue[0])
    reservation = reserve(sim.now, _capacity(sim), _holdings(sim),
                          GangNeed(head.members, head.gpus))
    reserved = [sim.cluster.index[n] for n in reservation.nodes] if reservation else []
    misses = {True: _Misses(), False: _Misses()}
    kept = sim.queue[:1]
    window = sim.queue[1:1 + BACKFILL_DEPTH]
    for position, job in enumerate(window):
        if misses[True].pod <= 1:  # not one GPU free anywhere
            kept.extend(window[position:])
            break
        shape = sim.shape(job)
        in_time = reservation is None or ends_in_time(
            Work(job.key, shape.gpus, shape.members, job.duration), sim.now, reservation)
        if misses[in_time].hopeless(shape) or \
                not _start_around(sim, job, reserved if not in_time else []):
            misses[in_time].record(shape)
            kept.append(job)
    sim.queue = kept + sim.queue[1 + BACKFILL_DEPTH:]


def _start_around(sim: JobsSim, job: TraceJob, reserved: list[int]) -> bool:
    """Start ``job`` keeping it off ``reserved`` nodes (cordoned in the working state for
    the duration of the attempt)."""
    cordoned = sim.cluster.state.cordoned
    cordoned[reserved] = True
    try:
        return sim.try_start(job)
    finally:
        cordoned[reserved] = False


def _capacity(sim: JobsSim) -> dict[str, Resources]:
    """GPUs only: the trace records no CPU or memory, and the simulated cluster gives each
    GPU a fixed share of both (``member_pod``), so they never block before GPUs do."""
    return dict.fromkeys(sim.cluster.state.names, Resources(sim.gpus_per_node))


def _holdings(sim: JobsSim) -> list[Holding]:
    names = sim.cluster.state.names
    counts = [Resources(g) for g in range(sim.gpus_per_node + 1)]  # shared: they are frozen
    out = []
    for run in sim.running.values():
        held: dict[str, Resources] = {}
        for alloc in run.allocations:
            node = names[alloc.node]
            before = held[node].gpus if node in held else 0
            held[node] = counts[before + len(alloc.gpu_milli)]
        out.append(Holding(run.job.key, held, run.end))
    return out


def drf_pass(sim: JobsSim) -> None:
    """Lowest dominant share first; each project's own queue is FIFO."""
    queues: dict[str, deque[TraceJob]] = defaultdict(deque)
    for job in sim.queue:
        queues[job.project].append(job)
    total = sim.cluster.total_gpus
    waiting = [(sim.held[p] / total, p) for p in queues]
    heapq.heapify(waiting)
    while waiting:
        _, project = heapq.heappop(waiting)
        if sim.try_start(queues[project][0]):
            queues[project].popleft()
            if queues[project]:
                heapq.heappush(waiting, (sim.held[project] / total, project))
    sim.queue = sorted((j for q in queues.values() for j in q),
                       key=lambda j: (j.arrival, j.key))


PASSES: dict[str, Callable[[JobsSim], None]] = {
    "fifo": fifo_pass, "backfill": backfill_pass, "priority": greedy_pass, "drf": drf_pass,
}


# --- the event loop -----------------------------------------------------------------


def fits_cluster(job: TraceJob, nodes: int, gpus_per_node: int) -> bool:
    shape = shape_of(job, gpus_per_node)
    return shape.members <= nodes and shape.gpus <= gpus_per_node


def run_jobs(jobs: Iterable[TraceJob], policy: str, nodes: int, gpus_per_node: int,
             profile: str = "default", seed: int = 0) -> JobsResult:
    """Replay ``jobs`` and summarise; jobs that could never fit the cluster are dropped."""
    every = list(jobs)
    records = replay(every, policy, nodes, gpus_per_node, profile, seed)
    dropped = len(every) - len(records)
    return summarize(policy, records, nodes * gpus_per_node, dropped)


def replay(jobs: list[TraceJob], policy: str, nodes: int, gpus_per_node: int,
           profile: str = "default", seed: int = 0) -> list[JobRecord]:
    """One record per job that fits the cluster, in order of completion."""
    if policy not in PASSES:
        raise ValueError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)})")
    usable = [j for j in jobs if fits_cluster(j, nodes, gpus_per_node)]
    workload = [member_pod(j.key, shape_of(j, gpus_per_node).gpus) for j in usable]
    cluster = SimCluster(nodes, gpus_per_node, Scheduler(profile, seed=seed), workload)
    sim = JobsSim(cluster, policy, gpus_per_node)
    _loop(sim, usable, PASSES[policy])
    return sim.records


def _loop(sim: JobsSim, jobs: list[TraceJob], run_pass: Callable[[JobsSim], None]) -> None:
    """Advance the virtual clock event by event (arrivals, completions), running the
    policy's pass after each. Under strict FIFO an event that only adds arrivals behind a
    blocked head cannot start anything (nothing freed, the head still first), so the pass
    is skipped: with a long queue this is most events."""
    ends = sim.ends
    order = _queue_key(sim)
    arrivals = deque(sorted(jobs, key=lambda j: (j.arrival, j.key)))
    while arrivals or ends:
        sim.now = min(arrivals[0].arrival if arrivals else math.inf,
                      ends[0][0] if ends else math.inf)
        freed = bool(ends) and ends[0][0] <= sim.now
        while ends and ends[0][0] <= sim.now:
            sim.finish(heapq.heappop(ends)[1])
        arrived = []
        while arrivals and arrivals[0].arrival <= sim.now:
            arrived.append(arrivals.popleft())
        head_blocked = sim.policy == "fifo" and bool(sim.queue) and not freed
        _enqueue(sim, arrived, order)
        if not head_blocked:
            run_pass(sim)


def _queue_key(sim: JobsSim) -> Callable[[TraceJob], tuple[float, float, str]] | None:
    if sim.policy != "priority":
        return None
    gpn = sim.gpus_per_node
    return lambda job: (-priority_of(job, gpn), job.arrival, job.key)


def _enqueue(sim: JobsSim, arrived: list[TraceJob],
             order: Callable[[TraceJob], tuple[float, float, str]] | None) -> None:
    if order is None:
        sim.queue.extend(arrived)
        return
    for job in arrived:
        bisect.insort(sim.queue, job, key=order)
