"""Usage: samples from the agents, the meter of Running intervals, node load.

* ``ingest``: a batch of samples from a node, fenced like every agent write (a stale
  token is 409 before anything is stored). A sample counts when its (pod, attempt) is, or
  was, on that node: the pod is bound there on that attempt, or the meter has that
  attempt's run there (samples spooled before an agent restart, or sent after the pod
  ended, still count). Stored once per (node, pod, attempt, seq): a resend is a no-op.
* The meter's rows are written by ``services.meter`` from the pods' phase transitions.
* ``pod_runs``: the meter rows overlapping a period with the samples' averages, for
  pricing; ``node_load``: exponentially weighted recent use per node, for placement.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from pydantic import TypeAdapter
from sqlalchemy import CursorResult, and_, bindparam, func, or_, select, text, tuple_
from sqlalchemy.dialects import sqlite
from sqlalchemy.exc import IntegrityError, NoResultFound
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import TextClause

from gpucloud.core.errors import Conflict, InvalidInput
from gpucloud.core.phases import ACTIVE_PHASE_VALUES
from gpucloud.core.usage import (
    MAX_FUTURE_SKEW_SECONDS,
    AgentUsageBatchOut,
    AgentUsageBatchRequest,
    NodeLoad,
    PodLoad,
    PodRun,
    UsageSample,
)
from gpucloud.db.models import Base, NodeModel, PodModel, PodRunModel, UsageSampleModel
from gpucloud.services.context import ServiceContext
from gpucloud.services.fencing import check_token

#: node_load: samples older than this are not read; their weight halves every half-life.
LOAD_WINDOW_SECONDS = 180.0
LOAD_HALF_LIFE_SECONDS = 30.0
_KEYS_PER_QUERY = 400
#: Samples per INSERT where ingest may pause between statements (``ingest``'s between):
#: a few milliseconds of one backend's work, the longest a paused batch runs on.
PAUSE_ROWS = 100
#: SQLite's default limit is 32,766 bound variables per statement; 15 a row.
_SQLITE_ROWS = 2000
_SAMPLES = Base.metadata.tables[UsageSampleModel.__tablename__]


# -- ingest ----------------------------------------------------------------------------
#
# The hot path: ~20,000 samples/s from 1,000 pods. Per batch, one fencing read, one query
# validating every (pod, attempt) of the batch, and INSERT … ON CONFLICT DO NOTHING
# carrying the samples (``PAUSE_ROWS`` a statement where the batch may pause, else the
# whole batch); no ORM objects, no per-sample statement. On PostgreSQL a statement's
# samples travel as one JSON array, pydantic's own serialization of the validated
# samples (Rust), which the server unpacks with ``json_to_recordset``: no Python work per
# value. (Column arrays through ``unnest``, as before, cost the ingest worker ~40–50 µs
# of CPU a sample, mostly psycopg's array dumpers looping per element in Python; this
# ~16–18, parsing included; PostgreSQL's side stays about the same, ~30 µs a sample.
# Measured on the loaded 2-core machine, 2026-12-02; see docs/usage.md.)

_COLUMNS = ("node_id", "pod_id", "attempt", "seq", "time", "cpu_seconds", "memory_bytes",
            "memory_peak_bytes", "gpu_util_percent", "gpu_memory_bytes", "gpus",
            "net_rx_bytes", "net_tx_bytes", "disk_bytes", "received_at")
#: The GPU figures as ``_gpu_figures`` computes them: the mean of the utilisations
#: given, the sum of the memory given (NULL: none given).
_GPU_MEAN = ("CASE WHEN json_array_length(s.gpus) > 0 THEN (SELECT avg(CAST(g ->> "
             "'util_percent' AS float8)) FROM json_array_elements(s.gpus) AS g) END")
_GPU_SUM = ("CASE WHEN json_array_length(s.gpus) > 0 THEN (SELECT CAST(sum(CAST(g ->> "
            "'memory_used_bytes' AS bigint)) AS bigint) FROM json_array_elements(s.gpus) "
            "AS g) END")
_PG_INSERT_NEW = (
    f"INSERT INTO usage_samples ({', '.join(_COLUMNS)}) "
    "SELECT CAST(:node_id AS varchar), s.pod_id, s.attempt, s.seq, s.time, s.cpu_seconds, "
    f"s.memory_bytes, s.memory_peak_bytes, {_GPU_MEAN}, {_GPU_SUM}, s.gpus, "
    "s.net_rx_bytes, s.net_tx_bytes, s.disk_bytes, CAST(:received_at AS timestamptz) "
    "FROM json_to_recordset(CAST(:samples AS json)) AS s(pod_id varchar, attempt integer, "
    "seq bigint, time timestamptz, cpu_seconds float8, memory_bytes bigint, "
    "memory_peak_bytes bigint, gpus json, net_rx_bytes bigint, net_tx_bytes bigint, "
    "disk_bytes bigint)")
#: A batch first goes in as plain INSERTs (``_PG_INSERT_NEW``) in a savepoint: ON
#: CONFLICT's speculative insertion probes the primary key once more per row, ~25 % of
#: PostgreSQL's CPU for the insert (measured 2026-12-03, docs/usage.md). A batch that
#: holds a stored key (a resend) fails on its first duplicate with a unique violation,
#: is rolled back to the savepoint and goes again with ON CONFLICT DO NOTHING.
_PG_INSERT = text(f"{_PG_INSERT_NEW} ON CONFLICT DO NOTHING")
_PG_PLAIN = text(_PG_INSERT_NEW)
_UNIQUE_VIOLATION = "23505"
#: The samples as JSON, every field written (``gpus`` as ``[]`` when empty, absent
#: counters as null), times in ISO 8601 with their offset.
_SAMPLE_LIST = TypeAdapter(list[UsageSample])
_BELONGS_SQL = (
    "SELECT id, attempt FROM pods WHERE node_id = :node_id AND id IN :pod_ids "
    "UNION SELECT pod_id, attempt FROM pod_runs WHERE node_id = :node_id "
    "AND pod_id IN :pod_ids")
_BELONGS = text(_BELONGS_SQL).bindparams(bindparam("pod_ids", expanding=True))
#: The node's name and fencing token with the first ``_KEYS_PER_QUERY`` pods' (pod,
#: attempt) pairs of ``_BELONGS`` (NULL: none), in one round trip: one row per pair, or
#: one row of the node alone.
_FENCE_AND_BELONGS = text(
    "SELECT n.name, n.fencing_token, k.id, k.attempt FROM nodes AS n "
    f"LEFT JOIN ({_BELONGS_SQL}) AS k ON 1 = 1 WHERE n.id = :node_id"
).bindparams(bindparam("pod_ids", expanding=True))
_NO_GPUS = "[]"


def ingest(ctx: ServiceContext, node_id: str, batch: AgentUsageBatchRequest,
           before_commit: Callable[[Session], None] | None = None,
           between: Callable[[], None] | None = None) -> AgentUsageBatchOut:
    """Store a node's samples; all or nothing (a refused batch stores none).
    ``before_commit`` runs last in the transaction (api/usage_worker.py: the commit mode).
    ``between`` runs before each statement of the batch and before the commit, and the
    samples are then inserted ``PAUSE_ROWS`` at a time (api/usage_worker.py pauses there
    while API calls run: between statements a backend holds no lightweight lock, so a
    batch paused mid-way stalls no create; its transaction stays all or nothing)."""
    now = ctx.clock.now()
    samples, keys = _checked(batch.samples, now)
    pause = between if between is not None else _no_pause
    with ctx.db.transaction() as session:
        _check_fence_and_belongs(session, node_id, batch.fencing_token, keys, pause)
        step = PAUSE_ROWS if between is not None else max(1, len(samples))
        accepted = _insert_batch(session, node_id, samples, now, step, pause)
        pause()
        if before_commit is not None:
            before_commit(session)
    return AgentUsageBatchOut(accepted=accepted, duplicates=len(batch.samples) - accepted)


def _no_pause() -> None:
    """``ingest`` without pauses: the whole batch in one INSERT."""


def _checked(samples: Sequence[UsageSample], now: datetime
             ) -> tuple[list[UsageSample], set[tuple[str, int]]]:
    """One sample per key (a batch may repeat one; the first wins, as in the table) and
    the batch's (pod, attempt) pairs, in one pass over the batch. Refused: strings with
    NUL (PostgreSQL's text cannot hold one), then (the first NUL anywhere wins) a time
    without a zone or too far ahead of ``now``."""
    latest = now + timedelta(seconds=MAX_FUTURE_SKEW_SECONDS)
    seen: dict[tuple[str, int, int], UsageSample] = {}
    late: InvalidInput | None = None
    for index, sample in enumerate(samples):
        if "\x00" in sample.pod_id:
            raise InvalidInput(f"samples[{index}].pod_id", "must not contain a NUL character")
        for number, gpu in enumerate(sample.gpus):
            if "\x00" in gpu.uuid:
                raise InvalidInput(f"samples[{index}].gpus[{number}].uuid",
                                   "must not contain a NUL character")
        if late is None:
            late = _time_error(index, sample.time, now, latest)
        seen.setdefault((sample.pod_id, sample.attempt, sample.seq), sample)
    if late is not None:
        raise late
    return list(seen.values()), {(pod_id, attempt) for pod_id, attempt, _ in seen}


def _time_error(index: int, time: datetime, now: datetime,
                latest: datetime) -> InvalidInput | None:
    if time.tzinfo is None:
        return InvalidInput(f"samples[{index}].time", "must carry a time zone (UTC)")
    if time > latest:
        return InvalidInput(
            f"samples[{index}].time",
            f"{time.isoformat()} is more than {MAX_FUTURE_SKEW_SECONDS:g}s ahead "
            f"of the server's clock ({now.isoformat()}); is the node's clock right?")
    return None


def _check_fence_and_belongs(session: Session, node_id: str, fencing_token: int,
                             keys: set[tuple[str, int]], pause: Callable[[], None]) -> None:
    """The fencing token first (stale: 409, nothing else looked at), then every (pod,
    attempt) of the batch (``_check_belongs``); the node's row and the first pods'
    pairs in one statement (``_FENCE_AND_BELONGS``), the rest, if any, after ``pause``."""
    pod_ids = sorted({pod_id for pod_id, _ in keys})
    first = pod_ids[:_KEYS_PER_QUERY]
    if not first:
        name, token = session.execute(
            select(NodeModel.name, NodeModel.fencing_token).where(NodeModel.id == node_id)
        ).one()
        check_token(token, fencing_token)
        return
    rows = session.execute(_FENCE_AND_BELONGS, {"node_id": node_id, "pod_ids": first}).all()
    if not rows:
        raise NoResultFound(f"no node {node_id!r}")
    name, token = rows[0][0], rows[0][1]
    check_token(token, fencing_token)
    known = {(str(p), int(a)) for _, _, p, a in rows if p is not None}
    pause()
    _check_belongs(session, node_id, str(name), keys, pod_ids[_KEYS_PER_QUERY:], known)


def _check_belongs(session: Session, node_id: str, node_name: str,
                   keys: set[tuple[str, int]], pod_ids: Sequence[str],
                   known: set[tuple[str, int]]) -> None:
    """Conflict naming the first (pod, attempt) that was never on this node: the pod is
    bound there on that attempt, or the meter has that attempt's run there. ``known``:
    the pairs found so far; ``pod_ids``: the pods still to look up (a query a chunk)."""
    for chunk in _chunks(pod_ids):
        known.update((str(p), int(a)) for p, a in session.execute(
            _BELONGS, {"node_id": node_id, "pod_ids": list(chunk)}))
    for pod_id, attempt in sorted(keys - known):
        raise Conflict(f"pod {pod_id!r} attempt {attempt} is not on node {node_name!r}; "
                       "its samples are refused")


def _gpu_figures(sample: UsageSample) -> tuple[float | None, int | None, str]:
    """Mean utilisation, summed memory (None: not measured) and the per-GPU JSON (SQLite;
    on PostgreSQL ``_PG_INSERT`` computes the same in SQL)."""
    if not sample.gpus:
        return None, None, _NO_GPUS
    utils = [g.util_percent for g in sample.gpus if g.util_percent is not None]
    memory = [g.memory_used_bytes for g in sample.gpus if g.memory_used_bytes is not None]
    return (sum(utils) / len(utils) if utils else None, sum(memory) if memory else None,
            json.dumps([g.model_dump() for g in sample.gpus]))


def _columns(samples: list[UsageSample]) -> dict[str, list[Any]]:
    """The batch as one list per column (``node_id`` and ``received_at`` are constant)."""
    columns: dict[str, list[Any]] = {c: [] for c in _COLUMNS[1:-1]}
    for sample in samples:
        util, memory, gpus = _gpu_figures(sample)
        columns["pod_id"].append(sample.pod_id)
        columns["attempt"].append(sample.attempt)
        columns["seq"].append(sample.seq)
        columns["time"].append(sample.time)
        columns["cpu_seconds"].append(sample.cpu_seconds)
        columns["memory_bytes"].append(sample.memory_bytes)
        columns["memory_peak_bytes"].append(sample.memory_peak_bytes)
        columns["gpu_util_percent"].append(util)
        columns["gpu_memory_bytes"].append(memory)
        columns["gpus"].append(gpus)
        columns["net_rx_bytes"].append(sample.net_rx_bytes)
        columns["net_tx_bytes"].append(sample.net_tx_bytes)
        columns["disk_bytes"].append(sample.disk_bytes)
    return columns


def _insert_batch(session: Session, node_id: str, samples: list[UsageSample],
                  now: datetime, step: int, pause: Callable[[], None]) -> int:
    """The batch ``step`` samples a statement, ``pause`` before each; how many were new.
    On PostgreSQL plain INSERTs in a savepoint first (``_PG_PLAIN``), and only when one
    meets a stored key the whole batch again with ON CONFLICT DO NOTHING."""
    postgresql = session.get_bind().dialect.name == "postgresql"
    if postgresql:
        try:
            with session.begin_nested():
                return _insert_steps(session, node_id, samples, now, step, pause, _PG_PLAIN)
        except IntegrityError as error:
            if getattr(error.orig, "sqlstate", None) != _UNIQUE_VIOLATION:
                raise
    return _insert_steps(session, node_id, samples, now, step, pause,
                         _PG_INSERT if postgresql else None)


def _insert_steps(session: Session, node_id: str, samples: list[UsageSample],
                  now: datetime, step: int, pause: Callable[[], None],
                  statement: TextClause | None) -> int:
    accepted = 0
    for start in range(0, len(samples), step):
        pause()
        accepted += _insert(session, node_id, samples[start:start + step], now, statement)
    return accepted


def _insert(session: Session, node_id: str, samples: list[UsageSample], now: datetime,
            statement: TextClause | None) -> int:
    """One INSERT of ``samples`` (``statement`` on PostgreSQL, None: SQLite's); returns
    how many rows were new."""
    if not samples:
        return 0
    if statement is not None:
        result = session.execute(statement, {
            "node_id": node_id, "received_at": now,
            "samples": _SAMPLE_LIST.dump_json(samples).decode()})
        assert isinstance(result, CursorResult)
        return int(result.rowcount)
    return _insert_sqlite(session, node_id, _columns(samples), now)


def _insert_sqlite(session: Session, node_id: str, columns: dict[str, list[Any]],
                   now: datetime) -> int:
    """SQLite (the embedded default, one node's worth of samples): multi-row VALUES."""
    rows = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(),
                                                                      strict=True)]
    for row in rows:
        row["node_id"], row["received_at"] = node_id, now
        row["gpus"] = json.loads(row["gpus"])
    stored = 0
    for start in range(0, len(rows), _SQLITE_ROWS):
        statement = sqlite.insert(_SAMPLES).values(rows[start:start + _SQLITE_ROWS])
        result = session.execute(statement.on_conflict_do_nothing())
        assert isinstance(result, CursorResult)
        stored += int(result.rowcount)
    return stored


def _chunks(items: Sequence[Any]) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), _KEYS_PER_QUERY):
        yield items[start:start + _KEYS_PER_QUERY]


