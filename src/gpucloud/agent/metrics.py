"""The agent's Prometheus endpoint (``gpucloud agent --metrics-port``) and the job-mapping
files that let a real dcgm-exporter label its own GPU series with gpucloud pods.

Figures come from the usage samples the agent takes anyway (agent/usage): each pod's
latest CPU seconds, memory, and per GPU utilisation and memory; per GPU the sums over its
pods; plus image pull and pod start durations. Names are ``gpucloud_*`` in base units
(seconds, bytes, ratios 0..1), never ``DCGM_FI_*``: those are dcgm-exporter's, in other
units (MiB, percent) and labels, and a real exporter on the host would duplicate them.

dcgm-exporter's ``--hpc-job-mapping-dir DIR`` reads one file per GPU index (``<gpu>``) or
MIG instance (``<gpu>.<gpu instance id>``), one job id per line, and adds an ``hpc_job``
label to that GPU's series. ``JobMapping.write`` keeps DIR in step with the running pods
(docs/usage.md has a working example).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpucloud.agent.usage import PodSampler, Target
from gpucloud.core.usage import UsageSample

DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)


@dataclass(frozen=True)
class _Latest:
    target: Target
    sample: UsageSample


class UsageCollector(Collector):
    """Per-pod and per-GPU gauges from the latest sample of each running container."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._latest: dict[str, _Latest] = {}
        self._lock = threading.Lock()

    def record(self, target: Target, sample: UsageSample) -> None:
        with self._lock:
            self._latest[target.cid] = _Latest(target, sample)

    def keep(self, live: set[str]) -> None:
        """Forget containers no longer running."""
        with self._lock:
            for cid in [c for c in self._latest if c not in live]:
                del self._latest[cid]

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            latest = list(self._latest.values())
        yield from _pod_families(self.node, latest)
        yield from _gpu_families(self.node, latest)


def _pod_families(node: str, latest: list[_Latest]) -> Iterator[Metric]:
    labels = ["node", "pod", "attempt"]
    cpu = CounterMetricFamily("gpucloud_pod_cpu_seconds", "CPU time used by the pod's "
                              "container since it started.", labels=labels)
    memory = GaugeMetricFamily("gpucloud_pod_memory_bytes", "Memory the pod uses now.",
                               labels=labels)
    peak = GaugeMetricFamily("gpucloud_pod_memory_peak_bytes", "Most memory the pod used.",
                             labels=labels)
    util = GaugeMetricFamily("gpucloud_pod_gpu_utilization_ratio", "Utilisation of an "
                             "assigned GPU attributed to the pod (0..1).",
                             labels=[*labels, "gpu", "uuid"])
    gpu_memory = GaugeMetricFamily("gpucloud_pod_gpu_memory_used_bytes", "GPU memory the "
                                   "pod uses on an assigned GPU.",
                                   labels=[*labels, "gpu", "uuid"])
    for entry in latest:
        s, values = entry.sample, [node, entry.sample.pod_id, str(entry.sample.attempt)]
        cpu.add_metric(values, s.cpu_seconds)
        memory.add_metric(values, s.memory_bytes)
        peak.add_metric(values, s.memory_peak_bytes)
        index = {d.uuid: str(d.index) for d in entry.target.gpus}
        for gpu in s.gpus:
            gpu_labels = [*values, index.get(gpu.uuid, ""), gpu.uuid]
            if gpu.util_percent is not None:
                util.add_metric(gpu_labels, gpu.util_percent / 100.0)
            if gpu.memory_used_bytes is not None:
                gpu_memory.add_metric(gpu_labels, gpu.memory_used_bytes)
    yield from (cpu, memory, peak, util, gpu_memory)


