"""Usage samples (agent → server), the meter's rows, and node load for the scheduler.

A sample holds *cumulative* counters of one pod attempt on one node (CPU seconds and
network bytes since the container started) plus gauges (memory, GPU utilisation, disk)
at ``time``. Samples are keyed by (node, pod, attempt, seq): a batch resent after a lost
acknowledgement, or reordered, changes nothing on the server.

The meter (``PodRun``) is one row per pod attempt's ``Running`` interval; its start and
end come from the pod's phase transitions, never from how many samples arrived.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from pydantic import BaseModel, Field

from gpucloud.core.spec import _Request

#: At most this many samples in one batch (the agent sends more in several).
MAX_BATCH_SAMPLES = 5000
#: Samples stamped further than this ahead of the server's clock are refused.
MAX_FUTURE_SKEW_SECONDS = 120.0
#: Reasons that end a run without charge (hardware faults are not the tenant's).
CREDITED_REASONS = frozenset({"GpuFault"})


#: PostgreSQL's BIGINT. The ingest route checks its body through these models alone (not
#: the generic walk of api/limits.py, too slow for thousands of values), so every integer
#: is bounded here and every string is checked for NUL (services/usage.py).
BIGINT_MAX = 2**63 - 1


class UsageGpu(BaseModel):
    """One assigned GPU as the pod used it: utilisation in percent, memory in bytes."""

    uuid: str = Field(min_length=1, max_length=96)
    util_percent: float | None = Field(default=None, ge=0, le=100, allow_inf_nan=False)
    memory_used_bytes: int | None = Field(default=None, ge=0, le=BIGINT_MAX // 64)


class UsageSample(BaseModel):
    pod_id: str = Field(min_length=1, max_length=32)
    attempt: int = Field(ge=0, le=2**31 - 1)
    seq: int = Field(ge=0, le=BIGINT_MAX)
    time: datetime
    cpu_seconds: float = Field(ge=0, allow_inf_nan=False)
    memory_bytes: int = Field(ge=0, le=BIGINT_MAX)
    memory_peak_bytes: int = Field(ge=0, le=BIGINT_MAX)
    gpus: list[UsageGpu] = Field(default_factory=list, max_length=64)
    net_rx_bytes: int | None = Field(default=None, ge=0, le=BIGINT_MAX)
    net_tx_bytes: int | None = Field(default=None, ge=0, le=BIGINT_MAX)
    disk_bytes: int | None = Field(default=None, ge=0, le=BIGINT_MAX)


class AgentUsageBatchRequest(_Request):
    fencing_token: int = Field(ge=-(2**63), le=BIGINT_MAX)
    samples: list[UsageSample] = Field(max_length=MAX_BATCH_SAMPLES)


class AgentUsageBatchOut(BaseModel):
    """``accepted``: stored now; ``duplicates``: already stored (a resend)."""

    accepted: int
    duplicates: int


@dataclass(frozen=True)
class PodRun:
    """One attempt's ``Running`` interval with what it was allocated and what it used.

    ``ended_at`` None: still running. ``gpu_util_avg`` (percent) and the other measured
    figures come from the samples; None when none arrived (or, for GPUs, none measured).
    ``credited``: ended by a hardware fault, not charged.
    """

    pod_id: str
    project_id: str
    job_id: str | None
    attempt: int
    node_id: str | None
    gpu_type: str | None
    gpus: float
    gpu_milli: int
    mig_profile: str | None
    cpu_milli: int
    memory_bytes: int
    volume_bytes: int
    priority_class: str | None
    spot: bool
    started_at: datetime
    ended_at: datetime | None
    end_reason: str | None
    credited: bool
    samples: int = 0
    gpu_util_avg: float | None = None
    gpu_memory_peak_bytes: int | None = None
    cpu_seconds: float | None = None
    memory_peak_bytes: int | None = None
    net_rx_bytes: int | None = None
    net_tx_bytes: int | None = None
    disk_bytes_max: int | None = None

    def seconds(self, until: datetime) -> float:
        """Billed seconds up to ``until`` (an open run counts to ``until``)."""
        end = self.ended_at if self.ended_at is not None else until
        return max(0.0, (min(end, until) - self.started_at).total_seconds())


@dataclass(frozen=True)
class PodLoad:
    """What one pod was last observed to use (EWMA), for the scheduler's estimates."""

    cpu_cores: float
    memory_bytes: float
    gpu_util_percent: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeLoad:
    """A node's recent actual use: exponentially weighted averages of its pods' samples.

    ``gpu_util_percent`` sums the pods' utilisation per GPU uuid (a shared GPU's load);
    ``sample_time`` is the newest sample's time (the scheduler expires stale loads);
    ``pods`` maps pod id to its own averages.
    """

    node_id: str
    cpu_cores: float
    memory_bytes: float
    gpu_util_percent: dict[str, float]
    sample_time: datetime
    pods: dict[str, PodLoad] = field(default_factory=dict)
