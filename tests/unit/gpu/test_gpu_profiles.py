from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpucloud.cli.gpu import app
from gpucloud.core.errors import InvalidInput
from gpucloud.gpu.discovery import discover
from gpucloud.gpu.domain import NodeHardware
from gpucloud.gpu.profiles import get_profile, list_profiles, simulate, simulated_uuid
from tests.unit.gpu.fake_nvml import nvswitch_box

NVML_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
TiB = 1024**4


@pytest.mark.parametrize(
    ("name", "count", "model", "memory_mib", "numa"),
    [
        ("dgx-h100", 8, "H100-80GB", 81_559, (0, 0, 0, 0, 1, 1, 1, 1)),
        ("hgx-a100-40gb", 8, "A100-40GB", 40_960, (0, 0, 0, 0, 1, 1, 1, 1)),
        ("pcie-l40s-4", 4, "L40S", 46_068, (0, 0, 1, 1)),
        ("rtx4090-2", 2, "RTX4090", 24_564, (0, 0)),
    ],
)
def test_profiles(
    name: str, count: int, model: str, memory_mib: int, numa: tuple[int, ...]
) -> None:
    hardware = simulate(name, "node-1")
    assert hardware.provider == "simulated" and hardware.profile == name
    assert [gpu.index for gpu in hardware.gpus] == list(range(count))
    assert {gpu.model for gpu in hardware.gpus} == {model}
    assert {gpu.memory_mib for gpu in hardware.gpus} == {memory_mib}
    assert tuple(gpu.numa_node for gpu in hardware.gpus) == numa
    assert all(gpu.simulated and NVML_UUID.match(gpu.uuid) for gpu in hardware.gpus)
    assert len({gpu.pci_bus_id for gpu in hardware.gpus}) == count


def test_nvswitch_profiles_are_all_to_all_and_symmetric() -> None:
    for name in ("dgx-h100", "hgx-a100-40gb"):
        gpus = simulate(name, "n").gpus
        for gpu in gpus:
            assert set(gpu.nvlink_peers) == set(range(8)) - {gpu.index}
    dgx = get_profile("dgx-h100")
    assert dgx.cpu_cores == 224 and dgx.memory_bytes == 2 * TiB and dgx.numa_node_count == 2


def test_pcie_profiles_have_no_nvlink_and_l40s_pairs_share_switches() -> None:
    l40s = simulate("pcie-l40s-4", "n").gpus
    assert all(gpu.nvlink_peers == () for gpu in l40s)
    assert [gpu.pcie_switch for gpu in l40s] == [0, 0, 1, 1]
    rtx = simulate("rtx4090-2", "n").gpus
    assert all(gpu.nvlink_peers == () and gpu.pcie_switch is None for gpu in rtx)


def test_uuids_are_stable_per_node_and_distinct_across_nodes() -> None:
    first = [gpu.uuid for gpu in simulate("dgx-h100", "node-a").gpus]
    assert first == [gpu.uuid for gpu in simulate("dgx-h100", "node-a").gpus]
    other = [gpu.uuid for gpu in simulate("dgx-h100", "node-b").gpus]
    assert len(set(first) | set(other)) == 16
    assert simulated_uuid("node-a", 0) == first[0]


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(InvalidInput, match="unknown hardware profile 'dgx-b200'.*dgx-h100"):
        simulate("dgx-b200", "n")


def test_hardware_serializes_to_json_and_back() -> None:
    hardware = simulate("pcie-l40s-4", "n")
    assert NodeHardware.model_validate_json(hardware.model_dump_json()) == hardware
    assert hardware.gpus[1].inventory() == {
        "uuid": hardware.gpus[1].uuid, "model": "L40S", "memory_mib": 46_068, "numa_node": 0,
        "nvlink_peers": [], "index": 1, "pci_bus_id": "0000:42:00.0", "mig_mode": False,
        "mig_capable": False,
        "pcie_switch": 0, "iommu_group": None,
    }


def test_discover_without_driver_or_profile_is_cpu_only(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree:  1 kB\n")
    hardware = discover(None, "n", nvml=None, meminfo=meminfo)
    assert hardware.provider == "none" and hardware.gpus == ()
    assert hardware.memory_bytes == 16_384_000 * 1024 and hardware.cpu_cores >= 1
    assert hardware.note and "CPU-only" in hardware.note and "not installed" in hardware.note


def test_discover_simulated_reports_the_profile_capacity() -> None:
    hardware = discover("hgx-a100-40gb", "n", nvml=None)
    assert hardware.cpu_cores == 256 and hardware.memory_bytes == TiB
    assert len(hardware.gpus) == 8


def test_discover_uses_nvml_when_a_driver_is_present() -> None:
    hardware = discover(None, "n", nvml=nvswitch_box(4))
    assert hardware.provider == "nvml" and hardware.driver_version == "550.54.15"
    assert [gpu.uuid for gpu in hardware.gpus] == [f"GPU-{i:08d}-real" for i in range(4)]


def test_explicit_simulation_wins_over_real_gpus_and_says_so() -> None:
    hardware = discover("rtx4090-2", "n", nvml=nvswitch_box(2))
    assert hardware.provider == "simulated" and hardware.gpus[0].model == "RTX4090"
    assert hardware.note and "2 real GPU(s) found by NVML are ignored" in hardware.note


def test_cli_profiles_json_lists_every_profile() -> None:
    result = CliRunner().invoke(app, ["profiles", "--output", "json"])
    assert result.exit_code == 0, result.output
    listed = json.loads(result.output)
    assert [p["name"] for p in listed] == [p.name for p in list_profiles()]
    assert {"dgx-h100", "hgx-a100-40gb", "pcie-l40s-4", "rtx4090-2"} <= {p["name"] for p in listed}
    assert listed[0]["gpus"] == 8 and listed[0]["description"]


def test_cli_profiles_table_and_discover_errors() -> None:
    table = CliRunner().invoke(app, ["profiles"])
    assert table.exit_code == 0 and "rtx4090-2" in table.output
    bad = CliRunner().invoke(app, ["discover", "--simulate", "nope", "--output", "json"])
    assert bad.exit_code == 2 and "unknown hardware profile 'nope'" in bad.output
    good = CliRunner().invoke(app, ["discover", "--simulate", "rtx4090-2", "-o", "json"])
    assert json.loads(good.output)["provider"] == "simulated"
