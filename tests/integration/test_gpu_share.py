"""Fractional GPUs: the share and memory limit are checked (422 naming the field), kept,
and sent to the agent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.integration.conftest import agent_headers, h100_gpus


@pytest.mark.parametrize(("fields", "field"), [
    ({"gpus": 0.005}, "gpus"),
    ({"gpus": 1.5}, "gpus"),
    ({"gpus": 0.5, "gpu_memory": "200Gi"}, "gpu_memory"),
    ({"gpus": 0.5, "gpu_type": "H100-80GB", "gpu_memory": "90Gi"}, "gpu_memory"),
    ({"gpus": 1, "gpu_memory": "20Gi"}, "gpu_memory"),
    ({"gpus": 0.5, "gpu_memory": "lots"}, "gpu_memory"),
])
def test_bad_shares_are_422_naming_the_field(api: TestClient, fields: dict[str, Any],
                                             field: str) -> None:
    response = api.post("/v1/pods", json={"name": "p", "image": "busybox", **fields})
    assert response.status_code == 422, response.text
    assert field in response.text
    assert api.get("/v1/pods").json() == []


def test_the_share_and_its_memory_limit_reach_the_agent(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    node = register_node("n", gpus=h100_gpus(1))
    created = api.post("/v1/pods", json={"name": "half", "image": "busybox", "gpus": 0.5,
                                         "gpu_memory": "20Gi"})
    assert created.status_code == 201, created.text
    assert created.json()["gpu_memory"] == 20 * 1024**3
    schedule()
    pods = api.get("/v1/agent/assignments", headers=agent_headers(node)).json()["pods"]
    assert [(p["gpu_milli"], p["gpu_memory_bytes"]) for p in pods] == [(500, 20 * 1024**3)]
