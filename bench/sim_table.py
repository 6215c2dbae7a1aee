"""The comparison table: every policy on every workload with published results, N seeds,
against the published 10-seed means -> bench/results/sim_table.json, and a Markdown table
(ours vs published per policy; our ``default`` vs published FGD) -> sim_table.md.

Usage: nice .venv/bin/python bench/sim_table.py [SEEDS] [POLICY,...]
       .venv/bin/python bench/sim_table.py render   (Markdown from the saved JSON)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from gpucloud.scheduler.registry import POLICY_NAMES
from gpucloud.sim.data import find_workload, load_nodes, load_pods
from gpucloud.sim.engine import run_openb
from gpucloud.sim.report import published_mean, published_workloads, seeds, summarize

RESULTS = Path(__file__).resolve().parent / "results"
PAPER = ("random", "dotprod", "clustering", "packing", "bestfit", "fgd")


def compute(count: int, policies: list[str]) -> list[dict[str, Any]]:
    rows = []
    for workload in published_workloads():
        found = find_workload(workload)
        nodes, pods = load_nodes(found.nodes_csv), load_pods(found.pods_csv)
        for policy in policies:
            runs = [run_openb(nodes, pods, policy, s) for s in seeds(count)]
            summary = summarize(policy, workload, runs).to_json()
            summary.pop("allocated_pct_curve")
            rows.append(summary)
            print(workload, policy, summary["unallocated_pct_at_100"],
                  published_mean(workload, policy), flush=True)
    return rows


def _cell(ours: float | None, published: float | None) -> str:
    if ours is None or published is None:
        return "–"
    return f"{ours:.2f} / {published:.2f} ({ours - published:+.2f})"


def render(rows: list[dict[str, Any]]) -> str:
    """Per workload: ours / published (difference) for each paper policy, then default."""
    table: dict[str, dict[str, float]] = {}
    for row in rows:
        table.setdefault(row["workload"], {})[row["policy"]] = row["unallocated_pct_at_100"]
    head = ["workload", *PAPER, "default vs published FGD"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for workload, ours in sorted(table.items()):
        cells = [_cell(ours.get(p), published_mean(workload, p)) for p in PAPER]
        cells.append(_cell(ours.get("default"), published_mean(workload, "fgd")))
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    saved = RESULTS / "sim_table.json"
    if len(sys.argv) > 1 and sys.argv[1] == "render":
        rows = json.loads(saved.read_text())
    else:
        count = int(sys.argv[1]) if len(sys.argv) > 1 else 10
        policies = sys.argv[2].split(",") if len(sys.argv) > 2 else list(POLICY_NAMES)
        rows = compute(count, policies)
        saved.write_text(json.dumps(rows, indent=2) + "\n")
    markdown = render(rows)
    (RESULTS / "sim_table.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
