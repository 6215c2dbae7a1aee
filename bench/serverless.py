"""Benchmark: serverless cold start and warm request latency through the durable queue.

A real server (SQLite), one real agent process (simulated dgx-h100, pods on the host
network) and Debian's ``docker-registry`` on 127.0.0.1; the worker image is built here
from the host's Python and the installed ``runpod`` package (tests/e2e/serverless_image.py:
the SDK's own ``runpod.serverless.start`` serving an echo handler). Measured:

* plain pod start: ``pod create`` of the same image running the worker's own start-up
  (Python importing ``runpod.serverless``) -> its first output line served by the API;
  first with the image not on the node (``pull``), then cached (the comparison point);
* cold start: an endpoint at zero workers, ``POST /v2/{id}/runsync`` -> its result: the
  autoscaler's reaction, the worker pod's placement and start, the SDK's start-up, its
  first job-take, the handler, the result (the image is cached on the node, as after its
  first use: the agent's image cache keeps it);
* warm latency: one worker kept (min-workers 1), sequential ``runsync`` requests to a
  handler that sleeps ``--handler-ms``; added latency = client round trip - that sleep
  and ``queue`` = client round trip - the server's ``executionTime`` (what is not spent
  between the worker's take and its result: the client's requests, the queue, the
  take's wake-up; target p50 < 50 ms); ``delayTime`` is reported too. ``added`` also
  holds the SDK's own pacing inside the worker: its job runner polls its internal queue
  every 0.1 s. Three cases (``warm_cases``): requests that find the worker waiting in its
  job-take long poll; back-to-back requests to a worker of concurrency 3; back-to-back
  requests to the SDK's default concurrency 1, which pays the SDK's own 1 s re-check.

    .venv/bin/python bench/serverless.py --quick    # a few minutes
    .venv/bin/python bench/serverless.py            # more runs

Writes JSON to bench/results/serverless.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.cluster import ADMIN_KEY, Cloud, clean_node, running_cloud  # noqa: E402
from tests.e2e.serverless_image import PYTHON, worker_image  # noqa: E402
from tests.fixtures.postgres import free_port  # noqa: E402
from tests.fixtures.registry import start_registry  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "serverless.json"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
READY = "worker python ready"
START_UP = f"import runpod, runpod.serverless; print({READY!r}, flush=True)"


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)
    return value


def plain_pod_start(cloud: Cloud, name: str, image: str) -> float:
    """Seconds from ``pod create`` to the worker start-up's first output line."""
    started = time.perf_counter()
    cloud.create_pod(name, image, [PYTHON, "-c", START_UP], cpu=0.5, memory="512Mi")
    wait(lambda: READY in cloud.client.pod_logs(name).text, 300, f"pod {name}'s first line")
    elapsed = time.perf_counter() - started
    cloud.wait_pod(name, "Succeeded", "Failed")
    cloud.client.delete_pod(name)
    return round(elapsed, 4)


def workers(http: httpx.Client) -> int:
    return int(http.get("/v1/endpoints/echo").json()["workers"])


def no_workers(cloud: Cloud) -> bool:
    return not [p for p in cloud.client.list_pods() if p.name.startswith("echo-w-")]


def runsync(http: httpx.Client, endpoint_id: str, payload: dict[str, Any]
            ) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    response = http.post(f"/v2/{endpoint_id}/runsync", json={"input": payload},
                         params={"wait": 120_000}, timeout=130)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    body = dict(response.json())
    if body.get("status") != "COMPLETED":
        raise RuntimeError(f"request not completed: {body}")
    return elapsed, body


def cold_starts(cloud: Cloud, http: httpx.Client, endpoint_id: str, runs: int) -> list[float]:
    seconds = []
    for run in range(runs):
        wait(lambda: no_workers(cloud), 60, "the endpoint to be at zero workers")
        elapsed, _ = runsync(http, endpoint_id, {"value": f"cold-{run}"})
        seconds.append(round(elapsed, 4))
    return seconds


def create_endpoint(http: httpx.Client, ref: str, name: str, **fields: Any) -> str:
    created = http.post("/v1/endpoints", json={
        "name": name, "image": ref, "max_workers": 1, "idle_timeout": "1s", "cpu": 0.5,
        "memory": "512Mi", **fields})
    created.raise_for_status()
    return str(created.json()["id"])


