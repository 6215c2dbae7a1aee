"""The pass's batched binds (``scheduling.bind_all``): a few statements for many pods, with
each pod's and each node's guard still checked per row (SQLite and PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from gpucloud.db.models import NodeModel, PodEventModel, PodModel
from gpucloud.scheduler import Decision, Scheduler
from gpucloud.services import scheduling
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import h100_gpus


def _pod(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "image": "busybox", "command": ["true"], **fields}


def _planned(ctx: ServiceContext) -> tuple[str, list[tuple[scheduling.LeasedPod, Decision]],
                                         scheduling.Snapshot]:
    """Lease, snapshot and decide as a pass does, binding nothing yet."""
    token, leased = scheduling.lease_pending(ctx, 100)
    snap = scheduling.snapshot(ctx)
    decisions = Scheduler("default").schedule(
        snap.nodes, [scheduling.pod_request(p) for p in leased])
    assert all(d.placement is not None for d in decisions)
    return token, list(zip(leased, decisions, strict=True)), snap


def test_a_batch_binds_the_current_pods_and_refuses_each_changed_pod_or_node(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any],
) -> None:
    for name in ("a", "b", "c"):
        register_node(name)
    for name in ("keep", "deleted", "cordoned"):
        api.post("/v1/pods", json=_pod(name, gpus=8))
    token, binds, snap = _planned(app_ctx)
    by_name = {api.get(f"/v1/pods/{n}").json()["id"]: n for n in ("keep", "deleted", "cordoned")}
    target = {by_name[p.id]: d.placement.node for p, d in binds if d.placement}
    assert len(set(target.values())) == 3  # a whole node each
    api.delete("/v1/pods/deleted")  # the pod's row changes after the lease
    assert api.post(f"/v1/nodes/{target['cordoned']}/cordon").status_code == 200
    versions = {name: node.version for name, node in snap.by_name.items()}
    bound, conflicts = scheduling.bind_all(app_ctx, token, binds, snap.by_name, versions)
    assert [by_name[i] for i in bound] == ["keep"]
    assert sorted(by_name[i] for i in conflicts) == ["cordoned", "deleted"]
    kept = api.get("/v1/pods/keep").json()
    assert kept["phase"] == "Scheduled" and kept["node"] == target["keep"]
    assert len(kept["gpu_uuids"]) == 8
    assert versions[target["keep"]] == snap.by_name[target["keep"]].version + 1
    assert versions[target["cordoned"]] == snap.by_name[target["cordoned"]].version
    with app_ctx.db.read() as session:
        events = session.execute(select(PodEventModel.pod_id, PodEventModel.reason,
                                        PodEventModel.message)
                                 .where(PodEventModel.reason == "Scheduled")).all()
        cordoned = session.get_one(PodModel, next(i for i, n in by_name.items()
                                                  if n == "cordoned"))
        assert cordoned.phase == "Pending" and cordoned.lock_token is None  # released
        assert cordoned.node_id is None and cordoned.attempt == 0
    assert [(by_name[p], m) for p, _, m in events] == [("keep", f"bound to {target['keep']}")]
    api.post(f"/v1/nodes/{target['cordoned']}/uncordon")
    schedule()  # the released pod is placed by the next pass, the deleted one never
    assert api.get("/v1/pods/cordoned").json()["phase"] == "Scheduled"


def test_pods_bound_together_on_one_node_claim_it_once_and_never_share_a_gpu(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
) -> None:
    node = register_node("solo", gpus=h100_gpus(4))
    for i in range(4):
        api.post("/v1/pods", json=_pod(f"p{i}", gpus=1))
    with app_ctx.db.read() as session:
        revision = session.get_one(NodeModel, node["node_id"]).assignments_revision
    token, binds, snap = _planned(app_ctx)
    versions = {name: n.version for name, n in snap.by_name.items()}
    bound, conflicts = scheduling.bind_all(app_ctx, token, binds, snap.by_name, versions)
    assert len(bound) == 4 and not conflicts
    pods = api.get("/v1/pods").json()
    uuids = [u for p in pods for u in p["gpu_uuids"]]
    assert len(uuids) == len(set(uuids)) == 4
    assert {p["phase"] for p in pods} == {"Scheduled"}
    with app_ctx.db.read() as session:
        row = session.get_one(NodeModel, node["node_id"])
        assert row.assignments_revision == revision + 1 and versions["solo"] == row.version
        attempts = session.scalars(select(PodModel.attempt)).all()
        events = session.scalar(select(func.count()).select_from(PodEventModel)
                                .where(PodEventModel.reason == "Scheduled"))
    assert attempts == [1, 1, 1, 1] and events == 4
    # the same leases again: every pod changed since, so nothing binds twice
    bound, conflicts = scheduling.bind_all(app_ctx, token, binds, snap.by_name,
                                           {name: n.version for name, n in snap.by_name.items()})
    assert not bound and len(conflicts) == 4


def test_chunks_commit_one_by_one_each_on_the_version_the_last_one_left(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass binds ``_BIND_CHUNK`` pods per transaction (their nodes' rows are held only
    that long): the next chunk claims a node on the version the previous chunk's claim
    left, and a node changed between two chunks refuses the later chunk's pods only."""
    monkeypatch.setattr(scheduling, "_BIND_CHUNK", 2)
    node = register_node("solo", gpus=h100_gpus(6))
    for i in range(6):
        api.post("/v1/pods", json=_pod(f"p{i}", gpus=1))
    token, binds, snap = _planned(app_ctx)
    versions = {name: n.version for name, n in snap.by_name.items()}
    commits: list[int] = []

    def announce(node_ids: list[str]) -> None:  # after each chunk's commit
        commits.append(len(commits))
        if len(commits) == 2:  # cordoned between the second chunk and the third
            assert api.post("/v1/nodes/solo/cordon").status_code == 200

    bound, conflicts = scheduling.bind_all(app_ctx, token, binds, snap.by_name, versions,
                                           announce)
    assert len(commits) == 2  # the third chunk claimed nothing: nothing to announce
    assert len(bound) == 4 and len(conflicts) == 2
    with app_ctx.db.read() as session:
        row = session.get_one(NodeModel, node["node_id"])
        phases = dict(session.execute(select(PodModel.id, PodModel.phase)).all())
    assert {phases[p] for p in bound} == {"Scheduled"}
    assert {phases[p] for p in conflicts} == {"Pending"}
    # two claims (+2), the cordon (+1); the tracked version is the last claim's
    assert versions["solo"] == snap.by_name["solo"].version + 2 == row.version - 1
