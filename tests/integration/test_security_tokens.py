"""Credentials: join tokens that expire, run out and can be revoked; every credential
checked with a constant-time comparison; agent tokens scoped to their own node."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpucloud.core.clock import ManualClock
from gpucloud.services import context
from tests.integration.conftest import agent_headers, h100_gpus

REFUSED = "invalid, expired, used up or revoked join token"


def _register(api: TestClient, token: str, name: str) -> Any:
    return api.post("/v1/agent/register", json={
        "join_token": token, "name": name, "cpu_cores": 8, "memory_bytes": 1 << 34,
        "gpus": h100_gpus(2)})


def test_a_single_use_token_registers_one_node(api: TestClient) -> None:
    created = api.post("/v1/nodes/join-tokens", json={"uses": 1})
    assert created.status_code == 201
    token = created.json()
    assert token["max_uses"] == 1 and token["uses"] == 0
    assert token["prefix"] == token["token"][:10]
    assert _register(api, token["token"], "n1").status_code == 201
    second = _register(api, token["token"], "n2")
    assert second.status_code == 401 and second.json()["detail"] == REFUSED
    listed = {t["id"]: t for t in api.get("/v1/nodes/join-tokens").json()}
    assert listed[token["id"]]["uses"] == 1 and "token" not in listed[token["id"]]


def test_a_token_for_n_uses_and_its_default_of_any(api: TestClient) -> None:
    three = api.post("/v1/nodes/join-tokens", json={"uses": 3}).json()["token"]
    codes = [_register(api, three, f"n{i}").status_code for i in range(4)]
    assert codes == [201, 201, 201, 401]
    anyuse = api.post("/v1/nodes/join-tokens").json()
    assert anyuse["max_uses"] is None
    assert all(_register(api, anyuse["token"], f"m{i}").status_code == 201 for i in range(5))


def test_revoked_and_expired_tokens_are_refused(api: TestClient, clock: ManualClock) -> None:
    token = api.post("/v1/nodes/join-tokens").json()
    revoked = api.post(f"/v1/nodes/join-tokens/{token['prefix']}/revoke")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    refused = _register(api, token["token"], "n1")
    assert refused.status_code == 401 and refused.json()["detail"] == REFUSED
    short = api.post("/v1/nodes/join-tokens", json={"ttl_seconds": 60}).json()["token"]
    clock.advance(61)
    assert _register(api, short, "n1").status_code == 401
    assert api.post("/v1/nodes/join-tokens/nope/revoke").status_code == 404


def test_join_token_bounds_and_admin_only(api: TestClient, app_client: TestClient) -> None:
    bad = api.post("/v1/nodes/join-tokens", json={"uses": 0})
    assert bad.status_code == 422 and bad.json()["field"] == "uses"
    team = api.post("/v1/projects", json={"name": "team"}).json()["key"]["key"]
    headers = {"Authorization": f"Bearer {team}"}
    assert app_client.get("/v1/nodes/join-tokens", headers=headers).status_code == 403
    token_id = api.post("/v1/nodes/join-tokens").json()["id"]
    assert app_client.post(f"/v1/nodes/join-tokens/{token_id}/revoke",
                           headers=headers).status_code == 403


def test_a_node_keeps_working_after_its_token_is_revoked(api: TestClient) -> None:
    token = api.post("/v1/nodes/join-tokens", json={"uses": 1}).json()
    reg = _register(api, token["token"], "n1").json()
    api.post(f"/v1/nodes/join-tokens/{token['id']}/revoke")
    lease = api.post("/v1/agent/lease", headers=agent_headers(reg),
                     json={"fencing_token": reg["fencing_token"]})
    assert lease.status_code == 200


@pytest.fixture
def comparisons(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """Records what ``hmac.compare_digest`` compares (it still does the comparing)."""
    seen: list[bytes] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append(bytes(a))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)  # the module secret_matches calls
    yield seen


def test_every_credential_is_compared_in_constant_time(
        api: TestClient, comparisons: list[bytes]) -> None:
    api.app.state.ctx.cache.clear()  # type: ignore[attr-defined]
    join = api.post("/v1/nodes/join-tokens").json()["token"]
    key_hash = context.hash_secret(api.headers["Authorization"].split()[1]).encode()
    assert key_hash in comparisons  # the admin key, on its first (uncached) use
    reg = _register(api, join, "n1").json()
    assert context.hash_secret(join).encode() in comparisons
    api.post("/v1/agent/lease", headers=agent_headers(reg), json={"fencing_token": None})
    assert context.hash_secret(reg["node_token"]).encode() in comparisons


# -- agent tokens are scoped to their node ----------------------------------------------


@pytest.fixture
def two_nodes(api: TestClient) -> tuple[dict[str, Any], dict[str, Any]]:
    token = api.post("/v1/nodes/join-tokens", json={"uses": 2}).json()["token"]
    first, second = _register(api, token, "node-a"), _register(api, token, "node-b")
    return first.json(), second.json()


def test_an_agent_cannot_touch_another_nodes_pods(
        api: TestClient, two_nodes: tuple[dict[str, Any], dict[str, Any]],
        schedule: Callable[[], Any]) -> None:
    a, b = two_nodes
    api.post("/v1/nodes/node-b/cordon")
    pod = api.post("/v1/pods", json={"name": "p", "image": "busybox", "gpus": 1}).json()
    schedule()
    assert api.get(f"/v1/pods/{pod['id']}").json()["node"] == "node-a"
    a_pods = api.get("/v1/agent/assignments", headers=agent_headers(a)).json()["pods"]
    b_pods = api.get("/v1/agent/assignments", headers=agent_headers(b)).json()["pods"]
    assert [p["pod_id"] for p in a_pods] == [pod["id"]] and b_pods == []
    # node B, with its own valid token and fencing token, writes about A's pod: refused
    status = api.post(f"/v1/agent/pods/{pod['id']}/status", headers=agent_headers(b),
                      json={"fencing_token": b["fencing_token"], "phase": "Failed",
                            "exit_code": 1})
    logs = api.post(f"/v1/agent/pods/{pod['id']}/logs", headers=agent_headers(b),
                    json={"fencing_token": b["fencing_token"], "offset": 0,
                          "data": "forged\n"})
    assert status.status_code == 409 and logs.status_code == 409
    # with A's fencing token but B's node token: still B, still refused (stale for B)
    forged = api.post(f"/v1/agent/pods/{pod['id']}/status", headers=agent_headers(b),
                      json={"fencing_token": a["fencing_token"] + 5, "phase": "Failed"})
    assert forged.status_code == 409
    after = api.get(f"/v1/pods/{pod['id']}").json()
    assert after["phase"] == "Scheduled" and after["node"] == "node-a"
    assert api.get(f"/v1/pods/{pod['id']}/logs").json()["text"] == ""
    # A itself may report
    ok = api.post(f"/v1/agent/pods/{pod['id']}/status", headers=agent_headers(a),
                  json={"fencing_token": a["fencing_token"], "phase": "Running"})
    assert ok.status_code == 200


def test_an_api_key_is_not_a_node_token_nor_the_reverse(
        api: TestClient, app_client: TestClient,
        two_nodes: tuple[dict[str, Any], dict[str, Any]]) -> None:
    a, _ = two_nodes
    assert app_client.get("/v1/agent/assignments").status_code == 401
    assert api.get("/v1/agent/assignments").status_code == 401  # the admin key
    assert app_client.get("/v1/pods", headers=agent_headers(a)).status_code == 401
