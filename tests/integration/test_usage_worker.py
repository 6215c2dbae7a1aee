"""Usage ingest in its niced worker process (api/usage_worker.py): batches are stored
there, at background priority (its PostgreSQL backends too), and a worker that dies is
replaced without a sample lost or counted twice."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from gpucloud.api.ingest_cgroup import PREFIX, find_hierarchy, open_group
from gpucloud.api.usage_admission import _admission, app_activity
from gpucloud.api.usage_worker import (
    APPLICATION_NAME,
    BACKENDS_ENV,
    MODE_ENV,
    CommitMode,
    IngestWorker,
    parse_and_ingest,
)
from gpucloud.core.clock import ManualClock
from gpucloud.services.context import ServiceContext
from gpucloud.services.usage import PAUSE_ROWS
from tests.integration.conftest import agent_headers


@pytest.fixture(autouse=True)
def _process_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODE_ENV, "process")  # SQLite too (default there: threads)


def _pod_on_node(api: TestClient, register_node: Callable[..., dict[str, Any]],
                 schedule: Callable[[], Any]) -> tuple[dict[str, Any], str]:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json={"name": "p", "image": "busybox", "gpus": 1,
                                     "command": ["sleep", "9"]}).json()
    schedule()
    return reg, pod["id"]


def _post(api: TestClient, reg: dict[str, Any], pod_id: str, seqs: range,
          clock: ManualClock, token: int = 1) -> Any:
    samples = [{"pod_id": pod_id, "attempt": 1, "seq": seq,
                "time": (clock.now() - timedelta(seconds=10 - seq)).isoformat(),
                "cpu_seconds": float(seq), "memory_bytes": 1 << 20,
                "memory_peak_bytes": 1 << 20, "gpus": []} for seq in seqs]
    return api.post("/v1/agent/usage", headers=agent_headers(reg),
                    json={"fencing_token": token, "samples": samples})


def _worker(api: TestClient) -> IngestWorker:
    worker: IngestWorker = api.app.state.usage_worker  # type: ignore[attr-defined]
    return worker


def _stored(ctx: ServiceContext) -> int:
    with ctx.db.read() as session:
        return int(session.execute(text("SELECT count(*) FROM usage_samples")).scalar_one())


def _niced(pids: list[int]) -> list[int]:
    """The nice levels of those processes' threads (a gone one: left out)."""
    levels = []
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir() if Path(f"/proc/{pid}").exists() else ():
            with contextlib.suppress(ProcessLookupError):
                levels.append(os.getpriority(os.PRIO_PROCESS, int(task.name)))
    return levels


