"""Lease renewals while the scheduler binds: do renewals wait on a bind's node locks?

One process on a PostgreSQL it starts, no HTTP (so the machine's other load matters less
than in bench/fleet.py): ``--nodes`` registered nodes each renew their lease every
``--period`` seconds through the real lease path (``api/lease_capacity.renew_current``,
batched; the full path, ``nodes.renew_lease``, where it answers None, as the lease route
does), while real scheduling passes (``services.scheduling.run_pass``) drain a backlog of
``--pods`` pending pods, binding ``--bind-chunk`` pods per transaction, and a few threads
report each bound pod ``Running`` as agents do (a report locks its node's row too). Per
variant (``--variants``: ``CHUNK:BUSY_LIMIT_S`` pairs, each on a fresh backlog, in turn):
the drain's pods/s and the renewals during it: latency p50/p99/max, how many took the
full path, how many found their row held (``BUSY``), and 503s.

    .venv/bin/python bench/lease_vs_bind.py                     # 1,000 nodes, 3,000 pods
    .venv/bin/python bench/lease_vs_bind.py --variants 1000:0,1000:2,250:2,100:2

``BUSY_LIMIT_S`` 0 is the lease path before renewals were sent again: a held row at once
takes the full path, whose row lock waits for the bind's commit.

Results: printed, and bench/results/lease_vs_bind.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastapi import HTTPException  # noqa: E402
from sqlalchemy import select, update  # noqa: E402
from sqlalchemy.exc import OperationalError  # noqa: E402
from tests.fixtures.postgres import postgres_server  # noqa: E402

from gpucloud.api import lease_capacity  # noqa: E402
from gpucloud.core.clock import SystemClock  # noqa: E402
from gpucloud.core.models import (  # noqa: E402
    AgentPodStatusRequest,
    LeaseRequest,
    NodeRegisterRequest,
    PodCreateRequest,
)
from gpucloud.core.phases import PodPhase  # noqa: E402
from gpucloud.core.settings import Settings  # noqa: E402
from gpucloud.db.migrate import upgrade  # noqa: E402
from gpucloud.db.models import PodModel  # noqa: E402
from gpucloud.db.session import Database  # noqa: E402
from gpucloud.scheduler import Scheduler  # noqa: E402
from gpucloud.services import (  # noqa: E402
    agent,
    join_tokens,
    lease_batch,
    nodes,
    pods,
    projects,
    scheduling,
)
from gpucloud.services.context import ServiceContext  # noqa: E402

ADMIN_KEY = "gpc_lease-vs-bind-admin-key"
RESULTS = ROOT / "bench" / "results"
GIB = 1024**3


def register(ctx: ServiceContext, count: int) -> list[tuple[str, str]]:
    """``count`` 8-GPU nodes registered as agents do: (node id, node token) each."""
    projects.bootstrap_admin(ctx)
    admin = projects.authenticate(ctx, ADMIN_KEY)
    token = join_tokens.create(ctx, admin).token
    out = []
    for i in range(count):
        gpus = [{"uuid": f"GPU-{i}-{g}", "model": "H100 80GB", "memory_mib": 81559,
                 "index": g, "numa_node": g // 4} for g in range(8)]
        reg = nodes.register_node(ctx, NodeRegisterRequest(
            join_token=token, name=f"node-{i:05d}", cpu_cores=128,
            memory_bytes=1024 * GIB, gpus=gpus))
        out.append((reg.node_id, reg.node_token))
    return out


def backlog(ctx: ServiceContext, count: int, tag: str) -> None:
    admin = projects.authenticate(ctx, ADMIN_KEY)
    for i in range(count):
        pods.create_pod(ctx, admin, PodCreateRequest(
            name=f"pod-{tag}-{i}", image="ghcr.io/acme/trainer:1", gpus=1, cpu=1,
            memory="4Gi"))


def clear(ctx: ServiceContext) -> None:
    """Every pod of the last variant ends: the nodes are empty again."""
    with ctx.db.transaction() as session:
        session.execute(update(PodModel).where(PodModel.deleted_at.is_(None)).values(
            phase=PodPhase.SUCCEEDED.value, deleted_at=ctx.clock.now()))


class Renewals:
    """Every node renews every ``period`` s (jittered) through the lease route's path."""

    def __init__(self, ctx: ServiceContext, fleet: list[tuple[str, str]], period: float):
        self.ctx, self.fleet, self.period = ctx, fleet, period
        self.latencies: list[tuple[float, float]] = []  # (sent, seconds)
        self.full_path: list[float] = []
        self.refused: list[float] = []
        self.timed_out: list[float] = []
        self.stop = asyncio.Event()

    async def one(self, node_id: str, token: str) -> None:
        await asyncio.sleep(random.uniform(0, self.period))
        while not self.stop.is_set():
            sent = time.perf_counter()
            received = self.ctx.clock.now()
            request = LeaseRequest(fencing_token=1)
            try:
                response = await lease_capacity.renew_current(self.ctx, token, request,
                                                              received)
                if response is None:  # the route's full path
                    self.full_path.append(sent)
                    await lease_capacity.run(partial(_renew_full, node_id, request,
                                                     received), self.ctx)
                self.latencies.append((sent, time.perf_counter() - sent))
            except HTTPException:  # waited past half the TTL (check_fresh)
                self.refused.append(sent)
            except OperationalError:  # the full path's row lock past the statement timeout
                self.timed_out.append(sent)
            await asyncio.sleep(max(0.0, sent + self.period * random.uniform(0.9, 1.1)
                                    - time.perf_counter()))

    async def run(self) -> None:
        await asyncio.gather(*(self.one(n, t) for n, t in self.fleet))


