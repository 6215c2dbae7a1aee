"""The serverless HTTP API through the app: /v1/endpoints CRUD (422s naming the field),
RunPod's client routes (/v2/{endpoint}/run, runsync, status, stream, cancel, health,
purge-queue) and the worker routes with the exact URLs, headers and bodies the `runpod`
SDK sends (the env of ``worker_env``; results as JSON in a form-encoded body)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import runpod
from fastapi.testclient import TestClient
from runpod.api.mutations import endpoints as endpoint_mutations
from runpod.api.mutations import templates as template_mutations
from runpod.api.queries import endpoints as endpoint_queries
from sqlalchemy import select, update

from gpucloud.core.clock import SystemClock
from gpucloud.core.settings import Settings
from gpucloud.db.models import PodModel
from gpucloud.db.session import Database
from gpucloud.services import autoscale, endpoints, serverless_queue
from gpucloud.services.context import ServiceContext
from tests.conftest import ADMIN_KEY
from tests.fixtures.server import live_server

CLIENT = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
def long_poll_seconds() -> float:
    """How long ``job-take``/``job-stop`` wait for work; a test that polls many times and
    never expects work parametrizes it shorter."""
    return 0.3


@pytest.fixture
def settings(settings: Settings, long_poll_seconds: float) -> Settings:
    return dataclasses.replace(settings, serverless_long_poll_seconds=long_poll_seconds)


def create(api: TestClient, **body: Any) -> dict[str, Any]:
    response = api.post("/v1/endpoints", json={"name": "echo", "image": "reg.local/echo:1",
                                               **body})
    assert response.status_code == 201, response.text
    return dict(response.json())


class Worker:
    """One worker pod of an endpoint and the URLs its env gives the SDK."""

    def __init__(self, api: TestClient, ctx: ServiceContext, endpoint_id: str,
                 name: str) -> None:
        pod = api.post("/v1/pods", json={"name": name, "image": "reg.local/echo:1"}).json()
        with ctx.db.transaction() as session:
            session.execute(update(PodModel).where(PodModel.id == pod["id"]).values(
                endpoint_id=endpoint_id, phase="Running"))

        class _Ref:
            id = endpoint_id

        self.env = endpoints.worker_env(ctx, _Ref(), name, "http://testserver")
        self.api, self.pod_id = api, pod["id"]
        self.headers = {"Authorization": self.env["RUNPOD_AI_API_KEY"]}

    def url(self, var: str, job_id: str = "") -> str:
        return (self.env[var].replace("$RUNPOD_POD_ID", self.env["RUNPOD_POD_ID"])
                .replace("$ID", job_id or self.env["RUNPOD_POD_ID"]))

    def take(self, batch: int = 1) -> Any:
        url = self.url("RUNPOD_WEBHOOK_GET_JOB")
        if batch > 1:
            url = url.replace("/job-take/", "/job-take-batch/") + f"&batch_size={batch}"
        response = self.api.get(url + "&job_in_progress=0", headers=self.headers)
        return None if response.status_code == 204 else response.json()

    def post(self, var: str, job_id: str, body: Any, is_stream: bool = False) -> Any:
        response = self.api.post(
            self.url(var, job_id) + f"&isStream={'true' if is_stream else 'false'}",
            content=json.dumps(body), headers={
                **self.headers, "Content-Type": "application/x-www-form-urlencoded",
                "X-Request-ID": job_id})
        assert response.status_code == 200, response.text
        return response.json()


def test_endpoint_crud_and_validation(api: TestClient) -> None:
    created = create(api, gpu_ids="ada_24,HOPPER_141", min_workers=0, max_workers=5,
                     idle_timeout="5s", scaler="request-count", scaler_value=2,
                     execution_timeout="10m", command=["python", "handler.py"])
    assert created["gpu_ids"] == "ADA_24,HOPPER_141"
    assert (created["idle_timeout_seconds"], created["execution_timeout_seconds"]) == (5, 600)
    assert (created["workers"], created["queue"]) == (0, 0)
    got = api.get("/v1/endpoints/echo").json()
    assert got["id"] == created["id"] and got["command"] == ["python", "handler.py"]
    updated = api.patch("/v1/endpoints/echo", json={"max_workers": 2, "env": {"A": "1"}})
    assert updated.status_code == 200, updated.text
    assert (updated.json()["max_workers"], updated.json()["env"]) == (2, {"A": "1"})
    assert updated.json()["scaler"] == "request-count"  # untouched fields stay
    cases: list[tuple[dict[str, Any], str]] = [
                        ({"min_workers": 3, "max_workers": 2}, "max_workers"),
                        ({"gpu_ids": "AMPERE_999"}, "gpu_ids"),
                        ({"idle_timeout": "soon"}, "idle_timeout"),
                        ({"scaler": "magic"}, "scaler"), ({"max_retries": 11}, "max_retries"),
                        ({"template": "none"}, "template")]
    for body, field in cases:
        refused = api.post("/v1/endpoints", json={"name": "bad", "image": "r/x:1", **body})
        assert refused.status_code == 422 and refused.json()["field"] == field, refused.text
    assert api.patch("/v1/endpoints/echo", json={"min_workers": 4}).json()["field"] == (
        "max_workers")
    assert api.post("/v1/endpoints", json={"name": "echo", "image": "r/x:1"}).json()[
        "field"] == "name"
    assert [e["name"] for e in api.get("/v1/endpoints").json()] == ["echo"]
    assert api.delete("/v1/endpoints/echo").status_code == 204
    assert api.get("/v1/endpoints/echo").status_code == 404
    assert api.get("/v1/endpoints").json() == []


def test_endpoint_from_a_template(api: TestClient) -> None:
    api.post("/v1/templates", json={"name": "base", "image": "reg.local/base:2",
                                    "env": {"B": "1"}, "gpus": 1}).raise_for_status()
    response = api.post("/v1/endpoints", json={"name": "echo", "template": "base",
                                               "max_workers": 1})
    assert response.status_code == 201, response.text
    created = response.json()
    assert (created["image"], created["env"], created["gpus"]) == (
        "reg.local/base:2", {"B": "1"}, 1)
    assert created["template"] == "base"


def test_client_and_worker_round_trip(api: TestClient, app_ctx: ServiceContext) -> None:
    endpoint = create(api, max_retries=1)
    worker = Worker(api, app_ctx, endpoint["id"], "echo-w-1")
    assert worker.take() is None  # 204 after the (short) long poll
    job = api.post(f"/v2/{endpoint['id']}/run", json={"input": {"x": 1}}, headers=CLIENT)
    assert job.json()["status"] == "IN_QUEUE"
    job_id = job.json()["id"]
    taken = worker.take()
    assert taken == {"id": job_id, "input": {"x": 1}}
    ping = api.get(worker.url("RUNPOD_WEBHOOK_PING"), params={"job_id": job_id,
                                                              "runpod_version": "1"},
                   headers=worker.headers)
    assert ping.json() == {"renewed": 1}
    assert worker.post("RUNPOD_WEBHOOK_POST_OUTPUT", job_id,
                       {"status": "IN_PROGRESS", "output": "half"}) == {"accepted": True}
    assert api.get(f"/v2/echo/status/{job_id}", headers=CLIENT).json()["output"] == "half"
    assert worker.post("RUNPOD_WEBHOOK_POST_OUTPUT", job_id, {"output": {"y": 2}}) == {
        "accepted": True}
    status = api.get(f"/v2/{endpoint['id']}/status/{job_id}", headers=CLIENT).json()
    assert status["status"] == "COMPLETED" and status["output"] == {"y": 2}
    assert {"delayTime", "executionTime"} <= set(status)
    health = api.get("/v2/echo/health", headers=CLIENT).json()
    assert health["jobs"]["completed"] == 1 and health["workers"] == {"idle": 1, "running": 1}
    assert api.get("/v1/endpoints/echo").json()["workers"] == 1


def test_runsync_waits_for_the_worker(api: TestClient, app_ctx: ServiceContext) -> None:
    endpoint = create(api)
    worker = Worker(api, app_ctx, endpoint["id"], "echo-w-1")
    answered: dict[str, Any] = {}

    def call() -> None:
        answered.update(api.post("/v2/echo/runsync?wait=20000", json={"input": "hi"},
                                 headers=CLIENT).json())

    caller = threading.Thread(target=call)
    caller.start()
    taken = None
    while taken is None:
        taken = worker.take()
    worker.post("RUNPOD_WEBHOOK_POST_OUTPUT", taken["id"], {"output": "HI"})
    caller.join(timeout=20)
    assert answered["status"] == "COMPLETED" and answered["output"] == "HI"


def test_batch_take_stream_cancel_and_stop(api: TestClient, app_ctx: ServiceContext) -> None:
    endpoint = create(api)
    worker = Worker(api, app_ctx, endpoint["id"], "echo-w-1")
    ids = [api.post("/v2/echo/run", json={"input": i}, headers=CLIENT).json()["id"]
           for i in range(3)]
    jobs = worker.take(batch=2)
    assert [job["id"] for job in jobs] == ids[:2]
    worker.post("RUNPOD_WEBHOOK_POST_STREAM", ids[0], {"output": "a"})
    worker.post("RUNPOD_WEBHOOK_POST_STREAM", ids[0], {"output": "b"})
    streamed = api.get(f"/v2/echo/stream/{ids[0]}", headers=CLIENT).json()
    assert [chunk["output"] for chunk in streamed["stream"]] == ["a", "b"]
    worker.post("RUNPOD_WEBHOOK_POST_OUTPUT", ids[0], {"output": ["a", "b"]}, is_stream=True)
    final = api.get(f"/v2/echo/stream/{ids[0]}", headers=CLIENT).json()
    assert (final["status"], final["stream"]) == ("COMPLETED", [])
    cancelled = api.post(f"/v2/echo/cancel/{ids[1]}", headers=CLIENT)
    assert cancelled.json() == {"id": ids[1], "status": "CANCELLED"}
    stop_url = worker.url("RUNPOD_WEBHOOK_GET_JOB").replace("/job-take/", "/job-stop/")
    assert api.get(stop_url, headers=worker.headers).json() == {"jobsToStop": [ids[1]]}
    assert api.get(stop_url, headers=worker.headers).status_code == 204
    late = worker.post("RUNPOD_WEBHOOK_POST_OUTPUT", ids[1], {"output": "late"})
    assert late == {"accepted": False}
    assert api.post("/v2/echo/purge-queue", headers=CLIENT).json() == {
        "removed": 1, "status": "completed"}


def test_auth_and_unknowns(api: TestClient, app_ctx: ServiceContext) -> None:
    endpoint = create(api)
    worker = Worker(api, app_ctx, endpoint["id"], "echo-w-1")
    take = worker.url("RUNPOD_WEBHOOK_GET_JOB")
    assert api.get(take, headers={"Authorization": ADMIN_KEY}).status_code == 401
    assert api.get(take.replace("echo-w-1", "other"), headers=worker.headers).status_code == 404
    # a worker's key serves its endpoint's worker routes and nothing else, and is no
    # key of the project's (it is not listed and cannot be revoked as one)
    bearer = {"Authorization": f"Bearer {worker.headers['Authorization']}"}
    assert api.get("/v1/pods", headers=bearer).status_code == 401
    assert api.post("/v2/echo/run", json={"input": 1}, headers=worker.headers).status_code == 401
    assert not [k for k in api.get("/v1/keys").json() if k["name"].startswith("sls-")]
    assert api.post("/v2/nope/run", json={"input": 1}, headers=CLIENT).status_code == 404
    assert api.post("/v2/echo/run", json={"inputs": 1}, headers=CLIENT).json()["field"] == (
        "input")
    assert api.post("/v2/echo/run", json={"input": 1},
                    headers={"Authorization": "wrong"}).status_code == 401
    plain = api.post("/v2/echo/run", json={"input": 1}, headers={"Authorization": ADMIN_KEY})
    assert plain.status_code == 200  # RunPod's raw-HTTP form: the key without Bearer
    bad = api.post(worker.url("RUNPOD_WEBHOOK_POST_OUTPUT", "x") + "&isStream=false",
                   content="not json", headers=worker.headers)
    assert bad.status_code == 422 and bad.json()["field"] == "body"
    api.delete(f"/v1/pods/{worker.pod_id}").raise_for_status()
    api.post("/v2/echo/run", json={"input": 2}, headers=CLIENT).raise_for_status()
    by_id = take.replace("echo-w-1", worker.pod_id)
    assert api.get(by_id, headers=worker.headers).status_code == 204  # stopping: no job
    api.delete("/v1/endpoints/echo")
    assert api.get(take, headers=worker.headers).status_code in (401, 404)


# 25 rounds of job-take and job-stop, each answered 204 when its long poll ends
@pytest.mark.parametrize("long_poll_seconds", [0.01])
def test_a_deleted_workers_revoked_key_polls_as_that_worker_and_locks_out_no_one(
        api: TestClient, app_ctx: ServiceContext) -> None:
    """The autoscaler deletes an ended worker and revokes its key while its container may
    still poll (its agent has not stopped it yet): those polls are answered as the
    deleted worker's (204, nothing to do), not refused. Refused, the SDK retries each at
    once and every refusal counts against the address it shares with its agent and the
    other workers of a host-network node: the agent's own calls were then refused (429)."""
    endpoint = create(api, max_workers=2)
    job = api.post("/v2/echo/run", json={"input": 1}, headers=CLIENT).json()
    assert autoscale.autoscale(app_ctx) == ["+echo-w-1"]
    with app_ctx.db.read() as session:
        [(pod_id, env)] = session.execute(select(PodModel.id, PodModel.env).where(
            PodModel.endpoint_id == endpoint["id"])).all()
    headers = {"Authorization": env["RUNPOD_AI_API_KEY"]}
    worker = f"/v2/_worker/{endpoint['id']}"
    api.post(f"/v2/echo/cancel/{job['id']}", headers=CLIENT).raise_for_status()
    with app_ctx.db.transaction() as session:
        session.execute(update(PodModel).where(PodModel.id == pod_id).values(phase="Failed"))
    assert autoscale.autoscale(app_ctx) == ["-echo-w-1"]  # ended: deleted, its key revoked
    for _ in range(app_ctx.settings.auth_failure_burst + 5):
        assert api.get(f"{worker}/job-take/{pod_id}", headers=headers).status_code == 204
        assert api.get(f"{worker}/ping/{pod_id}", headers=headers).json() == {"renewed": 0}
        assert api.get(f"{worker}/job-stop/{pod_id}", headers=headers).status_code == 204
    assert api.get("/v1/pods").status_code == 200  # the address is not locked out
    # the revoked key is still no key of any other pod: a live one, another deleted one
    api.post("/v2/echo/run", json={"input": 2}, headers=CLIENT).raise_for_status()
    [live] = autoscale.autoscale(app_ctx)
    assert live == "+echo-w-1"
    with app_ctx.db.read() as session:
        other = session.scalar(select(PodModel.id).where(
            PodModel.endpoint_id == endpoint["id"], PodModel.deleted_at.is_(None)))
    for ref in (other, "echo-w-1"):
        assert api.get(f"{worker}/job-take/{ref}", headers=headers).status_code == 401