def _gpu_families(node: str, latest: list[_Latest]) -> Iterator[Metric]:
    """Per GPU: the sum over its pods (a shared GPU's load), and how many pods it holds."""
    util: dict[tuple[str, str], float] = {}
    memory: dict[tuple[str, str], float] = {}
    pods: dict[tuple[str, str], int] = {}
    for entry in latest:
        index = {d.uuid: str(d.index) for d in entry.target.gpus}
        for device in entry.target.gpus:
            key = (str(device.index), device.uuid)
            pods[key] = pods.get(key, 0) + 1
        for gpu in entry.sample.gpus:
            key = (index.get(gpu.uuid, ""), gpu.uuid)
            if gpu.util_percent is not None:
                util[key] = min(1.0, util.get(key, 0.0) + gpu.util_percent / 100.0)
            if gpu.memory_used_bytes is not None:
                memory[key] = memory.get(key, 0.0) + gpu.memory_used_bytes
    labels = ["node", "gpu", "uuid"]
    families = (
        ("gpucloud_gpu_utilization_ratio", "GPU utilisation summed over its pods (0..1).",
         util),
        ("gpucloud_gpu_memory_used_bytes", "GPU memory used by its pods.", memory),
        ("gpucloud_gpu_pods", "Running pods assigned this GPU.", pods),
    )
    for name, doc, values in families:
        family = GaugeMetricFamily(name, doc, labels=labels)
        for (gpu_index, gpu_uuid), value in sorted(values.items()):
            family.add_metric([node, gpu_index, gpu_uuid], value)
        yield family


class AgentMetrics:
    """The agent's registry: usage gauges, pull and start histograms; served on demand."""

    def __init__(self, node: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.usage = UsageCollector(node)
        self.registry.register(self.usage)
        self.pull_seconds = Histogram(
            "gpucloud_image_pull_duration_seconds", "Time to pull (or find locally) a pod's "
            "image.", registry=self.registry, buckets=DURATION_BUCKETS)
        self.start_seconds = Histogram(
            "gpucloud_pod_start_duration_seconds", "Time from a pod attempt reaching the "
            "agent to its container running (pull and preparation included).",
            registry=self.registry, buckets=DURATION_BUCKETS)
        self._server: Any = None

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on a thread; returns the bound port (``port`` 0: any)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class ObservedSampler(PodSampler):
    """A ``PodSampler`` whose samples also feed the agent's metrics."""

    def __init__(self, metrics: AgentMetrics, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.metrics = metrics

    def sample(self, target: Target, seq: int) -> UsageSample | None:
        sample = super().sample(target, seq)
        if sample is not None:
            self.metrics.usage.record(target, sample)
        return sample


class JobMapping:
    """dcgm-exporter ``--hpc-job-mapping-dir`` files: ``<gpu>`` (or ``<gpu>.<gi>`` for a
    MIG instance) listing the ids of the pods on it, one per line. Files of GPUs with no
    pod are removed (the exporter then adds no ``hpc_job`` label). Written atomically."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def write(self, targets: Iterable[Target],
              mig: dict[str, tuple[int, int]] | None = None) -> dict[str, list[str]]:
        """Bring the folder in step; ``mig`` maps a pod id to its (GPU index, GPU
        instance id). Returns file name -> pod ids."""
        wanted: dict[str, list[str]] = {}
        for target in targets:
            placed = (mig or {}).get(target.pod_id)
            names = ([f"{placed[0]}.{placed[1]}"] if placed is not None
                     else [str(d.index) for d in target.gpus])
            for name in names:
                wanted.setdefault(name, []).append(target.pod_id)
        for name, pods in wanted.items():
            self._put(name, "".join(f"{p}\n" for p in sorted(set(pods))))
        for path in self.directory.iterdir():
            if path.is_file() and not path.name.startswith(".") and path.name not in wanted:
                path.unlink(missing_ok=True)
        return wanted

    def _put(self, name: str, text: str) -> None:
        path = self.directory / name
        try:
            if path.read_text() == text:
                return
        except FileNotFoundError:
            pass
        temporary = self.directory / f".{name}.tmp"
        temporary.write_text(text)
        os.replace(temporary, path)
