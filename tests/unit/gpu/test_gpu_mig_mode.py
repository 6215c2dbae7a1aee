"""Switching a GPU's MIG mode on the node (``node mig-mode``): the simulated provider flips
and keeps its state, the agent's MIG manager follows it (instances only where it is on,
never switched under a held instance), NVML's call sequence with the reset a pending mode
needs, and the agent's health worker reporting the transition."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpucloud.agent.health import NodeHealth
from gpucloud.core.models import GpuAction, NodeRegisterRequest
from gpucloud.gpu.domain import GpuDevice, NodeHardware
from gpucloud.gpu.health import HealthTracker
from gpucloud.gpu.mig import MigError, NvmlMig, mig_manager, with_mig_layout
from tests.unit.gpu.fake_mig_nvml import FakeMigNvml
from tests.unit.gpu.fake_nvml import FakeGpu, NVMLError

GiB = 1024**3


def _hardware(provider: str = "simulated", mig_mode: bool = False) -> NodeHardware:
    gpus = tuple(GpuDevice(index=i, uuid=f"GPU-sim-{i}", model="H100-80GB", memory_mib=81559,
                           mig_capable=i == 0, mig_mode=mig_mode and i == 0, simulated=True)
                 for i in range(2))
    return NodeHardware(cpu_cores=8, memory_bytes=64 * GiB, gpus=gpus,
                        provider=provider)


def test_simulated_switch_enables_instances_refuses_while_held_and_survives_restart(
        tmp_path: Path) -> None:
    manager = mig_manager(_hardware(), tmp_path)
    assert manager is not None
    with pytest.raises(MigError, match="MIG mode is off"):
        manager.acquire("pod-1", "GPU-sim-0", "1g.10gb", 0)
    assert "MIG mode on on GPU 0" in manager.set_mig_mode(0, True)
    made = manager.acquire("pod-1", "GPU-sim-0", "1g.10gb", 0)
    assert made.uuid.startswith("MIG-") and made.slot == 0
    with pytest.raises(MigError, match="hold MIG instances of GPU 0"):
        manager.set_mig_mode(0, False)
    with pytest.raises(MigError, match="does not support MIG"):
        manager.set_mig_mode(1, True)
    again = mig_manager(_hardware(), tmp_path)  # an agent restart: the GPU stayed in MIG mode
    assert again is not None and again.hardware.gpus[0].mig_mode is True
    body = NodeRegisterRequest(join_token="t", name="n", cpu_cores=8, memory_bytes=GiB,
                               gpus=[g.inventory() for g in _hardware().gpus])
    with_mig_layout(body, again)
    assert [g.mig_mode for g in body.gpus] == [True, False]
    assert [m.mig_uuid for m in body.gpus[0].mig_instances] == [made.uuid]
    manager.release("pod-1")
    manager.set_mig_mode(0, False)
    assert mig_manager(_hardware(), tmp_path).hardware.gpus[0].mig_mode is False  # type: ignore[union-attr]


class SwitchingNvml(FakeMigNvml):
    """NVML whose MIG mode change stays pending until the GPU is reset (as on H100)."""

    NVML_DEVICE_MIG_DISABLE = 0

    def nvmlDeviceSetMigMode(self, handle: int, mode: int) -> list[int]:
        gpu = self._gpu(handle)
        if gpu.mig is None:
            raise NVMLError("Not Supported")
        self.calls.append(("SetMigMode", handle, mode))
        gpu.mig = (gpu.mig[0], mode)
        return [0]

    def reset(self, argv: list[str]) -> tuple[int, str]:
        self.calls.append(tuple(argv))
        gpu = self.gpus[int(argv[-1])]
        assert gpu.mig is not None
        gpu.mig = (gpu.mig[1], gpu.mig[1])
        return 0, "GPU 00000000:18:00.0 was successfully reset."


def test_nvml_sets_the_mode_and_resets_where_it_is_pending(tmp_path: Path) -> None:
    nvml = SwitchingNvml([FakeGpu("NVIDIA H100 80GB HBM3", "GPU-sim-0", "00000000:18:00.0",
                                  80 * GiB, mig=(0, 0))])
    hardware = _hardware("nvml")
    backend = NvmlMig(nvml, hardware, minors=tmp_path / "minors", run=nvml.reset)
    done = backend.set_mode(hardware.gpus[0], True)
    assert nvml.calls == [("SetMigMode", 0, 1), ("nvidia-smi", "--gpu-reset", "-i", "0")]
    assert "reset to apply it" in done and nvml.gpus[0].mig == (1, 1)

    def failing_reset(argv: list[str]) -> tuple[int, str]:
        return 1, "GPU is in use"

    stuck = NvmlMig(nvml, hardware, minors=tmp_path / "minors", run=failing_reset)
    with pytest.raises(MigError, match="MIG mode is still 1"):
        stuck.set_mode(hardware.gpus[0], False)


def test_the_health_worker_reports_the_transition(tmp_path: Path) -> None:
    manager = mig_manager(_hardware(), tmp_path)
    assert manager is not None
    health = NodeHealth(lambda: [], HealthTracker(("GPU-sim-0", "GPU-sim-1")), 60,
                        mig_mode=manager.set_mig_mode, spawn=lambda work: work())
    health.submit([GpuAction(id="a1", gpu_uuid="GPU-sim-0", gpu_index=0, action="mig-on"),
                   GpuAction(id="a2", gpu_uuid="GPU-sim-1", gpu_index=1, action="mig-on")])
    results: dict[str, Any] = {r["id"]: r for r in health.report()["gpu_actions"]}
    assert results["a1"]["passed"] and "MIG mode on on GPU 0" in results["a1"]["output"]
    assert not results["a2"]["passed"] and "does not support MIG" in results["a2"]["output"]
    assert manager.hardware.gpus[0].mig_mode is True
    no_mig = NodeHealth(lambda: [], HealthTracker(("GPU-sim-0",)), 60, spawn=lambda w: w())
    no_mig.submit([GpuAction(id="b", gpu_uuid="GPU-sim-0", gpu_index=0, action="mig-off")])
    [result] = no_mig.report()["gpu_actions"]
    assert not result["passed"] and "no MIG-capable GPUs" in result["output"]
