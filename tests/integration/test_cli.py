"""The `gpucloud` CLI against a real server over HTTP: the forms of the issue, exactly."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpucloud.cli.main import main
from gpucloud.controllers.loops import SchedulingController
from gpucloud.core.settings import Settings
from gpucloud.services import wakeups
from gpucloud.services.context import ServiceContext
from tests.conftest import ADMIN_KEY
from tests.fixtures.postgres import free_port
from tests.fixtures.server import live_server
from tests.integration.conftest import h100_gpus


@pytest.fixture
def server(settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    with live_server(settings, run_controllers=False) as url:
        monkeypatch.setenv("GPUCLOUD_URL", url)
        monkeypatch.setenv("GPUCLOUD_API_KEY", ADMIN_KEY)
        monkeypatch.setenv("GPUCLOUD_HOME", str(tmp_path / "cli-home"))
        yield url


class Cli:
    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    def __call__(self, *args: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = main(list(args))
        out, err = self.capsys.readouterr()
        return code, out, err

    def json(self, *args: str) -> Any:
        code, out, err = self(*args, "--output", "json")
        assert code == 0, err
        return json.loads(out)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(capsys)


def _register(url: str, name: str, token: str, gpus: int = 8) -> None:
    response = httpx.post(f"{url}/v1/agent/register", json={
        "join_token": token, "name": name, "cpu_cores": 64, "memory_bytes": 512 * 1024**3,
        "gpus": h100_gpus(gpus)})
    response.raise_for_status()


def test_pod_lifecycle_through_the_cli(server: str, cli: Cli, ctx: ServiceContext) -> None:
    code, token, _ = cli("node", "join-token")
    assert code == 0 and token.strip().startswith("gpj_") and len(token.strip().split()) == 1
    _register(server, "gpu-1", token.strip())
    code, out, err = cli("pod", "create", "hello", "--image", "gpucloud/demo", "--gpus", "2",
                         "--gpu-type", "H100-80GB", "--cpu", "4", "--memory", "16Gi",
                         "--env", "A=1", "--env", "B=x=y", "--port", "8888/http",
                         "--restart", "on-failure", "--", "python", "-c", "print(1)")
    assert code == 0, err
    assert "hello" in out and "Pending" in out
    pod = cli.json("pod", "get", "hello")
    assert pod["command"] == ["python", "-c", "print(1)"]
    assert pod["env"] == {"A": "1", "B": "x=y"} and pod["ports"] == ["8888/http"]
    assert pod["memory"] == "16Gi" and pod["restart"] == "on-failure"
    SchedulingController(ctx).tick()
    assert cli.json("pod", "get", pod["id"])["node"] == "gpu-1"
    [listed] = cli.json("pod", "list")
    assert listed["name"] == "hello" and listed["phase"] == "Scheduled"
    code, out, _ = cli("pod", "list")
    assert code == 0 and "hello" in out and "gpu-1" in out
    events = cli.json("pod", "events", "hello")
    assert [e["to_phase"] for e in events] == ["Pending", "Scheduled"]
    assert cli("pod", "events", "hello")[0] == 0
    assert "Scheduled" in cli("pod", "why", "hello")[1]
    code, out, _ = cli("pod", "logs", "hello")
    assert code == 0 and out == ""
    assert cli.json("pod", "stop", "hello")["desired_state"] == "stopped"
    code, out, _ = cli("pod", "delete", "hello")
    assert code == 0 and "deleted" in out
    code, _, err = cli("pod", "get", "hello")
    assert code == 1 and err.strip() == "error: pod 'hello' not found"


def test_pod_logs_follow_prints_each_piece_once_it_is_stored(
        server: str, cli: Cli, ctx: ServiceContext) -> None:
    """``logs -f`` follows with waiting reads (no polling): each chunk the agent stores is
    printed, and the pod's end ends the follow."""
    token = cli("node", "join-token")[1].strip()
    node = httpx.post(f"{server}/v1/agent/register", json={
        "join_token": token, "name": "gpu-1", "cpu_cores": 64, "memory_bytes": 1 << 36,
        "gpus": h100_gpus(1)}).json()
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    pod = httpx.post(f"{server}/v1/pods", headers=admin, json={
        "name": "talker", "image": "busybox", "gpus": 1}).json()
    SchedulingController(ctx).tick()
    offset = 0

    def agent(what: str, **body: Any) -> dict[str, Any]:
        response = httpx.post(f"{server}/v1/agent/pods/{pod['id']}/{what}",
                              headers={"Authorization": f"Bearer {node['node_token']}"},
                              json={"fencing_token": node["fencing_token"], **body})
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    def ship(data: str) -> None:
        nonlocal offset
        offset = agent("logs", offset=offset, data=data)["next_offset"]

    def when_followed() -> None:  # once the follower waits: the next chunk, then the end
        while wakeups.LOGS.listeners(pod["id"]) == 0:
            threading.Event().wait(0.005)

    agent("status", phase="Running")
    ship("one\n")

    def the_pod_goes_on() -> None:
        when_followed()
        ship("two\n")
        when_followed()
        agent("status", phase="Succeeded", exit_code=0)

    talker = threading.Thread(target=the_pod_goes_on, daemon=True)
    talker.start()
    code, out, err = cli("pod", "logs", "talker", "-f")
    talker.join(timeout=30)
    assert (code, out, err) == (0, "one\ntwo\n", "")


