"""What one agent's full assignments answer costs the server (issue 16: every bind builds one).

Fills a database with a fleet (by default 10,000 nodes and 30,000 pods on PostgreSQL:
active and finished pods, volume disks, a few volume migrations, network volumes, jobs
behind a released barrier, checkpointing pods with their checkpoints, SSH keys and
registry logins), then builds ``services.agent.assignments`` for nodes running 0, 1 and 8
pods and for an 8-pod node using every feature, counting the CPU seconds of this process
(the replica's share: PostgreSQL runs in its own processes) and the statements sent.

The answer as it was built before (kept below as ``before_assignments``, its queries as
they ran) is timed in the same run, interleaved with the current one, first on the schema
without migration 0016's indexes and then with them; the two answers must be equal.

    .venv/bin/python bench/assignments.py                    # PostgreSQL it starts
    .venv/bin/python bench/assignments.py --sqlite
    .venv/bin/python bench/assignments.py --nodes 2000 --pods 6000 --reps 100

Results: printed, and bench/results/assignments.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from alembic import command  # noqa: E402
from sqlalchemy import insert, or_, select, text  # noqa: E402
from sqlalchemy.orm import Session, aliased  # noqa: E402
from tests.fixtures.postgres import postgres_server  # noqa: E402
from tests.integration.conftest import statements_sent  # noqa: E402

from gpucloud.core.access import NetworkVolumeMount  # noqa: E402
from gpucloud.core.clock import SystemClock  # noqa: E402
from gpucloud.core.models import AssignmentOut, AssignmentsOut, VolumeExport  # noqa: E402
from gpucloud.core.phases import ACTIVE_PHASE_VALUES  # noqa: E402
from gpucloud.core.settings import Settings  # noqa: E402
from gpucloud.db.migrate import alembic_config  # noqa: E402
from gpucloud.db.models import (  # noqa: E402
    CheckpointModel,
    JobModel,
    NodeModel,
    PodEventModel,
    PodModel,
    ProjectModel,
    RegistryAuthModel,
    SshKeyModel,
    VolumeModel,
)
from gpucloud.db.session import Database  # noqa: E402
from gpucloud.services import (  # noqa: E402
    agent,
    checkpoint_index,
    gpu_maintenance,
    interval,
    mig,
    migration,
    volumes,
)
from gpucloud.services.context import ServiceContext, TtlCache  # noqa: E402
from gpucloud.services.spec import pull_credentials  # noqa: E402
from gpucloud.services.ssh_keys import public_keys  # noqa: E402

RESULTS = ROOT / "bench" / "results"
GIB = 1024**3
NOW = datetime(2025, 6, 1, tzinfo=UTC)
PROBES = ("0 pods", "1 pod", "8 pods", "8 pods, every feature")


# -- the fleet ------------------------------------------------------------------------------

def _id(kind: str, n: int) -> str:
    return f"{kind}{n:0{32 - len(kind)}d}"


def _pod(n: int, project: str, node: str | None, phase: str, gpu: int) -> dict[str, Any]:
    return dict(
        id=_id("p", n), project_id=project, name=f"pod-{n}", phase=phase, ports=["8888/http"],
        restart_policy="never", gpus=1.0, node_id=node, gpu_uuids=[f"GPU-{node}-{gpu}"],
        gpu_milli={str(gpu): 1000}, created_at=NOW + timedelta(seconds=n),
        updated_at=NOW + timedelta(seconds=n), image="ghcr.io/acme/train:1.4",
        command=["python", "train.py", "--epochs", "90"],
        env={"WANDB_PROJECT": "acme", "HF_HOME": "/workspace/hf"}, cpu_milli=8000,
        memory_bytes=64 * GIB, attempt=1, container_disk_bytes=20 * GIB)


def _features(pod: dict[str, Any], rng: random.Random, fleet: _Fleet, everything: bool) -> None:
    """Volume disks, logins, checkpoints, network volumes: at fleet rates, or all."""
    project = pod["project_id"]
    if everything or rng.random() < 0.3:
        pod.update(volume_bytes=50 * GIB, volume_path="/workspace", volume_node_id=pod["node_id"])
    if (everything or rng.random() < 0.15) and project in fleet.logins:
        pod["registry_auth"] = "ghcr"
    if everything or rng.random() < 0.1:
        pod.update(checkpoint_dir="/ckpt", spot=True)
        fleet.checkpointing.append(pod)
    if (everything or rng.random() < 0.05) and project in fleet.volumes:
        pod["network_volumes"] = [{"name": fleet.volumes[project], "path": "/data"}]


class _Fleet:
    def __init__(self) -> None:
        self.rows: dict[type, list[dict[str, Any]]] = {}
        self.logins: set[str] = set()
        self.volumes: dict[str, str] = {}
        self.checkpointing: list[dict[str, Any]] = []
        self.probes: dict[str, str] = {}

    def add(self, model: type, **row: Any) -> dict[str, Any]:
        self.rows.setdefault(model, []).append(row)
        return row


def build_fleet(node_count: int, pod_count: int, seed: int = 16) -> _Fleet:
    rng = random.Random(seed)
    fleet = _Fleet()
    projects = [_id("j", i) for i in range(max(10, node_count // 50))]
    for i, project in enumerate(projects):
        fleet.add(ProjectModel, id=project, name=f"team-{i}", created_at=NOW)
        for k in range((i % 3 + 1) % 3):  # two thirds of the projects have SSH keys
            fleet.add(SshKeyModel, id=_id(f"k{k}", i), project_id=project, name=f"key-{k}",
                      key_type="ssh-ed25519", public_key=f"ssh-ed25519 AAAA{i:08d}{k} u@h",
                      fingerprint=f"SHA256:{i}-{k}", created_at=NOW)
        if i % 3 == 0:
            fleet.logins.add(project)
            fleet.add(RegistryAuthModel, id=_id("r", i), project_id=project, name="ghcr",
                      registry_host="ghcr.io", username="bot", password="s3cret",
                      created_at=NOW)
        if i % 4 == 0:
            fleet.volumes[project] = "datasets"
            fleet.add(VolumeModel, id=_id("v", i), project_id=project, name="datasets",
                      size_bytes=500 * GIB, created_at=NOW)
    nodes = [_id("n", i) for i in range(node_count)]
    for i, node in enumerate(nodes):
        fleet.add(NodeModel, id=node, name=f"gpu-{i:05d}", token_hash=f"{i:064d}",
                  status="Ready", cpu_milli=224_000, memory_bytes=2048 * GIB,
                  gpus=[{"index": g, "uuid": f"GPU-{node}-{g}", "model": "H100 80GB HBM3",
                         "memory_bytes": 80 * GIB, "numa_node": g // 4} for g in range(8)],
                  labels={"pool": f"pool-{i % 4}", "zone": f"z{i % 3}"},
                  fencing_token=1, registered_at=NOW, assignments_revision=7,
                  access_endpoint=f"10.0.{i // 250}.{i % 250}:2222",
                  access_host_key=f"ssh-ed25519 HOSTKEY{i} root@gpu-{i}", volume_mode="nfs")
    _place_pods(fleet, rng, projects, nodes, pod_count)
    return fleet


def _place_pods(fleet: _Fleet, rng: random.Random, projects: list[str], nodes: list[str],
                pod_count: int) -> None:
    """Four in five pods active: nodes hold 0 to 8 of them (the first three nodes are
    the probes: empty, one pod, eight); the rest finished (some deleted) on random nodes."""
    fleet.probes = {PROBES[0]: nodes[0], PROBES[1]: nodes[1], PROBES[2]: nodes[2],
                    PROBES[3]: nodes[3]}
    fill = {nodes[0]: 0, nodes[1]: 1, nodes[2]: 8, nodes[3]: 8}
    active = pod_count * 4 // 5
    n = 0
    jobs = 1
    job = _job(fleet, jobs, projects[0])  # two members of it on the featured node
    for node in nodes:
        want = fill.get(node, rng.choice((0, 2, 4, 4, 6, 8, 8, 8)))
        for gpu in range(want):
            if n >= active:
                break
            project = projects[0] if node == nodes[3] else rng.choice(projects)
            pod = fleet.add(PodModel, **_pod(n, project, node, "Running", gpu))
            _features(pod, rng, fleet, everything=node == nodes[3])
            if node == nodes[3] and gpu < 2:
                pod.update(job_id=job, rank=gpu)
            elif node != nodes[2] and rng.random() < 0.05:  # job members elsewhere
                jobs += 1
                pod.update(job_id=_job(fleet, jobs, project), rank=0)
            n += 1
    migrating = fleet.rows[PodModel][-1]  # copied from the featured node, running elsewhere
    migrating.update(volume_bytes=50 * GIB, volume_source_node_id=nodes[3], volume_node_id=None)
    for pod in fleet.rows[PodModel]:
        if pod["node_id"] == nodes[3] and pod.get("volume_bytes"):
            pod.update(volume_source_node_id=nodes[4], volume_node_id=None)  # being fetched
            break
    for m in range(n, pod_count):  # finished, on random nodes; one in four deleted
        pod = fleet.add(PodModel, **_pod(m, rng.choice(projects), rng.choice(nodes),
                                         rng.choice(("Succeeded", "Stopped", "Failed")), 0))
        if rng.random() < 0.3:
            pod.update(volume_bytes=50 * GIB, volume_path="/workspace",
                       volume_node_id=pod["node_id"])
        if rng.random() < 0.25:
            pod["deleted_at"] = NOW
    _checkpoints(fleet)


def _job(fleet: _Fleet, n: int, project: str) -> str:
    job = _id("b", n)
    fleet.add(JobModel, id=job, project_id=project, name=f"job-{n}", phase="Running",
              gang_state="running", num_nodes=2, gpus_per_node=8, topology="any",
              ready_timeout_seconds=600.0, created_at=NOW, updated_at=NOW,
              barrier_released_at=NOW, image="ghcr.io/acme/train:1.4", command=["torchrun"],
              env={}, cpu_milli=8000, memory_bytes=64 * GIB)
    return job


def _checkpoints(fleet: _Fleet) -> None:
    """Three committed checkpoints per checkpointing pod, and their Running events."""
    for pod in fleet.checkpointing:
        key = f"{pod['job_id']}-{pod['rank']}" if pod.get("job_id") else pod["id"]
        for seq in range(3):
            fleet.add(CheckpointModel, id=_id(f"c{seq}", int(pod["id"][1:])),
                      project_id=pod["project_id"], key=key, pod_id=pod["id"],
                      node_id=pod["node_id"], attempt=1, seq=seq, manifest=f"{key}/{seq}",
                      state="committed", size_bytes=10 * GIB, files=12, chunks=400,
                      bytes_sent=GIB, cost_seconds=30.0 + seq, digests=[],
                      created_at=NOW + timedelta(minutes=seq))
        fleet.add(PodEventModel, pod_id=pod["id"], time=NOW, reason="Started",
                  from_phase="Pulling", to_phase="Running")


def populate(db: Database, fleet: _Fleet) -> None:
    with db.transaction() as session:
        for model, rows in fleet.rows.items():
            for start in range(0, len(rows), 5000):
                session.execute(insert(model), rows[start:start + 5000])


# -- the answer as it was built before this change (one query per pod and feature) ---------

def before_assignments(ctx: ServiceContext, node_id: str) -> AssignmentsOut:
    with ctx.db.read() as session:
        node = session.get_one(NodeModel, node_id)
        rows = session.execute(
            select(PodModel, ProjectModel.name, JobModel.barrier_released_at)
            .join(ProjectModel, ProjectModel.id == PodModel.project_id)
            .outerjoin(JobModel, JobModel.id == PodModel.job_id)
            .where(PodModel.node_id == node_id, PodModel.phase.in_(ACTIVE_PHASE_VALUES),
                   PodModel.deleted_at.is_(None))
            .order_by(PodModel.created_at)
        ).all()
        keys = public_keys(session, {pod.project_id for pod, _, _ in rows})
        pods = [agent._with_public_key(agent._assignment(pod, project, released is not None),
                                       keys.get(pod.project_id))
                for pod, project, released in rows]
        for (pod, _, _), assignment in zip(rows, pods, strict=True):
            _before_volumes(ctx, session, node, pod, assignment)
            credentials = pull_credentials(session, pod, pod.project_id)
            if credentials is not None:
                assignment.registry_username, assignment.registry_password = credentials
            if checkpoint_index.keeps_checkpoints(pod):
                assignment.checkpoint_dir = pod.checkpoint_dir
                assignment.checkpoint_key = checkpoint_index.checkpoint_key(pod)
                assignment.restore_checkpoint = checkpoint_index.restore_target(session, pod)
            interval.add_to_assignment(pod, assignment, interval.plan_for(ctx, session, pod))
            assignment.mig_policy = mig.mig_policy(node)
        return AssignmentsOut(revision=node.assignments_revision,
                              fencing_token=node.fencing_token, pods=pods,
                              volume_pods=_before_volume_pods(session, node_id),
                              volume_exports=_before_exports(session, node_id),
                              gpu_actions=gpu_maintenance.pending(
                                  node, gpu_maintenance.busy_gpus(session, node_id)))


def _before_volumes(ctx: ServiceContext, session: Session, node: NodeModel, pod: PodModel,
                    assignment: AssignmentOut) -> None:
    assignment.volume_bytes = pod.volume_bytes
    assignment.volume_path = pod.volume_path
    assignment.container_disk_bytes = pod.container_disk_bytes
    source = (session.get(NodeModel, pod.volume_source_node_id)
              if pod.volume_source_node_id not in (None, node.id) else None)
    assignment.volume_source = migration.volume_source(
        pod, node, *((source.name, source.access_endpoint, source.access_host_key)
                     if source is not None else (None, None, None)))
    mounts = []
    for mount in pod.network_volumes or []:  # one query per mount
        row = session.scalar(select(VolumeModel).where(
            VolumeModel.project_id == pod.project_id, VolumeModel.name == mount["name"]))
        if row is not None:
            mounts.append(NetworkVolumeMount(
                name=row.name, volume_id=row.id, path=mount["path"],
                mode=node.volume_mode or volumes.HOSTPATH,
                source=str(volumes.volume_dir(ctx, row.id)), size_bytes=row.size_bytes))
    assignment.network_volumes = mounts


def _before_volume_pods(session: Session, node_id: str) -> list[str]:
    return list(session.scalars(select(PodModel.id).where(
        PodModel.deleted_at.is_(None), PodModel.volume_bytes.is_not(None),
        or_(PodModel.volume_node_id == node_id, PodModel.node_id == node_id,
            PodModel.volume_source_node_id == node_id)).order_by(PodModel.id)))


def _before_exports(session: Session, node_id: str) -> list[VolumeExport]:
    destination = aliased(NodeModel)
    rows = session.execute(
        select(PodModel.id, destination.name, destination.access_host_key)
        .join(destination, destination.id == PodModel.node_id)
        .where(PodModel.volume_source_node_id == node_id, PodModel.deleted_at.is_(None),
               PodModel.phase.in_(ACTIVE_PHASE_VALUES),
               destination.access_host_key.is_not(None))
        .order_by(PodModel.id)).all()
    return [VolumeExport(pod_id=p, peer_node=n, peer_key=k) for p, n, k in rows]


# -- measuring ------------------------------------------------------------------------------

Build = Callable[[ServiceContext, str], AssignmentsOut]


def measure(ctx: ServiceContext, probes: dict[str, str], variants: dict[str, Build],
            reps: int) -> dict[str, Any]:
    """Per probe node and variant: CPU and wall per answer, statements per answer, pods;
    the variants interleaved call by call so that load drifts hit them alike."""
    out: dict[str, Any] = {}
    for probe, node_id in probes.items():
        answers = {}
        figures: dict[str, Any] = {}
        for name, build in variants.items():
            with statements_sent(ctx.db) as sent:
                answers[name] = build(ctx, node_id)
            figures[name] = {"queries": len(sent), "pods": len(answers[name].pods)}
        first = next(iter(answers.values()))
        assert all(a == first for a in answers.values()), f"answers differ on {probe}"
        cpu = dict.fromkeys(variants, 0.0)
        wall = dict.fromkeys(variants, 0.0)
        for _ in range(reps):
            for name, build in variants.items():
                c0, w0 = time.process_time(), time.perf_counter()
                build(ctx, node_id)
                cpu[name] += time.process_time() - c0
                wall[name] += time.perf_counter() - w0
        for name in variants:
            figures[name].update(cpu_ms=round(cpu[name] / reps * 1e3, 3),
                                 wall_ms=round(wall[name] / reps * 1e3, 3))
        started = time.process_time()
        for _ in range(reps):
            first.model_dump_json()
        figures["json_ms"] = round((time.process_time() - started) / reps * 1e3, 3)
        out[probe] = figures
    return out


def explain(db: Database, node_id: str) -> list[str]:
    """PostgreSQL's plan of the volume-disk read (the one that scanned every pod)."""
    if db.is_sqlite:
        return []
    query = text("EXPLAIN SELECT id FROM pods WHERE deleted_at IS NULL AND "
                 "(volume_node_id = :n OR node_id = :n OR volume_source_node_id = :n) "
                 "AND (volume_bytes IS NOT NULL OR volume_source_node_id = :n)")
    with db.engine.connect() as connection:
        return [row[0] for row in connection.execute(query, {"n": node_id})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--pods", type=int, default=30_000)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--sqlite", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpucloud-answers-") as home, _database(
            args.sqlite, home) as url:
        db = Database(url)
        config = alembic_config(db.engine)
        command.upgrade(config, "0015")  # the schema before this change
        fleet = build_fleet(args.nodes, args.pods)
        started = time.perf_counter()
        populate(db, fleet)
        _analyze(db)
        filled = time.perf_counter() - started
        settings = Settings(home=Path(home), database_url=url)
        # The interruption statistics are fleet-wide and cached (the TTL cache): warmed
        # here and timed apart, not charged to each answer.
        ctx = ServiceContext(db=db, clock=SystemClock(), settings=settings,
                             cache=TtlCache(ttl_seconds=3600))
        stats_started = time.process_time()
        with db.read() as session:
            interval.interruption_stats(ctx, session)
        stats_ms = (time.process_time() - stats_started) * 1e3
        plan_before = explain(db, fleet.probes[PROBES[3]])
        old_schema = measure(ctx, fleet.probes, {"before": before_assignments}, args.reps)
        command.upgrade(config, "head")
        _analyze(db)
        plan_after = explain(db, fleet.probes[PROBES[3]])
        new_schema = measure(ctx, fleet.probes,
                             {"before": before_assignments, "after": agent.assignments},
                             args.reps)
        db.dispose()
    report(args, filled, stats_ms, old_schema, new_schema, plan_before, plan_after)


