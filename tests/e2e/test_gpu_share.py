"""Shared GPUs and GPU health with simulated agents: two half-GPU pods run on one GPU under
one MPS daemon that was given their limits; an injected XID 79 (fell off the bus) cordons
the node with the reason, and the node comes back once the checks pass again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.e2e.cluster import Cloud, wait_for
from tests.e2e.conftest import PushedImages

SHOW_ENV = ["sh", "-c", "echo share=$GPUCLOUD_GPU_SHARE threads=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
            " mem=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT pipe=$CUDA_MPS_PIPE_DIRECTORY; sleep 60"]


def _daemon(state_dir: Path, gpu_uuid: str) -> dict[str, Any]:
    """What the simulated MPS control daemon of that GPU was told (gpu/mps.py)."""
    path = state_dir / "mps" / gpu_uuid / "pipe" / "daemon.json"
    state: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    return state


def test_two_half_gpu_pods_share_one_gpu_under_mps_with_their_limits(
        cloud: Cloud, images: PushedImages) -> None:
    agent = cloud.agent("share-a", simulate="rtx4090-2")
    for name in ("h1", "h2"):
        cloud.create_pod(name, images.busybox, SHOW_ENV, gpus=0.5, gpu_memory="8Gi")
    pods = [cloud.wait_pod(name, "Running") for name in ("h1", "h2")]
    assert pods[0].gpu_uuids == pods[1].gpu_uuids and len(pods[0].gpu_uuids) == 1
    for name in ("h1", "h2"):
        line = cloud.wait_log(name, "share=").splitlines()[0]
        assert line == ("share=0.5 threads=50 mem=0=8192M pipe=/tmp/nvidia-mps"), line
    daemon = _daemon(agent.state_dir, pods[0].gpu_uuids[0])
    assert daemon["running"] is True
    assert daemon["commands"].count("set_default_active_thread_percentage 50") == 2, daemon

    for name in ("h1", "h2"):
        cloud.client.delete_pod(name)
    wait_for(lambda: _daemon(agent.state_dir, pods[0].gpu_uuids[0]).get("running") is False,
             20, "the MPS daemon to quit with its last pod")


def test_an_injected_xid79_cordons_the_node_until_the_checks_pass(
        cloud: Cloud, tmp_path: Path) -> None:
    faults = tmp_path / "faults"
    faults.write_text("")
    cloud.agent("sick", extra=["--fault-file", str(faults), "--health-interval", "0.2"])
    faults.write_text("GPU3:xid79\n")

    def cordoned() -> str | None:
        node = cloud.client.get_node("sick")
        return node.cordon_reason if node.cordoned else None

    reason = wait_for(cordoned, 20, "the node to be cordoned by its health check")
    assert "79" in reason, reason
    faults.write_text("")
    wait_for(lambda: not cloud.client.get_node("sick").cordoned, 20,
             "the node to be uncordoned once its checks pass again")