# -- reading the meter -------------------------------------------------------------------


def pod_runs(session: Session, project_id: str | None, since: datetime | None,
             until: datetime | None) -> list[PodRun]:
    """The runs overlapping [since, until) of a project (None: all), oldest first, each
    with the averages of its samples."""
    query = select(PodRunModel).order_by(PodRunModel.started_at, PodRunModel.pod_id,
                                         PodRunModel.attempt)
    if project_id is not None:
        query = query.where(PodRunModel.project_id == project_id)
    if until is not None:
        query = query.where(PodRunModel.started_at < until)
    if since is not None:
        query = query.where(or_(PodRunModel.ended_at.is_(None), PodRunModel.ended_at > since))
    runs = list(session.scalars(query))
    aggregates = _aggregates(session, runs)
    return [_pod_run(run, aggregates.get((run.node_id, run.pod_id, run.attempt)))
            for run in runs]


def _aggregates(session: Session, runs: Sequence[PodRunModel]
                ) -> dict[tuple[str | None, str, int], Any]:
    keys = sorted({(r.node_id, r.pod_id, r.attempt) for r in runs if r.node_id is not None})
    s = UsageSampleModel
    found: dict[tuple[str | None, str, int], Any] = {}
    for chunk in _chunks(keys):
        rows = session.execute(
            select(s.node_id, s.pod_id, s.attempt, func.count(), func.avg(s.gpu_util_percent),
                   func.max(s.gpu_memory_bytes), func.max(s.cpu_seconds),
                   func.max(s.memory_peak_bytes), func.max(s.net_rx_bytes),
                   func.max(s.net_tx_bytes), func.max(s.disk_bytes))
            .where(tuple_(s.node_id, s.pod_id, s.attempt).in_(list(chunk)))
            .group_by(s.node_id, s.pod_id, s.attempt))
        for row in rows:
            found[(row[0], row[1], int(row[2]))] = row
    return found


