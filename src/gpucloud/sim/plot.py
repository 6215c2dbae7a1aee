"""Allocated-vs-arrived curves of several policies (needs matplotlib: ``pip install
gpucloud[plot]``). Imported on demand by the CLI so that matplotlib stays optional."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gpucloud.sim.report import Summary  # noqa: E402


def plot_curves(summaries: Sequence[Summary], path: Path) -> None:
    """One line per policy: allocated GPU % against arrived GPU request %."""
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for summary in summaries:
        curve = summary.curve()
        axis.plot(range(len(curve)), curve,
                  label=f"{summary.policy} ({summary.mean:.2f}% unallocated)")
    axis.plot([0, 100], [0, 100], color="grey", linestyle=":", linewidth=0.8)
    axis.axvline(100, color="grey", linewidth=0.5)
    axis.set_xlabel("arrived GPU request (% of cluster GPUs)")
    axis.set_ylabel("allocated GPUs (%)")
    axis.set_title(f"openb {summaries[0].workload if summaries else ''}")
    axis.legend(loc="lower right", fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
