"""Benchmark: time from `pod create` to the pod's first output line, as a user sees it.

A real server (SQLite), one real agent process (simulated dgx-h100) and Debian's
``docker-registry`` on 127.0.0.1. Two cases:

* cached: a small busybox image already in the node's store (the usual restart/redeploy);
* cold: a ~200 MB image (busybox + incompressible data layers) never seen by the node,
  pulled from the local registry — a new image per run, so every run is really cold;
* floor: ``runc run`` of a bundle prepared from the cached image exactly as the agent does
  (image store, rootfs, ``RuncDriver.build``), timed from the spawn of runc to the first
  output line on its stdout: what no control plane can beat. ``cached_over_floor`` is the
  ratio of the medians, both measured in this run (the target: at most 2).

The clock starts just before the create call and stops when ``GET /v1/pods/{id}/logs``
first returns the line (polled every 10 ms). Phase timestamps from the pod's events give
a breakdown. Needs root, runc, busybox-static and docker-registry.

    .venv/bin/python bench/pod_start.py [--runs 9] [--cold-runs 3] [--cold-mb 200]
                                        [--floor-runs 15]

Writes JSON to bench/results/pod_start.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.cluster import Cloud, clean_node, running_cloud  # noqa: E402
from tests.fixtures.registry import start_registry  # noqa: E402

from gpucloud.agent.podworker import runtime_image_config  # noqa: E402
from gpucloud.core.models import PodEventOut  # noqa: E402
from gpucloud.images import ImageManager  # noqa: E402
from gpucloud.images.testing import (  # noqa: E402
    build_image,
    busybox_files,
    busybox_image,
    make_layer,
    random_image,
)
from gpucloud.runtime.bundle import ContainerSpec  # noqa: E402
from gpucloud.runtime.driver import DEFAULT_RUNC, RuncDriver  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "pod_start.json"
FIRST_LINE = "first line"


def time_to_first_line(cloud: Cloud, name: str, image: str, timeout: float = 300) -> float:
    """Seconds from the create call to the first output line being served by the API."""
    start = time.perf_counter()
    pod = cloud.create_pod(name, image, ["echo", FIRST_LINE], gpus=1)
    deadline = start + timeout
    while FIRST_LINE not in cloud.client.pod_logs(pod.id).text:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"pod {name} printed nothing in {timeout}s: "
                               f"{cloud.client.get_pod(pod.id)}")
        time.sleep(0.01)
    return time.perf_counter() - start


def breakdown(events: list[PodEventOut]) -> dict[str, float]:
    """Seconds between consecutive phases (Pending→Scheduled→Pulling→Running)."""
    at = {str(e.to_phase): e.time for e in events if e.to_phase is not None}
    steps = [("Pending", "Scheduled"), ("Scheduled", "Pulling"), ("Pulling", "Running")]
    return {f"{a}->{b}": (at[b] - at[a]).total_seconds() for a, b in steps if a in at and b in at}


def run_case(cloud: Cloud, prefix: str, images: list[str]) -> dict[str, Any]:
    seconds, phases = [], []
    for number, image in enumerate(images):
        name = f"{prefix}-{number}"
        seconds.append(round(time_to_first_line(cloud, name, image), 4))
        phases.append(breakdown(cloud.client.pod_events(name)))
        cloud.wait_pod(name, "Succeeded", "Failed")
        cloud.client.delete_pod(name)
    keys = sorted({key for step in phases for key in step})
    return {
        "runs": len(seconds),
        "median_seconds": round(statistics.median(seconds), 4),
        "min_seconds": min(seconds),
        "max_seconds": max(seconds),
        "all_seconds": seconds,
        "phase_median_seconds": {
            key: round(statistics.median(step[key] for step in phases if key in step), 4)
            for key in keys
        },
    }


def runc_floor(image_ref: str, state_dir: Path, runs: int) -> list[float]:
    """Seconds from spawning ``runc run`` of a prepared bundle to its first output line.

    The bundle is built the way the agent builds a pod's (the node's image store, its
    rootfs preparation, ``RuncDriver.build``) for the same image and command; only the
    runs themselves are timed, each under a fresh container id.
    """
    images = ImageManager(state_dir)
    driver = RuncDriver(state_dir)
    paths = driver.paths("floor-bundle")
    try:
        image = images.pull(image_ref)
        rootfs = images.prepare_rootfs(image, paths.root)
        spec = ContainerSpec(container_id="floor-bundle", hostname="floor",
                             command=("echo", FIRST_LINE), node_name="floor")
        driver.build(spec, rootfs, runtime_image_config(image.config))
        return [_time_runc_run(driver, paths.root, f"floor-{run}") for run in range(runs)]
    finally:
        images.release_rootfs(paths.root)
        driver.remove("floor-bundle")
        images.close()


def _time_runc_run(driver: RuncDriver, bundle: Path, cid: str) -> float:
    command = [DEFAULT_RUNC, "--root", str(driver.runc_root), "run", "--bundle", str(bundle), cid]
    start = time.perf_counter()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL) as runc:
        assert runc.stdout is not None
        line = runc.stdout.readline()
        elapsed = time.perf_counter() - start
        runc.stdout.read()
    subprocess.run([DEFAULT_RUNC, "--root", str(driver.runc_root), "delete", "--force", cid],
                   check=False, capture_output=True)
    if FIRST_LINE.encode() not in line:
        raise RuntimeError(f"runc run printed {line!r}, not {FIRST_LINE!r}")
    return round(elapsed, 4)


def push_cold_images(registry: str, runs: int, megabytes: int) -> tuple[list[str], float]:
    """One big image per run: busybox plus incompressible layers; returns refs and MB."""
    refs, size = [], 0.0
    base = make_layer(busybox_files())
    for run in range(runs):
        data = random_image(megabytes * 1_000_000, layers=4, seed=1000 + run).layers
        image = build_image([base, *data], cmd=["sh"])
        image.push(registry, f"bench/cold-{run}:1")
        refs.append(f"{registry}/bench/cold-{run}:1")
        size = sum(len(layer.data) for layer in image.layers) / 1e6
    return refs, round(size, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--runs", type=int, default=9, help="cached-image runs")
    parser.add_argument("--cold-runs", type=int, default=3, help="cold-pull runs")
    parser.add_argument("--cold-mb", type=int, default=200, help="size of the cold image")
    parser.add_argument("--floor-runs", type=int, default=15, help="runc run (floor) runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpucloud-bench-") as tmp:
        workdir = Path(tmp)
        with start_registry(workdir / "registry") as registry, \
                running_cloud(workdir / "cloud") as cloud:
            busybox_image().push(registry.host, "bench/busybox:1")
            cached = f"{registry.host}/bench/busybox:1"
            agent = cloud.agent("bench-node")
            time_to_first_line(cloud, "warm-up", cached)  # pulls it into the store
            cloud.client.delete_pod("warm-up")
            cold_refs, cold_mb = push_cold_images(registry.host, args.cold_runs, args.cold_mb)
            # Floor runs before and after the cached ones, so that load drifting during
            # the run weighs on both sides of the ratio alike.
            half = args.floor_runs // 2
            floor = runc_floor(cached, workdir / "floor", half)
            cached_case = run_case(cloud, "cached", [cached] * args.runs)
            floor += runc_floor(cached, workdir / "floor", args.floor_runs - half)
            floor_median = statistics.median(floor)
            result = {
                "benchmark": "pod_start",
                "measured": "pod create -> first output line served by GET /v1/pods/{id}/logs",
                "cached": cached_case,
                "floor_runc_run": {
                    "measured": "spawn of `runc run` of the prepared bundle -> first stdout line",
                    "runs": len(floor), "median_seconds": round(floor_median, 4),
                    "min_seconds": min(floor), "max_seconds": max(floor),
                    "all_seconds": floor,
                },
                "cached_over_floor": round(cached_case["median_seconds"] / floor_median, 2),
                "target_cached_over_floor": 2.0,
                "target_cached_median_seconds": 1.0,
            }
            if cold_refs:
                result["cold"] = {"image_mb": cold_mb, **run_case(cloud, "cold", cold_refs)}
            agent.terminate()
            clean_node(agent.state_dir)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
