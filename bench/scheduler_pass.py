"""One scheduling pass through the database: 1,000 nodes, 2,000 pending pods.

The scheduler library alone places thousands of pods per second (bench/scheduler_bench.py);
a live pass also leases the pods, snapshots the nodes and writes every binding. This
measures that whole pass (``services.scheduling.run_pass``) on a real database, pass after
pass until the backlog is placed, and can profile it:

    .venv/bin/python bench/scheduler_pass.py                       # SQLite in a temp dir
    .venv/bin/python bench/scheduler_pass.py --postgres            # a PostgreSQL it starts
    .venv/bin/python -m cProfile -o /tmp/pass.prof bench/scheduler_pass.py --passes 2
    .venv/bin/python bench/scheduler_pass.py --profile cpu         # cProfile by CPU time
    .venv/bin/python bench/scheduler_pass.py --per-pod-binds       # the unbatched variant
    .venv/bin/python bench/scheduler_pass.py --postgres --nodes 10000 --pods 4096
    .venv/bin/python bench/scheduler_pass.py --database postgresql+psycopg://…  # reuse one
    .venv/bin/python bench/scheduler_pass.py --no-cache            # full snapshot each pass

With ``--database`` the nodes already registered there are reused (registering 10,000
takes minutes) and only the pods are new. By default the passes share a
``SnapshotCache`` as the controller's do (each pass rebuilds the nodes that changed);
``--no-cache`` rebuilds the whole snapshot every pass, as before.

Results: printed, and bench/results/scheduler_pass_{batched,per-pod}[_full-snapshot].json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import func, select  # noqa: E402
from tests.fixtures.postgres import postgres_server  # noqa: E402

from gpucloud.core.clock import SystemClock  # noqa: E402
from gpucloud.core.models import NodeRegisterRequest, PodCreateRequest  # noqa: E402
from gpucloud.core.settings import Settings  # noqa: E402
from gpucloud.db.migrate import upgrade  # noqa: E402
from gpucloud.db.models import NodeModel  # noqa: E402
from gpucloud.db.session import Database  # noqa: E402
from gpucloud.scheduler import Decision, Scheduler  # noqa: E402
from gpucloud.services import join_tokens, nodes, pods, projects, scheduling  # noqa: E402
from gpucloud.services.context import ServiceContext  # noqa: E402

ADMIN_KEY = "gpc_scheduler-pass-admin-key"
RESULTS = ROOT / "bench" / "results"
GIB = 1024**3


@contextmanager
def _database(postgres: bool, url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    if postgres:
        with postgres_server(durable=False) as url:
            yield url
        return
    with tempfile.TemporaryDirectory(prefix="gpucloud-pass-") as directory:
        yield f"sqlite:///{directory}/gpucloud.db"


def populate(ctx: ServiceContext, node_count: int, pod_count: int) -> None:
    """``node_count`` 8-GPU nodes registered as agents do, ``pod_count`` 1-GPU pods created
    as the API does."""
    projects.bootstrap_admin(ctx)
    admin = projects.authenticate(ctx, ADMIN_KEY)
    token = join_tokens.create(ctx, admin).token
    with ctx.db.read() as session:
        known = session.scalar(select(func.count()).select_from(NodeModel)) or 0
    for i in range(known, node_count):
        gpus = [{"uuid": f"GPU-{i}-{g}", "model": "H100 80GB", "memory_mib": 81559,
                 "index": g, "numa_node": g // 4} for g in range(8)]
        nodes.register_node(ctx, NodeRegisterRequest(
            join_token=token, name=f"node-{i:05d}", cpu_cores=128,
            memory_bytes=1024 * GIB, gpus=gpus))
    run = uuid.uuid4().hex[:6]  # a reused database keeps the pods of earlier runs
    for i in range(pod_count):
        pods.create_pod(ctx, admin, PodCreateRequest(
            name=f"pod-{run}-{i}", image="ghcr.io/acme/trainer:1", gpus=1, cpu=1, memory="4Gi"))


def passes(ctx: ServiceContext, scheduler: Scheduler, limit: int,
           most: int | None, cache: scheduling.SnapshotCache | None) -> list[dict[str, Any]]:
    """Run passes until nothing is left to place (or ``most`` passes)."""
    out: list[dict[str, Any]] = []
    while most is None or len(out) < most:
        started, cpu = time.perf_counter(), time.process_time()
        result = scheduling.run_pass(ctx, scheduler, limit=limit, cache=cache)
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu
        if not result.considered:
            break
        out.append({"considered": result.considered, "scheduled": len(result.scheduled),
                    "conflicts": len(result.conflicts), "seconds": round(seconds, 4),
                    "cpu_s": round(cpu, 4)})
        print(f"pass {len(out)}: {len(result.scheduled)} bound of {result.considered}, "
              f"{len(result.conflicts)} conflicts, {seconds * 1000:.0f} ms "
              f"({len(result.scheduled) / seconds:.0f} pods/s)", flush=True)
    return out


_BATCHED = scheduling.bind_all


def _per_pod_binds(ctx: ServiceContext, token: str,
                   binds: list[tuple[scheduling.LeasedPod, Decision]],
                   nodes: dict[str, NodeModel], node_versions: dict[str, int],
                   ) -> tuple[list[str], list[str]]:
    """The variant to compare with: one transaction per pod (as before the batching)."""
    bound: list[str] = []
    conflicts: list[str] = []
    for pod, decision in binds:
        done, _ = _BATCHED(ctx, token, [(pod, decision)], nodes, node_versions)
        (bound if done else conflicts).append(pod.id)
    return bound, conflicts


def _profiler(kind: str | None) -> cProfile.Profile | None:
    if kind is None:
        return None
    return cProfile.Profile(time.process_time) if kind == "cpu" else cProfile.Profile()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--limit", type=int, default=scheduling.PASS_LIMIT, help="pods per pass")
    parser.add_argument("--passes", type=int, help="stop after this many passes")
    parser.add_argument("--postgres", action="store_true")
    parser.add_argument("--database", help="a database URL to use (and reuse) instead")
    parser.add_argument("--no-cache", action="store_true",
                        help="rebuild the whole snapshot every pass (no SnapshotCache)")
    parser.add_argument("--profile", nargs="?", const="wall", choices=["wall", "cpu"],
                        help="cProfile the passes by wall clock, or by this process's CPU "
                             "time (on a busy machine)")
    parser.add_argument("--per-pod-binds", action="store_true",
                        help="bind in one transaction per pod (the unbatched variant)")
    args = parser.parse_args()
    if args.per_pod_binds:
        scheduling.bind_all = _per_pod_binds
    with _database(args.postgres, args.database) as url, \
            tempfile.TemporaryDirectory() as home:
        db = Database(url)
        upgrade(db.engine)
        settings = Settings(home=Path(home), database_url=url, admin_key=ADMIN_KEY)
        ctx = ServiceContext(db=db, clock=SystemClock(), settings=settings)
        started = time.perf_counter()
        populate(ctx, args.nodes, args.pods)
        print(f"{args.nodes} nodes, {args.pods} pods in {time.perf_counter() - started:.1f} s")
        scheduler = Scheduler(settings.scheduler_profile)
        cache = None if args.no_cache else scheduling.SnapshotCache()
        if cache is not None:  # as in a running controller: the cache is warm
            scheduler.cluster_state(scheduling.snapshot(ctx, cache).nodes)
        profile = _profiler(args.profile)
        if profile:
            profile.enable()
        runs = passes(ctx, scheduler, args.limit, args.passes, cache)
        if profile:
            profile.disable()
            stats = pstats.Stats(profile)
            stats.sort_stats("cumulative").print_stats(30)
            stats.sort_stats("tottime").print_stats(15)
        db.dispose()
    bound = sum(r["scheduled"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    cpu = sum(r["cpu_s"] for r in runs)
    result = {"database": url.split(":", 1)[0].split("+", 1)[0], "nodes": args.nodes,
              "binds": "per-pod" if args.per_pod_binds else "batched",
              "snapshot": "full" if args.no_cache else "incremental",
              "pods": args.pods, "limit": args.limit, "passes": runs, "bound": bound,
              "seconds": round(seconds, 3),
              "pods_per_s": round(bound / seconds, 1) if seconds else 0.0,
              # this process's CPU (not PostgreSQL's): robust to a busy machine
              "cpu_s": round(cpu, 3), "pods_per_cpu_s": round(bound / cpu, 1) if cpu else 0.0}
    RESULTS.mkdir(exist_ok=True)
    suffix = "_full-snapshot" if args.no_cache else ""
    out = RESULTS / f"scheduler_pass_{result['binds']}{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{bound} pods bound in {seconds:.2f} s of passes: {result['pods_per_s']} pods/s "
          f"({cpu:.2f} s of this process's CPU: {result['pods_per_cpu_s']} pods/CPU-s)")


if __name__ == "__main__":
    main()
