"""Serverless end to end: a RunPod worker image built here from the host's Python and the
installed ``runpod`` package (tests/e2e/serverless_image.py, no image hub), an endpoint
with min-workers 0 on a real server and agent, 50 requests through the real ``runpod``
client (``run_sync``, ``run`` + ``status``), workers scaling up and back to zero, a worker
killed mid-request (its request retried, not lost), a server restart with requests queued
(the queue survives), one request cancelled. Nothing of the SDK is patched.

The agent runs pods on the host network, so workers reach the server on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import runpod

from gpucloud.core.errors import GpucloudError
from tests.e2e.cluster import ADMIN_KEY, Cloud, running_cloud, wait_for
from tests.e2e.serverless_image import worker_image
from tests.fixtures.postgres import free_port
from tests.fixtures.registry import Registry

AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
COLD = 90.0  # a cold start on a loaded 2-core machine: pull, unpack, start Python
T = TypeVar("T")


@pytest.fixture(scope="module")
def worker_ref(registry: Registry) -> str:
    worker_image().push(registry.host, "e2e/sls-worker:1")
    return f"{registry.host}/e2e/sls-worker:1"


@pytest.fixture
def sls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cloud]:
    """A cloud whose workers reach it on its fixed port; long polls held 2 s."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_cloud(tmp_path, port=port, serverless_url=url,
                       serverless_long_poll_seconds=2.0) as cloud:
        monkeypatch.setattr(runpod, "api_key", ADMIN_KEY)
        monkeypatch.setattr(runpod, "endpoint_url_base", f"{url}/v2")
        cloud.agent("node-a", extra=["--network", "host"])
        yield cloud


def endpoint(cloud: Cloud) -> dict[str, Any]:
    response = httpx.get(f"{cloud.url}/v1/endpoints/echo", headers=AUTH, timeout=10)
    response.raise_for_status()
    return dict(response.json())


def worker_pods(cloud: Cloud, *phases: str) -> list[Any]:
    return [p for p in cloud.client.list_pods() if p.name.startswith("echo-w-")
            and (not phases or p.phase in phases)]


def situation(cloud: Cloud, jobs: list[runpod.endpoint.runner.Job]) -> str:
    """The endpoint as a failed wait leaves it: its workers and queue, each worker pod's
    phase, reason, node and last events, the nodes' leases, the requests waited on, the
    last lines of each agent's log."""
    agents = {a.name: a.log.read_text(errors="replace").splitlines()[-3:]
              for a in cloud.agents if a.log.exists()}
    try:
        ep = endpoint(cloud)
        pods = []
        for pod in worker_pods(cloud):
            events = [f"{e.reason}{f' ({e.message})' if e.message else ''}"
                      for e in cloud.client.pod_events(pod.id)[-4:]]
            pods.append(f"{pod.name} {pod.phase} ({pod.reason or 'no reason'}) on "
                        f"{pod.node or 'no node'}{f': {pod.message}' if pod.message else ''}"
                        f" [{', '.join(events)}]")
        nodes = [f"{n.name} {n.status} (token {n.fencing_token}, lease until "
                 f"{n.lease_expires_at})" for n in cloud.client.list_nodes()]
        requests = [httpx.get(f"{cloud.url}/v2/{ep['id']}/status/{job.job_id}", headers=AUTH,
                              timeout=10).json() for job in jobs[:5]]
    except (httpx.HTTPError, GpucloudError, ValueError) as error:  # the server may be down
        return f"the state could not be read ({error!r}); agent logs end: {agents}"
    return (f"endpoint: {ep['workers']} running workers ({ep['workers_idle']} idle), "
            f"{ep['queue']} queued; worker pods: {'; '.join(pods) or 'none'}; "
            f"nodes: {'; '.join(nodes)}; requests: {requests}; agent logs end: {agents}")


def wait_sls(cloud: Cloud, check: Callable[[], T | None], timeout: float, what: str,
             jobs: list[runpod.endpoint.runner.Job] | None = None) -> T:
    """``wait_for``, failing with the endpoint's state (``situation``) at the deadline."""
    try:
        return wait_for(check, timeout, what)
    except pytest.fail.Exception as timed_out:
        pytest.fail(f"{timed_out}; {situation(cloud, jobs or [])}")


