"""Invariant: a server SIGKILLed in the middle of a burst of creates loses nothing it
acknowledged and leaves nothing half-written. After a restart on the same database every
pod that got a 201 exists, each stored pod is exactly what its request asked for (name,
image, command, resources), and no pod exists that no client asked for."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import ADMIN_KEY, START_TIMEOUT, wait_for
from tests.fixtures.postgres import free_port

CLIENTS = 4


def _start(home: Path, database_url: str, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "GPUCLOUD_HOME": str(home), "GPUCLOUD_DATABASE_URL": database_url,
           "GPUCLOUD_ADMIN_KEY": ADMIN_KEY}
    log = home.parent / "server.log"
    with log.open("ab") as out:
        server = subprocess.Popen([sys.executable, "-m", "gpucloud.cli.main", "server",
                                   "--port", str(port), "--ssh-port", "0"], env=env,
                                  stdout=out, stderr=subprocess.STDOUT)

    def up() -> bool:
        if server.poll() is not None:
            pytest.fail(f"the server exited ({server.returncode}):\n"
                        f"{log.read_text(errors='replace')[-3000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, START_TIMEOUT, "the server process to answer")
    return server


def _burst(url: str, client_no: int, acked: list[dict[str, object]],
           asked: list[str]) -> None:
    """Create pods one after another until the server dies under us (a kill resets the
    connections at once; the timeout is only for a slow answer on a loaded machine, which
    must not end the burst early)."""
    with httpx.Client(base_url=url, timeout=60,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as client:
        for number in range(10_000):
            name = f"c{client_no}-{number}"
            body: dict[str, object] = {"name": name, "image": "busybox:1",
                                       "command": ["echo", name], "cpu": (1 + client_no) / 10,
                                       "gpus": 0}
            asked.append(name)
            try:
                answer = client.post("/v1/pods", json=body)
            except httpx.TransportError:
                return
            if answer.status_code == 201:
                acked.append(body)


def test_kill_9_of_the_server_mid_burst_loses_no_acknowledged_create(
    tmp_path: Path, database_url: str
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _start(tmp_path / "home", database_url, port)
    acked: list[dict[str, object]] = []
    asked: list[str] = []
    threads = [threading.Thread(target=_burst, args=(url, n, acked, asked), daemon=True)
               for n in range(CLIENTS)]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: len(acked) >= 40, 60, "a burst of acknowledged creates")
        server.kill()  # SIGKILL, mid-burst: requests are in flight on every client
        server.wait(10)
        for thread in threads:
            thread.join(10)
        server = _start(tmp_path / "home", database_url, port)
        with httpx.Client(base_url=url, timeout=10,
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as client:
            listed = client.get("/v1/pods")
            listed.raise_for_status()
        stored = {p["name"]: p for p in listed.json()}
        missing = [b["name"] for b in acked if b["name"] not in stored]
        assert missing == [], f"acknowledged but lost: {missing}"
        assert set(stored) <= set(asked)  # nothing that nobody asked for
        for name, pod in stored.items():  # whole rows, as asked (acknowledged or not)
            client_no = int(name[1:].split("-")[0])
            assert pod["command"] == ["echo", name] and pod["image"] == "busybox:1"
            assert pod["cpu"] == (1 + client_no) / 10 and pod["gpus"] == 0
            assert pod["phase"] in ("Pending", "Unschedulable")
    finally:
        server.kill()
        server.wait(10)
