"""SSH keys, node access registration, PUBLIC_KEY, the access view and the exec WebSocket's
refusals, through the REST API (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import asyncssh
import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from gpucloud.access import keys
from gpucloud.core.errors import Conflict, NotFound
from gpucloud.core.settings import Settings
from gpucloud.services.access import pod_target, ssh_login
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import agent_headers

POD = {"name": "dev", "image": "busybox", "command": ["sleep", "600"], "gpus": 1,
       "ports": ["8888/http", "22/tcp"]}


def _public_line(comment: str = "me@laptop", kind: str = "ssh-ed25519") -> str:
    key = asyncssh.generate_private_key(kind, comment=comment)
    return key.export_public_key().decode().strip()


def _team(api: TestClient, name: str) -> dict[str, str]:
    created = api.post("/v1/projects", json={"name": name})
    assert created.status_code == 201, created.text
    return {"Authorization": f"Bearer {created.json()['key']['key']}"}


def test_ssh_keys_add_list_remove(api: TestClient) -> None:
    line = _public_line()
    added = api.post("/v1/ssh-keys", json={"public_key": line + "\n"})
    assert added.status_code == 201, added.text
    body = added.json()
    assert body["name"] == "me@laptop" and body["key_type"] == "ssh-ed25519"
    assert body["fingerprint"].startswith("SHA256:")
    assert body["public_key"] == " ".join(line.split()[:2])
    ecdsa = api.post("/v1/ssh-keys", json={"public_key": _public_line(
        "", "ecdsa-sha2-nistp384"), "name": "ci"}).json()
    assert [k["name"] for k in api.get("/v1/ssh-keys").json()] == ["me@laptop", "ci"]
    removed = api.delete(f"/v1/ssh-keys/{body['id']}")
    assert removed.status_code == 200 and removed.json()["id"] == body["id"]
    assert [k["id"] for k in api.get("/v1/ssh-keys").json()] == [ecdsa["id"]]
    assert api.delete(f"/v1/ssh-keys/{body['id']}").status_code == 404


@pytest.mark.parametrize("public_key", ["nope", "ssh-dss AAAA", "ssh-ed25519 ####", ""])
def test_bad_keys_are_422_naming_public_key_and_store_nothing(api: TestClient,
                                                              public_key: str) -> None:
    response = api.post("/v1/ssh-keys", json={"public_key": public_key})
    assert response.status_code == 422 and response.json()["field"] == "public_key"
    assert api.get("/v1/ssh-keys").json() == []


def test_the_same_key_twice_in_a_project_is_refused_but_another_project_may_hold_it(
        api: TestClient, app_client: TestClient) -> None:
    line = _public_line()
    assert api.post("/v1/ssh-keys", json={"public_key": line}).status_code == 201
    again = api.post("/v1/ssh-keys", json={"public_key": line, "name": "other"})
    assert again.status_code == 422 and again.json()["field"] == "public_key"
    assert "already in this project" in again.json()["detail"]
    team = _team(api, "team-b")
    assert app_client.post("/v1/ssh-keys", json={"public_key": line},
                           headers=team).status_code == 201
    theirs = app_client.get("/v1/ssh-keys", headers=team).json()
    assert len(theirs) == 1
    mine = api.get("/v1/ssh-keys").json()
    assert app_client.delete(f"/v1/ssh-keys/{mine[0]['id']}", headers=team).status_code == 404


def _running_pod(api: TestClient, register_node: Callable[..., dict[str, Any]],
                 schedule: Callable[[], Any], pod: dict[str, Any] | None = None,
                 **node: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    reg = register_node("gpu-1", **node)
    created = api.post("/v1/pods", json=pod or POD).json()
    schedule()
    status = api.post(f"/v1/agent/pods/{created['id']}/status", headers=agent_headers(reg),
                      json={"fencing_token": reg["fencing_token"], "phase": "Running"})
    assert status.status_code == 200, status.text
    return reg, created


def test_registration_stores_access_and_returns_the_gateway_key(
        api: TestClient, register_node: Callable[..., dict[str, Any]],
        settings: Settings) -> None:
    host_key = _public_line("agent")
    reg = register_node("gpu-1", access_endpoint="127.0.0.1:40022",
                        access_host_key=host_key, network_mode="bridge",
                        volume_mode="hostpath")
    assert reg["gateway_public_keys"] == [keys.public_line(keys.client_key(settings.home))]
    assert (settings.home / keys.CLIENT_KEY_FILE).stat().st_mode & 0o777 == 0o600
    node = api.get("/v1/nodes/gpu-1").json()
    assert node["access_endpoint"] == "127.0.0.1:40022"
    assert node["network_mode"] == "bridge" and node["volume_mode"] == "hostpath"
    again = register_node("gpu-1")
    assert again["gateway_public_keys"] == reg["gateway_public_keys"]  # made once
    assert api.get("/v1/nodes/gpu-1").json()["access_endpoint"] is None


def test_pods_get_the_projects_keys_as_public_key_unless_they_set_their_own(
        api: TestClient, register_node: Callable[..., dict[str, Any]],
        schedule: Callable[[], Any]) -> None:
    first, second = _public_line("a"), _public_line("b")
    for line in (first, second):
        api.post("/v1/ssh-keys", json={"public_key": line})
    reg = register_node("gpu-1")
    api.post("/v1/pods", json=POD)
    api.post("/v1/pods", json={**POD, "name": "own", "env": {"PUBLIC_KEY": "mine"}})
    schedule()
    pods = api.get("/v1/agent/assignments", headers=agent_headers(reg)).json()["pods"]
    env = {p["name"]: p["env"] for p in pods}
    expected = "\n".join(" ".join(line.split()[:2]) for line in (first, second))
    assert env["dev"]["PUBLIC_KEY"] == expected
    assert env["own"]["PUBLIC_KEY"] == "mine"


def test_access_view_lists_the_ssh_command_and_http_ports(api: TestClient) -> None:
    pod = api.post("/v1/pods", json=POD).json()
    access = api.get("/v1/pods/dev/access").json()
    assert access["pod_id"] == pod["id"] and access["ssh_user"] == pod["id"]
    assert access["ssh_port"] == 0 and access["ssh_command"] == ""  # no gateway in this app
    assert access["http"] == {"8888": f"http://{pod['id']}-8888.localhost/"}
    assert access["proxy_token"]
    assert api.get("/v1/pods/nope/access").status_code == 404


def test_pod_target_resolves_ids_suffixes_and_names_within_one_project(
        api: TestClient, app_client: TestClient, app_ctx: ServiceContext,
        register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]) -> None:
    reg, pod = _running_pod(api, register_node, schedule, access_endpoint="127.0.0.1:1",
                            access_host_key=_public_line("agent"))
    project = api.get("/v1/projects").json()
    admin_id = next(p["id"] for p in project if p["name"] == "admin")
    for ref in (pod["id"], f"{pod['id']}-64410f3c", "dev"):
        target = pod_target(app_ctx, admin_id, ref)
        assert target.pod_id == pod["id"] and target.endpoint == "127.0.0.1:1"
    _team(api, "team-b")
    other = next(p["id"] for p in api.get("/v1/projects").json() if p["name"] == "team-b")
    with pytest.raises(NotFound):
        pod_target(app_ctx, other, pod["id"])
    api.post(f"/v1/pods/{pod['id']}/stop")
    api.post(f"/v1/agent/pods/{pod['id']}/status", headers=agent_headers(reg),
             json={"fencing_token": reg["fencing_token"], "phase": "Stopped"})
    with pytest.raises(Conflict, match="start it with `gpucloud pod start dev`"):
        pod_target(app_ctx, admin_id, "dev")


def test_ssh_login_needs_a_key_of_the_pods_project(
        api: TestClient, app_client: TestClient, app_ctx: ServiceContext) -> None:
    pod = api.post("/v1/pods", json=POD).json()
    mine, theirs = _public_line("mine"), _public_line("theirs")
    api.post("/v1/ssh-keys", json={"public_key": mine})
    team = _team(api, "team-b")
    app_client.post("/v1/ssh-keys", json={"public_key": theirs}, headers=team)
    app_client.post("/v1/pods", json=POD, headers=team)  # team-b also has a pod "dev"

    def fingerprint(line: str) -> str:
        return asyncssh.import_public_key(line).get_fingerprint("sha256")

    found = ssh_login(app_ctx, pod["id"], fingerprint(mine))
    assert found is not None and found.pod_id == pod["id"]
    assert ssh_login(app_ctx, pod["id"], fingerprint(theirs)) is None
    by_name = ssh_login(app_ctx, "dev", fingerprint(theirs))
    assert by_name is not None and by_name.pod_id != pod["id"]
    assert ssh_login(app_ctx, pod["id"], "SHA256:unknown") is None


def _exec_error(api: TestClient, ref: str, headers: dict[str, str] | None = None,
                subprotocols: list[str] | None = None,
                first: dict[str, Any] | None = None) -> dict[str, Any]:
    with api.websocket_connect(f"/v1/pods/{ref}/exec", headers=headers or {},
                               subprotocols=subprotocols or ["gpucloud.exec"]) as ws:
        ws.send_text(json.dumps(first or {"command": ["true"]}))
        frame = ws.receive_bytes()
        assert frame[0] == 4
        body: dict[str, Any] = json.loads(frame[1:])
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_bytes()
        assert closed.value.code == 4000 + body["status"]
        return body


def test_exec_refusals_are_one_line_exit_frames(api: TestClient, app_client: TestClient) -> None:
    api.post("/v1/pods", json=POD)
    pending = _exec_error(api, "dev")
    assert pending["status"] == 409 and "is Pending" in pending["error"]
    assert _exec_error(api, "nope")["status"] == 404
    bad = _exec_error(api, "dev", first={"command": []})
    assert bad["status"] == 422
    no_key = _exec_error(app_client, "dev", headers={"Authorization": ""})
    assert no_key["status"] == 401
    team = _team(api, "team-b")
    token = team["Authorization"].split()[1]
    other = _exec_error(app_client, "dev", headers={"Authorization": ""},
                        subprotocols=["gpucloud.exec", f"bearer.{token}"])
    assert other["status"] == 404  # the subprotocol key works; the pod is another project's
