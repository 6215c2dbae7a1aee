"""A real agent process registers its access server, and the server's gateway key — and only
it — gets into a running pod with the real OpenSSH client (no gateway in between: the
gateway's own tests go through it)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from gpucloud.access.keys import CLIENT_KEY_FILE
from tests.e2e.cluster import Cloud
from tests.e2e.conftest import PushedImages
from tests.fixtures.openssh import keygen, unpinned_options


def ssh(endpoint: str, key: Path, user: str, command: str) -> subprocess.CompletedProcess[str]:
    host, _, port = endpoint.rpartition(":")
    return subprocess.run(
        ["ssh", *unpinned_options(key), "-p", port, f"{user}@{host}", "--", command],
        capture_output=True, text=True, timeout=30, check=False)


def test_the_agent_lets_the_gateway_key_into_its_running_pod(
    cloud: Cloud, images: PushedImages, tmp_path: Path
) -> None:
    agent = cloud.agent("gpu-a")
    pod = cloud.create_pod("dev", images.busybox, ["sh", "-c", "echo up; sleep 600"])
    cloud.wait_log("dev", "up")
    node = next(n for n in cloud.client.list_nodes() if n.name == "gpu-a")
    assert node.access_endpoint is not None and node.access_endpoint.startswith("127.0.0.1:")
    host_key = (agent.state_dir / "access_host_key")
    assert host_key.stat().st_mode & 0o777 == 0o600

    gateway_key = cloud.workdir / "home" / CLIENT_KEY_FILE
    result = ssh(node.access_endpoint, gateway_key, pod.id, "echo in $HOSTNAME; exit 4")
    assert result.returncode == 4, result.stderr
    assert result.stdout.startswith("in ")

    keygen(tmp_path / "user")
    refused = ssh(node.access_endpoint, tmp_path / "user", pod.id, "true")
    assert refused.returncode == 255 and "Permission denied" in refused.stderr
