"""A job's members pass the same spend-limit admission as pods, all or none; raw usage
samples past their retention are deleted by a controller in batches (the meter kept);
on both databases, with a manual clock."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from gpucloud.controllers.loops import UsageRetentionController
from gpucloud.core.clock import ManualClock
from gpucloud.core.settings import _retention_days
from gpucloud.db.models import UsageSampleModel
from gpucloud.services import usage, usage_retention
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import agent_headers


def _job(client: TestClient, name: str, nodes: int, gpus: int = 1) -> Any:
    return client.post("/v1/jobs", json={"name": name, "image": "busybox", "nodes": nodes,
                                         "gpus_per_node": gpus, "gpu_type": "H100-80GB"})


def test_a_job_over_the_spend_limit_is_refused_whole(
    api: TestClient, app_client: TestClient, register_node: Callable[..., dict[str, Any]],
) -> None:
    register_node("gpu-1")
    assert api.post("/v1/prices", json={"model": "H100-80GB", "price": "3.60"}
                    ).status_code in (200, 201)
    team = api.post("/v1/projects", json={"name": "team"}).json()
    assert api.put("/v1/projects/team/spend-limit", json={"per_hour": "10"}).status_code == 200
    user = TestClient(app_client.app, headers={"Authorization": f"Bearer {team['key']['key']}"})
    assert _job(user, "pair", nodes=2).status_code == 201  # 2 × $3.60/h = $7.20/h reserved
    refused = _job(user, "trio", nodes=3)  # 7.20 + 3 × 3.60 > 10: no member is admitted
    assert refused.status_code == 409, refused.text
    detail = refused.json()["detail"]
    assert "spend limit" in detail and "$10.00/h" in detail and "$7.20/h" in detail
    assert "$10.80/h" in detail and "3 members" in detail
    assert sorted(p["name"] for p in user.get("/v1/pods").json()) == ["pair-0", "pair-1"]
    assert [j["name"] for j in user.get("/v1/jobs").json()] == ["pair"]
    assert user.get("/v1/projects/team/spend-limit").json()["reserved_per_hour"] == "7.200000"
    # A job that fits beside the first is admitted (the limit is not a blanket refusal).
    assert api.put("/v1/projects/team/spend-limit", json={"per_hour": "18"}).status_code == 200
    assert _job(user, "trio", nodes=3).status_code == 201


def _samples(pod_id: str, seqs: range, clock: ManualClock) -> list[dict[str, Any]]:
    return [{"pod_id": pod_id, "attempt": 1, "seq": seq, "time": clock.now().isoformat(),
             "cpu_seconds": float(seq), "memory_bytes": 1 << 20, "memory_peak_bytes": 1 << 20,
             "gpus": []} for seq in seqs]


def test_samples_past_retention_are_deleted_in_batches_and_the_meter_is_kept(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    reg = register_node("gpu-1")
    pod_id = api.post("/v1/pods", json={"name": "p", "image": "busybox", "gpus": 1}).json()["id"]
    schedule()
    for phase in ("Pulling", "Running"):
        api.post(f"/v1/agent/pods/{pod_id}/status", headers=agent_headers(reg),
                 json={"fencing_token": reg["fencing_token"], "phase": phase})

    def post(seqs: range) -> None:
        response = api.post("/v1/agent/usage", headers=agent_headers(reg), json={
            "fencing_token": reg["fencing_token"], "samples": _samples(pod_id, seqs, clock)})
        assert response.status_code == 200, response.text

    post(range(0, 5))  # day 0
    clock.advance(timedelta(days=6, hours=23).total_seconds())
    post(range(5, 8))  # day 6 + 23 h: inside the 7 days at the end
    controller = UsageRetentionController(app_ctx, period_seconds=3 * 3600)
    assert controller.tick() == 0  # nothing is 7 days old yet
    clock.advance(timedelta(hours=2).total_seconds())  # day 7 + 1 h: the first 5 expire
    assert controller.tick() == 0  # its period (3 h) has not passed since the last pass
    assert usage_retention.prune(app_ctx, batch=2, max_batches=1) == 2  # one batch at most
    clock.advance(timedelta(hours=1, seconds=1).total_seconds())
    assert controller.tick() == 3  # the rest of the backlog, in batches
    assert _seqs(app_ctx) == [5, 6, 7]
    with app_ctx.db.read() as session:
        runs = usage.pod_runs(session, None, None, None)
    assert [(r.pod_id, r.ended_at) for r in runs] == [(pod_id, None)]  # the meter is kept


def _seqs(ctx: ServiceContext) -> list[int]:
    with ctx.db.read() as session:
        return sorted(int(s) for s in session.scalars(select(UsageSampleModel.seq)))


def test_the_retention_is_read_from_the_environment() -> None:
    assert _retention_days(None) == 7.0 and _retention_days("30d") == 30.0
    with pytest.raises(ValueError, match="GPUCLOUD_USAGE_RETENTION"):
        _retention_days("a week")
    with pytest.raises(ValueError, match="more than 0"):
        _retention_days("0")
