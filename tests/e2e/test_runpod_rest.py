"""RunPod REST v2 end to end: a pod created through /runpod/v2 runs on a real agent; GET
shows runtime.ports with the public 22/tcp entry (also as ssh.direct) and the private entry
(the pod's own address); stop, start and delete through the v2 actions."""

from __future__ import annotations

from typing import Any

import httpx

from tests.e2e.cluster import ADMIN_KEY, Cloud, wait_for
from tests.e2e.conftest import PushedImages


def test_v2_pod_runs_shows_its_ports_and_stops_starts_and_goes(
        cloud: Cloud, images: PushedImages) -> None:
    cloud.agent("node-a")
    api = httpx.Client(base_url=f"{cloud.url}/runpod/v2",
                       headers={"Authorization": ADMIN_KEY}, timeout=10)  # bare key
    created = api.post("/pods", json={"name": "rp", "image": images.busybox,
                                      "args": "sleep 300", "ports": ["22/tcp"],
                                      "cpu": {"id": "cpu3c", "vcpuCount": 1}})
    assert created.status_code == 201, created.text
    pod_id = created.json()["id"]

    def running() -> dict[str, Any] | None:
        pod: dict[str, Any] = api.get(f"/pods/{pod_id}").json()
        return pod if pod["status"] == "RUNNING" and pod["runtime"]["ports"] else None

    pod = wait_for(running, 30, "the v2 pod to run with its ports")
    ports = pod["runtime"]["ports"]
    private = [p for p in ports if not p["isIpPublic"]]
    public = [p for p in ports if p["isIpPublic"]]
    assert private and private[0]["ip"] and private[0]["ip"] != "127.0.0.1"
    assert public[0]["private"] == 22 and public[0]["ip"] == "127.0.0.1"
    assert pod["ssh"]["direct"] == {
        "host": "127.0.0.1", "port": public[0]["public"], "username": "root",
        "command": f"ssh root@127.0.0.1 -p {public[0]['public']}"}
    assert pod["actions"] == ["stop", "terminate"] and pod["cost"] >= 0
    assert api.post(f"/pods/{pod_id}/action", json={"action": "stop"}).status_code == 200
    wait_for(lambda: api.get(f"/pods/{pod_id}").json()["status"] == "EXITED" or None, 30,
             "the pod to stop")
    assert api.post(f"/pods/{pod_id}/start").json()["status"] == "PROVISIONING"
    wait_for(running, 30, "the pod to run again")
    assert api.delete(f"/pods/{pod_id}").status_code == 204
    assert api.get(f"/pods/{pod_id}").status_code == 404
    wait_for(lambda: not cloud.client.list_pods() or None, 20, "the pod to go")
    api.close()
