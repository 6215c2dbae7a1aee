"""Usage ingest yields to API calls (api/usage_admission.py), and nothing is lost: a batch
the server sheds (503 + Retry-After) stays in the agent's spool, is not sent again
before its Retry-After, and is then stored exactly once — through the agent's real
connection and reporter, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from gpucloud.agent.connection import Connection
from gpucloud.agent.identity import IdentityFile
from gpucloud.agent.usage import PodSampler, UsageReporter
from gpucloud.agent.usage_spool import UsageSpool
from gpucloud.api.usage_admission import RETRY_AFTER_SECONDS, ApiActivity, IngestAdmission
from gpucloud.core.clock import ManualClock
from gpucloud.core.models import NodeRegisterRequest
from gpucloud.core.usage import UsageSample
from gpucloud.db.models import UsageSampleModel
from gpucloud.gpu.usage import SimulatedGpuUsage
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import ThroughTestClient, agent_headers


class Seconds:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _reporter(api: TestClient, state: Path, seconds: Seconds) -> tuple[UsageReporter, str]:
    """The agent's connection and reporter for a node "gpu-1", and its pod's id."""
    token = api.post("/v1/nodes/join-tokens").json()["token"]
    registration = NodeRegisterRequest(join_token=token, name="gpu-1", cpu_cores=8,
                                       memory_bytes=1 << 34)
    conn = Connection("http://testserver", registration, IdentityFile(state / "identity"),
                      threading.Event(), transport=ThroughTestClient(api))
    conn.connect()
    reporter = UsageReporter(conn, UsageSpool(state / "usage"),
                             PodSampler(SimulatedGpuUsage()), lambda: [], interval=0.5,
                             stop=threading.Event(), live=set, clock=seconds)
    pod = api.post("/v1/pods", json={"name": "p", "image": "busybox", "cpu": 1,
                                     "memory": "1Gi", "command": ["sleep", "9"]})
    return reporter, pod.json()["id"]


def _stored(ctx: ServiceContext) -> list[int]:
    with ctx.db.read() as session:
        return [int(seq) for (seq,) in session.query(UsageSampleModel.seq)
                .order_by(UsageSampleModel.seq)]


def test_a_shed_batch_waits_its_retry_after_and_is_stored_once(
    api: TestClient, schedule: Callable[[], Any], clock: ManualClock,
    app_ctx: ServiceContext, tmp_path: Path,
) -> None:
    seconds = Seconds()
    reporter, pod_id = _reporter(api, tmp_path, seconds)
    schedule()
    for _ in range(3):
        reporter.spool.append(f"{pod_id}-1", lambda seq: UsageSample(
            pod_id=pod_id, attempt=1, seq=seq, time=clock.now(), cpu_seconds=float(seq),
            memory_bytes=1, memory_peak_bytes=1))
    # API calls under way in another worker: this process has no room for a batch.
    busy = IngestAdmission(ApiActivity(None, clock=seconds), busy_queue=-1, clock=seconds)
    busy.activity.touch()
    api.app.state.usage_admission = busy  # type: ignore[attr-defined]

    reporter.send()
    assert busy.shed == 1 and _stored(app_ctx) == []
    assert reporter.not_before == seconds.now + RETRY_AFTER_SECONDS
    assert [s.seq for s in reporter.spool.pending_of(f"{pod_id}-1")] == [0, 1, 2]
    seconds.now += RETRY_AFTER_SECONDS / 2
    reporter.send()  # before the Retry-After: not even tried
    assert busy.shed == 1

    seconds.now += RETRY_AFTER_SECONDS  # past it, and API calls go on: refused again,
    busy.activity.touch()               # and the agent backs off twice as long
    reporter.send()
    assert busy.shed == 2 and reporter.not_before == seconds.now + 2 * RETRY_AFTER_SECONDS

    seconds.now += 2 * RETRY_AFTER_SECONDS + busy.quiet_seconds  # the API calls are over
    reporter.send()
    assert busy.shed == 2 and _stored(app_ctx) == [0, 1, 2]
    assert reporter.spool.pending_of(f"{pod_id}-1") == []
    reporter.send()  # nothing left to send; a resend would have stored nothing anyway
    assert _stored(app_ctx) == [0, 1, 2]


def test_values_no_column_can_hold_are_422_naming_the_field(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    """The route skips the generic body walk (api/limits.py); its models and service
    refuse the same values: past BIGINT, NUL in a string, not JSON at all."""
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json={"name": "p", "image": "busybox", "cpu": 1,
                                     "command": ["sleep", "9"]}).json()
    schedule()
    good = {"pod_id": pod["id"], "attempt": 1, "seq": 0, "time": clock.now().isoformat(),
            "cpu_seconds": 1.0, "memory_bytes": 1, "memory_peak_bytes": 1}
    cases = [({"memory_bytes": 2**63}, "samples.0.memory_bytes"),
             ({"pod_id": pod["id"][:-1] + "\x00"}, "samples[0].pod_id"),
             ({"gpus": [{"uuid": "GPU-\x00"}]}, "samples[0].gpus[0].uuid")]
    for change, field in cases:
        body = {"fencing_token": reg["fencing_token"], "samples": [{**good, **change}]}
        refused = api.post("/v1/agent/usage", headers=agent_headers(reg), json=body)
        assert refused.status_code == 422 and refused.json()["field"] == field, refused.text
    garbled = api.post("/v1/agent/usage", headers={**agent_headers(reg),
                                                   "Content-Type": "application/json"},
                       content=b'{"fencing_token": 1, "samples": [')
    assert garbled.status_code == 422 and garbled.json()["field"] == "body"
    assert _stored(app_ctx) == []


def test_changes_through_the_api_make_ingest_yield_reads_and_agents_do_not(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
) -> None:
    reg = register_node("gpu-1")
    stamp = api.app.state.api_activity  # type: ignore[attr-defined]
    before = stamp.last()
    api.get("/v1/pods")
    api.post("/v1/agent/lease", headers=agent_headers(reg),
             json={"fencing_token": reg["fencing_token"]})
    assert stamp.last() == before
    api.post("/v1/pods", json={"name": "p", "image": "busybox", "command": ["true"]})
    assert stamp.last() > before
