"""Project quotas, borrowing and dominant resource shares: pure accounting.

A project's quota guarantees it a number of GPUs per model. It may use more — borrow what
the others leave idle — up to its borrow limit (GPUs in all, over every model). A project
with no quota is not limited and has no guarantee: all its GPUs count as borrowed, so the
owner of a quota may always reclaim them (``Ledger.protected`` says what may not be taken).

GPUs are counted in milli-GPUs (a whole GPU is 1000) so that shared GPUs count for their
share. ``Ledger`` is a mutable accumulator that a scheduling pass fills with the running
work, then updates as it admits more.

Quotas are GPUs only; fairness is not. The dominant share (DRF) is taken over every
resource a project holds — each GPU model, CPU and memory — so a project that runs
CPU- or memory-heavy work does not look idle to the fair ordering.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpucloud.core.gpu_models import canonical_name
from gpucloud.scheduler.types import FULL_GPU_MILLI, NodeState


@dataclass(frozen=True)
class Quota:
    """Guaranteed whole GPUs per canonical model; ``borrow_limit`` None means unlimited."""

    gpus: Mapping[str, int] = field(default_factory=dict)
    borrow_limit: int | None = 0

    def guaranteed_milli(self, model: str) -> int:
        return self.gpus.get(canonical_name(model), 0) * FULL_GPU_MILLI


#: What a project without a quota gets: no guarantee, no limit.
UNLIMITED = Quota({}, None)

#: The non-GPU resources DRF counts (in ``Ledger.held`` and ``drf_capacity``): CPU in
#: millicores, memory in bytes. Not GPU model names, which are canonical (``H100-80GB``).
CPU, MEMORY = "cpu", "memory"


def _gpus(milli: int) -> str:
    value = milli / FULL_GPU_MILLI
    return f"{value:g}"


@dataclass
class Ledger:
    """GPU use per project and model, and each project's quota."""

    quotas: Mapping[str, Quota]
    used: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    #: CPU and memory per project (``CPU``, ``MEMORY``): for DRF only, no quota applies.
    held: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))

    def quota(self, project: str) -> Quota:
        return self.quotas.get(project, UNLIMITED)

    def add(self, project: str, model: str, milli: int) -> None:
        self.used[project][canonical_name(model)] += milli

    def remove(self, project: str, model: str, milli: int) -> None:
        self.used[project][canonical_name(model)] -= milli

    def hold(self, project: str, cpu_milli: int, memory_bytes: int) -> None:
        """Count CPU and memory the project holds (negative amounts release them)."""
        self.held[project][CPU] += cpu_milli
        self.held[project][MEMORY] += memory_bytes

    def borrowed(self, project: str, extra: tuple[str, int] | None = None) -> int:
        """Milli-GPUs the project uses beyond its quota (with ``extra`` (model, milli))."""
        quota = self.quota(project)
        used = Counter(self.used.get(project, Counter()))
        if extra is not None:
            used[canonical_name(extra[0])] += extra[1]
        return sum(max(0, n - quota.guaranteed_milli(m)) for m, n in used.items())

    def admits(self, project: str, model: str, milli: int) -> bool:
        """Whether the project may use ``milli`` more of ``model``: within its quota, or
        borrowing no more than its borrow limit in all."""
        limit = self.quota(project).borrow_limit
        if limit is None:
            return True
        return self.borrowed(project, (model, milli)) <= limit * FULL_GPU_MILLI

    def would_borrow(self, project: str, model: str, milli: int) -> bool:
        """Whether ``milli`` more of ``model`` would take the project beyond its quota."""
        model = canonical_name(model)
        used = self.used.get(project, Counter())[model]
        return used + milli > self.quota(project).guaranteed_milli(model)

    def protected(self, project: str, model: str, milli: int) -> bool:
        """Whether taking ``milli`` of ``model`` away would leave the project below its
        quota: such work is within the guarantee and never preempted for a borrower."""
        model = canonical_name(model)
        used = self.used.get(project, Counter())[model]
        return used - milli < min(used, self.quota(project).guaranteed_milli(model))

    def over_quota_message(self, project: str, name: str, model: str, milli: int) -> str:
        """``over quota: project team-a uses 8/8 H100-80GB GPUs, borrow limit 0``."""
        model = canonical_name(model)
        quota = self.quota(project)
        used = self.used.get(project, Counter())[model]
        return (f"over quota: project {name} uses {_gpus(used)}/"
                f"{_gpus(quota.guaranteed_milli(model))} {model} GPUs, borrow limit "
                f"{quota.borrow_limit}; it asks for {_gpus(milli)} more")

    def dominant_share(self, project: str, capacity: Mapping[str, int]) -> float:
        """DRF: the largest share of any resource's capacity the project holds — a GPU
        model, or ``CPU`` and ``MEMORY`` when ``capacity`` has them (``drf_capacity``)."""
        used = self.used.get(project, Counter()) + self.held.get(project, Counter())
        return max((n / capacity[m] for m, n in used.items() if capacity.get(m)), default=0.0)


def gpu_capacity(nodes: Iterable[NodeState]) -> dict[str, int]:
    """Milli-GPUs per canonical model over the ready nodes."""
    capacity: Counter[str] = Counter()
    for node in nodes:
        if node.ready:
            for gpu in node.gpus:
                capacity[canonical_name(gpu.model)] += FULL_GPU_MILLI
    return dict(capacity)


def drf_capacity(nodes: Iterable[NodeState]) -> dict[str, int]:
    """The DRF denominators over the ready nodes: milli-GPUs per canonical model, and the
    ``CPU`` millicores and ``MEMORY`` bytes."""
    ready = [node for node in nodes if node.ready]
    return gpu_capacity(ready) | {CPU: sum(n.cpu_milli for n in ready),
                                  MEMORY: sum(n.memory_bytes for n in ready)}
