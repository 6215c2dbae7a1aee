"""`gpucloud node mig-mode` with a simulated agent (h100-1, MIG mode on): switching it off
goes through the agent (the simulated provider flips and keeps its state) and the node's
inventory follows, so a whole-GPU pod then runs there; switching it back on while that pod
holds the GPU and without a wait is refused."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from gpucloud.cli.node import app as node_app
from tests.e2e.cluster import ADMIN_KEY, Cloud, wait_for
from tests.e2e.conftest import PushedImages


def test_mig_mode_off_through_the_agent_then_a_whole_gpu_pod_runs(
        cloud: Cloud, images: PushedImages) -> None:
    agent = cloud.agent("switch", simulate="h100-1", extra=["--health-interval", "0.2"])
    wait_for(lambda: cloud.client.get_node("switch").gpus[0].mig_mode or None, 20,
             "the node registered in MIG mode")
    env = {"GPUCLOUD_URL": cloud.url, "GPUCLOUD_API_KEY": ADMIN_KEY}
    done = CliRunner().invoke(node_app, ["mig-mode", "switch", "0", "--off", "--wait", "20"],
                              env=env)
    assert done.exit_code == 0, done.output
    assert "gpu 0 mig-off passed" in done.output, done.output
    assert cloud.client.get_node("switch").gpus[0].mig_mode is False
    modes = json.loads((agent.state_dir / "mig" / "simulated-modes.json").read_text())
    assert modes == {"0": False}
    cloud.create_pod("whole", images.busybox, ["sleep", "60"], gpus=1)
    wait_for(lambda: cloud.client.get_pod("whole").phase == "Running" or None, 30,
             "the whole-GPU pod running")
    refused = CliRunner().invoke(node_app, ["mig-mode", "switch", "0", "--on", "--wait", "0"],
                                 env=env)
    assert refused.exit_code == 1 and "whole" in refused.output, refused.output
