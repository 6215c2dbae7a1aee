"""Usage ingest and the meter, on SQLite and PostgreSQL, over the agent protocol with a
manual clock: idempotent resends, fencing, pods not on the node, far-future batches, and
meter rows from phase transitions (a lost node's run ends at its last renewal)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta, timezone
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpucloud.api.usage_worker import MODE_ENV
from gpucloud.core.clock import ManualClock
from gpucloud.core.usage import PodRun
from gpucloud.db.models import UsageSampleModel
from gpucloud.services import usage
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import agent_headers

POD = {"name": "train", "image": "busybox", "command": ["sleep", "60"], "gpus": 2}


def _status(api: TestClient, reg: dict[str, Any], pod_id: str, phase: str,
            **extra: Any) -> Any:
    response = api.post(f"/v1/agent/pods/{pod_id}/status", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "phase": phase, **extra})
    assert response.status_code == 200, response.text
    return response


def _sample(pod_id: str, seq: int, clock: ManualClock, util: float = 50.0,
            attempt: int = 1, **extra: Any) -> dict[str, Any]:
    return {"pod_id": pod_id, "attempt": attempt, "seq": seq,
            "time": clock.now().isoformat(), "cpu_seconds": 1.5 * (seq + 1),
            "memory_bytes": 1000 * (seq + 1), "memory_peak_bytes": 5000,
            "gpus": [{"uuid": "GPU-00000000-test", "util_percent": util,
                      "memory_used_bytes": 1 << 30},
                     {"uuid": "GPU-00000001-test", "util_percent": util,
                      "memory_used_bytes": 1 << 30}],
            "net_rx_bytes": 10 * seq, "net_tx_bytes": 5 * seq, **extra}


def _post(api: TestClient, reg: dict[str, Any], samples: list[dict[str, Any]],
          token: int | None = None) -> Any:
    return api.post("/v1/agent/usage", headers=agent_headers(reg),
                    json={"fencing_token": token or reg["fencing_token"], "samples": samples})


def _running(api: TestClient, register_node: Callable[..., dict[str, Any]],
             schedule: Callable[[], Any]) -> tuple[dict[str, Any], str]:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json=POD).json()
    schedule()
    _status(api, reg, pod["id"], "Pulling")
    _status(api, reg, pod["id"], "Running")
    return reg, pod["id"]


def _stored(ctx: ServiceContext) -> list[tuple[str, int, int]]:
    with ctx.db.read() as session:
        rows = session.query(UsageSampleModel.pod_id, UsageSampleModel.attempt,
                             UsageSampleModel.seq).order_by(UsageSampleModel.seq).all()
    return [(str(p), int(a), int(s)) for p, a, s in rows]


def _runs(ctx: ServiceContext) -> list[PodRun]:
    with ctx.db.read() as session:
        return usage.pod_runs(session, None, None, None)


def test_a_resent_batch_is_not_counted_twice(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    reg, pod_id = _running(api, register_node, schedule)
    batch = [_sample(pod_id, seq, clock) for seq in range(3)]
    first = _post(api, reg, batch)
    assert first.status_code == 200 and first.json() == {"accepted": 3, "duplicates": 0}
    again = _post(api, reg, [*batch, _sample(pod_id, 3, clock)])
    assert again.json() == {"accepted": 1, "duplicates": 3}
    assert _stored(app_ctx) == [(pod_id, 1, seq) for seq in range(4)]
    [run] = _runs(app_ctx)
    assert run.samples == 4 and run.gpu_util_avg == 50.0 and run.cpu_seconds == 6.0


def test_stored_columns_are_the_samples_figures_on_either_backend(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    """What a row holds, as each backend's insert computes it (PostgreSQL unpacks the
    batch's JSON in SQL, SQLite gets the values from Python): the mean of the GPU
    utilisations given, the sum of the memory given, NULL where none was given; times
    with another offset; the first of a key repeated in one batch wins."""
    reg, pod_id = _running(api, register_node, schedule)
    gpu = "GPU-00000000-test"
    mixed = _sample(pod_id, 0, clock, cpu_seconds=0.1, disk_bytes=2**62)
    mixed["gpus"] = [{"uuid": gpu, "util_percent": 30.0, "memory_used_bytes": 1 << 30},
                     {"uuid": "GPU-00000001-test", "util_percent": 60.0}]
    mixed["time"] = clock.now().astimezone(timezone(timedelta(hours=2))).isoformat()
    none = _sample(pod_id, 1, clock, net_rx_bytes=None, net_tx_bytes=None)
    none["gpus"] = []
    unmeasured = _sample(pod_id, 2, clock)
    unmeasured["gpus"] = [{"uuid": gpu}]
    repeated = _sample(pod_id, 0, clock, cpu_seconds=99.0)
    answer = _post(api, reg, [mixed, none, unmeasured, repeated])
    assert answer.status_code == 200 and answer.json() == {"accepted": 3, "duplicates": 1}
    s = UsageSampleModel
    with app_ctx.db.read() as session:
        rows = session.query(s.seq, s.time, s.cpu_seconds, s.gpu_util_percent,
                             s.gpu_memory_bytes, s.gpus, s.net_rx_bytes, s.net_tx_bytes,
                             s.disk_bytes).order_by(s.seq).all()
    assert [tuple(row) for row in rows] == [
        (0, clock.now(), 0.1, 45.0, 1 << 30,
         [{"uuid": gpu, "util_percent": 30.0, "memory_used_bytes": 1 << 30},
          {"uuid": "GPU-00000001-test", "util_percent": 60.0, "memory_used_bytes": None}],
         0, 0, 2**62),
        (1, clock.now(), 3.0, None, None, [], None, None, None),
        (2, clock.now(), 4.5, None, None,
         [{"uuid": gpu, "util_percent": None, "memory_used_bytes": None}], 20, 10, None)]


def test_a_stale_token_is_409_and_stores_nothing(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    reg, pod_id = _running(api, register_node, schedule)
    api.post("/v1/agent/lease", headers=agent_headers(reg), json={"fencing_token": None})
    stale = _post(api, reg, [_sample(pod_id, 0, clock)])
    assert stale.status_code == 409 and "fencing token" in stale.json()["detail"]
    assert _stored(app_ctx) == []
    # the same samples under the new grant count: they belong to this node's attempt
    assert _post(api, reg, [_sample(pod_id, 0, clock)], token=2).json()["accepted"] == 1


def test_samples_of_a_pod_not_on_the_node_are_refused_whole(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    reg, pod_id = _running(api, register_node, schedule)
    other = register_node("gpu-2")
    mixed = [_sample(pod_id, 0, clock), _sample(pod_id, 1, clock, attempt=7)]
    refused = _post(api, reg, mixed)
    assert refused.status_code == 409 and "attempt 7 is not on node" in refused.json()["detail"]
    foreign = _post(api, other, [_sample(pod_id, 0, clock)])
    assert foreign.status_code == 409 and "gpu-2" in foreign.json()["detail"]
    unknown = _post(api, reg, [_sample("nosuchpod", 0, clock)])
    assert unknown.status_code == 409
    assert _stored(app_ctx) == []


def test_every_chunk_of_a_batchs_pods_is_checked_against_the_node(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fencing read carries the first chunk of the batch's pods (``_KEYS_PER_QUERY``
    of them); the pods past it are looked up on their own: a chunk of one here, so the
    second of two pods is in the second lookup (in this process: the worker process
    would not see the smaller chunk)."""
    monkeypatch.setenv(MODE_ENV, "thread")
    monkeypatch.setattr(usage, "_KEYS_PER_QUERY", 1)
    reg = register_node("gpu-1")
    pods = sorted(api.post("/v1/pods", json={**POD, "name": f"p{i}", "gpus": 1}).json()["id"]
                  for i in range(2))
    schedule()
    both = _post(api, reg, [_sample(pods[0], 0, clock), _sample(pods[1], 0, clock)])
    assert both.json() == {"accepted": 2, "duplicates": 0}
    late = _post(api, reg, [_sample(pods[0], 1, clock), _sample(pods[1], 1, clock, attempt=7)])
    assert late.status_code == 409 and f"pod {pods[1]!r} attempt 7" in late.json()["detail"]
    assert len(_stored(app_ctx)) == 2


