from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gpucloud.gpu.cdi import (
    CdiError,
    CdiRegistry,
    apply_edits,
    parse_spec,
    write_simulated_spec,
)
from gpucloud.gpu.domain import GpuDevice
from gpucloud.gpu.profiles import simulate

# Shaped like `nvidia-ctk cdi generate` output (trimmed); /dev/null and /dev/zero stand in
# for /dev/nvidia0 and /dev/nvidiactl so that host stat() works on any machine.
NVIDIA_SPEC = """\
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
      hostPath: /dev/null
- name: GPU-aaaa
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
      hostPath: /dev/null
- name: 1
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia1
      type: c
      major: 195
      minor: 1
      permissions: rw
- name: all
  containerEdits:
    deviceNodes:
    - {path: /dev/nvidia0, hostPath: /dev/null}
containerEdits:
  env:
  - NVIDIA_VISIBLE_DEVICES=void
  - NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu
  deviceNodes:
  - path: /dev/nvidiactl
    hostPath: /dev/zero
  mounts:
  - hostPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
    containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
    options: [ro, nosuid, nodev, bind]
  hooks:
  - hookName: createContainer
    path: /usr/bin/nvidia-ctk
    args: [nvidia-ctk, hook, update-ldcache, --folder, /usr/lib/x86_64-linux-gnu]
    env: [NVIDIA_CTK_DEBUG=false]
"""


def _registry(tmp_path: Path, files: dict[str, str]) -> CdiRegistry:
    directories = []
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if path.parent not in directories:
            directories.append(path.parent)
    return CdiRegistry.load(directories)


def _config() -> dict[str, Any]:
    return {"process": {"env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"]}, "mounts": [],
            "linux": {"resources": {"devices": [{"allow": False, "access": "rwm"}]}}}


def _real_gpu(index: int, uuid: str) -> GpuDevice:
    return GpuDevice(index=index, uuid=uuid, model="H100-80GB", memory_mib=81_559)


def test_nvidia_spec_applies_common_edits_once_and_device_edits(tmp_path: Path) -> None:
    registry = _registry(tmp_path, {"etc/cdi/nvidia.yaml": NVIDIA_SPEC})
    edits = registry.resolve(["nvidia.com/gpu=GPU-aaaa", "nvidia.com/gpu=1"])
    assert len(edits) == 3  # common edits, then one per device
    config = _config()
    apply_edits(config, edits)
    null, zero = os.stat("/dev/null"), os.stat("/dev/zero")
    assert config["process"]["env"] == [
        "PATH=/bin", "NVIDIA_VISIBLE_DEVICES=void",
        "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu",
    ]
    assert config["linux"]["devices"] == [
        {"path": "/dev/nvidiactl", "type": "c", "major": os.major(zero.st_rdev),
         "minor": os.minor(zero.st_rdev), "fileMode": 0o666},
        {"path": "/dev/nvidia0", "type": "c", "major": os.major(null.st_rdev),
         "minor": os.minor(null.st_rdev), "fileMode": 0o666},
        {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1, "fileMode": 0o666},
    ]
    rules = config["linux"]["resources"]["devices"]
    assert rules[0] == {"allow": False, "access": "rwm"}
    assert rules[-1] == {"allow": True, "type": "c", "major": 195, "minor": 1, "access": "rw"}
    assert config["mounts"] == [{
        "destination": "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15", "type": "bind",
        "source": "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
        "options": ["ro", "nosuid", "nodev", "bind"],
    }]
    assert config["hooks"]["createContainer"] == [{
        "path": "/usr/bin/nvidia-ctk",
        "args": ["nvidia-ctk", "hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"],
        "env": ["NVIDIA_CTK_DEBUG=false"],
    }]


def test_gpus_are_found_by_uuid_then_by_index(tmp_path: Path) -> None:
    registry = _registry(tmp_path, {"etc/cdi/nvidia.yaml": NVIDIA_SPEC})
    by_uuid = registry.edits_for_gpus([_real_gpu(0, "GPU-aaaa")])
    by_index = registry.edits_for_gpus([_real_gpu(1, "GPU-bbbb")])
    assert by_uuid[1].device_nodes[0].host_path == "/dev/null"
    assert by_index[1].device_nodes[0].path == "/dev/nvidia1"
    with pytest.raises(CdiError, match="no CDI spec provides device nvidia.com/gpu=7.*nvidia-ctk"):
        registry.edits_for_gpus([_real_gpu(7, "GPU-cccc")])


def test_later_directories_take_precedence(tmp_path: Path) -> None:
    override = NVIDIA_SPEC.replace("major: 195", "major: 511")
    registry = _registry(tmp_path, {"etc/cdi/nvidia.yaml": NVIDIA_SPEC,
                                    "run/cdi/nvidia.json": override})
    found = registry.lookup("nvidia.com/gpu=1")
    assert found is not None and found[1].container_edits.device_nodes[0].major == 511


def test_unreadable_specs_are_reported_without_hiding_good_ones(tmp_path: Path) -> None:
    registry = _registry(tmp_path, {"cdi/a-broken.yaml": "cdiVersion: [",
                                    "cdi/b-old.yaml": NVIDIA_SPEC.replace("0.5.0", "0.3.0"),
                                    "cdi/c-good.yaml": NVIDIA_SPEC.replace("nvidia.com", "ok.io"),
                                    "cdi/notes.txt": "ignored"})
    assert registry.lookup("ok.io/gpu=0") is not None
    assert len(registry.errors) == 2
    assert "older than 0.5.0" in registry.errors[1]
    with pytest.raises(CdiError, match="unreadable specs: .*a-broken.yaml"):
        registry.resolve(["nvidia.com/gpu=0"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cdiVersion: 0.6.0\nkind: nogpu\n", "is not vendor/class"),
        ("cdiVersion: 0.6.0\nkind: a.b/c\ncontainerEdits:\n  hooks:\n"
         "  - {hookName: sometime, path: /bin/true}\n", "unknown hook name"),
        ("kind: a.b/c\n", "not a valid CDI spec"),
    ],
)
def test_invalid_specs(text: str, message: str) -> None:
    with pytest.raises(CdiError, match=message):
        parse_spec(text, "test.yaml")


def test_missing_host_device_node_is_a_clear_error() -> None:
    spec = parse_spec("cdiVersion: 0.6.0\nkind: a.b/c\ndevices:\n- name: x\n  containerEdits:\n"
                      "    deviceNodes: [{path: /dev/nvidia9}]\n", "t")
    with pytest.raises(CdiError, match="CDI device node /dev/nvidia9: No such file"):
        apply_edits(_config(), [spec.devices[0].container_edits])


def test_simulated_spec_round_trips_through_the_registry(tmp_path: Path) -> None:
    hardware = simulate("dgx-h100", "node-a")
    path = write_simulated_spec(tmp_path / "cdi", hardware)
    registry = CdiRegistry.load([tmp_path / "cdi"])
    assert registry.errors == () and path.exists()
    chosen = [hardware.gpus[3], hardware.gpus[6]]
    config = _config()
    apply_edits(config, registry.edits_for_gpus(chosen))
    assert config["process"]["env"][-3:] == [
        "GPUCLOUD_SIMULATED_GPUS=dgx-h100",
        f"GPUCLOUD_SIM_GPU_3={chosen[0].uuid}",
        f"GPUCLOUD_SIM_GPU_6={chosen[1].uuid}",
    ]
    assert config["mounts"] == [] and "devices" not in config["linux"]
    assert registry.lookup("gpucloud.sim/gpu=3") is not None
