from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.gpu.host import normalize_bus_id, pci_numa_node
from gpucloud.gpu.nvml import NvmlInventory, NvmlUnavailable, read_nvml
from tests.unit.gpu.fake_nvml import FakeGpu, FakeNvml, GiB, nvswitch_box


def _inventory(nvml: FakeNvml, sysfs: Path = Path("/nonexistent")) -> NvmlInventory:
    result = read_nvml(nvml, sysfs)
    assert isinstance(result, NvmlInventory), result
    return result


def test_nvswitch_system_peers_come_from_p2p_status() -> None:
    inventory = _inventory(nvswitch_box())
    assert [gpu.nvlink_peers for gpu in inventory.gpus] == [
        tuple(peer for peer in range(8) if peer != index) for index in range(8)
    ]
    first = inventory.gpus[0]
    assert first.model == "H100-80GB" and first.memory_mib == 80 * 1024
    assert first.pci_bus_id == "0000:18:00.0" and first.numa_node == 0
    assert inventory.gpus[7].numa_node == 1
    assert first.mig_capable and not first.mig_mode and not first.simulated
    assert inventory.driver_version == "550.54.15" and inventory.cuda_version == "12.4"


def test_direct_links_map_remote_bus_ids_to_local_indices() -> None:
    # Two bridged pairs (0-1, 2-3), two links each; P2P status must not be needed.
    buses = ["00000000:41:00.0", "00000000:42:00.0", "00000000:C1:00.0", "00000000:C2:00.0"]
    pairs = {0: 1, 1: 0, 2: 3, 3: 2}
    gpus = [FakeGpu("NVIDIA A100-PCIE-40GB", f"GPU-{i}", bus, 40 * GiB,
                    links=[buses[pairs[i]]] * 2) for i, bus in enumerate(buses)]
    inventory = _inventory(FakeNvml(gpus))
    assert [gpu.nvlink_peers for gpu in inventory.gpus] == [(1,), (0,), (3,), (2,)]
    assert inventory.gpus[2].pci_bus_id == "0000:c1:00.0"
    assert inventory.gpus[0].model == "A100-40GB"
    assert not inventory.gpus[0].mig_capable  # MIG query not supported


def test_numa_node_falls_back_to_sysfs(tmp_path: Path) -> None:
    device = tmp_path / "bus" / "pci" / "devices" / "0000:3b:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("1\n")
    gpus = [FakeGpu("NVIDIA L4", "GPU-a", "00000000:3B:00.0", 24 * GiB),
            FakeGpu("Some Future GPU", "GPU-b", "00000000:3C:00.0", 24 * GiB, mig=(1, 1))]
    inventory = _inventory(FakeNvml(gpus), tmp_path)
    assert inventory.gpus[0].numa_node == 1
    assert inventory.gpus[1].numa_node is None  # no sysfs entry either
    assert inventory.gpus[1].model == "Some Future GPU"  # unknown models are kept as named
    assert inventory.gpus[1].mig_mode


@pytest.mark.parametrize(
    ("nvml", "reason"),
    [
        (None, "nvidia-ml-py (pynvml) is not installed"),
        (FakeNvml([], init_error="Driver Not Loaded"), "NVML unavailable: Driver Not Loaded"),
        (FakeNvml([]), "NVIDIA driver 550.54.15 reports no GPUs"),
    ],
)
def test_unavailable_nvml_is_a_reason_not_an_exception(nvml: FakeNvml | None, reason: str) -> None:
    assert read_nvml(nvml) == NvmlUnavailable(reason)


def test_real_pynvml_without_a_driver_reports_unavailable() -> None:
    result = read_nvml()
    if isinstance(result, NvmlInventory):
        pytest.skip("this host has an NVIDIA driver")
    assert result.reason.startswith(("NVML unavailable:", "NVIDIA driver"))


def test_nvml_is_shut_down_after_reading() -> None:
    nvml = nvswitch_box(2)
    _inventory(nvml)
    assert not nvml.initialized


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [("00000000:18:00.0", "0000:18:00.0"), (b"00000000:AB:00.0\x00", "0000:ab:00.0"),
     ("0000:18:00.0", "0000:18:00.0"), ("18:00.0", "0000:18:00.0")],
)
def test_bus_id_normalization(raw: str | bytes, normalized: str) -> None:
    assert normalize_bus_id(raw) == normalized


def test_pci_numa_minus_one_means_unknown(tmp_path: Path) -> None:
    device = tmp_path / "bus" / "pci" / "devices" / "0000:01:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("-1\n")
    assert pci_numa_node("00000000:01:00.0", tmp_path) is None