def test_a_nul_anywhere_in_a_batch_is_reported_before_a_bad_time(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    reg, pod_id = _running(api, register_node, schedule)
    late = _sample(pod_id, 0, clock)
    late["time"] = (clock.now() + timedelta(hours=2)).isoformat()
    refused = _post(api, reg, [late, _sample("bad\u0000pod", 1, clock)])
    assert refused.status_code == 422 and refused.json()["field"] == "samples[1].pod_id"
    assert _stored(app_ctx) == []


def test_a_batch_far_in_the_future_is_refused(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    reg, pod_id = _running(api, register_node, schedule)
    late = _sample(pod_id, 1, clock)
    late["time"] = (clock.now() + timedelta(hours=2)).isoformat()
    refused = _post(api, reg, [_sample(pod_id, 0, clock), late])
    assert refused.status_code == 422 and refused.json()["field"] == "samples[1].time"
    bad = _post(api, reg, [_sample(pod_id, 0, clock, util=150)])
    assert bad.status_code == 422
    assert _stored(app_ctx) == []


def test_the_meter_bills_running_seconds_from_transitions_not_samples(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json=POD).json()
    schedule()
    _status(api, reg, pod["id"], "Pulling")
    clock.advance(30)  # pulling: not billed
    _status(api, reg, pod["id"], "Running")
    started = clock.now()
    clock.advance(10)
    assert [r.ended_at for r in _runs(app_ctx)] == [None]
    assert _runs(app_ctx)[0].seconds(clock.now()) == 10
    _post(api, reg, [_sample(pod["id"], 0, clock, util=40)])
    api.post(f"/v1/pods/{pod['id']}/stop")
    clock.advance(2)  # the stop grace: billed
    _status(api, reg, pod["id"], "Stopped", exit_code=143)
    clock.advance(5)
    _post(api, reg, [_sample(pod["id"], 1, clock, util=60)])  # sent late: still counts
    [run] = _runs(app_ctx)
    assert run.started_at == started and run.seconds(clock.now()) == 12
    assert run.end_reason is not None and not run.credited
    assert run.gpus == 2 and run.gpu_milli == 2000 and run.gpu_util_avg == 50.0
    with app_ctx.db.read() as session:
        project = usage.pod_runs(session, run.project_id, started + timedelta(seconds=20),
                                 None)
    assert project == []  # ended before the period


def test_a_lost_nodes_run_ends_at_its_last_lease_renewal(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
    expire_leases: Callable[[], list[str]],
) -> None:
    reg, pod_id = _running(api, register_node, schedule)
    started = clock.now()
    clock.advance(4)
    api.post("/v1/agent/lease", headers=agent_headers(reg), json={"fencing_token": 1})
    renewed = clock.now()
    clock.advance(9)
    _post(api, reg, [_sample(pod_id, 0, clock)])  # after the renewal: never extends billing
    clock.advance(5)
    assert expire_leases() == ["gpu-1"]
    [run] = _runs(app_ctx)
    assert run.ended_at == renewed and run.end_reason == "NodeLost"
    assert run.seconds(clock.now()) == (renewed - started).total_seconds() == 4


def test_node_load_weighs_recent_samples_of_live_pods(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    reg, pod_id = _running(api, register_node, schedule)
    samples = []
    for seq in range(4):
        clock.advance(5)
        samples.append({**_sample(pod_id, seq, clock, util=30), "cpu_seconds": 10.0 * (seq + 1),
                        "memory_bytes": 2 << 30})
    _post(api, reg, samples)
    with app_ctx.db.read() as session:
        loads = usage.node_load(session, clock.now())
    [load] = loads.values()
    assert load.cpu_cores == 2.0 and load.memory_bytes == 2 << 30  # 10 CPU-s per 5 s
    assert load.gpu_util_percent == {"GPU-00000000-test": 30.0, "GPU-00000001-test": 30.0}
    assert load.sample_time == clock.now() and set(load.pods) == {pod_id}
    api.delete(f"/v1/pods/{pod_id}")
    _status(api, reg, pod_id, "Stopped")
    with app_ctx.db.read() as session:
        assert usage.node_load(session, clock.now()) == {}  # ended pods are gone at once
