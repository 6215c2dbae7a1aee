"""Check: the real NVML path on a machine with NVIDIA GPUs, in well under two minutes.

Runs the agent's own code against the driver (no server, no containers):

1. **inventory** — ``gpu.discovery.discover`` (NVML + sysfs): model, memory, MIG capable /
   mode, PCI bus id, NUMA node, PCIe switch, IOMMU group of every GPU.
2. **health** — ``gpu.health.nvml_faults`` (ECC, pending retired pages, temperature against
   the model's slowdown threshold, fallen off the bus, kernel-log XIDs) through the
   ``HealthTracker``, and which maintenance tools the node has (nvidia-smi, dcgmi).
3. **mig** — on each GPU whose MIG mode is on: the instances NVML lists, and for every
   profile of the model NVML's possible placements (start, size) against the scheduler's
   rules (``scheduler.mig``: starts and memory slices) — they must agree.
4. optional ``--mig-create`` (root, a MIG-mode GPU with no instances in use): create the
   smallest profile's instance at the slot the scheduler would choose (``MigManager``, as
   for a pod), check NVML has it there with a ``MIG-`` UUID and CDI device nodes that
   exist, then destroy it and check it is gone.
5. optional ``--diag`` — ``HostMaintenance.diag`` level 1 on GPU 0 (``dcgmi diag -r 1``
   where DCGM is installed: about a minute; else the NVML checks).

Prints one JSON object (``ok``: every step that ran passed) and exits 0 when ``ok``:

    .venv/bin/python bench/nvml_check.py [--mig-create] [--diag]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpucloud.gpu.discovery import discover  # noqa: E402
from gpucloud.gpu.domain import GpuDevice, NodeHardware  # noqa: E402
from gpucloud.gpu.health import (  # noqa: E402
    HealthTracker,
    HostMaintenance,
    nvml_faults,
)
from gpucloud.gpu.mig import MIG_MINORS, MigManager, NvmlMig  # noqa: E402
from gpucloud.gpu.nvml import DEFAULT_NVML  # noqa: E402
from gpucloud.scheduler.mig import MIG_PROFILES, best_start  # noqa: E402

KERNEL_LOG = Path("/var/log/kern.log")


def _step(results: dict[str, Any], name: str, work: Callable[[], dict[str, Any]]) -> None:
    """Run one step; record its output, time and whether it passed (an error fails it)."""
    started = time.monotonic()
    try:
        out = work()
    except Exception as error:  # noqa: BLE001 - a check reports every failure, never raises
        out = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    out["seconds"] = round(time.monotonic() - started, 2)
    results[name] = out


def _inventory(hardware: NodeHardware) -> dict[str, Any]:
    gpus = [{"index": g.index, "uuid": g.uuid, "model": g.model, "memory_mib": g.memory_mib,
             "mig_capable": g.mig_capable, "mig_mode": g.mig_mode, "pci_bus_id": g.pci_bus_id,
             "numa_node": g.numa_node, "pcie_switch": g.pcie_switch,
             "iommu_group": g.iommu_group, "nvlink_peers": list(g.nvlink_peers)}
            for g in hardware.gpus]
    return {"ok": hardware.provider == "nvml" and bool(gpus), "provider": hardware.provider,
            "note": hardware.note, "driver": hardware.driver_version,
            "cuda": hardware.cuda_version, "gpus": gpus}


def _health(hardware: NodeHardware) -> dict[str, Any]:
    uuids = tuple(g.uuid for g in hardware.gpus)
    bus_ids = tuple(g.pci_bus_id for g in hardware.gpus)
    faults = nvml_faults(DEFAULT_NVML, uuids, bus_ids,
                         KERNEL_LOG if KERNEL_LOG.exists() else None)
    report = HealthTracker(uuids).update(faults)
    return {"ok": True, "faults": [f.describe() for f in faults],
            "gpus": [{"uuid": g.uuid, "healthy": g.healthy, "reason": g.reason}
                     for g in report.gpus],
            "node_fault": report.node_fault,
            "tools": {tool: shutil.which(tool) for tool in ("nvidia-smi", "dcgmi")}}


def _placements(mig: NvmlMig, gpu: GpuDevice) -> dict[str, Any]:
    """NVML's possible placements per profile against the scheduler's start slots."""
    used = 0
    for item in mig.instances():
        if item.gpu_index == gpu.index:
            used |= ((1 << item.size) - 1) << item.slot
    handle = mig.nvml.nvmlDeviceGetHandleByIndex(gpu.index)
    profiles: dict[str, Any] = {}
    agree = True
    for profile, geom in MIG_PROFILES.get(gpu.model, {}).items():
        try:
            found = [(int(p.start), int(p.size)) for p in mig._placements(handle, geom)]
        except mig.nvml.NVMLError as error:
            profiles[profile] = {"error": str(error)}
            agree = False
            continue
        every = [(s, geom.size) for s in geom.starts]
        free = [(s, geom.size) for s in geom.starts if used & geom.mask(s) == 0]
        matches = sorted(found) in (every, free)  # NVML lists all, or only the free ones
        agree &= matches
        profiles[profile] = {"nvml": found, "scheduler": every, "agree": matches}
    return {"agree": agree, "used_slices": f"{used:08b}", "profiles": profiles}


def _mig(hardware: NodeHardware, nvml: Any = DEFAULT_NVML) -> dict[str, Any]:
    migged = [g for g in hardware.gpus if g.mig_mode]
    if not migged:
        return {"ok": True, "skipped": "no GPU has MIG mode on (nvidia-smi -i N -mig 1, "
                "on an idle GPU, as root)"}
    mig = NvmlMig(nvml, hardware)
    instances = [vars(i) for i in mig.instances()]
    gpus = {str(g.index): _placements(mig, g) for g in migged}
    return {"ok": all(v["agree"] for v in gpus.values()), "instances": instances,
            "gpus": gpus}


def _mig_create(hardware: NodeHardware, nvml: Any = DEFAULT_NVML,
                minors: Path = MIG_MINORS, dev: Path = Path("/dev")) -> dict[str, Any]:
    """One instance made where the scheduler would put it, checked, then destroyed."""
    gpu = next((g for g in hardware.gpus if g.mig_mode), None)
    if gpu is None:
        return {"ok": False, "error": "no GPU has MIG mode on"}
    profile, geom = min(MIG_PROFILES[gpu.model].items(), key=lambda item: item[1].size)
    mig = NvmlMig(nvml, hardware, minors=minors, dev=dev)
    used = 0
    for item in mig.instances():
        if item.gpu_index == gpu.index:
            used |= ((1 << item.size) - 1) << item.slot
    slot = best_start(geom, used)
    if slot is None:
        return {"ok": False, "error": f"no free {profile} slot on GPU {gpu.index}"}
    with tempfile.TemporaryDirectory() as state:
        manager = MigManager(mig, hardware, Path(state), Path(state) / "cdi")
        made = manager.acquire("nvml-check", gpu.uuid, profile, slot)
        listed = [i for i in mig.instances() if i.uuid == made.uuid]
        edits = mig.device_edits(made)
        nodes = [n["path"] for n in edits.get("deviceNodes", [])]
        manager.release("nvml-check")
        gone = all(i.uuid != made.uuid for i in mig.instances())
    return {"ok": bool(listed) and listed[0].slot == slot and made.uuid.startswith("MIG-")
            and all(Path(n).exists() for n in nodes) and gone,
            "gpu": gpu.index, "profile": profile, "slot": slot, "mig_uuid": made.uuid,
            "listed_at": [i.slot for i in listed], "device_nodes": nodes,
            "device_nodes_exist": [Path(n).exists() for n in nodes], "destroyed": gone}


def _diag(hardware: NodeHardware) -> dict[str, Any]:
    host = HostMaintenance(DEFAULT_NVML, tuple(g.uuid for g in hardware.gpus))
    outcome = host.diag(0, 1)
    return {"ok": outcome.passed, "gpu": 0, "output": outcome.output[-2000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--mig-create", action="store_true",
                        help="create and destroy one MIG instance (root, MIG mode on)")
    parser.add_argument("--diag", action="store_true", help="run a level-1 diag on GPU 0")
    args = parser.parse_args()
    started = time.monotonic()
    results: dict[str, Any] = {}
    hardware = discover(None, "nvml-check")
    _step(results, "inventory", lambda: _inventory(hardware))
    if hardware.provider == "nvml":
        _step(results, "health", lambda: _health(hardware))
        _step(results, "mig", lambda: _mig(hardware))
        if args.mig_create:
            _step(results, "mig_create", lambda: _mig_create(hardware))
        if args.diag:
            _step(results, "diag", lambda: _diag(hardware))
    ok = all(step.get("ok") for step in results.values())
    print(json.dumps({"ok": ok, "seconds": round(time.monotonic() - started, 2), **results},
                     indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