def _until(condition: Callable[[], bool], seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.mark.parametrize("backends_mode", ["follow", "normal"])
def test_batches_are_stored_by_a_worker_niced_while_api_calls_run(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
    monkeypatch: pytest.MonkeyPatch, backends_mode: str,
) -> None:
    """The worker's ingest threads at nice 19 while API calls run; its backends too with
    ``…_BACKENDS=follow``, and at 0 throughout by default (``normal``: a running batch
    pauses between statements instead, where its backend holds no lock)."""
    monkeypatch.setenv(BACKENDS_ENV, backends_mode)  # read by the worker, started below
    reg, pod_id = _pod_on_node(api, register_node, schedule)
    _until(lambda: not _admission(api.app).busy())  # the pod's create is over
    assert _post(api, reg, pod_id, range(3), clock).json() == {"accepted": 3, "duplicates": 0}
    pid = _worker(api).pid()
    assert pid is not None and pid != os.getpid()
    stale = _post(api, reg, pod_id, range(3, 5), clock, token=7)
    assert stale.status_code == 409 and "fencing token" in stale.json()["detail"]
    assert _stored(app_ctx) == 3
    backends: list[int] = []
    if not app_ctx.db.is_sqlite:
        with app_ctx.db.read() as session:
            backends = list(session.execute(text(
                "SELECT pid FROM pg_stat_activity WHERE application_name = :name"),
                {"name": APPLICATION_NAME}).scalars())
        assert backends
    # quiet: the server's own priority (this process's: the worker and PostgreSQL are
    # its children; 0 unless pytest runs under ``nice``); an API call (a create): its 2
    # ingest threads and its backends at nice 19 within milliseconds, back to the
    # server's level once the API is quiet again
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert base < 19, "at nice 19 already, nothing could be seen lowered"
    _until(lambda: set(_niced([pid, *backends])) == {base})
    app_activity(api.app).touch()
    _until(lambda: _niced([pid]).count(19) == 2 and all(
        level == (19 if backends_mode == "follow" else base) for level in _niced(backends)))
    _until(lambda: set(_niced([pid, *backends])) == {base})


def test_a_batch_stored_in_pieces_is_still_all_or_nothing(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    """With a pause point (the worker's), a batch goes in PAUSE_ROWS samples a statement,
    in one transaction: one that fails after some of its statements stores nothing, and
    sent again it is stored whole, each sample once."""
    reg, pod_id = _pod_on_node(api, register_node, schedule)
    count = 2 * PAUSE_ROWS + 7
    body = json.dumps({"fencing_token": reg["fencing_token"], "samples": [
        {"pod_id": pod_id, "attempt": 1, "seq": seq,
         "time": (clock.now() - timedelta(seconds=count - seq)).isoformat(),
         "cpu_seconds": float(seq), "memory_bytes": 1, "memory_peak_bytes": 1}
        for seq in range(count)]}).encode()
    calls: list[int] = []

    def failing() -> None:
        calls.append(_stored(app_ctx))  # another session: nothing visible yet
        if len(calls) == 3:  # after the ownership query and the first INSERT
            raise RuntimeError("the worker died mid-batch")

    with pytest.raises(RuntimeError):
        parse_and_ingest(app_ctx, reg["node_id"], body, between=failing)
    assert calls == [0, 0, 0] and _stored(app_ctx) == 0
    paused: list[int] = []
    out = parse_and_ingest(app_ctx, reg["node_id"], body,
                           between=lambda: paused.append(_stored(app_ctx)))
    # before the ownership query, each of the 3 INSERTs and the commit; none visible yet
    assert paused == [0] * 5 and out.accepted == count and _stored(app_ctx) == count
    again = parse_and_ingest(app_ctx, reg["node_id"], body, between=lambda: None)
    assert (again.accepted, again.duplicates) == (0, count)


def test_a_dead_worker_is_replaced_and_nothing_is_lost_or_doubled(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    reg, pod_id = _pod_on_node(api, register_node, schedule)
    assert _post(api, reg, pod_id, range(3), clock).status_code == 200
    worker = _worker(api)
    first = worker.pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)
    resent = _post(api, reg, pod_id, range(6), clock)  # the spool resends 0-2 with 3-5
    assert resent.status_code in (200, 503)
    if resent.status_code == 503:  # met the dying worker: nothing acknowledged, resend
        assert resent.headers["Retry-After"] == "1"
        resent = _post(api, reg, pod_id, range(6), clock)
    assert resent.json() == {"accepted": 3, "duplicates": 3}
    assert worker.pid() not in (None, first) and worker.restarts == 1
    assert _stored(app_ctx) == 6


def test_a_database_the_worker_cannot_reach_is_a_503_and_nothing_is_stored(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
) -> None:
    """The worker's connections cut (a PostgreSQL restart, as the worker sees it): the
    batch is the API's one 503 for an unreachable database, with
    Retry-After, never a 500; once the database is back the resent batch is stored."""
    if app_ctx.db.is_sqlite:
        pytest.skip("cutting the worker's PostgreSQL connections")
    reg, pod_id = _pod_on_node(api, register_node, schedule)
    assert _post(api, reg, pod_id, range(2), clock).status_code == 200
    with app_ctx.db.engine.connect() as connection:  # its pooled connections: gone
        cut = connection.execute(text("SELECT count(pg_terminate_backend(pid)) FROM "
                                      "pg_stat_activity WHERE application_name = :name"),
                                 {"name": APPLICATION_NAME}).scalar_one()
        connection.commit()
    assert cut >= 1
    refused = _post(api, reg, pod_id, range(4), clock)
    assert refused.status_code == 503, refused.text
    assert refused.headers["Retry-After"].isdigit()
    assert refused.json() == {"detail": "the database is unavailable; retry shortly",
                              "field": None}
    assert _stored(app_ctx) == 2
    resent = _post(api, reg, pod_id, range(4), clock)
    assert resent.json() == {"accepted": 2, "duplicates": 2}


def test_while_api_calls_run_a_batch_commits_lazily_and_is_answered_once_durable(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
    tmp_path: Path,
) -> None:
    if app_ctx.db.is_sqlite:
        pytest.skip("PostgreSQL's commit mode")
    reg, pod_id = _pod_on_node(api, register_node, schedule)
    stamp = tmp_path / "api-activity"
    stamp.write_bytes(struct.pack("dd", time.monotonic(), time.monotonic()))  # a create now
    mode = CommitMode(app_ctx.db, stamp, quiet_seconds=60)
    body = json.dumps({"fencing_token": reg["fencing_token"], "samples": [
        {"pod_id": pod_id, "attempt": 1, "seq": 0, "time": clock.now().isoformat(),
         "cpu_seconds": 1.0, "memory_bytes": 1, "memory_peak_bytes": 1}]}).encode()
    deferred: list[bool] = []
    out = parse_and_ingest(app_ctx, reg["node_id"], body, mode.before_commit(deferred))
    assert deferred == [True] and out.accepted == 1
    with app_ctx.db.read() as session:
        committed = session.execute(text("SELECT pg_current_wal_insert_lsn()")).scalar_one()
    mode.wait_flushed()
    with app_ctx.db.read() as session:
        flushed = session.execute(text("SELECT pg_current_wal_flush_lsn() >= CAST(:lsn AS "
                                        "pg_lsn)"), {"lsn": str(committed)}).scalar_one()
    assert flushed and _stored(app_ctx) == 1
    quiet = CommitMode(app_ctx.db, stamp, quiet_seconds=0)  # no API call: a plain commit
    again: list[bool] = []
    parse_and_ingest(app_ctx, reg["node_id"], body, quiet.before_commit(again))
    assert again == []
    sync = CommitMode(app_ctx.db, stamp, quiet_seconds=60, lazy=False)  # ..._COMMIT=sync
    assert sync.busy()
    parse_and_ingest(app_ctx, reg["node_id"], body, sync.before_commit(again))
    assert again == []


def _cpu_cgroup(pid: int) -> str | None:
    """The path of process ``pid`` in the cpu hierarchy (None: gone)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)


def test_the_worker_and_its_backends_are_in_a_cpu_cgroup_idle_while_api_calls_run(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], clock: ManualClock, app_ctx: ServiceContext,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """nice holds only inside one scheduling group (PostgreSQL is in another): the
    worker and (``…_BACKENDS=follow``) its backends share an idle cgroup while API calls
    run."""
    monkeypatch.setenv(BACKENDS_ENV, "follow")
    probe = open_group(os.getpid())
    if probe is None:
        pytest.skip("no writable cpu cgroup here (root and a cpu controller needed)")
    probe.close(os.getpid())
    reg, pod_id = _pod_on_node(api, register_node, schedule)
    _until(lambda: not _admission(api.app).busy())
    assert _post(api, reg, pod_id, range(3), clock).status_code == 200
    pid = _worker(api).pid()
    assert pid is not None
    hierarchy = find_hierarchy(Path(f"/proc/{pid}/cgroup").read_text(),
                               Path(f"/proc/{pid}/mountinfo").read_text())
    assert hierarchy is not None and hierarchy.directory.name == f"{PREFIX}{pid}"
    group = hierarchy.directory
    members = [pid]
    if not app_ctx.db.is_sqlite:
        with app_ctx.db.read() as session:
            members += list(session.execute(text(
                "SELECT pid FROM pg_stat_activity WHERE application_name = :name"),
                {"name": APPLICATION_NAME}).scalars())
    assert {_cpu_cgroup(member) for member in members} == {_cpu_cgroup(pid)}
    assert _cpu_cgroup(pid) != _cpu_cgroup(os.getpid())  # the API worker stays out
    idle = group / "cpu.idle"
    setting = idle if idle.exists() else group / (
        "cpu.shares" if hierarchy.version == 1 else "cpu.weight")
    quiet = setting.read_text().strip()
    app_activity(api.app).touch()
    _until(lambda: setting.read_text().strip() != quiet)
    assert setting.read_text().strip() in ("1", "2")  # idle, or the least weight
    _until(lambda: setting.read_text().strip() == quiet)
    _worker(api).close()
    _until(lambda: not group.exists())  # removed once the worker and backends left
