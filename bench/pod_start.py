"""Benchmark: time from `pod create` to the pod's first output line, as a user sees it.

A real server (SQLite) as its own process (``gpucloud server``, as in production: the
bench's client, waiting on the log, then shares no GIL with the server's create, scheduling
pass and log commits), one real agent process (simulated dgx-h100) and Debian's
``docker-registry`` on 127.0.0.1. The cases:

* cached: a small busybox image already in the node's store (the usual restart/redeploy);
* cold: a ~200 MB image (busybox + incompressible data layers) never seen by the node,
  pulled from the local registry — a new image per run, so every run is really cold;
* floor: ``runc run`` of a bundle prepared from the cached image exactly as the agent does
  (image store, rootfs, ``RuncDriver.build``), timed from the spawn of runc to the first
  output line on its stdout: what no control plane can beat. ``cached_over_floor`` is the
  ratio of the medians, both measured in this run (the target: at most 2).

The clock starts just before the create call and stops when ``GET /v1/pods/{id}/logs``
first returns the line: waiting reads (``?wait=30``), each answered as soon as the log's
commit wakes it, as ``gpucloud pod logs -f`` follows (before them: a poll every 10 ms).
Phase timestamps from the pod's events give a breakdown. Needs root, runc, busybox-static
and docker-registry.

    .venv/bin/python bench/pod_start.py [--runs 9] [--cold-runs 3] [--cold-mb 200]
                                        [--floor-runs 15] [--trace FILE]

``--trace FILE`` turns on the cross-process trace (core/trace.py, ``GPUCLOUD_TRACE``, which
the server's process inherits) for the server, the agent and its supervisors, and adds
``cached.timeline``: for every step of a cached start (create committed, scheduling pass,
bind, long poll woken and answered, the agent's answer, bundle, runc, first log read and
shipped, log served) its median time after the create call, and the whole timeline of the
median run.

Writes JSON to bench/results/pod_start.json and prints it. Figures: docs/agent.md ("The
start path"); with the server its own process, at load 3–35 on 2 cores, 11 runs: cached
median 0.305 s, floor 0.092 s, ratio median 3.08 (3.63 with the server on a thread of the
bench, 12 runs alternated with those).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.cluster import (  # noqa: E402
    ADMIN_KEY,
    LEASE_TTL,
    Cloud,
    ServerThread,
    clean_node,
    cloud_on,
    wait_for,
)
from tests.fixtures.postgres import free_port  # noqa: E402
from tests.fixtures.registry import start_registry  # noqa: E402

from gpucloud.agent.podworker import runtime_image_config  # noqa: E402
from gpucloud.core import trace  # noqa: E402
from gpucloud.core.models import PodEventOut  # noqa: E402
from gpucloud.core.settings import Settings  # noqa: E402
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
#: Each waiting log read's ``?wait=`` (the API's longest): it answers once output is stored.
LOG_WAIT = 30.0


class ServerProcess(ServerThread):
    """``gpucloud server`` as its own process, as in production (``gpucloud up`` spawns it
    the same way): the bench's log polling then competes with the server for CPU only, not
    for one GIL. Its settings go by the environment (``Settings.from_env``); the trace
    variable, when set, is inherited with the rest."""

    def __init__(self, settings: Settings, port: int, log: Path) -> None:
        super().__init__(settings, port)
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "GPUCLOUD_HOME": str(self.settings.home),
               "GPUCLOUD_DATABASE_URL": self.settings.database_url,
               "GPUCLOUD_ADMIN_KEY": self.settings.admin_key or "",
               "GPUCLOUD_LEASE_TTL": str(self.settings.lease_ttl_seconds)}
        env.pop("GPUCLOUD_SSH_PORT", None)
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gpucloud.cli.main", "server", "--port", str(self.port),
                 "--ssh-port", "0"],  # any free port: the bench never uses the gateway
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        process = self.process

        def healthy() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with status {process.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")
            try:
                return httpx.get(f"{self.url}/healthz", timeout=1.0).is_success
            except httpx.TransportError:
                return False

        try:
            wait_for(healthy, 60, "the server to start")
        except BaseException:
            process.kill()
            process.wait()
            raise

    def stop(self) -> None:
        """SIGTERM (uvicorn's graceful stop, its in-flight long polls cut after 3 s)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@contextmanager
def server_cloud(workdir: Path) -> Iterator[Cloud]:
    """``tests.e2e.cluster.running_cloud``'s cloud (SQLite, its admin key and lease TTL,
    agents added on demand), with the server a process of its own."""
    workdir.mkdir(parents=True, exist_ok=True)
    settings = Settings(home=workdir / "home",
                        database_url=f"sqlite:///{workdir / 'db.sqlite'}",
                        admin_key=ADMIN_KEY, lease_ttl_seconds=LEASE_TTL)
    with cloud_on(ServerProcess(settings, free_port(), workdir / "server.log"),
                  workdir) as cloud:
        yield cloud


def time_to_first_line(cloud: Cloud, name: str, image: str, timeout: float = 300) -> float:
    """Seconds from the create call to the first output line being served by the API."""
    start = time.perf_counter()
    trace.mark("bench.create", name=name)
    pod = cloud.create_pod(name, image, ["echo", FIRST_LINE], gpus=1)
    trace.mark("bench.created")
    deadline = start + timeout
    seen, offset = "", 0
    while FIRST_LINE not in seen:  # waiting reads: each answers when output is stored
        left = deadline - time.perf_counter()
        if left <= 0:
            raise RuntimeError(f"pod {name} printed nothing in {timeout}s: "
                               f"{cloud.client.get_pod(pod.id)}")
        chunk = cloud.client.pod_logs(pod.id, offset=offset, wait=min(LOG_WAIT, left))
        seen, offset = seen + chunk.text, chunk.next_offset
        if chunk.finished and FIRST_LINE not in seen:
            raise RuntimeError(f"pod {name} ended without its line: "
                               f"{cloud.client.get_pod(pod.id)}")
    elapsed = time.perf_counter() - start
    trace.mark("bench.served", name=name)
    return elapsed


def _label(event: dict[str, Any]) -> str:
    """An event's name, with the phase it reports when it has one."""
    return f"{event['event']}:{event['phase']}" if "phase" in event else str(event["event"])


def start_timeline(events: list[dict[str, Any]], name: str) -> list[tuple[str, float]]:
    """Every traced step of pod ``name``'s start: (label, seconds after create), from its
    ``bench.create`` to its ``bench.served``, in time order."""
    begin = next(float(e["t"]) for e in events
                 if e["event"] == "bench.create" and e.get("name") == name)
    end = next(float(e["t"]) for e in events
               if e["event"] == "bench.served" and e.get("name") == name)
    return [(_label(e), round(float(e["t"]) - begin, 4)) for e in events
            if begin <= float(e["t"]) <= end]


def timeline_summary(events: list[dict[str, Any]], names: list[str],
                     seconds: list[float]) -> dict[str, Any]:
    """Each step's median time after create over the runs (first occurrence per run),
    and the full timeline of the median run."""
    firsts: dict[str, list[float]] = {}
    runs = [start_timeline(events, name) for name in names]
    for steps in runs:
        seen: set[str] = set()
        for label, at in steps:
            if label in seen:
                continue
            seen.add(label)
            firsts.setdefault(label, []).append(at)
    medians = {label: round(statistics.median(ats), 4) for label, ats in firsts.items()}
    order = dict(sorted(medians.items(), key=lambda item: item[1]))
    median_run = sorted(range(len(names)), key=lambda i: seconds[i])[len(names) // 2]
    return {
        "step_median_seconds_after_create": order,
        "step_runs": {label: len(firsts[label]) for label in order},
        "median_run": names[median_run],
        "median_run_steps": [f"{at:.4f} {label}" for label, at in runs[median_run]],
    }


def breakdown(events: list[PodEventOut]) -> dict[str, float]:
    """Seconds between consecutive phases (Pending→Scheduled→Pulling→Running)."""
    at = {str(e.to_phase): e.time for e in events if e.to_phase is not None}
    steps = [("Pending", "Scheduled"), ("Scheduled", "Pulling"), ("Pulling", "Running")]
    return {f"{a}->{b}": (at[b] - at[a]).total_seconds() for a, b in steps if a in at and b in at}


def run_case(cloud: Cloud, prefix: str, images: list[str],
             trace_file: Path | None = None) -> dict[str, Any]:
    seconds, phases, names = [], [], []
    for number, image in enumerate(images):
        name = f"{prefix}-{number}"
        names.append(name)
        seconds.append(round(time_to_first_line(cloud, name, image), 4))
        phases.append(breakdown(cloud.client.pod_events(name)))
        cloud.wait_pod(name, "Succeeded", "Failed")
        cloud.client.delete_pod(name)
    keys = sorted({key for step in phases for key in step})
    timeline = ({"timeline": timeline_summary(trace.load(str(trace_file)), names, seconds)}
                if trace_file is not None else {})
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
        **timeline,
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
    parser.add_argument("--trace", type=Path, metavar="FILE",
                        help="trace every process to FILE (core/trace.py) and report each "
                             "step of the cached starts")
    args = parser.parse_args()
    if args.trace is not None:
        args.trace.unlink(missing_ok=True)
        trace.set_path(str(args.trace.resolve()))  # before the server and agent start
    with tempfile.TemporaryDirectory(prefix="gpucloud-bench-") as tmp:
        workdir = Path(tmp)
        with start_registry(workdir / "registry") as registry, \
                server_cloud(workdir / "cloud") as cloud:
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
            cached_case = run_case(cloud, "cached", [cached] * args.runs, args.trace)
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
