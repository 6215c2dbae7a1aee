"""The agent's GPU health checks, reported with each lease renewal (gpu/health).

Checks run at most every ``health_interval_seconds``; between checks a renewal repeats the
last report, so the server's view never lapses. Real GPUs are checked through NVML and the
kernel log; simulated ones report the faults injected with ``--inject-fault`` or written
into ``--fault-file`` by a test (an emptied file is the simulated reset).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpucloud.agent.config import AgentConfig
from gpucloud.gpu.domain import NodeHardware
from gpucloud.gpu.health import (
    Fault,
    HealthReport,
    HealthTracker,
    InjectedFaults,
    nvml_faults,
    parse_injected,
)
from gpucloud.gpu.nvml import DEFAULT_NVML

KERNEL_LOG = Path("/var/log/kern.log")


@dataclass
class NodeHealth:
    faults: Callable[[], list[Fault]]
    tracker: HealthTracker
    interval: float
    auto_uncordon: bool = True
    clock: Callable[[], float] = time.monotonic
    _last: HealthReport | None = None
    _due: float = field(default=0.0)

    def check(self) -> HealthReport:
        self._last = self.tracker.update(self.faults())
        self._due = self.clock() + self.interval
        return self._last

    def report(self) -> dict[str, Any]:
        """The lease request's health fields (a fresh check when one is due)."""
        last = self._last if self._last is not None and self.clock() < self._due \
            else self.check()
        return {"gpu_health": [{"uuid": g.uuid, "healthy": g.healthy, "reason": g.reason}
                               for g in last.gpus],
                "node_fault": last.node_fault, "auto_uncordon": self.auto_uncordon}


def node_health(config: AgentConfig, hardware: NodeHardware) -> NodeHealth | None:
    """The checks of this node; None without GPUs or with checks turned off."""
    if not hardware.gpus or config.health_interval_seconds <= 0:
        return None
    uuids = tuple(gpu.uuid for gpu in hardware.gpus)
    faults: Callable[[], list[Fault]]
    if hardware.provider == "simulated":
        faults = InjectedFaults(tuple(parse_injected(f) for f in config.inject_faults),
                                config.fault_file).read
    else:
        bus_ids = tuple(gpu.pci_bus_id for gpu in hardware.gpus)
        log = KERNEL_LOG if KERNEL_LOG.exists() else None

        def faults() -> list[Fault]:
            return nvml_faults(DEFAULT_NVML, uuids, bus_ids, log)

    return NodeHealth(faults, HealthTracker(uuids), config.health_interval_seconds,
                      config.auto_uncordon)
