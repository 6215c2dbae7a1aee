"""Lease renewals have threads of their own (api/lease_capacity.py): a request thread pool
taken by other routes cannot delay one, and so cannot make a healthy node look Lost."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import anyio.to_thread
from fastapi.testclient import TestClient

from tests.integration.conftest import agent_headers


def test_a_renewal_is_answered_while_every_shared_request_thread_is_taken(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
) -> None:
    reg = register_node("busy-1")
    portal = api.portal
    assert portal is not None
    shared = portal.call(anyio.to_thread.current_default_thread_limiter)
    saved, borrower = shared.total_tokens, object()
    portal.call(setattr, shared, "total_tokens", 1)
    portal.call(shared.acquire_on_behalf_of, borrower)  # the last shared thread is taken
    answers: dict[str, Any] = {}
    other = threading.Thread(target=lambda: answers.update(
        other=api.get("/v1/nodes/busy-1")))
    try:
        renewal = threading.Thread(target=lambda: answers.update(lease=api.post(
            "/v1/agent/lease", headers=agent_headers(reg), json={"fencing_token": 1})))
        renewal.start()
        renewal.join(timeout=20)
        assert not renewal.is_alive(), "the renewal waited for the shared thread pool"
        assert answers["lease"].status_code == 200 and not answers["lease"].json()["new_grant"]
        other.start()  # a sync route meanwhile waits for that pool, as renewals used to
        other.join(timeout=0.5)
        assert other.is_alive()
    finally:
        portal.call(shared.release_on_behalf_of, borrower)
        portal.call(setattr, shared, "total_tokens", saved)
    other.join(timeout=20)
    assert answers["other"].status_code == 200
