"""`pod start --migrate` with two real agents and runc: the stopped pod's volume disk is
copied agent to agent (checked by sha256), the pod runs on the other node and reads its
files, and the source deletes its copy; a Lost source is refused in one line."""

from __future__ import annotations

import pytest

from gpucloud.core.errors import Conflict
from tests.e2e.cluster import Cloud, wait_for
from tests.e2e.conftest import PushedImages

#: First run: writes /workspace (a file, a 2 MiB random blob, a symlink, a file owned by
#: uid 1000); every run: prints what it finds, then runs until stopped.
PROBE = ("if [ ! -f /workspace/x ]; then echo moved-data > /workspace/x; "
         "dd if=/dev/urandom of=/workspace/blob bs=1024 count=2048 2>/dev/null; "
         "mkdir -p /workspace/d; ln -s ../x /workspace/d/link; "
         "echo owned > /workspace/d/app; chown 1000:1000 /workspace/d/app; fi; "
         "echo x=$(cat /workspace/x) link=$(cat /workspace/d/link) "
         "owner=$(stat -c %u /workspace/d/app) "
         "blob=$(sha256sum /workspace/blob | cut -c1-64); echo ready; "
         "trap 'exit 0' TERM; while true; do sleep 0.05; done")


def _first_run(cloud: Cloud, images: PushedImages) -> str:
    """Run dev on gpu-a once and stop it; returns the line describing its files."""
    cloud.create_pod("dev", images.busybox, ["sh", "-c", PROBE], volume_size="20Mi",
                     gpus=1)
    line = cloud.wait_log("dev", "ready").splitlines()[0]
    assert line.startswith("x=moved-data link=moved-data owner=1000 blob=")
    cloud.client.stop_pod("dev")
    cloud.wait_pod("dev", "Stopped")
    return line


def test_migrate_moves_the_volume_to_another_agent(cloud: Cloud, images: PushedImages) -> None:
    source = cloud.agent("gpu-a")
    before = _first_run(cloud, images)
    pod_id = cloud.client.get_pod("dev").id
    assert (source.state_dir / "volumes" / pod_id / "x").read_text() == "moved-data\n"
    destination = cloud.agent("gpu-b")
    cloud.client.cordon("gpu-a")
    cloud.client.start_pod("dev", migrate=True)
    pod = cloud.wait_pod("dev", "Running")
    assert (pod.node, pod.volume_node) == ("gpu-b", "gpu-b")
    log = cloud.wait_log("dev", "ready")
    assert log.splitlines()[0] == before  # same files, link, owner and blob digest
    migrated = [e for e in cloud.client.pod_events("dev") if e.reason == "VolumeMigrated"]
    assert len(migrated) == 1
    assert "copied from node gpu-a to gpu-b, sha256 " in (migrated[0].message or "")
    assert (destination.state_dir / "volumes" / pod_id / "x").is_file()

    def source_copy_gone() -> bool:
        return not (source.state_dir / "volumes" / pod_id).exists()

    wait_for(source_copy_gone, 20, "the source to delete its copy")
    assert not (destination.state_dir / "volumes-incoming" / pod_id).exists()


def test_migrate_from_a_lost_node_is_refused(
        short_lease_cloud: Cloud, images: PushedImages) -> None:
    cloud = short_lease_cloud  # the killed agent's node must go Lost
    source = cloud.agent("gpu-a")
    _first_run(cloud, images)
    cloud.agent("gpu-b")
    source.kill()
    cloud.wait_node("gpu-a", "Lost")
    with pytest.raises(Conflict, match=r"the volume is on lost node gpu-a.*--gpus 0"):
        cloud.client.start_pod("dev", migrate=True)
    assert cloud.client.get_pod("dev").phase == "Stopped"
