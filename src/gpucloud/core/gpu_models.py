"""Catalog of GPU models gpucloud knows by name.

Canonical names are short and stable (``H100-80GB``); aliases cover what NVML reports
(``NVIDIA H100 80GB HBM3``) and what users type (``h100``). Models from cluster traces that
are not in the catalog are still accepted by the scheduler; the API accepts a model when it
is in the catalog or some registered node has it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuModel:
    name: str
    memory_mib: int
    mig_capable: bool = False
    aliases: tuple[str, ...] = ()


CATALOG: tuple[GpuModel, ...] = (
    GpuModel("H200-141GB", 143_771, True, ("h200", "nvidia h200", "nvidia h200 141gb hbm3e")),
    GpuModel(
        "H100-80GB", 81_559, True, ("h100", "nvidia h100 80gb hbm3", "h100-sxm", "nvidia h100")
    ),
    GpuModel("H800-80GB", 81_559, True, ("h800", "nvidia h800")),
    GpuModel(
        "A100-80GB", 81_920, True, ("a100-80g", "nvidia a100-sxm4-80gb", "nvidia a100 80gb pcie")
    ),
    GpuModel("A100-40GB", 40_960, True, ("a100", "nvidia a100-sxm4-40gb", "nvidia a100-pcie-40gb")),
    GpuModel("L40S", 46_068, False, ("nvidia l40s",)),
    GpuModel("L4", 23_034, False, ("nvidia l4",)),
    GpuModel("A10", 23_028, False, ("nvidia a10",)),
    GpuModel("A10G", 23_028, False, ("nvidia a10g",)),
    GpuModel("RTX4090", 24_564, False, ("nvidia geforce rtx 4090", "rtx-4090", "4090")),
    GpuModel("T4", 15_360, False, ("tesla t4", "nvidia t4")),
    GpuModel("V100-32GB", 32_768, False, ("v100m32", "tesla v100-sxm2-32gb")),
    GpuModel("V100-16GB", 16_384, False, ("v100", "v100m16", "tesla v100-sxm2-16gb")),
    GpuModel("P100", 16_384, False, ("tesla p100-pcie-16gb",)),
)

_BY_KEY: dict[str, GpuModel] = {}
for _model in CATALOG:
    for _key in (_model.name, *_model.aliases):
        _BY_KEY[_key.lower()] = _model

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,63}$")


@functools.lru_cache(maxsize=4096)
def lookup(name: str) -> GpuModel | None:
    """The catalog entry for a canonical name or alias (case-insensitive), if any.
    Memoised: a 10,000-node snapshot asks it for each of 80,000 GPUs, of a few models."""
    return _BY_KEY.get(name.strip().lower())


@functools.lru_cache(maxsize=4096)
def canonical_name(name: str) -> str:
    """The canonical name of a known model, else the name itself, trimmed."""
    model = lookup(name)
    return model.name if model else name.strip()


def is_well_formed(name: str) -> bool:
    """Whether a model name is plausible text (letters, digits, space, '.', '_', '-')."""
    return bool(_MODEL_NAME.match(name))
