"""Invariant: PostgreSQL stopped (as a crash) and started again under load costs clients
nothing but a retry. While it is down every request fails cleanly, 503 with Retry-After
and the one error body, never a 500; once it is back the same server answers again by
itself (no restart), every create it acknowledged exists, and the controllers resume: a
pod created afterwards is scheduled and runs."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx

from tests.e2e.cluster import ADMIN_KEY, wait_for
from tests.faults.cluster import COUNTER, IMAGE, Postgres, fault_cloud


class Load:
    """A client thread: creates a pod, lists pods, over and over; records every answer."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=10,
                                   headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        self.answers: list[httpx.Response] = []
        self.created: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        number = 0
        while not self.stop.is_set():
            number += 1
            name = f"load-{number}"
            made = self.client.post("/v1/pods", json={"name": name, "image": IMAGE,
                                                     "command": ["true"], "gpus": 0})
            if made.status_code == 201:
                self.created.append(name)
            self.answers += [made, self.client.get("/v1/pods")]

    def codes(self) -> set[int]:
        return {r.status_code for r in list(self.answers)}


def test_a_database_restart_fails_requests_cleanly_and_recovers(
    tmp_path: Path, archive: Path, database_url: str, pg: Postgres
) -> None:
    with fault_cloud(tmp_path, archive, database_url, lease_ttl=10) as cloud:
        cloud.node_agent("gpu-a")
        load = Load(cloud.url)
        load.thread.start()
        try:
            wait_for(lambda: len(load.created) >= 3, 10, "creates to land")
            pg.stop()
            try:
                wait_for(lambda: 503 in load.codes(), 10, "a 503 while the database is down")
            finally:
                pg.start()
            seen = len(load.answers)
            wait_for(lambda: [r.status_code for r in load.answers[seen:]].count(201) >= 2, 20,
                     "creates to succeed again without a server restart")
        finally:
            load.stop.set()
            load.thread.join(15)
            load.client.close()
        assert load.codes() <= {200, 201, 503}, load.codes()
        for answer in load.answers:
            if answer.status_code == 503:
                assert answer.headers["Retry-After"].isdigit()
                assert answer.json() == {"detail": "the database is unavailable; retry shortly",
                                         "field": None}
        names = {p.name for p in cloud.client.list_pods()}
        assert set(load.created) <= names  # every acknowledged create is there
        cloud.create_pod("after", IMAGE, COUNTER)
        cloud.wait_pod("after", "Running", timeout=20)  # scheduling and the agent resumed
        assert cloud.client.get_node("gpu-a").status == "Ready"