def test_why_explains_a_pending_pod(server: str, cli: Cli, ctx: ServiceContext) -> None:
    token = cli("node", "join-token")[1].strip()
    for name in ("a", "b", "c", "d"):
        _register(server, name, token, gpus=2)
    cli("node", "cordon", "d")
    cli("pod", "create", "big", "--image", "busybox", "--gpus", "4")
    SchedulingController(ctx).tick()
    code, out, _ = cli("pod", "why", "big")
    assert code == 0
    assert out.strip() == "3 nodes: too few GPUs on node; 1 node: cordoned"
    nodes = cli.json("node", "list")
    assert [n["cordoned"] for n in nodes] == [False, False, False, True]
    assert cli.json("node", "uncordon", "d")["cordoned"] is False
    assert cli.json("node", "get", "a")["gpus"][1]["uuid"] == "GPU-00000001-test"
    assert "gpu 1: H100-80GB" in cli("node", "get", "a")[1]


@pytest.mark.parametrize(("args", "message"), [
    (["pod", "create", "Bad_Name", "--image", "busybox"], "name:"),
    (["pod", "create", "ok", "--image", "busybox", "--gpus", "-2"], "gpus:"),
    (["pod", "create", "ok", "--image", "busybox", "--memory", "lots"], "memory:"),
    (["pod", "create", "ok", "--image", "busybox", "--gpu-type", "TPU-v9"], "gpu_type"),
    (["pod", "create", "ok", "--image", "NOT VALID"], "image:"),
    (["pod", "create", "ok"], "--image is required"),
    (["pod", "create", "ok", "--image", "busybox", "--env", "NOEQUALS"], "--env"),
    (["pod", "create", "ok", "--image", "busybox", "--restart", "maybe"], "restart"),
    (["pod", "create", "ok", "--image", "busybox", "--gpus", "many"], "gpus"),
    (["pod", "frobnicate"], "No such command"),
])
def test_bad_input_is_one_line_and_non_zero(server: str, cli: Cli, args: list[str],
                                            message: str) -> None:
    code, out, err = cli(*args)
    assert code != 0
    assert message in err and err.count("\n") == 1, err
    assert cli.json("pod", "list") == []


def test_duplicate_name_from_the_cli(server: str, cli: Cli) -> None:
    assert cli("pod", "create", "dup", "--image", "busybox")[0] == 0
    code, _, err = cli("pod", "create", "dup", "--image", "busybox")
    assert code == 1 and "already exists" in err and err.count("\n") == 1


def test_projects_and_keys(server: str, cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, _ = cli("project", "create", "team-a")
    assert code == 0 and "api key" in out
    created = cli.json("project", "create", "team-b")
    monkeypatch.setenv("GPUCLOUD_API_KEY", created["key"]["key"])
    key = cli("key", "create", "--name", "ci")[1].strip()
    assert key.startswith("gpc_")
    assert sorted(k["name"] for k in cli.json("key", "list")) == ["ci", "default"]
    assert cli.json("key", "revoke", "ci")["revoked_at"]
    assert [p["name"] for p in cli.json("project", "list")] == ["team-b"]
    code, _, err = cli("project", "create", "team-c")
    assert code == 1 and err.strip() == "error: this needs an admin key"
    monkeypatch.setenv("GPUCLOUD_API_KEY", key)
    code, _, err = cli("pod", "list")
    assert code == 1 and "invalid or revoked API key" in err


def test_unreachable_server_is_one_line(cli: Cli, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    monkeypatch.setenv("GPUCLOUD_HOME", str(tmp_path))
    monkeypatch.setenv("GPUCLOUD_URL", f"http://127.0.0.1:{free_port()}")
    code, _, err = cli("pod", "list")
    assert code == 1 and "cannot reach the gpucloud server" in err and err.count("\n") == 1


def test_server_command_bootstraps_admin_key_once(tmp_path: Path) -> None:
    home = tmp_path / "home"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCLOUD_")}
    env["GPUCLOUD_HOME"] = str(home)
    command = [sys.executable, "-m", "gpucloud.cli.main", "server", "--port", str(port)]
    outputs = []
    for _ in range(2):
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        try:
            _wait_healthy(f"http://127.0.0.1:{port}", process)
        finally:
            process.terminate()
            outputs.append(process.communicate(timeout=30)[0])
    key_file = home / "admin.key"
    key = key_file.read_text().strip()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key in outputs[0] and key not in outputs[1]
    assert (home / "gpucloud.db").exists()


def _wait_healthy(url: str, process: subprocess.Popen[str]) -> None:
    """Poll /healthz until the server answers (a condition, not a fixed sleep); up to
    120 s: a server start at load 20 measured up to 80 s (600 polls were about 30 s)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError("the server exited early")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        try:
            process.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            continue
    raise AssertionError("the server never became healthy")


def test_server_refuses_a_bad_setting_in_one_line(cli: Cli, monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setenv("GPUCLOUD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GPUCLOUD_WEBHOOK_ALLOW", "127.0.0.1/32,ten")
    code, out, err = cli("server", "--port", str(free_port()))
    assert code == 1 and out == ""
    assert err.strip() == ("error: GPUCLOUD_WEBHOOK_ALLOW: 'ten' is not an IP network "
                           "(e.g. 10.0.0.0/8)")
    assert not (tmp_path / "home").exists()  # nothing written
