"""bench/nvml_check.py, the real-GPU check, against the stand-in NVML MIG library: its
placement comparison agrees with the scheduler's rules and its create/destroy round trip
passes, so on a real machine a failure means the driver disagrees, not the script."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.nvml_check import _mig, _mig_create, _step

from gpucloud.gpu.domain import GpuDevice, NodeHardware
from tests.unit.gpu.fake_mig_nvml import FakeMigNvml
from tests.unit.gpu.fake_nvml import FakeGpu

GiB = 1024**3


def _h100() -> tuple[FakeMigNvml, NodeHardware]:
    nvml = FakeMigNvml([FakeGpu("NVIDIA H100 80GB HBM3", "GPU-real-0", "00000000:18:00.0",
                                80 * GiB, mig=(1, 1))])
    gpu = GpuDevice(index=0, uuid="GPU-real-0", model="H100-80GB", memory_mib=81559,
                    mig_capable=True, mig_mode=True)
    return nvml, NodeHardware(cpu_cores=8, memory_bytes=64 * GiB, gpus=(gpu,), provider="nvml")


def test_placements_agree_and_an_instance_round_trips(tmp_path: Path) -> None:
    nvml, hardware = _h100()
    report = _mig(hardware, nvml)
    assert report["ok"], report
    assert report["gpus"]["0"]["profiles"]["3g.40gb"]["scheduler"] == [(0, 4), (4, 4)]
    minors = tmp_path / "mig-minors"
    minors.write_text("gpu0/gi1/access 21\ngpu0/gi1/ci0/access 22\n")
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    for node in ("nvidia0", "nvidia-caps/nvidia-cap21", "nvidia-caps/nvidia-cap22"):
        (dev / node).touch()
    made = _mig_create(hardware, nvml, minors, dev)
    assert made["ok"] and made["profile"] == "1g.10gb" and made["destroyed"], made
    assert nvml.gis == []


def test_a_failing_step_is_reported_not_raised() -> None:
    results: dict[str, Any] = {}

    def broken() -> dict[str, Any]:
        raise RuntimeError("NVML: GPU is lost")

    _step(results, "health", broken)
    assert results["health"]["ok"] is False and "GPU is lost" in results["health"]["error"]
