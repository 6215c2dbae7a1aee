"""`pod start --migrate` through the REST API and the agent protocol (both databases):
who may fetch the volume disk from whom, what a confirmed or failed copy changes, and
what is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncssh
import pytest
from fastapi.testclient import TestClient

from gpucloud.cli.main import main
from gpucloud.core.settings import Settings
from tests.conftest import ADMIN_KEY
from tests.fixtures.server import live_server
from tests.integration.conftest import agent_headers

POD = {"name": "dev", "image": "busybox", "command": ["sleep", "60"], "gpus": 1,
       "volume_size": "20Gi"}
ONE_GPU = [{"uuid": "GPU-a", "model": "H100-80GB", "memory_mib": 81559}]
DIGEST = "ab" * 32
Register = Callable[..., dict[str, Any]]


def host_key() -> str:
    return str(asyncssh.generate_private_key("ssh-ed25519")
               .export_public_key("openssh").decode().strip())


def _status(api: TestClient, reg: dict[str, Any], pod_id: str, phase: str,
            **extra: Any) -> dict[str, Any]:
    response = api.post(f"/v1/agent/pods/{pod_id}/status", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "phase": phase, **extra})
    assert response.status_code == 200, response.text
    return dict(response.json()) if response.content else {}


def _assignments(api: TestClient, reg: dict[str, Any]) -> dict[str, Any]:
    response = api.get("/v1/agent/assignments", headers=agent_headers(reg))
    assert response.status_code == 200, response.text
    return dict(response.json())


def _events(api: TestClient, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.get(f"/v1/pods/{name}/events").json() if e["reason"] == reason]


class Cluster:
    """n1 (one GPU) holds dev's stopped volume, and its GPU is taken by another pod."""

    def __init__(self, api: TestClient, register: Register,
                 schedule: Callable[[], Any]) -> None:
        self.api, self.schedule = api, schedule
        self.n1_key = host_key()
        self.n1 = register("n1", gpus=ONE_GPU, access_endpoint="127.0.0.1:4001",
                           access_host_key=self.n1_key)
        self.pod = api.post("/v1/pods", json=POD).json()
        schedule()
        _status(api, self.n1, self.pod["id"], "Running")
        api.post("/v1/pods/dev/stop")
        _status(api, self.n1, self.pod["id"], "Stopped")

    def take_n1(self) -> None:
        self.api.post("/v1/pods", json={"name": "other", "image": "busybox", "gpus": 1})
        self.schedule()

    def add_n2(self) -> dict[str, Any]:
        self.n2_key = host_key()
        return self._register("n2", self.n2_key)

    def _register(self, name: str, key: str) -> dict[str, Any]:
        token = self.api.post("/v1/nodes/join-tokens").json()["token"]
        response = self.api.post("/v1/agent/register", json={
            "join_token": token, "name": name, "cpu_cores": 64, "memory_bytes": 512 * 1024**3,
            "gpus": [{"uuid": f"GPU-{name}", "model": "H100-80GB", "memory_mib": 81559}],
            "access_endpoint": "127.0.0.1:4002", "access_host_key": key})
        assert response.status_code == 201, response.text
        return dict(response.json())


@pytest.fixture
def cluster(api: TestClient, register_node: Register,
            schedule: Callable[[], Any]) -> Cluster:
    return Cluster(api, register_node, schedule)


def test_migrate_copies_to_a_node_with_room_and_the_source_lets_go(
    api: TestClient, cluster: Cluster
) -> None:
    cluster.take_n1()
    n2 = cluster.add_n2()
    started = api.post("/v1/pods/dev/start", params={"migrate": True})
    assert started.status_code == 200, started.text
    pod_id = cluster.pod["id"]
    # pending: unpinned, and n1 keeps the disk (it is the source)
    assert _assignments(api, cluster.n1)["volume_pods"] == [pod_id]
    cluster.schedule()
    assert api.get("/v1/pods/dev").json()["node"] == "n2"
    mine = [p for p in _assignments(api, n2)["pods"] if p["pod_id"] == pod_id][0]
    assert mine["volume_source"] == {"node": "n1", "endpoint": "127.0.0.1:4001",
                                     "host_key": cluster.n1_key}
    source = _assignments(api, cluster.n1)
    assert source["volume_pods"] == [pod_id]
    assert source["volume_exports"] == [{"pod_id": pod_id, "peer_node": "n2",
                                         "peer_key": cluster.n2_key}]

    report = {"source_node": "n1", "size_bytes": 10240, "sha256": DIGEST}
    for _ in range(2):  # a retried report changes nothing more
        _status(api, n2, pod_id, "Pulling", volume_migration=report)
    migrated = _events(api, "dev", "VolumeMigrated")
    assert len(migrated) == 1
    assert migrated[0]["message"] == (f"10Ki (10240 bytes) copied from node n1 to n2, "
                                      f"sha256 {DIGEST}")
    source = _assignments(api, cluster.n1)
    assert (source["volume_pods"], source["volume_exports"]) == ([], [])
    assert api.get("/v1/pods/dev").json()["volume_node"] == "n2"
    mine = [p for p in _assignments(api, n2)["pods"] if p["pod_id"] == pod_id][0]
    assert mine["volume_source"] is None
    assert _assignments(api, n2)["volume_pods"] == [pod_id]


