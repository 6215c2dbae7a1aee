"""Node load for the scheduler's snapshot: ``usage.node_load`` turned into the
``scheduler.types.NodeLoad`` that the LoadAware plugins read (docs/scheduler.md).

Per node with recent samples:

* smoothed use = the EWMA of its live pods' samples (``usage.node_load``; pods that ended
  are left out there at once);
* peak use = the sum of its live pods' highest CPU rate and memory in the same window
  (an upper bound of the node's max, which is what the filter wants);
* pods bound to the node that have not reported yet, or started within one report
  interval before the newest sample, count at their estimate minus what they are already
  seen to use (``loadaware.estimate_load``);
* ``requested_*``: the requests of the pods counted, so the scheduler estimates whatever
  it places, or reserves, on top.

A node without samples in the window gets no load: the plugins fail open for it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from gpucloud.core.phases import ACTIVE_PHASE_VALUES
from gpucloud.core.usage import NodeLoad as ObservedLoad
from gpucloud.db.models import NodeModel, PodModel, UsageSampleModel
from gpucloud.scheduler.plugins.loadaware import NodeSample, PodUse, estimate_load
from gpucloud.scheduler.types import NodeLoad
from gpucloud.services import usage

#: The agent reports about this often: a pod started less than this before the newest
#: sample may not show its full use in it yet.
REPORT_INTERVAL_SECONDS = 30.0


@dataclass(frozen=True)
class _Pod:
    id: str
    node_id: str
    cpu_milli: int
    memory_bytes: int
    gpu_milli: dict[str, int]
    started_at: datetime | None


def node_loads(session: Session, now: datetime,
               nodes: Sequence[NodeModel]) -> dict[str, NodeLoad]:
    """Node id -> load, for the nodes with samples in ``usage.LOAD_WINDOW_SECONDS``."""
    observed = usage.node_load(session, now)
    if not observed:
        return {}
    pods = _active_pods(session)
    peaks = _peaks(session, now, usage.LOAD_WINDOW_SECONDS)
    out: dict[str, NodeLoad] = {}
    for node in nodes:
        load = observed.get(node.id)
        if load is not None:
            out[node.id] = _node_load(node, load, pods.get(node.id, []), peaks, now)
    return out


def _node_load(node: NodeModel, load: ObservedLoad, pods: list[_Pod],
               peaks: dict[str, tuple[float, float]], now: datetime) -> NodeLoad:
    index = {str(g["uuid"]): int(g["index"]) for g in node.gpus}
    sample_time = load.sample_time
    peak_cpu = sum(peaks.get(p, (0.0, 0.0))[0] for p in load.pods) * 1000
    peak_memory = sum(peaks.get(p, (0.0, 0.0))[1] for p in load.pods)
    sample = NodeSample(
        age_seconds=max(0.0, (now - sample_time).total_seconds()),
        cpu_milli=load.cpu_cores * 1000, memory_bytes=load.memory_bytes,
        cpu_peak_milli=max(peak_cpu, load.cpu_cores * 1000),
        memory_peak_bytes=max(peak_memory, load.memory_bytes),
        gpu_util={index[u]: v for u, v in load.gpu_util_percent.items() if u in index})
    recent_after = sample_time - timedelta(seconds=REPORT_INTERVAL_SECONDS)
    uses = [_use(pod, load, recent_after) for pod in pods]
    return estimate_load(sample, uses)


def _use(pod: _Pod, load: ObservedLoad, recent_after: datetime) -> PodUse:
    seen = load.pods.get(pod.id)
    return PodUse(
        cpu_request_milli=pod.cpu_milli, memory_request_bytes=pod.memory_bytes,
        observed_cpu_milli=None if seen is None else seen.cpu_cores * 1000,
        observed_memory_bytes=None if seen is None else seen.memory_bytes,
        gpu_milli={int(i): m for i, m in pod.gpu_milli.items()},
        recent=pod.started_at is not None and pod.started_at > recent_after)


def _active_pods(session: Session) -> dict[str, list[_Pod]]:
    rows = session.execute(
        select(PodModel.id, PodModel.node_id, PodModel.cpu_milli, PodModel.memory_bytes,
               PodModel.gpu_milli, PodModel.started_at)
        .where(PodModel.phase.in_(ACTIVE_PHASE_VALUES), PodModel.node_id.is_not(None))).all()
    out: dict[str, list[_Pod]] = defaultdict(list)
    for pod_id, node_id, cpu, memory, gpu_milli, started_at in rows:
        out[str(node_id)].append(_Pod(pod_id, str(node_id), cpu, memory, gpu_milli or {},
                                      started_at))
    return out


def _peaks(session: Session, now: datetime,
           window_seconds: float) -> dict[str, tuple[float, float]]:
    """Pod id -> (highest CPU cores between two samples, highest memory bytes) over the
    load window, for live pods on their current node and attempt."""
    s, p = UsageSampleModel, PodModel
    rows = session.execute(
        select(s.pod_id, s.time, s.cpu_seconds, s.memory_bytes)
        .join(p, and_(p.id == s.pod_id, p.node_id == s.node_id, p.attempt == s.attempt))
        .where(s.time >= now - timedelta(seconds=window_seconds),
               p.phase.in_(ACTIVE_PHASE_VALUES))
        .order_by(s.pod_id, s.time)).all()
    out: dict[str, tuple[float, float]] = {}
    previous: tuple[str, datetime, float] | None = None
    for pod_id, time, cpu_seconds, memory in rows:
        cpu, mem = out.get(pod_id, (0.0, 0.0))
        if previous is not None and previous[0] == pod_id:
            elapsed = (time - previous[1]).total_seconds()
            if elapsed > 0:
                cpu = max(cpu, (cpu_seconds - previous[2]) / elapsed)
        out[pod_id] = (cpu, max(mem, float(memory)))
        previous = (pod_id, time, cpu_seconds)
    return out
