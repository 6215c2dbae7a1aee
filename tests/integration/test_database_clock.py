"""The server's service clock (api/app.py ``prepare``, db/clock.py): on PostgreSQL the
database's, read before anything is written and kept read on a thread of its own while
the app runs; on SQLite the system's; a clock passed in (a test's) is kept."""

from __future__ import annotations

import threading
from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy import func, select

from gpucloud.api.app import create_app
from gpucloud.core.clock import ManualClock, SystemClock
from gpucloud.core.settings import Settings
from gpucloud.db.clock import DatabaseClock


def _threads() -> set[str]:
    return {thread.name for thread in threading.enumerate() if thread.is_alive()}


def test_the_server_keeps_the_databases_time(settings: Settings) -> None:
    app = create_app(settings, run_controllers=False)
    with TestClient(app) as client:
        clock = client.app.state.ctx.clock  # type: ignore[attr-defined]
        if settings.database_url.startswith("sqlite"):
            assert type(clock) is SystemClock
            assert "database-clock" not in _threads()
            return
        assert isinstance(clock, DatabaseClock) and "database-clock" in _threads()
        anchor = clock.anchor
        assert anchor is not None and anchor.uncertainty < 0.05
        with client.app.state.ctx.db.read() as session:  # type: ignore[attr-defined]
            before = session.scalar(select(func.clock_timestamp()))
            now = clock.now()
            after = session.scalar(select(func.clock_timestamp()))
        slack = timedelta(seconds=2 * anchor.uncertainty + 0.01)
        assert before - slack <= now <= after + slack
    assert "database-clock" not in _threads()  # stopped with the app


def test_a_clock_passed_in_is_kept(settings: Settings, clock: ManualClock) -> None:
    with TestClient(create_app(settings, clock, run_controllers=False)) as client:
        assert client.app.state.ctx.clock is clock  # type: ignore[attr-defined]
        assert "database-clock" not in _threads()