def test_a_failed_copy_pins_the_pod_back_to_the_source(
    api: TestClient, cluster: Cluster
) -> None:
    cluster.take_n1()
    n2 = cluster.add_n2()
    api.post("/v1/pods/dev/start", params={"migrate": True})
    cluster.schedule()
    pod_id = cluster.pod["id"]
    error = "source node n1 unreachable at 127.0.0.1:4001: Connection refused"
    _status(api, n2, pod_id, "Pulling",
            volume_migration={"source_node": "n1", "error": error})
    _status(api, n2, pod_id, "Failed", reason=f"VolumeMigrationFailed: {error}")
    assert [e["message"] for e in _events(api, "dev", "VolumeMigrationFailed")] == [error]
    pod = api.get("/v1/pods/dev").json()
    assert (pod["phase"], pod["volume_node"]) == ("Failed", "n1")
    assert pod["reason"].startswith("VolumeMigrationFailed: source node n1 unreachable")
    assert _assignments(api, cluster.n1)["volume_pods"] == [pod_id]
    assert _assignments(api, cluster.n1)["volume_exports"] == []
    # a plain start goes back to n1 (still busy): it waits there
    assert api.post("/v1/pods/dev/start").status_code == 200
    cluster.schedule()
    assert api.get("/v1/pods/dev/why").json()["summary"].startswith("its volume is on node n1")


def test_stopping_a_pending_migration_and_starting_plainly_goes_back_to_the_source(
    api: TestClient, cluster: Cluster
) -> None:
    cluster.take_n1()
    api.post("/v1/pods/dev/start", params={"migrate": True})
    cluster.schedule()
    why = api.get("/v1/pods/dev/why").json()["summary"]
    assert why.startswith("its volume is copied from node n1 to the node it gets; ")
    api.post("/v1/pods/dev/stop")  # no node had room yet
    assert _assignments(api, cluster.n1)["volume_pods"] == [cluster.pod["id"]]
    api.post("/v1/pods/dev/start")
    cluster.add_n2()
    cluster.schedule()
    pod = api.get("/v1/pods/dev").json()
    assert (pod["phase"], pod["volume_node"]) == ("Pending", "n1")


def test_migrate_back_onto_the_source_copies_nothing(api: TestClient, cluster: Cluster) -> None:
    assert api.post("/v1/pods/dev/start", params={"migrate": True}).status_code == 200
    cluster.schedule()  # n1 has room again: that is where it lands
    pod = api.get("/v1/pods/dev").json()
    assert (pod["node"], pod["volume_node"]) == ("n1", "n1")
    mine = _assignments(api, cluster.n1)
    assert mine["pods"][0]["volume_source"] is None and mine["volume_exports"] == []


def test_migrate_from_a_lost_node_is_refused(
    api: TestClient, cluster: Cluster, expire_leases: Callable[[], list[str]], clock: Any
) -> None:
    clock.advance(3600)
    expire_leases()
    cluster.add_n2()
    refused = api.post("/v1/pods/dev/start", params={"migrate": True})
    assert refused.status_code == 409
    detail = refused.json()["detail"]
    assert "the volume is on lost node n1" in detail and "--gpus 0" in detail
    assert "\n" not in detail
    assert api.get("/v1/pods/dev").json()["phase"] == "Stopped"


def test_migrate_without_a_volume_disk_is_422(api: TestClient, register_node: Register,
                                              schedule: Callable[[], Any]) -> None:
    register_node("n1")
    api.post("/v1/pods", json={**POD, "volume_size": None})
    api.post("/v1/pods/dev/stop")
    response = api.post("/v1/pods/dev/start", params={"migrate": True})
    assert response.status_code == 422 and response.json()["field"] == "migrate"


def test_bad_migration_reports_are_422(api: TestClient, cluster: Cluster) -> None:
    response = api.post(
        f"/v1/agent/pods/{cluster.pod['id']}/status", headers=agent_headers(cluster.n1),
        json={"fencing_token": cluster.n1["fencing_token"], "phase": "Stopped",
              "volume_migration": {"source_node": "n1", "sha256": "not-hex"}})
    assert response.status_code == 422


def test_the_cli_passes_migrate_and_errors_in_one_line(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with live_server(settings, run_controllers=False) as url:
        monkeypatch.setenv("GPUCLOUD_URL", url)
        monkeypatch.setenv("GPUCLOUD_API_KEY", ADMIN_KEY)
        monkeypatch.setenv("GPUCLOUD_HOME", str(tmp_path / "cli-home"))
        assert main(["pod", "create", "plain", "--image", "busybox", "--", "true"]) == 0
        assert main(["pod", "stop", "plain"]) == 0
        capsys.readouterr()
        assert main(["pod", "start", "plain", "--migrate"]) != 0
        err = capsys.readouterr().err
        assert "migrate" in err and "no volume disk" in err
        assert len(err.strip().splitlines()) == 1
        assert main(["pod", "create", "dev", "--image", "busybox", "--volume-size", "1Gi",
                     "--", "true"]) == 0
        assert main(["pod", "stop", "dev"]) == 0
        assert main(["pod", "start", "dev", "--migrate"]) == 0  # never placed: starts anywhere
        assert "pod dev: Pending" in capsys.readouterr().out
