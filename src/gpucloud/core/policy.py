"""Wire types of scheduling policy: priority classes (``/v1/priority-classes``) and project
quotas (``/v1/quotas``)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field, field_validator

from gpucloud.core.gpu_models import canonical_name, is_well_formed
from gpucloud.core.spec import DnsName, _Request

#: The priority classes every cluster has; more are created by an admin.
DEFAULT_PRIORITY_CLASSES: dict[str, tuple[int, str]] = {
    "spot": (0, "preemptible by anything else"),
    "batch": (100, "the default for pods and jobs"),
    "on-demand": (1000, "preempts spot and batch work when the cluster is full"),
}
#: The class of pods and jobs created without one.
DEFAULT_PRIORITY_CLASS = "batch"
MAX_PRIORITY = 1_000_000_000


class PriorityClassCreateRequest(_Request):
    name: DnsName
    value: int = Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    description: str | None = Field(default=None, max_length=200)


class PriorityClassOut(BaseModel):
    name: str
    value: int
    description: str | None = None
    created_at: datetime


class QuotaSetRequest(_Request):
    """``gpus``: guaranteed whole GPUs per model; ``borrow_limit``: GPUs it may use beyond
    them, in all (None: no limit)."""

    gpus: dict[str, int] = Field(default_factory=dict)
    borrow_limit: int | None = Field(default=0, ge=0, le=1_000_000)

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, value: dict[str, int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for model, count in value.items():
            if not is_well_formed(model):
                raise ValueError(f"bad GPU model name {model!r}")
            if not 0 <= count <= 1_000_000:
                raise ValueError(f"{model}: GPU count must be 0 or more")
            out[canonical_name(model)] = count
        return out


class QuotaOut(BaseModel):
    project: str
    gpus: dict[str, int]
    borrow_limit: int | None
    #: GPUs the project's running work holds now, per model (shares count as fractions).
    used: dict[str, float] = Field(default_factory=dict)
    updated_at: datetime
