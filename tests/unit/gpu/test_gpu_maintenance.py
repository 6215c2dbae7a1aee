"""GPU reset and diag (``node gpu-reset`` / ``node diag``): the simulated provider's
equivalents, the real tools' call sequence against stand-ins (``nvidia-smi``, ``dcgmi`` and
the NVML library), and the agent's side that runs each action once and reports it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from gpucloud.agent.health import NodeHealth
from gpucloud.core.models import GpuAction
from gpucloud.gpu.health import (
    DiagOutcome,
    Fault,
    HealthTracker,
    HostMaintenance,
    InjectedFaults,
    SimulatedMaintenance,
    dcgm_failed,
)

UUIDS = ("GPU-a", "GPU-b")


def test_simulated_reset_clears_transient_faults_and_the_diag_sees_the_rest(
        tmp_path: Path) -> None:
    path = tmp_path / "faults"
    path.write_text("GPU1:xid48\nGPU0:xid94\n")
    injected = InjectedFaults((Fault(0, xid=62),), path)
    sim = SimulatedMaintenance(injected)
    assert not sim.diag(1, 1).passed and "XID 48" in sim.diag(1, 1).output
    assert sim.reset(1).passed
    assert path.read_text() == "GPU0:xid94\n"  # only GPU 1's lines go
    assert sim.diag(1, 2).passed
    sim.reset(0)
    outcome = sim.diag(0, 1)  # --inject-fault stands for broken hardware: it stays
    assert not outcome.passed and "XID 62" in outcome.output


class _Nvml:
    """Just the NVML calls the health checks make; GPU ``bad`` has uncorrected ECC."""

    NVMLError = RuntimeError
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_FEATURE_ENABLED = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1

    def __init__(self, bad: str | None = None) -> None:
        self.bad = bad
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return uuid

    def nvmlDeviceGetPciInfo(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(busId=b"00000000:18:00.0")

    def nvmlDeviceGetTotalEccErrors(self, handle: str, kind: int, counter: int) -> int:
        return 3 if handle == self.bad else 0

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: str) -> int:
        return 0

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        return 40

    def nvmlDeviceGetTemperatureThreshold(self, handle: str, kind: int) -> int:
        return 90


PASS = {"DCGM GPU Diagnostic": {"test_categories": [
    {"category": "Deployment", "tests": [{"name": "Denylist", "results": [
        {"gpu_id": "1", "status": "Pass"}]}]}]}}
FAIL = {"DCGM GPU Diagnostic": {"test_categories": [
    {"category": "Hardware", "tests": [{"name": "GPU Memory", "results": [
        {"gpu_id": "1", "status": "Fail", "info": "DBE"}]}]}]}}


def test_host_reset_then_dcgm_diag_call_sequence_and_verdicts() -> None:
    ran: list[list[str]] = []
    answers = {"nvidia-smi": (0, "GPU 00000000:2A:00.0 was successfully reset."),
               "dcgmi": (0, json.dumps(PASS))}

    def run(argv: list[str]) -> tuple[int, str]:
        ran.append(argv)
        return answers[argv[0]]

    host = HostMaintenance(_Nvml(), UUIDS, run=run, which=lambda tool: f"/usr/bin/{tool}")
    assert host.reset(1).passed and host.diag(1, 2).passed
    assert ran == [["nvidia-smi", "--gpu-reset", "-i", "1"],
                   ["dcgmi", "diag", "-r", "2", "-i", "1", "-j"]]
    answers["dcgmi"] = (226, json.dumps(FAIL))
    assert not host.diag(1, 1).passed
    answers["nvidia-smi"] = (255, "Unable to reset GPU: in use by another client")
    assert "in use" in host.reset(1).output and not host.reset(1).passed


def test_host_diag_without_dcgm_is_the_nvml_checks() -> None:
    nvml = _Nvml(bad="GPU-b")
    host = HostMaintenance(nvml, UUIDS, run=lambda argv: (0, ""), which=lambda tool: None)
    clean, broken = host.diag(0, 1), host.diag(1, 1)
    assert clean.passed and "dcgmi not installed" in clean.output
    assert not broken.passed and "ecc" in broken.output
    assert not host.reset(0).passed  # no nvidia-smi: nothing is claimed
    assert nvml.calls.count("init") == nvml.calls.count("shutdown") == 2


def test_dcgm_report_parsing() -> None:
    assert not dcgm_failed(json.dumps(PASS)) and dcgm_failed(json.dumps(FAIL))
    assert dcgm_failed("Error: unable to connect to host engine")


class _Maintenance:
    def __init__(self, diag_passes: bool) -> None:
        self.diag_passes = diag_passes
        self.calls: list[str] = []

    def reset(self, index: int) -> DiagOutcome:
        self.calls.append(f"reset {index}")
        return DiagOutcome(True, "reset")

    def diag(self, index: int, level: int) -> DiagOutcome:
        self.calls.append(f"diag {index} {level}")
        return DiagOutcome(self.diag_passes, "diag output")


def _health(faults: list[Fault], maintenance: _Maintenance) -> NodeHealth:
    return NodeHealth(lambda: list(faults), HealthTracker(UUIDS), 3600.0,
                      clock=lambda: 0.0, maintenance=maintenance, spawn=lambda work: work())


def test_agent_runs_each_action_once_recovers_on_pass_and_forgets_answered_ones() -> None:
    faults = [Fault(1, xid=48)]
    maintenance = _Maintenance(diag_passes=True)
    health = _health(faults, maintenance)
    assert [g["healthy"] for g in health.report()["gpu_health"]] == [True, False]
    reset = GpuAction(id="a1", gpu_uuid="GPU-b", gpu_index=1, action="reset", level=2)
    faults.clear()  # the reset cleared it
    health.submit([reset])
    health.submit([reset])  # listed again until the server has the result: not rerun
    assert maintenance.calls == ["reset 1", "diag 1 2"]
    report = health.report()
    assert report["gpu_actions"] == [{"id": "a1", "passed": True, "output": "diag output"}]
    assert [g["healthy"] for g in report["gpu_health"]] == [True, True]  # no hysteresis wait
    health.submit([])
    assert health.report()["gpu_actions"] == []


def test_a_failed_diag_keeps_the_gpu_out() -> None:
    health = _health([Fault(0, xid=62)], _Maintenance(diag_passes=False))
    health.report()
    health.submit([GpuAction(id="d", gpu_uuid="GPU-a", gpu_index=0, action="diag")])
    report = health.report()
    assert report["gpu_actions"][0]["passed"] is False
    assert [g["healthy"] for g in report["gpu_health"]] == [False, True]