def finished(cloud: Cloud, jobs: list[runpod.endpoint.runner.Job], timeout: float
             ) -> list[str]:
    """Every job's final status (the SDK's ``status()`` keeps a final one)."""
    final = {"COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"}
    wait_sls(cloud, lambda: all(job.status() in final for job in jobs), timeout,
             f"{len(jobs)} requests to finish", jobs)
    return [job.status() for job in jobs]


def test_serverless_end_to_end(sls: Cloud, worker_ref: str) -> None:
    created = httpx.post(f"{sls.url}/v1/endpoints", headers=AUTH, timeout=10, json={
        "name": "echo", "image": worker_ref, "min_workers": 0, "max_workers": 3,
        "idle_timeout": "2s", "scaler": "request-count", "scaler_value": 8,
        "execution_timeout": "60s", "max_retries": 3, "cpu": 0.5, "memory": "512Mi"})
    assert created.status_code == 201, created.text
    endpoint_id = created.json()["id"]
    assert endpoint(sls)["workers"] == 0 and worker_pods(sls) == []
    echo = runpod.Endpoint(endpoint_id)

    # scale from zero: the first request waits for a cold start, then 50 more
    started = time.monotonic()
    assert echo.run_sync({"value": "first"}, timeout=int(COLD))["echo"] == "first"
    cold = time.monotonic() - started
    jobs = [echo.run({"value": i, "sleep": 0.2}) for i in range(44)]
    # 44 queued at 8 per worker: the autoscaler asks for max-workers (3) at once
    wait_sls(sls, lambda: len(worker_pods(sls)) == 3, 10, "the endpoint to scale up to 3")
    with ThreadPoolExecutor(6) as pool:
        synced = list(pool.map(lambda i: echo.run_sync({"value": f"s{i}"}, timeout=120),
                               range(6)))
    assert [out["echo"] for out in synced] == [f"s{i}" for i in range(6)]
    assert finished(sls, jobs, COLD) == ["COMPLETED"] * len(jobs)
    assert [job.output()["echo"] for job in jobs] == list(range(44))

    # back to zero after the idle timeout
    wait_sls(sls, lambda: not worker_pods(sls), 30, "the workers to scale back to zero")
    assert endpoint(sls)["workers"] == 0

    # a worker killed mid-request: the request is retried on a replacement, not lost
    slow = echo.run({"value": "survivor", "sleep": 3})
    wait_sls(sls, lambda: slow.status() == "IN_PROGRESS", COLD, "the slow request to start",
             [slow])
    victims = {p.id for p in wait_sls(sls, lambda: worker_pods(sls, "Running"), 20,
                                      "the worker to be reported Running")}
    driver = sls.agents[0].driver()
    for container in driver.containers():  # SIGKILL, as a crash of the worker
        if container.container_id.rpartition("-")[0] in victims:
            driver.signal(container.container_id, "KILL")
    assert finished(sls, [slow], COLD) == ["COMPLETED"]
    assert slow.output()["echo"] == "survivor" and slow.output()["pod"] not in victims

    # cancel one: it never runs to completion
    long = echo.run({"value": "cancel-me", "sleep": 30})
    long.cancel()
    assert finished(sls, [long], 10) == ["CANCELLED"]

    # a server restart with requests queued: none is lost
    queued = [echo.run({"value": f"q{i}"}) for i in range(3)]
    sls.server.stop()
    sls.server.start()
    assert finished(sls, queued, COLD) == ["COMPLETED"] * 3
    assert [job.output()["echo"] for job in queued] == ["q0", "q1", "q2"]
    health = echo.health()
    assert health["jobs"]["retried"] >= 1 and health["jobs"]["failed"] == 0
    wait_sls(sls, lambda: not worker_pods(sls), 30, "the workers to scale back to zero")
    # worker seconds are billed like pods': every worker that ran is metered
    billed = [row for row in sls.client.usage(by="pod").rows
              if row.pod and row.pod.startswith("echo-w-")]
    assert billed and all(row.seconds > 0 and row.cpu_core_seconds > 0 for row in billed)
    print(f"cold start (scale from zero to the first result): {cold:.2f}s")
