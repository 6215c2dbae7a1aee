"""The autoscaler's pass on both databases (manual clock, passes driven by the test):
scale from zero, one worker per N requests, idle workers stopped after the idle timeout
down to min-workers, ended workers replaced and their requests requeued, worker pods
that are ordinary pods (the worker API's env, the endpoint's spec, billed as pods)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from gpucloud.controllers.loops import AutoscaleController
from gpucloud.core.clock import ManualClock
from gpucloud.db.models import EndpointModel, EndpointRequestModel, PodModel
from gpucloud.services import autoscale, serverless_queue
from gpucloud.services.context import ServiceContext, new_id
from gpucloud.services.projects import Principal, authenticate
from tests.conftest import ADMIN_KEY

WORKER_VARS = {"RUNPOD_WEBHOOK_GET_JOB", "RUNPOD_WEBHOOK_POST_OUTPUT",
               "RUNPOD_WEBHOOK_POST_STREAM", "RUNPOD_WEBHOOK_PING", "RUNPOD_AI_API_KEY",
               "RUNPOD_POD_ID", "RUNPOD_ENDPOINT_ID"}


@pytest.fixture
def admin(app_ctx: ServiceContext) -> Principal:
    return authenticate(app_ctx, ADMIN_KEY)


def make_endpoint(ctx: ServiceContext, caller: Principal, **settings: Any) -> EndpointModel:
    """An endpoint row as the create service writes it (the spec columns, the sizing)."""
    now = ctx.clock.now()
    values: dict[str, Any] = dict(
        id=new_id(), project_id=caller.project_id, name="echo", ports=[], gpus=0,
        min_workers=0, max_workers=3, idle_timeout_seconds=5.0, scaler="request-count",
        scaler_value=2, execution_timeout_seconds=600.0, max_retries=2, created_at=now,
        updated_at=now, version=0, image="registry.local/echo:1", command=[],
        env={"MODE": "echo"}, cpu_milli=1000, memory_bytes=2**30)
    values.update(settings)
    with ctx.db.transaction() as session:
        session.add(EndpointModel(**values))
    with ctx.db.read() as session:
        endpoint = session.get(EndpointModel, values["id"])
        assert endpoint is not None
        session.expunge(endpoint)
        return endpoint


def workers(ctx: ServiceContext, endpoint_id: str) -> dict[str, PodModel]:
    with ctx.db.read() as session:
        rows = list(session.scalars(select(PodModel).where(
            PodModel.endpoint_id == endpoint_id, PodModel.deleted_at.is_(None))))
        session.expunge_all()
    return {pod.name: pod for pod in rows}


def submit(ctx: ServiceContext, caller: Principal, endpoint: EndpointModel, n: int) -> list[str]:
    return [serverless_queue.submit(ctx, caller, endpoint.id, {"input": {"n": i}}, sync=False)
            ["id"] for i in range(n)]


def test_scale_from_zero_per_request_count_and_back_to_zero(
        api: TestClient, app_ctx: ServiceContext, admin: Principal, clock: ManualClock) -> None:
    endpoint = make_endpoint(app_ctx, admin)
    assert autoscale.autoscale(app_ctx) == []  # nothing queued: still zero
    submit(app_ctx, admin, endpoint, 3)
    assert sorted(autoscale.autoscale(app_ctx)) == ["+echo-w-1", "+echo-w-2"]  # ceil(3/2)
    pods = workers(app_ctx, endpoint.id)
    worker = pods["echo-w-1"]
    assert WORKER_VARS <= set(worker.env) and worker.env["MODE"] == "echo"
    assert worker.env["RUNPOD_POD_ID"] == worker.id
    assert worker.image == endpoint.image and worker.memory_bytes == 2**30
    # an ordinary pod of the project: the pod API lists it
    assert {p["name"] for p in api.get("/v1/pods").json()} >= {"echo-w-1", "echo-w-2"}
    assert autoscale.autoscale(app_ctx) == []  # sized already: idempotent
    jobs = [*serverless_queue.take(app_ctx, endpoint.id, pods["echo-w-1"].id, 2),
            *serverless_queue.take(app_ctx, endpoint.id, pods["echo-w-2"].id, 1)]
    clock.advance(30)
    assert autoscale.autoscale(app_ctx) == []  # all busy: none stops however long
    for job in jobs:
        owner = next(p.id for p in pods.values() if _holds(app_ctx, p.id, job["id"]))
        assert serverless_queue.finish(app_ctx, owner, job["id"], {"output": job["input"]})
    clock.advance(4.9)
    assert autoscale.autoscale(app_ctx) == []  # idle, not yet for the idle timeout
    clock.advance(0.1)
    assert sorted(autoscale.autoscale(app_ctx)) == ["-echo-w-1", "-echo-w-2"]
    assert workers(app_ctx, endpoint.id) == {}
    assert api.get("/v1/pods").json() == []


def _holds(ctx: ServiceContext, pod_id: str, request_id: str) -> bool:
    with ctx.db.read() as session:
        return session.scalar(select(EndpointRequestModel.worker_pod_id).where(
            EndpointRequestModel.id == request_id)) == pod_id


def test_min_workers_stay_and_max_workers_cap(
        api: TestClient, app_ctx: ServiceContext, admin: Principal, clock: ManualClock) -> None:
    endpoint = make_endpoint(app_ctx, admin, min_workers=1, max_workers=2, scaler_value=1)
    assert autoscale.autoscale(app_ctx) == ["+echo-w-1"]  # warm: min-workers from the start
    submit(app_ctx, admin, endpoint, 5)
    assert autoscale.autoscale(app_ctx) == ["+echo-w-2"]  # 5 wanted, max 2
    serverless_queue.purge(app_ctx, admin, endpoint.id)
    clock.advance(60)
    assert len(autoscale.autoscale(app_ctx)) == 1  # idle: back down to min-workers, not 0
    assert len(workers(app_ctx, endpoint.id)) == 1


def test_queue_delay_scales_once_requests_wait(
        api: TestClient, app_ctx: ServiceContext, admin: Principal, clock: ManualClock) -> None:
    endpoint = make_endpoint(app_ctx, admin, scaler="queue-delay", scaler_value=4)
    submit(app_ctx, admin, endpoint, 3)
    assert autoscale.autoscale(app_ctx) == ["+echo-w-1"]  # from zero at once
    pod = workers(app_ctx, endpoint.id)["echo-w-1"]
    serverless_queue.take(app_ctx, endpoint.id, pod.id, 1)
    clock.advance(3)
    assert autoscale.autoscale(app_ctx) == []
    clock.advance(1)  # the oldest queued request has waited 4 s
    assert autoscale.autoscale(app_ctx) == ["+echo-w-2"]


def test_an_ended_worker_is_replaced_and_its_request_requeued(
        api: TestClient, app_ctx: ServiceContext, admin: Principal) -> None:
    endpoint = make_endpoint(app_ctx, admin, scaler_value=1)
    [request_id] = submit(app_ctx, admin, endpoint, 1)
    autoscale.autoscale(app_ctx)
    pod = workers(app_ctx, endpoint.id)["echo-w-1"]
    [job] = serverless_queue.take(app_ctx, endpoint.id, pod.id, 1)
    with app_ctx.db.transaction() as session:  # what the agent reports of a killed worker
        session.execute(update(PodModel).where(PodModel.id == pod.id).values(
            phase="Failed", exit_code=137, version=PodModel.version + 1))
    assert autoscale.autoscale(app_ctx) == ["-echo-w-1", "+echo-w-1"]
    replacement = workers(app_ctx, endpoint.id)["echo-w-1"]
    assert replacement.id != pod.id and replacement.env["RUNPOD_POD_ID"] == replacement.id
    serverless_queue.expire(app_ctx)
    with app_ctx.db.read() as session:
        row = session.get(EndpointRequestModel, request_id)
        assert row is not None and (row.status, row.retries) == ("IN_QUEUE", 1)
    assert serverless_queue.take(app_ctx, endpoint.id, replacement.id, 1)[0]["id"] == job["id"]


def test_a_deleted_endpoint_gets_no_workers(
        api: TestClient, app_ctx: ServiceContext, admin: Principal) -> None:
    endpoint = make_endpoint(app_ctx, admin, min_workers=2)
    with app_ctx.db.transaction() as session:
        session.execute(update(EndpointModel).where(EndpointModel.id == endpoint.id)
                        .values(deleted_at=app_ctx.clock.now()))
    assert autoscale.autoscale(app_ctx) == []


def test_gpu_pools_map_onto_a_model_the_fleet_has(
        api: TestClient, app_ctx: ServiceContext, admin: Principal,
        register_node: Any) -> None:
    register_node("h100-node")  # eight H100s
    endpoint = make_endpoint(app_ctx, admin, gpus=1, gpu_ids="AMPERE_80,ADA_80_PRO",
                             min_workers=1)
    assert autoscale.pool_gpu_type(app_ctx, "HOPPER_141") == "H200-141GB"  # none: the first
    assert autoscale.autoscale(app_ctx) == ["+echo-w-1"]
    worker = workers(app_ctx, endpoint.id)["echo-w-1"]
    assert (worker.gpu_type, worker.gpus) == ("H100-80GB", 1)


def test_the_controller_requeues_and_replaces_in_one_tick(
        api: TestClient, app_ctx: ServiceContext, admin: Principal) -> None:
    controller = AutoscaleController(app_ctx)
    endpoint = make_endpoint(app_ctx, admin, scaler_value=1)
    [request_id] = submit(app_ctx, admin, endpoint, 1)
    assert controller.tick() == ["+echo-w-1"]
    pod = workers(app_ctx, endpoint.id)["echo-w-1"]
    serverless_queue.take(app_ctx, endpoint.id, pod.id, 1)
    with app_ctx.db.transaction() as session:
        session.execute(update(PodModel).where(PodModel.id == pod.id).values(phase="Lost"))
    assert controller.tick() == ["-echo-w-1", "+echo-w-1"]
    with app_ctx.db.read() as session:
        row = session.get(EndpointRequestModel, request_id)
        assert row is not None and (row.status, row.worker_pod_id) == ("IN_QUEUE", None)
    controller.stop()
