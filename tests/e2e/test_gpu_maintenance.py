"""`gpucloud node gpu-reset` with a simulated agent: an XID 48 written into the fault file
takes GPU 1 out of scheduling; the reset (the simulated provider clears that GPU's faults)
and its diag pass through the agent, and the GPU is back in service at once. A GPU whose
fault was given with --inject-fault (broken hardware) fails the diag and stays out."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from gpucloud.cli.node import app as node_app
from tests.e2e.cluster import ADMIN_KEY, Cloud, wait_for


def _healthy(cloud: Cloud, node: str) -> list[bool]:
    return [gpu.healthy for gpu in cloud.client.get_node(node).gpus]


def test_reset_returns_a_gpu_to_service_and_a_broken_one_stays_out(
        cloud: Cloud, tmp_path: Path) -> None:
    faults = tmp_path / "faults"
    faults.write_text("")
    cloud.agent("maint", simulate="h100-1", extra=[
        "--fault-file", str(faults), "--health-interval", "0.2",
        "--inject-fault", "GPU0:xid62"])
    wait_for(lambda: _healthy(cloud, "maint") == [False] or None, 20,
             "GPU 0 (--inject-fault xid62) out of service")
    env = {"GPUCLOUD_URL": cloud.url, "GPUCLOUD_API_KEY": ADMIN_KEY}
    failed = CliRunner().invoke(node_app, ["gpu-reset", "maint", "0", "--wait", "20"], env=env)
    assert failed.exit_code == 1, failed.output
    assert "gpu 0 reset failed" in failed.output and "XID 62" in failed.output, failed.output
    assert _healthy(cloud, "maint") == [False]


def test_reset_clears_a_transient_fault(cloud: Cloud, tmp_path: Path) -> None:
    faults = tmp_path / "faults"
    faults.write_text("")
    cloud.agent("flaky", simulate="dgx-h100", extra=[
        "--fault-file", str(faults), "--health-interval", "0.2"])
    faults.write_text("GPU1:xid48\n")
    wait_for(lambda: not _healthy(cloud, "flaky")[1] or None, 20, "GPU 1 out of service")
    env = {"GPUCLOUD_URL": cloud.url, "GPUCLOUD_API_KEY": ADMIN_KEY}
    done = CliRunner().invoke(node_app, ["gpu-reset", "flaky", "1", "--wait", "20"], env=env)
    assert done.exit_code == 0, done.output
    assert "gpu 1 reset passed" in done.output, done.output
    assert faults.read_text() == ""  # the simulated reset
    assert _healthy(cloud, "flaky") == [True] * 8
