"""Invariant: a crash of the PostgreSQL primary and the promotion of its synchronous
streaming standby cost clients nothing but a retry, and lose nothing acknowledged. The
server's URL names both hosts (libpq multi-host, ``target_session_attrs=read-write``).
While the primary is down and the standby still read-only, every request fails cleanly:
503 with Retry-After and the one error body, never a 500, never a hang. Once the standby
is promoted the same server process answers again by itself (no restart) within a bound:
creates succeed; every create acknowledged with 201, before, during and after, is on the
new primary, whole (as its request asked), and no pod exists that no client asked for; the
LISTEN/NOTIFY bridge listens on the new primary; the controllers resume: a pod created
afterwards is scheduled and runs, and the node stays (or is again) Ready."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gpucloud.services.notify import CHANNEL
from tests.e2e.cluster import ADMIN_KEY, wait_for
from tests.faults.cluster import COUNTER, IMAGE, ReplicaPair, fault_cloud

#: Seconds from the promotion to the first acknowledged create, at most.
RECOVERY_BOUND = 15.0


@dataclass
class Answer:
    sent: float
    answered: float
    response: httpx.Response


class Load:
    """A client thread: creates a pod, lists pods, over and over; records every answer
    and when it came, and any request that got no answer (a hang is a ReadTimeout)."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=10,
                                   headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        self.answers: list[Answer] = []
        self.asked: list[str] = []
        self.created: list[str] = []
        self.failures: list[BaseException] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _request(self, method: str, path: str,
                 body: dict[str, object] | None = None) -> httpx.Response:
        sent = time.monotonic()
        response = self.client.request(method, path, json=body)
        self.answers.append(Answer(sent, time.monotonic(), response))
        return response

    def _run(self) -> None:
        number = 0
        try:
            while not self.stop.is_set():
                number += 1
                name = f"load-{number}"
                self.asked.append(name)
                made = self._request("POST", "/v1/pods", {
                    "name": name, "image": IMAGE, "command": ["echo", name], "gpus": 0})
                if made.status_code == 201:
                    self.created.append(name)
                self._request("GET", "/v1/pods")
        except Exception as error:  # noqa: BLE001 - no answer at all breaks the invariant
            self.failures.append(error)

    def first(self, code: int, after: float) -> Answer | None:
        """The first ``code`` answered after ``after`` (its request maybe sent before)."""
        self.check()
        return next((a for a in list(self.answers)
                     if a.response.status_code == code and a.answered > after), None)

    def sent_after(self, code: int, after: float) -> int:
        """How many ``code`` answers to requests sent after ``after``."""
        self.check()
        return sum(1 for a in list(self.answers)
                   if a.response.status_code == code and a.sent > after)

    def check(self) -> None:
        """Fail the test at once if a request got no answer."""
        assert not self.failures, f"a request got no answer: {self.failures[0]!r}"


@pytest.fixture
def pair() -> Iterator[ReplicaPair]:
    servers = ReplicaPair()
    try:
        yield servers
    finally:
        servers.close()


def test_a_failover_to_the_standby_fails_requests_cleanly_and_loses_nothing(
    tmp_path: Path, archive: Path, pair: ReplicaPair
) -> None:
    database, url = pair.fresh_database()
    with fault_cloud(tmp_path, archive, url, lease_ttl=10) as cloud:
        cloud.node_agent("gpu-a")
        load = Load(cloud.url)
        load.thread.start()
        try:
            wait_for(lambda: load.sent_after(201, 0) >= 3, 20, "creates to land")
            killed = time.monotonic()
            pair.primary.stop("immediate")  # a crash: every connection cut at once
            wait_for(lambda: load.sent_after(503, killed), 10,
                     "a 503 while the primary is down and the standby read-only")
            begun = time.monotonic()
            pair.standby.promote()
            promoted = time.monotonic()
            first = wait_for(lambda: load.first(201, promoted),
                             RECOVERY_BOUND, "a create to succeed on the new primary "
                             "without a server restart")
            wait_for(lambda: load.sent_after(201, first.answered) >= 2, 10,
                     "creates to go on succeeding")
        finally:
            load.stop.set()
            load.thread.join(15)
            load.client.close()
        print(f"\nfailover: primary down {begun - killed:.2f} s (until a 503 was seen), "
              f"pg_ctl promote {promoted - begun:.2f} s, first 201 "
              f"{first.answered - promoted:.2f} s after the promotion "
              f"({first.answered - killed:.2f} s after the crash); "
              f"{len(load.created)} creates acknowledged of {len(load.asked)}, "
              f"{len(load.answers)} answers")
        assert not load.thread.is_alive() and not load.failures, load.failures
        codes = {a.response.status_code for a in load.answers}
        assert codes <= {200, 201, 503}, codes
        for answer in load.answers:
            if answer.response.status_code == 503:
                assert answer.response.headers["Retry-After"].isdigit()
                assert answer.response.json() == {
                    "detail": "the database is unavailable; retry shortly", "field": None}

        # On the new primary itself (the old one is gone for good): every acknowledged
        # create, each row whole as its request asked, none that nobody asked for.
        rows = pair.standby.sql("SELECT name, image, command FROM pods "
                                "WHERE deleted_at IS NULL", dbname=database)
        stored = {name: (image, command) for name, image, command in rows}
        missing = [name for name in load.created if name not in stored]
        assert missing == [], f"acknowledged but lost in the failover: {missing}"
        assert set(stored) <= set(load.asked), set(stored) - set(load.asked)
        for name, (image, command) in stored.items():
            assert (image, command) == (IMAGE, ["echo", name]), name
        assert {p.name for p in cloud.client.list_pods()} == set(stored)

        # The server's own connections all follow the primary: the LISTEN bridge ...
        wait_for(lambda: pair.standby.sql(
            "SELECT 1 FROM pg_stat_activity WHERE datname = %s AND query = %s",
            database, f"LISTEN {CHANNEL}", dbname=database), 10,
            "the LISTEN/NOTIFY bridge to listen on the new primary")
        # ... and the controllers (their lease) and the node leases.
        cloud.create_pod("after", IMAGE, COUNTER)
        cloud.wait_pod("after", "Running", timeout=20)
        wait_for(lambda: cloud.client.get_node("gpu-a").status == "Ready", 15,
                 "the node to be Ready")
