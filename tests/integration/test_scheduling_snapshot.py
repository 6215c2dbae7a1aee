"""The controller's incremental snapshot (``scheduling.SnapshotCache``): after any change
to a node's row or its usage it is the snapshot a full rebuild gives, while the nodes
that did not change keep their very ``NodeState`` objects (SQLite and PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlalchemy.exc import OperationalError

from gpucloud.db.models import NodeModel
from gpucloud.services import loadaware, scheduling
from gpucloud.services.context import ServiceContext


def _same_as_full(ctx: ServiceContext, cache: scheduling.SnapshotCache,
                  ) -> scheduling.Snapshot:
    cached, full = scheduling.snapshot(ctx, cache), scheduling.snapshot(ctx)
    assert cached.nodes == full.nodes
    assert {n: (m.id, m.version, m.status, m.cordoned, m.gpus) for n, m in
            cached.by_name.items()} == {n: (m.id, m.version, m.status, m.cordoned, m.gpus)
                                        for n, m in full.by_name.items()}
    assert cached.usage == full.usage
    return cached


def _set(ctx: ServiceContext, node_id: str, **values: Any) -> None:
    """A write that does not bump the node's version (as labels or health reports)."""
    with ctx.db.transaction() as session:
        session.execute(update(NodeModel).where(NodeModel.id == node_id).values(**values))


def test_the_incremental_snapshot_follows_every_change_and_reuses_the_rest(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any],
) -> None:
    ids = {name: register_node(name)["node_id"] for name in ("a", "b", "c")}
    cache = scheduling.SnapshotCache()
    first = _same_as_full(app_ctx, cache)
    again = _same_as_full(app_ctx, cache)
    assert all(x is y for x, y in zip(first.nodes, again.nodes, strict=True))

    _set(app_ctx, ids["a"], labels={"zone": "z1"})
    with app_ctx.db.read() as session:
        gpus = [dict(g) for g in session.get_one(NodeModel, ids["b"]).gpus]
    gpus[0]["healthy"] = False
    _set(app_ctx, ids["b"], gpus=gpus)
    _set(app_ctx, ids["c"], capabilities={"criu": True})
    changed = _same_as_full(app_ctx, cache)
    assert changed.nodes[0].labels.get("zone") == "z1"
    assert len(changed.nodes[1].gpus) == len(first.nodes[1].gpus) - 1
    assert all(x is not y for x, y in zip(first.nodes, changed.nodes, strict=True))

    api.post("/v1/pods", json={"name": "p", "image": "busybox", "gpus": 2})
    assert schedule().scheduled  # its node's usage and version change
    placed = api.get("/v1/pods/p").json()["node"]
    after_bind = _same_as_full(app_ctx, cache)
    for x, y in zip(changed.nodes, after_bind.nodes, strict=True):
        assert (x is y) == (x.name != placed)

    assert api.post("/v1/nodes/c/cordon").status_code == 200
    _set(app_ctx, ids["a"], status="Lost")
    register_node("d")
    last = _same_as_full(app_ctx, cache)
    assert [n.name for n in last.nodes] == ["a", "b", "c", "d"]
    assert not last.nodes[0].ready and last.nodes[2].cordoned


def test_passes_with_the_cache_never_place_two_pods_on_one_gpu(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any],
) -> None:
    for name in ("a", "b"):
        register_node(name)
    for wave in range(3):  # each pass sees the binds of the last through the cache
        for i in range(5):
            api.post("/v1/pods", json={"name": f"w{wave}-{i}", "image": "busybox", "gpus": 1})
        schedule()
    pods = api.get("/v1/pods").json()
    placed = [(p["node"], uuid) for p in pods if p["node"] for uuid in p["gpu_uuids"]]
    assert len(placed) == 15 and len(set(placed)) == 15


def test_a_read_that_fails_after_loading_rows_leaves_the_cache_usable(
    app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The database went away mid-snapshot (CI's PostgreSQL restart): the read rolled
    back after the cache had taken the rows it loaded. Later passes must still work,
    where they once raised ``DetachedInstanceError`` on every pass for good."""
    for name in ("a", "b"):
        register_node(name)
    cache = scheduling.SnapshotCache()
    real = loadaware.node_loads

    def gone(*args: Any) -> Any:
        raise OperationalError("SELECT", {}, Exception("the database went away"))

    monkeypatch.setattr(loadaware, "node_loads", gone)
    with pytest.raises(OperationalError):
        scheduling.snapshot(app_ctx, cache)
    monkeypatch.setattr(loadaware, "node_loads", real)
    assert [n.name for n in _same_as_full(app_ctx, cache).nodes] == ["a", "b"]
