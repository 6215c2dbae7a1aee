"""gpucloud's scheduler: a pure library (no DB, HTTP or asyncio).

A cluster snapshot and pending pods in, one decision per pod out::

    from gpucloud.scheduler import Scheduler, NodeState, GpuState, PodRequest
    decisions = Scheduler("default").schedule(nodes, pods)

Policies are profiles of plugins (``registry.py``); the simulator (``gpucloud.sim``) runs
the very same code.
"""

from gpucloud.scheduler.framework.status import Code, Status
from gpucloud.scheduler.registry import POLICY_NAMES
from gpucloud.scheduler.scheduler import Scheduler
from gpucloud.scheduler.types import (
    Decision,
    Explanation,
    GpuState,
    NodeState,
    Placement,
    PodRequest,
)

__all__ = [
    "POLICY_NAMES",
    "Code",
    "Decision",
    "Explanation",
    "GpuState",
    "NodeState",
    "Placement",
    "PodRequest",
    "Scheduler",
    "Status",
]
