"""Scheduler placement throughput at 1,000 and 10,000 nodes -> bench/results/scheduler.json,
and 64-node gang placement on 10,000 nodes -> bench/results/scheduler_gang.json.

Usage: nice .venv/bin/python bench/scheduler_bench.py [PODS]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gpucloud.sim.bench import GANG_LAYOUTS, run_bench, run_gang_bench

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    pods = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    results = [run_bench(nodes, pods).to_json() for nodes in (1000, 10_000)]
    gangs = [run_gang_bench(10_000, 64, layout).to_json() for layout in GANG_LAYOUTS]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scheduler.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "scheduler_gang.json").write_text(json.dumps(gangs, indent=2) + "\n")
    for g in gangs:
        print(f"gang of {g['members']} on {g['nodes']} nodes ({g['layout']}): "
              f"p50 {g['p50_latency_ms']:.1f} ms, p99 {g['p99_latency_ms']:.1f} ms")
    for r in results:
        print(
            f"{r['nodes']:>6} nodes: {r['placements_per_s']:>8.0f} placements/s, "
            f"p99 {r['p99_latency_ms']:.2f} ms"
        )


if __name__ == "__main__":
    main()
