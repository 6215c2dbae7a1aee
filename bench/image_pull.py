"""Benchmark: cold pull of a ~200 MB image from a local docker-registry.

Builds an image of incompressible data (4 gzip layers) with ``gpucloud.images.testing``,
pushes it to Debian's ``docker-registry`` started on 127.0.0.1, then pulls it into fresh
image stores and times: the pull (download + verify), the first rootfs preparation (layer
unpack) and a cached rootfs preparation (what a pod start from a cached image pays).

    .venv/bin/python bench/image_pull.py [--mb 200] [--layers 4] [--runs 3]

Writes JSON to bench/results/image_pull.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from gpucloud.images import ImageManager
from gpucloud.images.testing import random_image

RESULTS = Path(__file__).parent / "results" / "image_pull.json"


@contextmanager
def local_registry(workdir: Path) -> Iterator[str]:
    """docker-registry on a free loopback port; yields ``127.0.0.1:PORT``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = {
        "version": 0.1,
        "log": {"level": "error", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(workdir / "storage")}},
        "http": {"addr": f"127.0.0.1:{port}"},
    }
    (workdir / "config.yml").write_text(json.dumps(config))
    process = subprocess.Popen(
        ["docker-registry", "serve", str(workdir / "config.yml")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("docker-registry did not start") from None
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def run_once(host: str, reference: str, state: Path) -> dict[str, float]:
    """One cold pull into an empty store, then a first and a cached rootfs."""
    with ImageManager(state) as manager:
        started = time.perf_counter()
        image = manager.pull(f"{host}/{reference}")
        pulled = time.perf_counter()
        manager.prepare_rootfs(image, state / "pod1")
        unpacked = time.perf_counter()
        manager.prepare_rootfs(manager.get(f"{host}/{reference}"), state / "pod2")
        cached = time.perf_counter()
        for pod in ("pod1", "pod2"):
            manager.release_rootfs(state / pod)
        mode = manager.rootfs_mode.value
    return {
        "pull_s": pulled - started,
        "first_rootfs_s": unpacked - pulled,
        "cached_rootfs_s": cached - unpacked,
        "overlay": float(mode == "overlay"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    image = random_image(args.mb * 1_000_000, layers=args.layers)
    size_mb = sum(len(layer.data) for layer in image.layers) / 1e6
    with tempfile.TemporaryDirectory(prefix="gpucloud-bench-") as tmp:
        work = Path(tmp)
        with local_registry(work) as host:
            image.push(host, "bench/random:1")
            runs = [run_once(host, "bench/random:1", work / f"state{i}") for i in range(args.runs)]
    pulls = [r["pull_s"] for r in runs]
    result = {
        "benchmark": "image_pull",
        "image_mb": round(size_mb, 1),
        "layers": args.layers,
        "runs": args.runs,
        "rootfs_mode": "overlay" if runs[0]["overlay"] else "copy",
        "pull_seconds_median": round(statistics.median(pulls), 3),
        "pull_mb_per_s_median": round(size_mb / statistics.median(pulls), 1),
        "first_rootfs_seconds_median": round(
            statistics.median(r["first_rootfs_s"] for r in runs), 3
        ),
        "cached_rootfs_seconds_median": round(
            statistics.median(r["cached_rootfs_s"] for r in runs), 4
        ),
        "pull_seconds_all": [round(p, 3) for p in pulls],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
