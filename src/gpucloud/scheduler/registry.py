"""The built-in plugin registry and the named profiles (policies) built from it.

``default`` is gpucloud's own policy; the six others reproduce the policies compared in the
FGD paper (ATC '23) with the reference simulator's rules, including random tie-breaks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpucloud.scheduler.framework.registry import ProfileConfig, Registry
from gpucloud.scheduler.plugins.fgd import FgdReserve, FgdScore
from gpucloud.scheduler.plugins.filters import (
    AvoidNode,
    CpuMemoryFit,
    GpuFit,
    GpuModel,
    NodeCondition,
    NodeSelector,
    RequestCheck,
    RequiredNode,
)
from gpucloud.scheduler.plugins.loadaware import LoadAwareFilter, LoadAwareScore
from gpucloud.scheduler.plugins.policies import (
    BestFitScore,
    DotProductScore,
    GpuClusteringScore,
    GpuPackingScore,
    RandomScore,
)
from gpucloud.scheduler.plugins.reserve import GpuReserve
from gpucloud.scheduler.plugins.topology import TopologyScore

PRE_FILTERS = ("RequestCheck",)
FILTERS = ("RequiredNode", "AvoidNode", "NodeCondition", "NodeSelector", "GpuModel",
           "CpuMemoryFit", "GpuFit")

PLUGINS: tuple[Any, ...] = (
    RequestCheck, RequiredNode, AvoidNode, NodeCondition, NodeSelector, CpuMemoryFit,
    GpuModel, GpuFit,
    TopologyScore, RandomScore, DotProductScore, GpuClusteringScore,
    GpuPackingScore, BestFitScore, FgdScore, GpuReserve, FgdReserve,
    LoadAwareScore, LoadAwareFilter,
)


def default_registry() -> Registry:
    """A registry with every built-in plugin."""
    registry = Registry()
    for cls in PLUGINS:
        registry.register(cls.name, cls)
    return registry


def _paper(score: str, share: str = "bestfit") -> dict[str, Any]:
    """A reproduction profile: one score, the reference GPU choice, and its tie-break.

    The reference simulator runs a patched Kubernetes scheduler whose ``selectHost``
    takes, among the best-scored nodes, the one with the smallest name; node names carry
    a prefix from a seeded random permutation. So ties go to a random node order that is
    fixed for the whole run (``rank``): not the first node, not a fresh draw per pod.
    """
    return {
        "pre_filters": PRE_FILTERS, "filters": FILTERS, "scores": {score: 1.0},
        "reserve": "GpuReserve", "tie_break": "rank",
        "args": {"GpuReserve": {"share": share, "whole": "lowest"}},
    }


# ``default`` measures fragmentation against the GPU pod types that cover 60 % of the
# workload (ten types at a time): the frequent shapes it must keep room for.
_DEFAULT_TYPICAL: dict[str, Any] = {
    "typical_threshold": 0.60, "typical_step": 10, "typical_cpu_pods": False,
}

RAW_PROFILES: dict[str, Mapping[str, Any]] = {
    "random": _paper("Random", share="random"),
    "dotprod": _paper("DotProduct"),
    "clustering": _paper("GpuClustering"),
    "packing": _paper("GpuPacking"),
    "bestfit": _paper("BestFit"),
    "fgd": {**_paper("FGD"), "reserve": "FgdReserve", "args": {}},
    "default": {
        "pre_filters": PRE_FILTERS, "filters": FILTERS,
        "scores": {"FGD": 1.0, "Topology": 0.01},
        "reserve": "FgdReserve", "tie_break": "first",
        "sample_size": 256, "sample_threshold": 2048,
        "args": {"FGD": {"refined": True, **_DEFAULT_TYPICAL},
                 "FgdReserve": {"refined": True, "whole": "topology", **_DEFAULT_TYPICAL}},
    },
}

# ``default`` plus placement by real use (plugins/loadaware.py): the LoadAware score at a
# weight below FGD's, so it decides among placements FGD finds equal; the ``-filter``
# variant also keeps pods off nodes whose peak use would pass 65 % CPU / 95 % memory.
LOAD_AWARE_WEIGHT = 0.25
_DEFAULT = RAW_PROFILES["default"]
RAW_PROFILES["default+load-aware"] = {
    **_DEFAULT, "scores": {"FGD": 1.0, "LoadAware": LOAD_AWARE_WEIGHT, "Topology": 0.01},
}
RAW_PROFILES["default+load-aware-filter"] = {
    **RAW_PROFILES["default+load-aware"], "filters": (*FILTERS, "LoadAwareFilter"),
}
LOAD_AWARE_PROFILES = ("default+load-aware", "default+load-aware-filter")

POLICY_NAMES = ("random", "dotprod", "clustering", "packing", "bestfit", "fgd", "default")


def profile_configs(overrides: Mapping[str, Mapping[str, Any]] | None = None,
                    ) -> dict[str, ProfileConfig]:
    """Built-in profiles, with ``overrides`` (from a config file) added or replacing them."""
    raw = {**RAW_PROFILES, **(overrides or {})}
    return {name: ProfileConfig.from_mapping(name, spec) for name, spec in raw.items()}