HANDLER = '''
import asyncio
import runpod

async def handler(job):
    data = job["input"]
    if data.get("sleep"):
        await asyncio.sleep(data["sleep"])
    if data.get("fail"):
        raise ValueError("asked to fail")
    return {"echo": data}

runpod.serverless.start({"handler": handler})
'''

GENERATOR = '''
import runpod

def handler(job):
    for word in job["input"]["words"]:
        yield word.upper()

runpod.serverless.start({"handler": handler, "return_aggregate_stream": True})
'''


class SdkWorker:
    """The real `runpod` SDK worker loop in a subprocess, with a worker pod's env."""

    def __init__(self, ctx: ServiceContext, url: str, endpoint_id: str, name: str,
                 script: Path) -> None:
        pod = httpx.post(f"{url}/v1/pods", headers=CLIENT,
                         json={"name": name, "image": "reg.local/echo:1"}).json()
        self.pod_id = pod["id"]
        with ctx.db.transaction() as session:
            session.execute(update(PodModel).where(PodModel.id == pod["id"]).values(
                endpoint_id=endpoint_id, phase="Running"))

        class _Ref:
            id = endpoint_id

        env = {**os.environ, **endpoints.worker_env(ctx, _Ref(), name, url),
               "RUNPOD_PING_INTERVAL": "1000", "RUNPOD_DEBUG_LEVEL": "INFO"}
        log = (script.parent / f"{name}.log").open("wb")  # noqa: SIM115 (the child's)
        # a session of its own: the SDK's heartbeat is a child process, stopped with it
        self.process = subprocess.Popen([sys.executable, str(script)], env=env,
                                        stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the worker and its heartbeat
        self.process.wait()


def wait_for(check: Any, seconds: float = 20) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_runpod_sdk_worker_and_client(settings: Settings, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """runpod.serverless.start() and runpod.Endpoint against a real server on loopback:
    run_sync, run + status, a failing handler, cancel of a running request (the worker
    stops it), and a worker killed mid-request (its request retried on another)."""
    script = tmp_path / "handler.py"
    script.write_text(HANDLER)
    settings = dataclasses.replace(settings, serverless_long_poll_seconds=2)
    with live_server(settings, run_controllers=False) as url:
        ctx = ServiceContext(db=Database(settings.database_url), clock=SystemClock(),
                             settings=settings)
        created = httpx.post(f"{url}/v1/endpoints", headers=CLIENT, json={
            "name": "echo", "image": "reg.local/echo:1", "max_retries": 2}).json()
        monkeypatch.setattr(runpod, "api_key", ADMIN_KEY)
        monkeypatch.setattr(runpod, "endpoint_url_base", f"{url}/v2")
        endpoint = runpod.Endpoint(created["id"])
        first = SdkWorker(ctx, url, created["id"], "echo-w-1", script)
        workers = [first]
        try:
            assert endpoint.run_sync({"input": {"n": 1}}, timeout=30) == {"echo": {"n": 1}}
            jobs = [endpoint.run({"n": i}) for i in range(5)]
            assert [job.output(timeout=20) for job in jobs] == [{"echo": {"n": i}}
                                                               for i in range(5)]
            failing = endpoint.run({"fail": True})
            wait_for(lambda: failing.status() == "FAILED")
            assert "asked to fail" in httpx.get(
                f"{url}/v2/echo/status/{failing.job_id}", headers=CLIENT).json()["error"]
            slow = endpoint.run({"sleep": 30})
            wait_for(lambda: slow.status() == "IN_PROGRESS")
            assert slow.cancel()["status"] == "CANCELLED"
            # the worker stopped it (job-stop) and takes the next one at once
            assert endpoint.run_sync({"input": {"n": 2}}, timeout=20) == {"echo": {"n": 2}}
            health = endpoint.health()
            assert health["jobs"]["completed"] == 7 and health["workers"]["running"] == 1

            lost = endpoint.run({"sleep": 3, "n": 3})
            wait_for(lambda: lost.status() == "IN_PROGRESS")
            first.stop()  # killed mid-request
            with ctx.db.transaction() as session:
                session.execute(update(PodModel).where(PodModel.id == first.pod_id)
                                .values(phase="Failed"))
            assert serverless_queue.expire(ctx) == 1
            workers.append(SdkWorker(ctx, url, created["id"], "echo-w-2", script))
            assert lost.output(timeout=20) == {"echo": {"sleep": 3, "n": 3}}
            assert httpx.get(f"{url}/v2/echo/status/{lost.job_id}",
                             headers=CLIENT).json()["retries"] == 1

            generator = tmp_path / "generator.py"
            generator.write_text(GENERATOR)
            streaming = httpx.post(f"{url}/v1/endpoints", headers=CLIENT, json={
                "name": "shout", "image": "reg.local/echo:1"}).json()
            workers.append(SdkWorker(ctx, url, streaming["id"], "shout-w-1", generator))
            job = runpod.Endpoint(streaming["id"]).run({"words": ["a", "b", "c"]})
            assert job.output(timeout=20) == ["A", "B", "C"]  # the aggregate
            assert list(job.stream()) == ["A", "B", "C"]  # each chunk once
        finally:
            for worker in workers:
                worker.stop()
            ctx.db.dispose()


def graphql(api: TestClient, query: str) -> dict[str, Any]:
    response = api.post("/graphql", json={"query": query})
    assert response.status_code == 200 and "errors" not in response.json(), response.text
    return dict(response.json()["data"])


def test_graphql_with_the_sdk_mutations(api: TestClient) -> None:
    """The exact strings the runpod SDK sends (runpod.api.mutations/queries)."""
    template = graphql(api, template_mutations.generate_pod_template(
        name="worker", image_name="reg.local/echo:1", is_serverless=True,
        env={"MODE": "echo"}))["saveTemplate"]
    saved = graphql(api, endpoint_mutations.generate_endpoint_mutation(
        name="echo", template_id=template["id"], gpu_ids="ADA_24", idle_timeout=7,
        scaler_type="REQUEST_COUNT", scaler_value=2, workers_min=0, workers_max=4,
        flashboot=True, gpu_count=1))["saveEndpoint"]
    assert (saved["name"], saved["templateId"], saved["gpuIds"], saved["scalerType"]) == (
        "echo", template["id"], "ADA_24", "REQUEST_COUNT")
    assert (saved["idleTimeout"], saved["workersMax"], saved["gpuCount"]) == (7, 4, 1)
    rest = api.get(f"/v1/endpoints/{saved['id']}").json()
    assert (rest["image"], rest["env"], rest["template"]) == (
        "reg.local/echo:1", {"MODE": "echo"}, "worker")
    listed = graphql(api, endpoint_queries.QUERY_ENDPOINT)["myself"]["endpoints"]
    assert [e["id"] for e in listed] == [saved["id"]]
    other = graphql(api, template_mutations.generate_pod_template(
        name="worker2", image_name="reg.local/echo:2"))["saveTemplate"]
    moved = graphql(api, endpoint_mutations.update_endpoint_template_mutation(
        saved["id"], other["id"]))["updateEndpointTemplate"]
    assert moved["templateId"] == other["id"]
    assert api.get(f"/v1/endpoints/{saved['id']}").json()["image"] == "reg.local/echo:2"
    graphql(api, f'mutation {{ deleteEndpoint(id: "{saved["id"]}") }}')
    assert api.get("/v1/endpoints").json() == []