def _analyze(db: Database) -> None:
    with db.engine.connect() as connection:
        connection.execute(text("ANALYZE"))
        connection.commit()


@contextmanager
def _database(sqlite: bool, home: str) -> Iterator[str]:
    if sqlite:
        yield f"sqlite:///{home}/gpucloud.db"
        return
    with postgres_server(durable=True) as url:
        yield url


def report(args: argparse.Namespace, filled: float, stats_ms: float,
           old_schema: dict[str, Any], new_schema: dict[str, Any], plan_before: list[str],
           plan_after: list[str]) -> None:
    print(f"{'sqlite' if args.sqlite else 'postgresql'}: {args.nodes} nodes, "
          f"{args.pods} pods (filled in {filled:.1f}s), {args.reps} answers per figure; "
          f"interruption stats (cached, once per TTL): {stats_ms:.1f} ms CPU")
    print(f"{'node':<24}{'before @0015':>22}{'before @0016':>22}{'after @0016':>22}"
          f"{'ratio':>8}{'json':>9}")
    for probe in PROBES:
        old, new = old_schema[probe]["before"], new_schema[probe]
        cells = [f"{f['cpu_ms']:.3f} ms, {f['queries']} q" for f in
                 (old, new["before"], new["after"])]
        ratio = old["cpu_ms"] / new["after"]["cpu_ms"]
        print(f"{probe:<24}{cells[0]:>22}{cells[1]:>22}{cells[2]:>22}{ratio:>7.1f}x"
              f"{new['json_ms']:>7.3f}ms")
    print("volume-disk read, before 0016:", *plan_before, sep="\n  ")
    print("after 0016:", *plan_after, sep="\n  ")
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "assignments_sqlite.json" if args.sqlite else "assignments.json"
    (RESULTS / name).write_text(json.dumps({
        "database": "sqlite" if args.sqlite else "postgresql", "nodes": args.nodes,
        "pods": args.pods, "reps": args.reps, "interruption_stats_ms": round(stats_ms, 1),
        "schema_0015": old_schema, "schema_0016": new_schema,
        "plan_before": plan_before, "plan_after": plan_after}, indent=2) + "\n")


if __name__ == "__main__":
    main()
