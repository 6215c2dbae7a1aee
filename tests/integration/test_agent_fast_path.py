"""The agent's renewals and long polls are served without the framework's request cycle
(api/agent_fast.py): the same answers and errors as the FastAPI route, which still takes
what the fast path does not recognise as well-formed (and answers its 422s)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from gpucloud.services.metrics import families
from tests.integration.conftest import agent_headers

LEASE = "/v1/agent/lease"
POLL = "/v1/agent/assignments"
#: A JSON media type FastAPI parses and the fast path leaves to it.
ROUTED_JSON = {"Content-Type": "application/merge-patch+json"}


def served(api: TestClient) -> dict[tuple[str, str], float]:
    """``gpucloud_agent_requests_served_total`` by (route, served)."""
    return {(labels["route"], labels["served"]): value
            for name, labels, value in families(api.get("/metrics").text)
            if name == "gpucloud_agent_requests_served_total"}


def counted(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float],
            route: str, how: str) -> float:
    return after.get((route, how), 0) - before.get((route, how), 0)


def test_renewals_and_polls_take_the_fast_path_with_the_routes_answers(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any]
) -> None:
    reg = register_node("gpu-1")
    headers = agent_headers(reg)
    assert api.post("/v1/pods", json={"name": "p1", "image": "busybox:1",
                                      "gpus": 2}).status_code == 201
    schedule()
    before = served(api)
    fast = api.post(LEASE, headers=headers, json={"fencing_token": 1})
    routed = api.post(LEASE, headers=headers | ROUTED_JSON,
                      content=json.dumps({"fencing_token": 1}))
    assert fast.status_code == routed.status_code == 200
    assert fast.headers["content-type"] == routed.headers["content-type"]
    assert fast.json().keys() == routed.json().keys()
    assert {k: v for k, v in fast.json().items() if k != "lease_expires_at"} == \
        {k: v for k, v in routed.json().items() if k != "lease_expires_at"}
    polled = api.get(f"{POLL}?wait=0", headers=headers)
    repolled = api.get(f"{POLL}?wait=0&via=route", headers=headers)  # an unknown key
    assert polled.status_code == repolled.status_code == 200
    assert polled.json() == repolled.json() and len(polled.json()["pods"]) == 1
    assert polled.headers["content-type"] == repolled.headers["content-type"]
    after = served(api)
    assert counted(before, after, LEASE, "fast") == 1
    assert counted(before, after, LEASE, "route") == 1
    assert counted(before, after, POLL, "fast") == 1
    assert counted(before, after, POLL, "route") == 1


def test_the_fast_paths_errors_are_the_routes(
    api: TestClient, register_node: Callable[..., dict[str, Any]]
) -> None:
    reg = register_node("gpu-1")
    headers = agent_headers(reg)
    before = served(api)
    stale = api.post(LEASE, headers=headers, json={"fencing_token": 7})
    stale_routed = api.post(LEASE, headers=headers | ROUTED_JSON,
                            content=json.dumps({"fencing_token": 7}))
    assert stale.status_code == stale_routed.status_code == 409
    assert stale.json() == stale_routed.json()
    wrong = {"Authorization": "Bearer gpn_not-a-token"}
    for response in (api.post(LEASE, headers=wrong, json={"fencing_token": 1}),
                     api.get(f"{POLL}?wait=0", headers=wrong)):
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["field"] is None
    after = served(api)
    assert counted(before, after, LEASE, "fast") == 2
    assert counted(before, after, POLL, "fast") == 1
    # the route template is counted for the fast path's answers too
    codes = {(labels["route"], labels["code"]) for name, labels, _ in
             families(api.get("/metrics").text) if name == "gpucloud_http_requests_total"}
    assert {(LEASE, "409"), (LEASE, "401"), (POLL, "401")} <= codes


def test_what_the_fast_path_does_not_take_the_route_answers(
    api: TestClient, register_node: Callable[..., dict[str, Any]]
) -> None:
    reg = register_node("gpu-1")
    headers = agent_headers(reg)
    before = served(api)
    bad_body = api.post(LEASE, headers=headers, json={"fencing_token": "seven"})
    assert bad_body.status_code == 422 and bad_body.json()["field"] == "fencing_token"
    unknown = api.post(LEASE, headers=headers, json={"fencing_token": 1, "extra": 1})
    assert unknown.status_code == 422 and unknown.json()["field"] == "extra"
    for query, field in (("wait=61", "wait"), ("wait=abc", "wait"), ("wait=1e1", None),
                         ("revision=x", "revision"), ("wait=0&wait=1", None)):
        response = api.get(f"{POLL}?{query}", headers=headers)
        if field is None:  # forms the route accepts (no revision: no wait)
            assert response.status_code == 200, (query, response.text)
        else:
            assert response.status_code == 422, query
            assert response.json()["field"] == field, query
    missing = api.post(LEASE, headers={"Authorization": ""},  # no token: the route's 401
                       json={"fencing_token": 1})
    assert missing.status_code == 401 and missing.json()["detail"] == "missing node token"
    after = served(api)
    assert counted(before, after, LEASE, "route") == 3
    assert counted(before, after, POLL, "route") == 5
    assert counted(before, after, LEASE, "fast") == counted(before, after, POLL, "fast") == 0