def _renew_full(node_id: str, request: LeaseRequest, received: Any,
                ctx: ServiceContext) -> Any:
    lease_capacity.check_fresh(ctx, received)
    return nodes.renew_lease(ctx, node_id, request.fencing_token, request, received)


def reporter(ctx: ServiceContext, stop: threading.Event) -> int:
    """Report the bound pods ``Running`` (4 threads, as agents' reports arrive)."""
    reported = 0
    with ThreadPoolExecutor(4) as pool:
        while not stop.is_set():
            with ctx.db.read() as session:
                rows = session.execute(select(PodModel.id, PodModel.node_id, PodModel.attempt)
                                       .where(PodModel.phase == PodPhase.SCHEDULED.value,
                                              PodModel.deleted_at.is_(None))
                                       .limit(200)).all()
            if not rows:
                time.sleep(0.05)
                continue
            list(pool.map(lambda r: agent.report_status(ctx, r[1], r[0], AgentPodStatusRequest(
                fencing_token=1, phase=PodPhase.RUNNING, attempt=r[2])), rows))
            reported += len(rows)
    return reported


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


async def variant(ctx: ServiceContext, fleet: list[tuple[str, str]], chunk: int,
                  busy_limit: float, pod_count: int, period: float, tag: str) -> dict[str, Any]:
    scheduling._BIND_CHUNK = chunk
    lease_capacity.BUSY_LIMIT_S = busy_limit
    await asyncio.to_thread(backlog, ctx, pod_count, tag)
    busy = {"count": 0}
    renew_many = lease_batch.renew_many

    def counted(ctx: ServiceContext, renewals: list[lease_batch.Renewal]) -> Any:
        out = renew_many(ctx, renewals)
        busy["count"] += sum(isinstance(r, lease_batch.Busy) for r in out)
        return out

    lease_batch.renew_many = counted
    renewals = Renewals(ctx, fleet, period)
    task = asyncio.create_task(renewals.run())
    await asyncio.sleep(period * 2)  # every node renewing before the drain
    stop = threading.Event()
    reports = asyncio.create_task(asyncio.to_thread(reporter, ctx, stop))
    scheduler = Scheduler(ctx.settings.scheduler_profile)
    cache = scheduling.SnapshotCache()
    started = time.perf_counter()
    bound = 0
    while bound < pod_count:
        result = await asyncio.to_thread(scheduling.run_pass, ctx, scheduler, cache=cache)
        bound += len(result.scheduled)
        if not result.considered:
            break
    drained = time.perf_counter()
    await asyncio.sleep(period)
    stop.set()
    reported = await reports
    renewals.stop.set()
    await task
    lease_batch.renew_many = renew_many
    during = [s for t, s in renewals.latencies if started <= t <= drained]
    return {
        "bind_chunk": chunk, "busy_limit_s": busy_limit, "pods": pod_count, "bound": bound,
        "drain_s": round(drained - started, 2),
        "pods_per_s": round(bound / (drained - started), 1),
        "reported_running": reported,
        "renewals_during_drain": len(during),
        "renewal_p50_ms": round(percentile(during, 0.5) * 1000, 1),
        "renewal_p99_ms": round(percentile(during, 0.99) * 1000, 1),
        "renewal_max_ms": round(max(during, default=0.0) * 1000, 1),
        "full_path_during_drain": sum(started <= t <= drained for t in renewals.full_path),
        "busy_answers": busy["count"],
        "refused_503": len(renewals.refused),
        "lock_timeouts_503": len(renewals.timed_out),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=3000)
    parser.add_argument("--period", type=float, default=1.0,
                        help="seconds between a node's renewals (1,000 nodes: 1,000/s)")
    parser.add_argument("--variants", default="1000:0,1000:2,250:2,100:2,1000:0,1000:2",
                        help="CHUNK:BUSY_LIMIT_S pairs, run in turn")
    args = parser.parse_args()
    plans = [(int(c), float(b)) for c, b in (v.split(":") for v in args.variants.split(","))]
    runs = []
    with postgres_server(durable=False) as url, tempfile.TemporaryDirectory() as home:
        db = Database(url, pool_size=16)
        upgrade(db.engine)
        settings = Settings(home=Path(home), database_url=url, admin_key=ADMIN_KEY,
                            lease_ttl_seconds=30.0)
        ctx = ServiceContext(db=db, clock=SystemClock(), settings=settings)
        fleet = register(ctx, args.nodes)
        print(f"{args.nodes} nodes registered", flush=True)
        for i, (chunk, busy_limit) in enumerate(plans):
            result = asyncio.run(variant(ctx, fleet, chunk, busy_limit, args.pods,
                                         args.period, f"v{i}"))
            clear(ctx)
            runs.append(result)
            print(json.dumps(result), flush=True)
        lease_capacity.close(db)
        db.dispose()
    RESULTS.mkdir(exist_ok=True)
    out = {"nodes": args.nodes, "pods": args.pods, "period_s": args.period, "runs": runs}
    (RESULTS / "lease_vs_bind.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
