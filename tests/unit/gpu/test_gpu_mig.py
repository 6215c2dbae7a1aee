"""MIG instances on the node: the NVML call sequence (stand-in NVML), and the simulated
provider's full path (create at the scheduler's slot, CDI device, destroy, adopt, orphan)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpucloud.gpu.cdi import apply_edits
from gpucloud.gpu.domain import GpuDevice, NodeHardware
from gpucloud.gpu.mig import MigError, MigManager, NvmlMig, SimulatedMig, mig_manager
from gpucloud.gpu.profiles import simulate
from gpucloud.scheduler.mig import best_start, geometry
from tests.unit.gpu.fake_mig_nvml import FakeMigNvml
from tests.unit.gpu.fake_nvml import FakeGpu

GiB = 1024**3


def _real_h100() -> tuple[FakeMigNvml, NodeHardware]:
    nvml = FakeMigNvml([FakeGpu("NVIDIA H100 80GB HBM3", "GPU-real-0", "00000000:18:00.0",
                                80 * GiB, mig=(1, 1))])
    gpu = GpuDevice(index=0, uuid="GPU-real-0", model="H100-80GB", memory_mib=81559,
                    mig_capable=True, mig_mode=True)
    return nvml, NodeHardware(cpu_cores=8, memory_bytes=64 * GiB, gpus=(gpu,),
                              provider="nvml")


def test_nvml_creates_at_the_slot_after_checking_placements_and_destroys_ci_then_gi(
        tmp_path: Path) -> None:
    nvml, hardware = _real_h100()
    minors = tmp_path / "mig-minors"
    minors.write_text("gpu0/gi1/access 21\ngpu0/gi1/ci0/access 22\ngpu0/gi2/access 30\n")
    backend = NvmlMig(nvml, hardware, minors=minors, dev=tmp_path / "dev")
    manager = MigManager(backend, hardware, tmp_path / "state", tmp_path / "cdi")
    made = manager.acquire("pod-a-1", "GPU-real-0", "3g.40gb", 4)
    assert (made.slot, made.size, made.gi_id, made.ci_id) == (4, 4, 1, 0)
    assert made.uuid == "MIG-fake-0-1-0"
    # Placements are checked before the instance is made at the scheduler's slot, then
    # its compute instance (what follows lists the instances for the CDI spec).
    assert nvml.calls[:8] == [
        ("GetGpuInstanceProfileInfo", 0, 2), ("GetGpuInstancePossiblePlacements", 0, 2),
        ("GetGpuInstanceProfileInfo", 0, 2), ("GetGpuInstancePossiblePlacements", 0, 2),
        ("GetGpuInstanceProfileInfo", 0, 2), ("CreateGpuInstanceWithPlacement", 0, 2, 4),
        ("GetComputeInstanceProfileInfo", 1, 2), ("CreateComputeInstance", 1, 2)]
    spec = json.loads((tmp_path / "cdi" / "gpucloud-mig.json").read_text())
    device = spec["devices"][0]
    assert device["name"] == made.uuid
    assert [n["path"] for n in device["containerEdits"]["deviceNodes"]] == [
        f"{tmp_path}/dev/nvidia0", f"{tmp_path}/dev/nvidia-caps/nvidia-cap21",
        f"{tmp_path}/dev/nvidia-caps/nvidia-cap22"]
    assert f"NVIDIA_VISIBLE_DEVICES={made.uuid}" in device["containerEdits"]["env"]
    nvml.calls.clear()
    manager.release("pod-a-1")
    destroys = [c for c in nvml.calls if c[0].endswith("Destroy")]
    assert destroys == [("ComputeInstanceDestroy", 1, 0), ("GpuInstanceDestroy", 1)]
    assert nvml.gis == []
    assert json.loads((tmp_path / "cdi" / "gpucloud-mig.json").read_text())["devices"] == []


def test_nvml_refuses_a_slot_the_driver_does_not_offer(tmp_path: Path) -> None:
    nvml, hardware = _real_h100()
    minors = tmp_path / "mig-minors"
    minors.write_text("gpu0/gi1/access 21\ngpu0/gi1/ci0/access 22\n")
    manager = MigManager(NvmlMig(nvml, hardware, minors=minors), hardware, tmp_path,
                         tmp_path / "cdi")
    manager.acquire("pod-a-1", "GPU-real-0", "4g.40gb", 0)
    with pytest.raises(MigError, match="cannot place 3g.40gb at slot 0"):
        manager.acquire("pod-b-1", "GPU-real-0", "3g.40gb", 0)
    assert not any(c[0] == "CreateGpuInstanceWithPlacement" and c[3] == 0 and c[2] == 2
                   for c in nvml.calls)


def _sim(tmp_path: Path) -> MigManager:
    manager = mig_manager(simulate("h100-1", "n1"), tmp_path / "state")
    assert manager is not None
    return manager


def test_simulated_full_path_create_container_sees_it_release_destroys(tmp_path: Path) -> None:
    manager = _sim(tmp_path)
    gpu = manager.hardware.gpus[0]
    geom = geometry(gpu.model, "1g.10gb")
    assert geom is not None
    slot = best_start(geom, 0)
    assert slot is not None
    made = manager.acquire("pod-x-1", gpu.uuid, "1g.10gb", slot)
    assert made.uuid.startswith("MIG-") and made.slot == slot
    config: dict[str, object] = {"process": {"env": ["NVIDIA_VISIBLE_DEVICES=GPU-x"]}}
    apply_edits(config, manager.edits(made))
    env = config["process"]["env"]  # type: ignore[index]
    assert f"NVIDIA_VISIBLE_DEVICES={made.uuid}" in env and "NVIDIA_VISIBLE_DEVICES=GPU-x" \
        not in env
    assert [i.uuid for i in manager.backend.instances()] == [made.uuid]
    manager.release("pod-x-1")
    assert manager.backend.instances() == []


def test_simulated_follows_the_placement_rules(tmp_path: Path) -> None:
    manager = _sim(tmp_path)
    uuid = manager.hardware.gpus[0].uuid
    manager.acquire("a", uuid, "3g.40gb", 4)
    with pytest.raises(MigError, match="slot 1"):
        manager.acquire("b", uuid, "2g.20gb", 1)  # 2g starts only at 0, 2 or 4
    with pytest.raises(MigError, match="slot 4"):
        manager.acquire("b", uuid, "1g.10gb", 4)  # taken by the 3g
    manager.acquire("c", uuid, "4g.40gb", 0)
    with pytest.raises(MigError):
        manager.acquire("d", uuid, "1g.10gb", 6)
    assert sorted((i.profile, i.slot) for i in manager.backend.instances()) == [
        ("3g.40gb", 4), ("4g.40gb", 0)]


def test_restart_adopts_running_pods_instances_and_destroys_orphans(tmp_path: Path) -> None:
    first = _sim(tmp_path)
    uuid = first.hardware.gpus[0].uuid
    kept = first.acquire("pod-kept-1", uuid, "1g.10gb", 0)
    first.acquire("pod-gone-1", uuid, "1g.10gb", 1)
    again = _sim(tmp_path)  # the agent restarted: the "GPU" kept its instances
    assert again.reconcile({"pod-kept-1"}) != []
    assert [i.uuid for i in again.backend.instances()] == [kept.uuid]
    assert again.acquire("pod-kept-1", uuid, "1g.10gb", 0) == kept  # adopted, not remade


def test_an_instance_left_mid_creation_is_an_orphan(tmp_path: Path) -> None:
    manager = _sim(tmp_path)
    gpu = manager.hardware.gpus[0]
    backend = manager.backend
    assert isinstance(backend, SimulatedMig)
    manager._save({"pod-crashed-1": {"gpu_index": 0, "slot": 2, "profile": "1g.10gb",
                                     "uuid": None, "created": True}})
    backend.create(gpu, "1g.10gb", 2)  # made, then the agent died before recording it
    assert manager.reconcile(set()) and backend.instances() == []


def test_a_gpu_not_in_mig_mode_is_never_switched_by_placing(tmp_path: Path) -> None:
    manager = mig_manager(simulate("dgx-h100", "n1"), tmp_path)
    assert manager is not None
    with pytest.raises(MigError, match="MIG mode is off on GPU 0"):
        manager.acquire("p", manager.hardware.gpus[0].uuid, "1g.10gb", 0)