def _pod_run(run: PodRunModel, agg: Any | None) -> PodRun:
    def number(index: int) -> Any:
        return None if agg is None or agg[index] is None else agg[index]

    util = number(4)
    return PodRun(
        pod_id=run.pod_id, project_id=run.project_id, job_id=run.job_id,
        attempt=run.attempt, node_id=run.node_id, gpu_type=run.gpu_type, gpus=run.gpus,
        gpu_milli=run.gpu_milli, mig_profile=run.mig_profile, cpu_milli=run.cpu_milli,
        memory_bytes=run.memory_bytes, volume_bytes=run.volume_bytes,
        priority_class=run.priority_class, spot=run.spot, started_at=run.started_at,
        ended_at=run.ended_at, end_reason=run.end_reason, credited=run.credited,
        samples=int(agg[3]) if agg is not None else 0,
        gpu_util_avg=float(util) if util is not None else None,
        gpu_memory_peak_bytes=_int(number(5)), cpu_seconds=_float(number(6)),
        memory_peak_bytes=_int(number(7)), net_rx_bytes=_int(number(8)),
        net_tx_bytes=_int(number(9)), disk_bytes_max=_int(number(10)),
    )


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


# -- node load ---------------------------------------------------------------------------


#: ``node_load``'s read, built once (each scheduling pass runs it): the live pods'
#: samples since ``since``, per node and pod in time order.
_LOAD_ROWS = (
    select(UsageSampleModel.node_id, UsageSampleModel.pod_id, UsageSampleModel.time,
           UsageSampleModel.cpu_seconds, UsageSampleModel.memory_bytes,
           UsageSampleModel.gpus, PodModel.started_at)
    .join(PodModel, and_(PodModel.id == UsageSampleModel.pod_id,
                         PodModel.node_id == UsageSampleModel.node_id,
                         PodModel.attempt == UsageSampleModel.attempt))
    .where(UsageSampleModel.time >= bindparam("since"),
           PodModel.phase.in_(ACTIVE_PHASE_VALUES))
    .order_by(UsageSampleModel.node_id, UsageSampleModel.pod_id, UsageSampleModel.time))


