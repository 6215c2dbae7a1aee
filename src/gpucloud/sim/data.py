"""Loading the Alibaba "openb" trace (ATC '23 FGD paper) into scheduler snapshot types.

Each trace (a dataset folder) is read in place from the first of: ``$GPUCLOUD_SHARED_DATA``,
``../shared/data`` next to the repository, ``$GPUCLOUD_HOME/data`` (where
``gpucloud sim data fetch`` puts the traces it downloads from upstream).
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

from gpucloud.core.errors import InvalidInput, NotFound
from gpucloud.core.settings import gpucloud_home
from gpucloud.scheduler.types import FULL_GPU_MILLI, GpuState, NodeState, PodRequest

MIB = 1024 * 1024
TRACE_DIR = "alibaba-gpu-2023"
NODES_FILE = "openb_node_list_gpu_node.csv"


FETCH_COMMAND = "gpucloud sim data fetch"


class MissingData(NotFound):
    """A trace is in none of the data folders; the message names the fetch command."""


def data_roots() -> list[Path]:
    """Where traces are looked for, in order (see the module's docstring)."""
    roots = []
    override = os.environ.get("GPUCLOUD_SHARED_DATA")
    if override:
        roots.append(Path(override))
    roots.append(Path(__file__).resolve().parents[3].parent / "shared" / "data")
    roots.append(fetched_data_dir())
    return roots


def fetched_data_dir() -> Path:
    """Where ``gpucloud sim data fetch`` downloads to."""
    return gpucloud_home() / "data"


def dataset_dir(name: str) -> Path:
    """The folder of dataset ``name`` in the first data root that has it."""
    roots = data_roots()
    for root in roots:
        if (root / name).is_dir():
            return root / name
    looked = ", ".join(str(root) for root in roots)
    raise MissingData(f"trace {name!r} is missing (looked in {looked}); "
                      f"download it with `{FETCH_COMMAND} {name}`")


def shared_data_dir() -> Path:
    """The first data root that exists (the fetch folder when none does)."""
    roots = data_roots()
    return next((root for root in roots if root.is_dir()), roots[-1])


def trace_dir() -> Path:
    return dataset_dir(TRACE_DIR)


@dataclass(frozen=True)
class Workload:
    """A named pod list of the trace and the node list it runs on."""

    name: str
    nodes_csv: Path
    pods_csv: Path


def workload_names() -> list[str]:
    """Names of the pod lists in the trace folder (``default``, ``gpushare40`` …)."""
    folder = trace_dir() / "csv"
    prefix = "openb_pod_list_"
    return sorted(p.stem[len(prefix):] for p in folder.glob(f"{prefix}*.csv"))


def find_workload(name: str) -> Workload:
    """The files of a workload by name; NotFound lists the names that exist."""
    folder = trace_dir() / "csv"
    pods = folder / f"openb_pod_list_{name}.csv"
    if not pods.is_file():
        known = ", ".join(workload_names()) or f"none (no trace under {folder})"
        raise NotFound(f"no workload {name!r} in {folder}; known: {known}")
    return Workload(name, folder / NODES_FILE, pods)


def _read_rows(path: Path) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as handle:
            return list(csv.DictReader(handle))
    except OSError as exc:
        raise NotFound(f"cannot read {path}: {exc.strerror}") from exc


def _int(row: dict[str, str], column: str, path: Path) -> int:
    try:
        return int(float(row[column] or 0))
    except (KeyError, ValueError) as exc:
        raise InvalidInput(f"{path.name}:{column}", f"bad value in row {row}") from exc


def load_nodes(path: Path) -> list[NodeState]:
    """GPU nodes of a node list (nodes without GPUs are left out, as in the paper)."""
    nodes = []
    for row in _read_rows(path):
        count = _int(row, "gpu", path)
        if count <= 0:
            continue
        name, model = row["sn"], row.get("model", "") or ""
        gpus = tuple(GpuState(i, f"{name}-{i}", model, 0) for i in range(count))
        nodes.append(NodeState(name, _int(row, "cpu_milli", path),
                               _int(row, "memory_mib", path) * MIB, gpus))
    return nodes


def load_pods(path: Path) -> list[PodRequest]:
    """Pods of a pod list; ``gpu_milli`` < 1000 on one GPU is a share, else whole GPUs."""
    pods = []
    for row in _read_rows(path):
        num, milli = _int(row, "num_gpu", path), _int(row, "gpu_milli", path)
        whole = num if milli >= FULL_GPU_MILLI else 0
        share = milli if num == 1 and 0 < milli < FULL_GPU_MILLI else 0
        pods.append(PodRequest(
            key=row["name"], gpus=whole, gpu_milli=share,
            gpu_model=(row.get("gpu_spec") or None),
            cpu_milli=_int(row, "cpu_milli", path),
            memory_bytes=_int(row, "memory_mib", path) * MIB,
        ))
    return pods
