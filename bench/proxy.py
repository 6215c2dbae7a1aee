"""Benchmark: latency the HTTP proxy adds to a GET, over loopback.

A real ``gpucloud server`` process (SQLite), one real agent process (simulated dgx-h100)
and a busybox runc pod running ``httpd`` (Debian's ``docker-registry`` on 127.0.0.1
serves its image). Each round sends one GET straight to the pod's server (its address on
the node: the pod's network namespace, or loopback with host networking) and one through
the proxy (host form, ``Host: {pod}-8080.localhost``: server → SSH channel → agent →
pod), each on its own keep-alive connection, alternating so that drift hits both alike.
Target: added p50 < 5 ms. Needs root, runc, busybox-static and docker-registry.

    .venv/bin/python bench/proxy.py [--requests 2000]

Writes JSON to bench/results/proxy.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.cluster import AgentProcess, clean_node  # noqa: E402
from tests.e2e.proxy_image import COMMAND, HTTP_PORT, INDEX, PORTS, proxy_pod_image  # noqa: E402
from tests.fixtures.postgres import free_port  # noqa: E402
from tests.fixtures.registry import start_registry  # noqa: E402

from gpucloud.client.sdk import GpucloudClient  # noqa: E402
from gpucloud.core.models import PodOut  # noqa: E402

ADMIN_KEY = "gpc_bench-proxy-admin-key"
RESULTS = ROOT / "bench" / "results"
TARGET_ADDED_P50_MS = 5.0


@contextmanager
def server_process(workdir: Path) -> Iterator[str]:
    """``gpucloud server`` in its own process (the load generator does not share its GIL)."""
    port = free_port()
    env = {**os.environ, "GPUCLOUD_HOME": str(workdir / "home"),
           "GPUCLOUD_ADMIN_KEY": ADMIN_KEY}
    log = (workdir / "server.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "gpucloud.cli.main", "server", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait(lambda: _healthy(url, process), 60, "the server to start")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def _healthy(url: str, process: subprocess.Popen[bytes]) -> bool:
    if process.poll() is not None:
        raise RuntimeError("the server exited; see server.log")
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def start_agent(client: GpucloudClient, url: str, workdir: Path) -> AgentProcess:
    state_dir = workdir / "node-a"
    state_dir.mkdir(parents=True)
    token = client.create_join_token().token
    agent = AgentProcess("node-a", state_dir, [
        sys.executable, "-m", "gpucloud.cli.agent", "--server", url, "--join-token", token,
        "--name", "node-a", "--state-dir", str(state_dir), "--simulate", "dgx-h100"])
    agent.start()
    wait(lambda: any(n.name == "node-a" and n.status == "Ready"
                     for n in client.list_nodes()), 30, "the node to be Ready")
    return agent


def direct_address(pod: PodOut) -> str:
    """The pod's own address as its node reaches it (loopback with host networking)."""
    for port in pod.ports_runtime:
        if not port.isIpPublic and port.ip:
            return port.ip
    return "127.0.0.1"


def timed_get(client: httpx.Client, url: str, headers: dict[str, str]) -> float:
    started = time.perf_counter()
    response = client.get(url, headers=headers)
    elapsed = time.perf_counter() - started
    if response.status_code != 200 or response.text != INDEX:
        raise RuntimeError(f"GET {url}: {response.status_code} {response.text[:200]!r}")
    return elapsed * 1000


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def measure(server: str, pod: PodOut, requests: int) -> dict[str, object]:
    direct_url = f"http://{direct_address(pod)}:{HTTP_PORT}/index.html"
    proxy_headers = {"Host": f"{pod.id}-{HTTP_PORT}.localhost",
                     "Authorization": f"Bearer {ADMIN_KEY}"}
    direct, proxied = [], []
    with httpx.Client(timeout=10) as to_pod, httpx.Client(timeout=10) as to_proxy:
        for _ in range(50):  # warm-up: connections, caches, the pooled SSH channel
            timed_get(to_pod, direct_url, {})
            timed_get(to_proxy, f"{server}/index.html", proxy_headers)
        for _ in range(requests):
            direct.append(timed_get(to_pod, direct_url, {}))
            proxied.append(timed_get(to_proxy, f"{server}/index.html", proxy_headers))
    result: dict[str, object] = {"requests": requests, "direct_url": direct_url}
    for name, values in (("direct", direct), ("proxied", proxied)):
        result[name] = {"p50_ms": round(statistics.median(values), 3),
                        "p99_ms": round(percentile(values, 0.99), 3),
                        "mean_ms": round(statistics.fmean(values), 3)}
    added_p50 = statistics.median(proxied) - statistics.median(direct)
    result["added_p50_ms"] = round(added_p50, 3)
    result["added_p99_ms"] = round(percentile(proxied, 0.99) - percentile(direct, 0.99), 3)
    result["target_added_p50_ms"] = TARGET_ADDED_P50_MS
    result["meets_target"] = added_p50 < TARGET_ADDED_P50_MS
    return result


def run(requests: int) -> dict[str, object]:
    workdir = Path(tempfile.mkdtemp(prefix="gpucloud-bench-proxy-"))
    with start_registry(workdir / "registry") as registry, server_process(workdir) as url:
        proxy_pod_image().push(registry.host, "bench/proxy-pod:1")
        client = GpucloudClient(url, ADMIN_KEY)
        agent = start_agent(client, url, workdir)
        try:
            client.create_pod({"name": "web", "image": f"{registry.host}/bench/proxy-pod:1",
                               "command": COMMAND, "ports": PORTS})
            wait(lambda: client.get_pod("web").phase == "Running", 60, "the pod to run")
            pod = client.get_pod("web")
            wait(lambda: httpx.get(f"{url}/index.html", timeout=5, headers={
                "Host": f"{pod.id}-{HTTP_PORT}.localhost",
                "Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200,
                 30, "httpd to answer through the proxy")
            return measure(url, pod, requests)
        finally:
            agent.terminate()
            clean_node(agent.state_dir)
            client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    result = run(args.requests)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "proxy.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
