"""Small fluent builders for scheduler test objects: ``node("a").gpus(8, "H100").build()``."""

from __future__ import annotations

from dataclasses import replace

from gpucloud.scheduler import GpuState, NodeState, PodRequest

GIB = 1024**3


class NodeBuilder:
    def __init__(self, name: str) -> None:
        self._node = NodeState(name=name, cpu_milli=64_000, memory_bytes=512 * GIB)
        self._gpus: list[GpuState] = []

    def cpu(self, milli: int, used: int = 0) -> NodeBuilder:
        self._node = replace(self._node, cpu_milli=milli, cpu_used_milli=used)
        return self

    def memory(self, gib: int, used_gib: int = 0) -> NodeBuilder:
        self._node = replace(self._node, memory_bytes=gib * GIB, memory_used_bytes=used_gib * GIB)
        return self

    def gpus(self, count: int, model: str = "H100-80GB", memory_mib: int = 81_559,
             used: tuple[int, ...] = (), nvlink: bool = False, numa_split: bool = False,
             ) -> NodeBuilder:
        peers = tuple(range(count)) if nvlink else ()
        for i in range(count):
            taken = used[i] if i < len(used) else 0
            numa = (i * 2) // count if numa_split else 0
            self._gpus.append(GpuState(i, f"{self._node.name}-gpu{i}", model, memory_mib,
                                       numa_node=numa, nvlink_peers=peers, used_milli=taken))
        return self

    def gpu(self, gpu: GpuState) -> NodeBuilder:
        self._gpus.append(gpu)
        return self

    def cordoned(self) -> NodeBuilder:
        self._node = replace(self._node, cordoned=True)
        return self

    def not_ready(self) -> NodeBuilder:
        self._node = replace(self._node, ready=False)
        return self

    def labels(self, **labels: str) -> NodeBuilder:
        self._node = replace(self._node, labels=labels)
        return self

    def build(self) -> NodeState:
        return replace(self._node, gpus=tuple(self._gpus))


class PodBuilder:
    def __init__(self, key: str) -> None:
        self._pod = PodRequest(key=key)

    def gpus(self, count: int) -> PodBuilder:
        self._pod = replace(self._pod, gpus=count)
        return self

    def share(self, milli: int) -> PodBuilder:
        self._pod = replace(self._pod, gpu_milli=milli)
        return self

    def model(self, model: str) -> PodBuilder:
        self._pod = replace(self._pod, gpu_model=model)
        return self

    def cpu(self, milli: int) -> PodBuilder:
        self._pod = replace(self._pod, cpu_milli=milli)
        return self

    def memory(self, gib: int) -> PodBuilder:
        self._pod = replace(self._pod, memory_bytes=gib * GIB)
        return self

    def mig(self, profile: str) -> PodBuilder:
        self._pod = replace(self._pod, mig_profile=profile)
        return self

    def min_gpu_memory(self, mib: int) -> PodBuilder:
        self._pod = replace(self._pod, min_gpu_memory_mib=mib)
        return self

    def selector(self, **labels: str) -> PodBuilder:
        self._pod = replace(self._pod, node_selector=labels)
        return self

    def build(self) -> PodRequest:
        return self._pod


def node(name: str) -> NodeBuilder:
    return NodeBuilder(name)


def pod(key: str = "p") -> PodBuilder:
    return PodBuilder(key)
