"""The control plane's Prometheus metrics (``/metrics``, see docs/usage.md "Metrics").

Two kinds:

* **events** counted where they happen (requests, scheduling passes, lease renewals and
  expiries): prometheus-client counters and histograms of this process. With several
  server workers, ``PROMETHEUS_MULTIPROC_DIR`` (set by ``gpucloud server --workers N``)
  puts them in prometheus-client's multiprocess mode, so any worker's ``/metrics``
  answers for all of them;
* **state** read from the database at scrape time (pending pods by reason, pods by phase,
  nodes by state): the database is the one source of truth, so every replica and worker
  reports the same figures, and nothing has to be kept in step by hand.

Names are ``gpucloud_*`` with Prometheus base units (seconds, bytes).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import REGISTRY, Collector
from sqlalchemy import func, select

from gpucloud.core.phases import NodeStatus, PodPhase
from gpucloud.core.settings import MULTIPROC_ENV
from gpucloud.db.models import NodeModel, PodModel
from gpucloud.services.context import ServiceContext
from gpucloud.services.nodes import display_status

CONTENT_TYPE = CONTENT_TYPE_LATEST
#: Label of requests that matched no route (so scanners cannot blow up the series count).
UNMATCHED = "<unmatched>"

REQUESTS = Counter("gpucloud_http_requests_total", "API requests by route template, method "
                   "and status code.", ("route", "method", "code"))
REQUEST_SECONDS = Histogram("gpucloud_http_request_duration_seconds", "API request latency "
                            "by route template and method.", ("route", "method"),
                            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                     0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
PASS_SECONDS = Histogram("gpucloud_scheduler_pass_duration_seconds", "Duration of one "
                         "scheduling pass over pending pods (lease, plan, apply).",
                         buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                                  5.0, 10.0))
PASS_PODS = Counter("gpucloud_scheduler_pods_total", "Pods considered by scheduling passes, "
                    "by outcome.", ("outcome",))
LEASES_RENEWED = Counter("gpucloud_node_lease_renewals_total", "Node lease renewals "
                         "accepted.")
AGENT_FAST_PATH = Counter("gpucloud_agent_requests_served_total", "The agent's renewals and "
                          "long polls by the path that answered them: ``fast`` "
                          "(api/agent_fast.py) or ``route`` (FastAPI's, for what the fast "
                          "path does not take).", ("route", "served"))
LEASES_EXPIRED = Counter("gpucloud_node_lease_expiries_total", "Node leases that lapsed "
                         "(the node was marked Lost).")

#: Outcomes of a pass, as ``scheduling.PassResult`` fields.
PASS_OUTCOMES = ("scheduled", "unschedulable", "conflicts", "over_quota", "waiting")


def observe_pass(seconds: float, outcomes: dict[str, int]) -> None:
    """Record one scheduling pass: its duration and how its pods fared."""
    PASS_SECONDS.observe(seconds)
    for outcome, count in outcomes.items():
        if count:
            PASS_PODS.labels(outcome).inc(count)


class StateCollector(Collector):
    """Gauges computed from the database at each scrape."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def collect(self) -> Iterable[Metric]:
        with self.ctx.db.read() as session:
            phases = session.execute(
                select(PodModel.phase, func.count()).where(PodModel.deleted_at.is_(None))
                .group_by(PodModel.phase)).all()
            pending = session.execute(
                select(PodModel.reason, func.count())
                .where(PodModel.deleted_at.is_(None),
                       PodModel.phase == PodPhase.PENDING.value)
                .group_by(PodModel.reason)).all()
            nodes = session.scalars(select(NodeModel)).all()
            states = [(display_status(n).value, n.cordoned) for n in nodes]
        yield _gauge("gpucloud_pods", "Pods (not deleted) by phase.", "phase",
                     _counts([(str(p), int(n)) for p, n in phases], [p.value for p in PodPhase]))
        yield _gauge("gpucloud_pending_pods", "Pending pods by reason (Queued: not looked "
                     "at yet).", "reason",
                     _counts([(str(r or "Queued"), int(n)) for r, n in pending], []))
        yield _gauge("gpucloud_nodes", "Nodes by state.", "state",
                     _counts([(s, 1) for s, _ in states], [s.value for s in NodeStatus]))
        cordoned = GaugeMetricFamily("gpucloud_nodes_cordoned", "Cordoned nodes.")
        cordoned.add_metric([], sum(1 for _, c in states if c))
        yield cordoned


def _counts(rows: Iterable[tuple[str, int]], always: Iterable[str]) -> dict[str, int]:
    """Counts per label value; ``always`` values appear (as 0) even when absent."""
    out = dict.fromkeys(always, 0)
    for label, count in rows:
        out[label] = out.get(label, 0) + count
    return out


def _gauge(name: str, doc: str, label: str, values: dict[str, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for value, count in sorted(values.items()):
        family.add_metric([value], count)
    return family


def exposition(ctx: ServiceContext) -> bytes:
    """The text exposition: this process's (or all workers') events, then the state."""
    registry = CollectorRegistry(auto_describe=False)
    if os.environ.get(MULTIPROC_ENV):
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        parts = [generate_latest(registry)]
    else:
        parts = [generate_latest(REGISTRY)]
    state = CollectorRegistry(auto_describe=False)
    state.register(StateCollector(ctx))
    parts.append(generate_latest(state))
    return b"".join(parts)


def families(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in an exposition (for tests and tools)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, dict(sample.labels), float(sample.value)