def node_load(session: Session, now: datetime,
              window_seconds: float = LOAD_WINDOW_SECONDS,
              half_life_seconds: float = LOAD_HALF_LIFE_SECONDS) -> dict[str, NodeLoad]:
    """Per node, the EWMA of its live pods' recent samples (newer samples weigh more:
    the weight halves every ``half_life_seconds``); only pods still active on that node
    and attempt count, so a pod that ended is gone at once."""
    rows = session.connection().execute(
        _LOAD_ROWS, {"since": now - timedelta(seconds=window_seconds)}).all()
    series: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for row in rows:
        series[(row[0], row[1])].append(row)
    loads: dict[str, NodeLoad] = {}
    for (node_id, pod_id), points in series.items():
        pod = _pod_load(points, now, half_life_seconds)
        loads[node_id] = _add(loads.get(node_id), node_id, pod_id, pod, points[-1][2])
    return loads


def _weight(time: datetime, now: datetime, half_life: float) -> float:
    return float(0.5 ** (max(0.0, (now - time).total_seconds()) / half_life))


def _pod_load(points: list[Any], now: datetime, half_life: float) -> PodLoad:
    """Weighted means of CPU cores (from consecutive cumulative counters; the first
    sample against the attempt's start), memory and each GPU's utilisation."""
    cpu: list[tuple[float, float]] = []
    memory: list[tuple[float, float]] = []
    gpus: dict[str, list[tuple[float, float]]] = defaultdict(list)
    previous: tuple[datetime, float] | None = None
    for _, _, time, cpu_seconds, memory_bytes, per_gpu, started_at in points:
        weight = _weight(time, now, half_life)
        base = previous or ((started_at, 0.0) if started_at is not None else None)
        if base is not None and (time - base[0]).total_seconds() > 0:
            rate = (cpu_seconds - base[1]) / (time - base[0]).total_seconds()
            cpu.append((max(0.0, rate), weight))
        previous = (time, cpu_seconds)
        memory.append((float(memory_bytes), weight))
        for gpu in per_gpu or []:
            if gpu.get("util_percent") is not None:
                gpus[str(gpu["uuid"])].append((float(gpu["util_percent"]), weight))
    return PodLoad(cpu_cores=_mean(cpu), memory_bytes=_mean(memory),
                   gpu_util_percent={uuid: _mean(values) for uuid, values in gpus.items()})


def _mean(values: list[tuple[float, float]]) -> float:
    total = sum(weight for _, weight in values)
    return sum(value * weight for value, weight in values) / total if total > 0 else 0.0


def _add(load: NodeLoad | None, node_id: str, pod_id: str, pod: PodLoad,
         time: datetime) -> NodeLoad:
    if load is None:
        return NodeLoad(node_id, pod.cpu_cores, pod.memory_bytes, dict(pod.gpu_util_percent),
                        time, {pod_id: pod})
    gpus = dict(load.gpu_util_percent)
    for uuid, util in pod.gpu_util_percent.items():
        gpus[uuid] = gpus.get(uuid, 0.0) + util
    return NodeLoad(node_id, load.cpu_cores + pod.cpu_cores,
                    load.memory_bytes + pod.memory_bytes, gpus, max(load.sample_time, time),
                    {**load.pods, pod_id: pod})
