"""No secret in logs or events: a representative flow with every logger at DEBUG, then
every captured line and every pod event is searched for each secret the flow used."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpucloud.core.redact import MASK, RedactSecrets
from tests.conftest import ADMIN_KEY
from tests.integration.conftest import agent_headers, h100_gpus

PASSWORD = "hunter2-registry-password"


def _flow(api: TestClient, app_client: TestClient, schedule: Any) -> tuple[list[str], str]:
    """Keys, tokens and a registry password through the API; returns them and a pod id."""
    project = api.post("/v1/projects", json={"name": "team"}).json()
    team_key = project["key"]["key"]
    extra_key = api.post("/v1/keys", json={"name": "ci"}).json()["key"]
    join = api.post("/v1/nodes/join-tokens", json={"uses": 2}).json()["token"]
    reg = api.post("/v1/agent/register", json={
        "join_token": join, "name": "n1", "cpu_cores": 8, "memory_bytes": 1 << 34,
        "gpus": h100_gpus(2)}).json()
    team = {"Authorization": f"Bearer {team_key}"}
    assert app_client.post("/v1/registry-auths", headers=team, json={
        "name": "lab", "username": "alice", "password": PASSWORD,
        "registry": "127.0.0.1:5000"}).status_code == 201
    pod = app_client.post("/v1/pods", headers=team, json={
        "name": "p", "image": "127.0.0.1:5000/lab/app:1", "gpus": 1,
        "registry_auth": "lab", "ports": ["8888/http"]}).json()
    schedule()
    assignments = app_client.get("/v1/agent/assignments", headers=agent_headers(reg)).json()
    assert assignments["pods"][0]["registry_password"] == PASSWORD  # the agent gets it
    app_client.post(f"/v1/agent/pods/{pod['id']}/status", headers=agent_headers(reg),
                    json={"fencing_token": reg["fencing_token"], "phase": "Running"})
    access = app_client.get(f"/v1/pods/{pod['id']}/access", headers=team).json()
    proxy_token = str(access.get("proxy_token") or "")
    # wrong credentials of every kind, which services log nothing about either
    app_client.get("/v1/pods", headers={"Authorization": f"Bearer {team_key}x"})
    app_client.get("/v1/agent/assignments",
                   headers={"Authorization": f"Bearer {reg['node_token']}x"})
    if proxy_token:
        app_client.get(f"/proxy/{pod['id']}/8888/?gpucloud_token={proxy_token}",
                       follow_redirects=False)
    secrets = [ADMIN_KEY, team_key, extra_key, join, reg["node_token"], PASSWORD]
    return [s for s in [*secrets, proxy_token] if s], pod["id"]


def test_no_secret_reaches_a_log_line_or_an_event(
        api: TestClient, app_client: TestClient, schedule: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        secrets, pod_id = _flow(api, app_client, schedule)
    assert len(caplog.records) > 0  # the flow does log (sql echo off, our own lines on)
    text = caplog.text + "\n".join(str(r.__dict__) for r in caplog.records)
    events = api.get(f"/v1/pods/{pod_id}/events").text
    pod = api.get(f"/v1/pods/{pod_id}").text
    for secret in secrets:
        assert secret not in text, f"a secret ({secret[:4]}…) is in the logs"
        assert secret not in events and secret not in pod


def test_an_access_log_line_is_redacted() -> None:
    """uvicorn's access log, as it formats a proxied request with the browser token, and a
    line naming an API key or a Bearer credential."""
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", "/proxy/abc/8888/?x=1&gpucloud_token=Tok3nVALUE-123", "1.1",
         307), None)
    RedactSecrets().filter(record)
    line = record.getMessage()
    assert "Tok3nVALUE" not in line and f"gpucloud_token={MASK}" in line and "x=1" in line
    other = logging.LogRecord("x", logging.INFO, __file__, 1, "key %s and %s",
                              ("gpc_AbCdEf0123456789xyz", "Authorization: Bearer s3cr3tv4lue99"),
                              None)
    RedactSecrets().filter(other)
    assert "AbCdEf" not in other.getMessage() and "s3cr3tv4lue" not in other.getMessage()
