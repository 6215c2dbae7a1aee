"""The load-aware experiment (``sim/load.py``, ``gpucloud sim load``) on a small synthetic
cluster: the documented use/request distribution, and the filter keeping real CPU use
under its threshold where the default profile, which sees only requests, does not."""

from __future__ import annotations

import numpy as np
import pytest

from gpucloud.scheduler.plugins.loadaware import CPU_FACTOR, CPU_THRESHOLD
from gpucloud.sim.load import LIGHT_SHARE, run_load, use_ratios
from tests.unit.scheduler.builders import NodeBuilder, PodBuilder

NODE_CPU, POD_CPU = 8_000, 2_000


def test_use_ratios_follow_the_documented_mixture() -> None:
    cpu, memory = use_ratios(40_000, seed=7)
    again = use_ratios(40_000, seed=7)
    assert np.array_equal(cpu, again[0]) and np.array_equal(memory, again[1])
    assert 0 <= cpu.min() and cpu.max() <= 1.2 and 0 <= memory.min() and memory.max() <= 1
    # 70 % Beta(2, 5) (mean 2/7), 30 % 1.2 x Beta(5, 2) (mean 1.2 x 5/7); memory Beta(4, 3)
    light, heavy = 2 / 7, 1.2 * 5 / 7
    assert cpu.mean() == pytest.approx(LIGHT_SHARE * light + (1 - LIGHT_SHARE) * heavy,
                                       abs=0.01)
    assert memory.mean() == pytest.approx(4 / 7, abs=0.01)
    # only heavy pods burst over their request: P(Beta(5, 2) > 1/1.2) = 1 - x^5 (6 - 5x)
    x = 1 / 1.2
    assert float((cpu > 1).mean()) == pytest.approx(
        (1 - LIGHT_SHARE) * (1 - x**5 * (6 - 5 * x)), abs=0.01)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_filter_keeps_real_cpu_use_under_its_threshold(seed: int) -> None:
    """Nodes report after every pod (age 0): the filter admits a pod only while the
    node's real use plus the pod's estimate stays within 65 %, so real use ends at most
    one pod's burst above it; the default profile packs GPUs and runs nodes hotter."""
    nodes = [NodeBuilder(f"n{i}").cpu(NODE_CPU).memory(256).gpus(4).build()
             for i in range(30)]
    pods = [PodBuilder(f"p{i}").gpus(1).cpu(POD_CPU).memory(16).build() for i in range(40)]
    default = run_load(nodes, pods, "default", seed, report_seconds=1)
    filtered = run_load(nodes, pods, "default+load-aware-filter", seed, report_seconds=1)
    bound = CPU_THRESHOLD + 100 * (1.2 - CPU_FACTOR) * POD_CPU / NODE_CPU
    assert filtered.max_cpu_use_pct <= bound and filtered.hot_nodes == 0
    assert default.max_cpu_use_pct > CPU_THRESHOLD
    # the price: GPUs left idle on CPU-hot nodes (the default places every pod here)
    assert default.placed_pct == 100.0 and filtered.placed_pct < 100.0
    assert filtered.allocation_pct + filtered.unallocated_gpu_pct == pytest.approx(100.0)
    assert run_load(nodes, pods, "default", seed, report_seconds=1) == default  # seeded
