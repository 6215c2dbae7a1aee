"""The agent's /metrics (served on loopback, parsed back) and dcgm-exporter job files."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import httpx

from gpucloud.agent.metrics import AgentMetrics, JobMapping
from gpucloud.agent.usage import Target
from gpucloud.core.usage import UsageGpu, UsageSample
from gpucloud.gpu.domain import GpuDevice
from gpucloud.services.metrics import families

GPUS = tuple(GpuDevice(index=i, uuid=f"GPU-{i}", model="H100", memory_mib=81_559)
             for i in range(3))


def _target(pod: str, gpus: tuple[GpuDevice, ...]) -> Target:
    return Target(cid=f"{pod}-1", pod_id=pod, attempt=1, pid=1, gpus=gpus, env={},
                  exclusive_gpus=len(gpus) > 1, own_netns=False, volume_dir=None)


def _sample(pod: str, util: dict[str, float]) -> UsageSample:
    return UsageSample(pod_id=pod, attempt=1, seq=0, time=datetime.now(UTC), cpu_seconds=12.5,
                       memory_bytes=2 << 30, memory_peak_bytes=3 << 30,
                       gpus=[UsageGpu(uuid=u, util_percent=v, memory_used_bytes=1 << 30)
                             for u, v in util.items()])


def test_metrics_endpoint_serves_pod_and_gpu_series() -> None:
    metrics = AgentMetrics("node-1")
    metrics.usage.record(_target("a", GPUS[:2]), _sample("a", {"GPU-0": 50, "GPU-1": 50}))
    metrics.usage.record(_target("b", GPUS[2:]), _sample("b", {"GPU-2": 30}))
    metrics.usage.record(_target("c", GPUS[2:]), _sample("c", {"GPU-2": 25}))
    metrics.pull_seconds.observe(1.5)
    port = metrics.serve("127.0.0.1", 0)
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        metrics.close()
    got = {(n, tuple(sorted(ls.items()))): v for n, ls, v in families(text)}

    def value(name: str, **labels: str) -> float:
        return next(v for (n, ls), v in got.items()
                    if n == name and labels.items() <= dict(ls).items())

    assert value("gpucloud_pod_cpu_seconds_total", pod="a") == 12.5
    assert value("gpucloud_pod_memory_bytes", pod="a", node="node-1") == 2 << 30
    assert value("gpucloud_pod_gpu_utilization_ratio", pod="a", gpu="1") == 0.5
    assert value("gpucloud_gpu_utilization_ratio", gpu="2") == 0.55
    assert value("gpucloud_gpu_pods", gpu="2") == 2
    assert value("gpucloud_gpu_memory_used_bytes", uuid="GPU-2") == 2 << 30
    assert value("gpucloud_image_pull_duration_seconds_count") == 1
    assert not any(n.startswith("DCGM_") for n, _ in got)
    metrics.usage.keep({"b-1"})
    assert [s for s in metrics.usage.collect() if s.name == "gpucloud_pod_memory_bytes"][0] \
        .samples[0].labels["pod"] == "b"


def test_job_mapping_files_follow_the_pods(tmp_path: Path) -> None:
    mapping = JobMapping(tmp_path / "jobs")
    mapping.write([_target("a", GPUS[:2]), _target("b", GPUS[2:]), _target("c", GPUS[2:])])
    folder = tmp_path / "jobs"
    assert {p.name: p.read_text() for p in folder.iterdir()} == {
        "0": "a\n", "1": "a\n", "2": "b\nc\n"}
    mapping.write([_target("c", GPUS[2:]), _target("m", GPUS[:1])], mig={"m": (0, 3)})
    assert {p.name: p.read_text() for p in folder.iterdir()} == {"2": "c\n", "0.3": "m\n"}
    mapping.write([])
    assert list(folder.iterdir()) == []
