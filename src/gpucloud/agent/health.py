"""The agent's GPU health checks, reported with each lease renewal (gpu/health).

Checks run at most every ``health_interval_seconds``; between checks a renewal repeats the
last report, so the server's view never lapses. Real GPUs are checked through NVML and the
kernel log; simulated ones report the faults injected with ``--inject-fault`` or written
into ``--fault-file`` by a test (an emptied file is the simulated reset).

Admin maintenance (``node gpu-reset`` / ``node diag`` / ``node mig-mode``) arrives in the
assignments: each action runs once, off the poll thread (a DCGM diag takes minutes), and
its result rides with every renewal until the assignments stop listing it (the server has
it). A reset and a passed diag put the GPU back in service at once; the next report is a
fresh check.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpucloud.agent.config import AgentConfig
from gpucloud.core.models import GpuAction
from gpucloud.gpu.domain import NodeHardware
from gpucloud.gpu.health import (
    DiagOutcome,
    Fault,
    HealthReport,
    HealthTracker,
    HostMaintenance,
    InjectedFaults,
    Maintenance,
    SimulatedMaintenance,
    nvml_faults,
    parse_injected,
)
from gpucloud.gpu.mig import MigError
from gpucloud.gpu.nvml import DEFAULT_NVML

MIG_ACTIONS = ("mig-on", "mig-off")

KERNEL_LOG = Path("/var/log/kern.log")


@dataclass
class NodeHealth:
    faults: Callable[[], list[Fault]]
    tracker: HealthTracker
    interval: float
    auto_uncordon: bool = True
    clock: Callable[[], float] = time.monotonic
    maintenance: Maintenance | None = None
    #: Switches a GPU's MIG mode (``node mig-mode``: the agent's MIG manager, set by the
    #: agent where the node has MIG-capable GPUs); returns what it did, raises MigError.
    mig_mode: Callable[[int, bool], str] | None = None
    #: How an action runs: a daemon thread (tests pass one that runs it inline).
    spawn: Callable[[Callable[[], None]], None] = field(default=lambda work: threading.Thread(
        target=work, name="gpu-maintenance", daemon=True).start())
    _last: HealthReport | None = None
    _due: float = field(default=0.0)
    _started: set[str] = field(default_factory=set)
    _results: dict[str, dict[str, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self) -> HealthReport:
        self._last = self.tracker.update(self.faults())
        self._due = self.clock() + self.interval
        return self._last

    def report(self) -> dict[str, Any]:
        """The lease request's health fields (a fresh check when one is due)."""
        last = self._last if self._last is not None and self.clock() < self._due \
            else self.check()
        with self._lock:
            results = list(self._results.values())
        return {"gpu_health": [{"uuid": g.uuid, "healthy": g.healthy, "reason": g.reason}
                               for g in last.gpus],
                "node_fault": last.node_fault, "auto_uncordon": self.auto_uncordon,
                "gpu_actions": results}

    def submit(self, actions: Iterable[GpuAction]) -> None:
        """The assignments' GPU actions: start the new ones; forget the results of those
        no longer listed (the server recorded them)."""
        listed = {a.id: a for a in actions}
        with self._lock:
            for gone in [i for i in self._results if i not in listed]:
                del self._results[gone]
            self._started &= set(listed)
            new = [a for i, a in listed.items() if i not in self._started]
            self._started.update(a.id for a in new)
        for action in new:
            self.spawn(lambda action=action: self._run(action))  # type: ignore[misc]

    def _run(self, action: GpuAction) -> None:
        outcome = self._outcome(action)
        if outcome.passed and action.action not in MIG_ACTIONS:
            self.tracker.recovered(action.gpu_index)
        with self._lock:
            self._results[action.id] = {"id": action.id, "passed": outcome.passed,
                                        "output": outcome.output[-4000:]}
            self._due = 0.0  # the next renewal carries a fresh check

    def _outcome(self, action: GpuAction) -> DiagOutcome:
        if action.action in MIG_ACTIONS:
            return self._switch_mig(action)
        if self.maintenance is None:
            return DiagOutcome(False, "this node has no GPU maintenance tools")
        try:
            if action.action == "reset":
                reset = self.maintenance.reset(action.gpu_index)
                if not reset.passed:
                    return DiagOutcome(False, f"reset failed: {reset.output}")
            return self.maintenance.diag(action.gpu_index, action.level)
        except (OSError, ValueError) as error:  # the action's failure, not the agent's
            return DiagOutcome(False, f"{action.action} failed: {error}")


    def _switch_mig(self, action: GpuAction) -> DiagOutcome:
        """``mig-on`` / ``mig-off``: the transition the agent reports (server: the GPU's
        ``mig_mode`` follows a passed one)."""
        if self.mig_mode is None:
            return DiagOutcome(False, "this node has no MIG-capable GPUs to switch")
        on = action.action == "mig-on"
        try:
            done = self.mig_mode(action.gpu_index, on)
        except (MigError, OSError) as error:
            return DiagOutcome(False, f"MIG mode {'on' if on else 'off'} failed: {error}")
        return DiagOutcome(True, f"MIG mode {'on' if on else 'off'} on GPU "
                                 f"{action.gpu_index}: {done}")


def node_health(config: AgentConfig, hardware: NodeHardware) -> NodeHealth | None:
    """The checks of this node; None without GPUs or with checks turned off."""
    if not hardware.gpus or config.health_interval_seconds <= 0:
        return None
    uuids = tuple(gpu.uuid for gpu in hardware.gpus)
    faults: Callable[[], list[Fault]]
    maintenance: Maintenance
    if hardware.provider == "simulated":
        injected = InjectedFaults(tuple(parse_injected(f) for f in config.inject_faults),
                                  config.fault_file)
        faults, maintenance = injected.read, SimulatedMaintenance(injected)
    else:
        bus_ids = tuple(gpu.pci_bus_id for gpu in hardware.gpus)
        log = KERNEL_LOG if KERNEL_LOG.exists() else None
        maintenance = HostMaintenance(DEFAULT_NVML, uuids)

        def faults() -> list[Fault]:
            return nvml_faults(DEFAULT_NVML, uuids, bus_ids, log)

    return NodeHealth(faults, HealthTracker(uuids), config.health_interval_seconds,
                      config.auto_uncordon, maintenance=maintenance)
