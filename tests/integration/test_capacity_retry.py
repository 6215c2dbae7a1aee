"""Capacity that appears (a node registering) marks a retry of the unschedulable pods; the
next scheduling pass clears their back-off once (services/capacity.py), so the
registration itself writes no pod row, and the pod is placed at once, not after
``UNSCHEDULABLE_RETRY_SECONDS``. A mark from another replica arrives by the NOTIFY bridge."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient

from gpucloud.services import capacity, notify
from gpucloud.services.context import ServiceContext, TtlCache
from tests.integration.conftest import statements_sent


def test_a_registration_marks_and_the_next_pass_places_the_unschedulable_pod(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any]
) -> None:
    assert api.post("/v1/pods", json={"name": "p1", "image": "busybox:1",
                                      "gpus": 8}).status_code == 201
    schedule()
    assert api.get("/v1/pods/p1").json()["reason"] == "Unschedulable"
    schedule()  # nothing changed: the pod waits out its back-off
    assert api.get("/v1/pods/p1").json()["phase"] == "Pending"
    with statements_sent(app_ctx.db, frozenset({"UPDATE"})) as updates:
        register_node("gpu-1")
    assert not [s for s in updates if s.lstrip().upper().startswith("UPDATE PODS")], updates
    schedule()  # the clock has not moved: the mark, not the back-off's end, let it in
    assert api.get("/v1/pods/p1").json()["phase"] == "Scheduled"
    assert not capacity.CAPACITY.take()  # the pass took the mark


def test_the_mark_is_taken_once_however_many_changes_came() -> None:
    signal = capacity.CapacitySignal()
    assert signal.take()  # a process starts marked (what it missed before it listened)
    assert not signal.take()
    signal.mark()
    signal.mark()
    assert signal.take() and not signal.take()  # many changes, one retry


@pytest.mark.postgres
def test_a_mark_on_another_replica_reaches_this_one(postgres_url: str) -> None:
    bridge = notify.NotifyBridge(postgres_url, TtlCache())
    capacity.CAPACITY.take()
    bridge.start()
    try:
        marked = False
        for _ in range(50):  # until the bridge's LISTEN is up: a hint sent before is lost
            with psycopg.connect(notify._dsn(postgres_url), autocommit=True) as conn:
                conn.execute("SELECT pg_notify(%s, %s)", (notify.CHANNEL, notify.CAPACITY))
            time.sleep(0.1)
            if capacity.CAPACITY.take():
                marked = True
                break
        assert marked
    finally:
        bridge.stop()


@pytest.mark.postgres
def test_a_replicas_own_mark_does_not_come_back_to_it(postgres_url: str) -> None:
    """Its listener hears its own NOTIFY: read as news, that echo would mark it again
    after its pass took the mark, and the next pass would retry every unschedulable pod
    once more (and an idle pass would not be idle)."""
    bridge = notify.NotifyBridge(postgres_url, TtlCache())
    with psycopg.connect(notify._dsn(postgres_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {notify.CHANNEL}")
        bridge.start()
        try:
            capacity.CAPACITY.mark()
            sent = next(item for note in listener.notifies(timeout=10.0)
                        for item in note.payload.split()
                        if item.startswith(notify.CAPACITY))
        finally:
            bridge.stop()
    assert sent == notify.CAPACITY + bridge.origin
    capacity.CAPACITY.take()
    bridge._receive(sent)
    assert not capacity.CAPACITY.take()
    bridge._receive(notify.CAPACITY + "another")
    assert capacity.CAPACITY.take()
