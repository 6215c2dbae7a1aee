"""The built-in price list: RunPod-like figures, used where an admin has set no price.

Approximations of RunPod's public per-hour prices (secure cloud on-demand; spot about 60 %
of it), in USD. They are a starting point, not a quote: an admin sets the cluster's own
with ``gpucloud price set``; a set price always wins over these from its effective time.
"""

from __future__ import annotations

from decimal import Decimal

#: GPU model (canonical name, ``core.gpu_models``) → (on-demand, spot) per GPU-hour.
GPU_PER_HOUR: dict[str, tuple[Decimal, Decimal]] = {
    "H200-141GB": (Decimal("3.99"), Decimal("2.39")),
    "H100-80GB": (Decimal("2.99"), Decimal("1.79")),
    "H800-80GB": (Decimal("2.99"), Decimal("1.79")),
    "A100-80GB": (Decimal("1.89"), Decimal("1.13")),
    "A100-40GB": (Decimal("1.39"), Decimal("0.83")),
    "L40S": (Decimal("0.86"), Decimal("0.52")),
    "L4": (Decimal("0.43"), Decimal("0.26")),
    "A10": (Decimal("0.50"), Decimal("0.30")),
    "A10G": (Decimal("0.50"), Decimal("0.30")),
    "RTX4090": (Decimal("0.69"), Decimal("0.41")),
    "T4": (Decimal("0.40"), Decimal("0.24")),
    "V100-32GB": (Decimal("0.50"), Decimal("0.30")),
    "V100-16GB": (Decimal("0.40"), Decimal("0.24")),
    "P100": (Decimal("0.30"), Decimal("0.18")),
}
#: A CPU core of a CPU-only pod, per hour (GPU pods' CPU and memory are in the GPU price).
CPU_PER_CORE_HOUR = Decimal("0.03")
#: A GiB of volume (a pod's volume disk while it runs, a network volume while it exists),
#: per 30-day month: RunPod's network-volume price.
VOLUME_PER_GIB_MONTH = Decimal("0.07")