def warm(http: httpx.Client, endpoint_id: str, requests: int, handler_ms: float,
         gap: float) -> dict[str, Any]:
    """Sequential requests to a warm worker, ``gap`` seconds apart."""
    for _ in range(3):  # the worker's first requests warm its connections
        runsync(http, endpoint_id, {"value": "warm-up"})
    added, queue, delay, execution = [], [], [], []
    for n in range(requests):
        time.sleep(gap)
        elapsed, body = runsync(http, endpoint_id, {"value": n, "sleep": handler_ms / 1000})
        added.append((elapsed - handler_ms / 1000) * 1000)
        delay.append(float(body.get("delayTime") or 0))
        execution.append(float(body.get("executionTime") or 0))
        queue.append(elapsed * 1000 - execution[-1])
    return {
        "requests": requests, "handler_ms": handler_ms, "gap_seconds": gap,
        "added_ms_p50": round(quantile(added, 0.5), 2),
        "added_ms_p99": round(quantile(added, 0.99), 2),
        "added_ms_max": round(max(added), 2),
        "queue_ms_p50": round(quantile(queue, 0.5), 2),
        "queue_ms_p99": round(quantile(queue, 0.99), 2),
        "server_delay_time_ms_p50": round(statistics.median(delay), 2),
        "server_execution_time_ms_p50": round(statistics.median(execution), 2),
        "target_queue_ms_p50": 50,
    }


def warm_cases(http: httpx.Client, ref: str, echo_id: str, requests: int,
               handler_ms: float) -> dict[str, Any]:
    """Two warm cases. The SDK fetches a job only below its concurrency and, while full,
    re-checks once a second: with its default concurrency 1 a request sent right after
    the previous one finished waits for that re-check. So: requests that find the
    worker in its job-take long poll (1.1 s apart), and back-to-back requests to a
    worker whose handler sets ``concurrency_modifier`` to 3 (the SDK counts a job just
    taken twice, queued and in progress: from 3 on a job-take long poll always waits)."""
    http.patch("/v1/endpoints/echo", json={"min_workers": 1}).raise_for_status()
    wait(lambda: workers(http) >= 1, 120, "a warm worker")
    spaced = warm(http, echo_id, max(10, requests // 5), handler_ms, gap=1.1)
    back_to_back_sdk_default = warm(http, echo_id, max(10, requests // 5), handler_ms, gap=0)
    http.delete("/v1/endpoints/echo").raise_for_status()
    wide = create_endpoint(http, ref, "echo2", min_workers=1,
                           env={"WORKER_CONCURRENCY": "3"})
    wait(lambda: int(http.get("/v1/endpoints/echo2").json()["workers"]) >= 1, 120,
         "a warm worker of concurrency 3")
    return {"long_poll_waiting": spaced,
            "back_to_back_concurrency_3": warm(http, wide, requests, handler_ms, gap=0),
            "back_to_back_sdk_default_concurrency_1": back_to_back_sdk_default}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="few runs (a few minutes)")
    parser.add_argument("--cold-runs", type=int, default=None)
    parser.add_argument("--plain-runs", type=int, default=None)
    parser.add_argument("--warm-requests", type=int, default=None)
    parser.add_argument("--handler-ms", type=float, default=10.0)
    args = parser.parse_args()
    cold_runs = args.cold_runs or (3 if args.quick else 7)
    plain_runs = args.plain_runs or (3 if args.quick else 7)
    warm_requests = args.warm_requests or (100 if args.quick else 1000)
    with tempfile.TemporaryDirectory(prefix="gpucloud-bench-") as tmp:
        workdir = Path(tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with start_registry(workdir / "registry") as registry, \
                running_cloud(workdir / "cloud", port=port, serverless_url=url) as cloud, \
                httpx.Client(base_url=url, headers=AUTH, timeout=30) as http:
            image = worker_image()
            image.push(registry.host, "bench/sls-worker:1")
            ref = f"{registry.host}/bench/sls-worker:1"
            agent = cloud.agent("bench-node", extra=["--network", "host"])
            pull = plain_pod_start(cloud, "plain-pull", ref)
            plain = [plain_pod_start(cloud, f"plain-{n}", ref) for n in range(plain_runs)]
            endpoint_id = create_endpoint(http, ref, "echo", min_workers=0)
            cold = cold_starts(cloud, http, endpoint_id, cold_runs)
            warm_case = warm_cases(http, ref, endpoint_id, warm_requests, args.handler_ms)
            result = {
                "benchmark": "serverless", "mode": "quick" if args.quick else "full",
                "image_mb": round(sum(len(layer.data) for layer in image.layers) / 1e6, 1),
                "plain_pod_start_pull_seconds": pull,
                "plain_pod_start_cached": {"runs": plain, "median_seconds":
                                           round(statistics.median(plain), 4)},
                "cold_start": {
                    "measured": "runsync at zero workers -> its result (image cached)",
                    "runs": cold, "median_seconds": round(statistics.median(cold), 4)},
                "cold_over_plain_cached": round(statistics.median(cold)
                                                / statistics.median(plain), 2),
                "warm": warm_case,
            }
            http.delete("/v1/endpoints/echo2")
            wait(lambda: not [p for p in cloud.client.list_pods()
                              if p.name.startswith("echo")], 60, "the workers to go")
            agent.terminate()
            clean_node(agent.state_dir)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
