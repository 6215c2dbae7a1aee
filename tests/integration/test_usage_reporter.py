"""The agent's usage reporter (agent/usage.py) against the real server, through its real
connection, on SQLite and PostgreSQL: a stale fencing token is refreshed and the batch
stored once; a batch the server refuses whole (409: a pod not on the node) is sent again
per container and only the refused container's samples leave the spool unstored."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from gpucloud.agent.usage import UsageReporter
from gpucloud.core.clock import ManualClock
from gpucloud.core.usage import UsageSample
from gpucloud.db.models import UsageSampleModel
from gpucloud.services.context import ServiceContext
from tests.integration.test_usage_admission import Seconds, _reporter


def _spool(reporter: UsageReporter, pod_id: str, count: int, clock: ManualClock) -> None:
    for _ in range(count):
        reporter.spool.append(f"{pod_id}-1", lambda seq: UsageSample(
            pod_id=pod_id, attempt=1, seq=seq, time=clock.now(), cpu_seconds=float(seq),
            memory_bytes=1, memory_peak_bytes=1))


def _stored(ctx: ServiceContext) -> list[tuple[str, int]]:
    with ctx.db.read() as session:
        rows = session.query(UsageSampleModel.pod_id, UsageSampleModel.seq).order_by(
            UsageSampleModel.pod_id, UsageSampleModel.seq)
        return [(str(pod), int(seq)) for pod, seq in rows]


def test_a_stale_token_is_refreshed_and_the_batch_stored_once(
    api: TestClient, schedule: Callable[[], Any], clock: ManualClock,
    app_ctx: ServiceContext, tmp_path: Path,
) -> None:
    reporter, pod_id = _reporter(api, tmp_path, Seconds())
    schedule()
    _spool(reporter, pod_id, 3, clock)
    held = reporter.conn.fencing_token
    newer = reporter.conn.client.lease(None, timeout=5).fencing_token  # a grant since
    assert newer > held

    reporter.send()
    assert reporter.conn.fencing_token > newer  # it took a grant of its own
    assert _stored(app_ctx) == [(pod_id, 0), (pod_id, 1), (pod_id, 2)]
    assert reporter.spool.pending_of(f"{pod_id}-1") == []


def test_a_refused_container_is_dropped_and_the_others_are_stored(
    api: TestClient, schedule: Callable[[], Any], clock: ManualClock,
    app_ctx: ServiceContext, tmp_path: Path,
) -> None:
    reporter, pod_id = _reporter(api, tmp_path, Seconds())
    schedule()
    elsewhere = api.post("/v1/pods", json={"name": "never-here", "image": "busybox",
                                           "cpu": 64, "memory": "1Gi"}).json()["id"]
    schedule()  # too big for the node: it stays pending, never on gpu-1
    _spool(reporter, pod_id, 2, clock)
    _spool(reporter, elsewhere, 2, clock)
    _spool(reporter, pod_id, 1, clock)

    reporter.send()
    assert _stored(app_ctx) == [(pod_id, 0), (pod_id, 1), (pod_id, 2)]
    assert reporter.spool.pending_of(f"{pod_id}-1") == []
    assert reporter.spool.pending_of(f"{elsewhere}-1") == []  # refused: not resent forever
