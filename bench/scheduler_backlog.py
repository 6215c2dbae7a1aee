"""The scheduler library on a live pass's backlog: 10,000 8-GPU nodes, passes of 4,096
one-GPU pods, the nodes of each pass's placements rebuilt for the next (as the
controller's snapshot does), with and without shape tables (framework/tables.py).

    nice .venv/bin/python bench/scheduler_backlog.py [--nodes N] [--pods P] [--passes K]

Counts this process's CPU time (robust on a shared machine) and checks that both ways
make the very same placements. Results: printed, and bench/results/scheduler_backlog.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpucloud.scheduler import GpuState, NodeState, Placement, PodRequest, Scheduler

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 1024**3


def fleet(count: int) -> list[NodeState]:
    """Nodes as bench/fleet.py's agents register them (8 H100, two NUMA nodes)."""
    gpus = tuple(GpuState(i, f"g{i}", "H100 80GB", 81_559, numa_node=i // 4) for i in range(8))
    return [NodeState(f"fleet-{i}", 128_000, 1024 * GIB, gpus) for i in range(count)]


def taken(nodes: list[NodeState], placements: list[Placement]) -> list[NodeState]:
    """The nodes with ``placements`` taken (new objects only for the nodes they touch)."""
    index = {n.name: i for i, n in enumerate(nodes)}
    out = list(nodes)
    for placement in placements:
        i = index[placement.node]
        gpus = list(out[i].gpus)
        for g, milli in placement.gpu_milli.items():
            gpus[g] = replace(gpus[g], used_milli=gpus[g].used_milli + milli)
        out[i] = replace(out[i], gpus=tuple(gpus), cpu_used_milli=out[i].cpu_used_milli + 1000,
                         memory_used_bytes=out[i].memory_used_bytes + 4 * GIB)
    return out


def run(nodes: int, pods: int, passes: int, tables: bool) -> dict[str, Any]:
    cluster = fleet(nodes)
    scheduler = Scheduler("default", shape_tables=tables)
    scheduler.cluster_state(cluster)  # warm, as a running controller's is
    rates: list[float] = []
    digest = hashlib.sha1()
    for k in range(passes):
        batch = [PodRequest(f"p{k}-{i}", gpus=1, cpu_milli=1000, memory_bytes=4 * GIB)
                 for i in range(pods)]
        started = time.process_time()
        decisions = scheduler.schedule(cluster, batch)
        rates.append(pods / (time.process_time() - started))
        placed = [d.placement for d in decisions if d.placement is not None]
        digest.update(repr([(p.node, sorted(p.gpu_milli.items())) for p in placed]).encode())
        cluster = taken(cluster, placed)
    return {"shape_tables": tables, "pods_per_cpu_s": [round(r) for r in rates],
            "placements_digest": digest.hexdigest()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--pods", type=int, default=4096)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    runs = [run(args.nodes, args.pods, args.passes, tables) for tables in (False, True)]
    same = runs[0]["placements_digest"] == runs[1]["placements_digest"]
    result = {"nodes": args.nodes, "pods_per_pass": args.pods, "runs": runs,
              "same_placements": same}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scheduler_backlog.json").write_text(json.dumps(result, indent=2) + "\n")
    for r in runs:
        print(f"shape tables {'on ' if r['shape_tables'] else 'off'}: "
              f"{r['pods_per_cpu_s']} pods per CPU-s")
    print(f"same placements: {same}")


if __name__ == "__main__":
    main()
