"""A node's state dir full (issue 16's fault list): the usage spool and the log shipper's
records on a small tmpfs the test mounts and fills, the log shipped to the real server
(SQLite and PostgreSQL) through the agent's real connection.

Invariants: a full disk is a clear error (ENOSPC, logged) and never a corrupt file or a
leftover temporary one; nothing the server has not acknowledged is dropped (the spool
still holds every sample it has not confirmed, the server's log is whole and has no byte
twice); when space returns everything carries on by itself, across an agent restart too.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpucloud.agent.connection import Connection
from gpucloud.agent.identity import IdentityFile
from gpucloud.agent.logship import LogShipper
from gpucloud.agent.usage_spool import UsageSpool
from gpucloud.api.app import create_app
from gpucloud.core.clock import ManualClock
from gpucloud.core.models import NodeRegisterRequest
from gpucloud.core.settings import Settings
from gpucloud.core.usage import UsageSample
from tests.conftest import ADMIN_KEY
from tests.integration.conftest import ThroughTestClient

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: a state dir that fills up."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                   check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte; the filler file, to delete when space returns."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as out:
        try:
            while True:
                out.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC
    with filler.open("ab", buffering=0) as out:  # the last partial page
        try:
            while True:
                out.write(b"\0")
        except OSError as error:
            assert error.errno == errno.ENOSPC
    return filler


def _sample(seq: int) -> UsageSample:
    return UsageSample(pod_id="p1", attempt=1, seq=seq, time=datetime(2026, 1, 1, tzinfo=UTC),
                       cpu_seconds=float(seq), memory_bytes=1, memory_peak_bytes=1)


def _seqs(spool: UsageSpool) -> list[int]:
    return [s.seq for s in spool.pending_of("p1-1")]


def _append_until_full(spool: UsageSpool) -> OSError:
    """Append until the disk refuses (the file's last page fills first): the error."""
    for _ in range(4096 // 100 + 2):  # a sample line is over 100 bytes
        try:
            spool.append("p1-1", _sample)
        except OSError as error:
            return error
    raise AssertionError("the spool never filled the disk")


def test_a_full_usage_spool_loses_no_unacknowledged_sample(small_disk: Path) -> None:
    spool = UsageSpool(small_disk / "usage")
    for _ in range(3):
        spool.append("p1-1", _sample)
    spool.acknowledge("p1-1", 0)
    filler = _fill(small_disk)
    full = _append_until_full(spool)
    assert full.errno == errno.ENOSPC  # a clear error: the caller logs it and goes on
    taken = _seqs(spool)
    assert taken == list(range(1, taken[-1] + 1))  # the refused sample is not taken
    with pytest.raises(OSError):
        spool.acknowledge("p1-1", 1)  # the server has 1; the state cannot say so yet
    assert not list(small_disk.glob("usage/.*"))  # no temporary file left taking space
    assert _seqs(spool) == taken[1:]
    # An agent restart while full reads whole lines only, and nothing the server has not
    # confirmed is missing (1 is sent again; the server stores each seq once).
    assert _seqs(UsageSpool(small_disk / "usage")) == taken
    filler.unlink()  # space returns: the next round carries on, numbering too
    assert spool.append("p1-1", _sample).seq == taken[-1] + 1
    spool.acknowledge("p1-1", taken[-1])
    assert _seqs(UsageSpool(small_disk / "usage")) == [taken[-1] + 1]


def _connect(api: TestClient, state: Path) -> Connection:
    token = api.post("/v1/nodes/join-tokens").json()["token"]
    registration = NodeRegisterRequest(join_token=token, name="gpu-1", cpu_cores=8,
                                       memory_bytes=1 << 34)
    conn = Connection("http://testserver", registration, IdentityFile(state / "identity"),
                      threading.Event(), transport=ThroughTestClient(api))
    conn.connect()
    return conn


def test_log_shipping_goes_on_with_a_full_state_dir(
        api: TestClient, small_disk: Path, tmp_path: Path, schedule: Callable[[], Any],
        caplog: pytest.LogCaptureFixture) -> None:
    conn = _connect(api, tmp_path)
    pod = api.post("/v1/pods", json={"name": "job", "image": "busybox"}).json()
    schedule()
    log_file, record = tmp_path / "container.log", small_disk / "logship" / "c1.json"
    record.parent.mkdir()
    filler = _fill(small_disk)
    log_file.write_text("one\n")

    def shipper() -> LogShipper:  # a new one: what an agent restart makes
        return LogShipper(conn, pod["id"], log_file, record, attempt=1)

    running = shipper()
    with caplog.at_level(logging.WARNING, logger="gpucloud.agent.logship"):
        assert running.ship()
        with log_file.open("a") as out:
            out.write("two\n")
        assert running.ship()
    assert "cannot save the shipped offset" in caplog.text
    assert caplog.text.count("cannot save") == 1  # once per outage, not per chunk
    assert not record.exists() and not list(record.parent.iterdir())  # no torn record
    assert api.get("/v1/pods/job/logs").json()["text"] == "one\ntwo\n"
    assert shipper().ship()  # a restart while full: no record, the server realigns it
    filler.unlink()
    with log_file.open("a") as out:
        out.write("three\n")
    assert shipper().ship()
    assert record.exists()  # saved again once there is room
    assert api.get("/v1/pods/job/logs").json()["text"] == "one\ntwo\nthree\n"


def test_a_full_database_disk_is_a_clean_503_and_recovers(tmp_path: Path) -> None:
    """The server's SQLite database on a disk that fills: creates fail cleanly with 503
    and Retry-After (never a 500, never a half-written pod), every acknowledged create is
    there, and the server serves again as soon as space returns (no restart)."""
    disk = tmp_path / "db-disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], check=True)
    try:
        settings = Settings(home=tmp_path / "home", database_url=f"sqlite:///{disk}/db.sqlite",
                            admin_key=ADMIN_KEY)
        with TestClient(create_app(settings, ManualClock(), run_controllers=False)) as api:
            api.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
            filler = _fill(disk)
            acknowledged, refused = [], None
            for i in range(400):
                answer = api.post("/v1/pods", json={"name": f"p{i}", "image": "busybox",
                                                    "env": {"PAD": "x" * 8000}})
                if answer.status_code != 201:
                    refused = answer
                    break
                acknowledged.append(f"p{i}")
            assert refused is not None, "the disk never filled"
            assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
            assert "database" in refused.json()["detail"]
            assert api.get(f"/v1/pods/p{len(acknowledged)}").status_code in (404, 503)
            filler.unlink()
            names = {p["name"] for p in api.get("/v1/pods").json()}
            assert set(acknowledged) <= names and f"p{len(acknowledged)}" not in names
            again = api.post("/v1/pods", json={"name": "after", "image": "busybox"})
            assert again.status_code == 201, again.text
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
