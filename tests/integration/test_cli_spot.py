"""`gpucloud pod create --spot …` and `gpucloud node drain/undrain` against a real server
over HTTP: the forms of issue 10, exactly; bad input is one line naming the field.

The node's agent is played by the test (its registration, assignments and reports over
HTTP); the scheduler and the drain controller are ticked."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gpucloud.controllers.loops import SchedulingController
from gpucloud.services import drain
from gpucloud.services.context import ServiceContext
from tests.conftest import ADMIN_KEY
from tests.integration.conftest import h100_gpus
from tests.integration.test_cli import Cli, cli, server  # noqa: F401 - fixtures


def _register(url: str, name: str, token: str) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/agent/register", json={
        "join_token": token, "name": name, "cpu_cores": 64, "memory_bytes": 512 * 1024**3,
        "gpus": h100_gpus(8)})
    response.raise_for_status()
    registration: dict[str, Any] = response.json()
    return registration


def _headers(registration: dict[str, Any]) -> dict[str, str]:
    return {"Authorization": f"Bearer {registration['node_token']}"}


def _stop_what_is_stopped(url: str, registration: dict[str, Any]) -> list[str]:
    """The node's agent: report every pod it is told to stop as Stopped (exit 75)."""
    answer = httpx.get(f"{url}/v1/agent/assignments", headers=_headers(registration)).json()
    stopped = []
    for pod in answer["pods"]:
        if pod["desired_state"] == "stopped":
            httpx.post(f"{url}/v1/agent/pods/{pod['pod_id']}/status",
                       headers=_headers(registration),
                       json={"fencing_token": answer["fencing_token"], "phase": "Stopped",
                             "attempt": pod["attempt"], "exit_code": 75}).raise_for_status()
            stopped.append(pod["name"])
    return stopped


def _run_scheduled(url: str, registration: dict[str, Any]) -> None:
    answer = httpx.get(f"{url}/v1/agent/assignments", headers=_headers(registration)).json()
    for pod in answer["pods"]:
        if pod["phase"] == "Scheduled":
            httpx.post(f"{url}/v1/agent/pods/{pod['pod_id']}/status",
                       headers=_headers(registration),
                       json={"fencing_token": answer["fencing_token"], "phase": "Running",
                             "attempt": pod["attempt"]}).raise_for_status()


def test_spot_pod_and_job_options_through_the_cli(server: str, cli: Cli) -> None:  # noqa: F811
    code, out, err = cli("pod", "create", "train", "--image", "busybox", "--gpus", "1",
                         "--spot", "--bid", "1.20", "--grace", "45", "--checkpoint-dir",
                         "/ckpt", "--restart", "always", "--", "sh", "-c", "train")
    assert code == 0, err
    assert "train" in out
    pod = cli.json("pod", "get", "train")
    assert (pod["spot"], pod["bid"], pod["grace"], pod["priority_class"]) == (
        True, 1.2, 45, "spot")
    assert (pod["checkpoint_dir"], pod["restart"], pod["command"]) == (
        "/ckpt", "always", ["sh", "-c", "train"])
    assert (pod["preemptions"], pod["last_preemption_reason"], pod["time_lost_seconds"]) \
        == (0, None, 0)
    shown = cli("pod", "get", "train")[1]
    assert "spot" in shown and "/ckpt" in shown
    code, _, err = cli("job", "create", "big", "--nodes", "2", "--gpus-per-node", "8",
                       "--spot", "--checkpoint-dir", "/ckpt", "--image", "busybox", "--",
                       "python", "train.py")
    assert code == 0, err
    job = cli.json("job", "get", "big")
    assert (job["spot"], job["checkpoint_dir"], job["priority_class"]) == (
        True, "/ckpt", "spot")


@pytest.mark.parametrize(("args", "field"), [
    (["--checkpoint-dir", "ckpt"], "checkpoint_dir"),
    (["--checkpoint-dir", "/ckpt/../etc"], "checkpoint_dir"),
    (["--bid", "1.5"], "bid"),
    (["--spot", "--bid", "-1"], "bid"),
    (["--spot", "--priority-class", "on-demand"], "priority_class"),
    (["--spot", "--grace", "-1"], "grace"),
    (["--priority-class", "urgent"], "priority_class"),
    (["--checkpoint-dir", "/ckpt", "--checkpoint-signal", "SIGNOPE"], "checkpoint_signal"),
    (["--checkpoint", "sometimes"], "checkpoint"),
    (["--checkpoint", "transparent"], "checkpoint"),  # no node has the capability
])
def test_bad_spot_and_checkpoint_input_is_a_422_in_one_line(
        server: str, cli: Cli, args: list[str], field: str) -> None:  # noqa: F811
    for kind, sized in (("pod", ["--gpus", "0"]), ("job", ["--nodes", "1"])):
        code, _, err = cli(kind, "create", "bad", "--image", "busybox", *sized, *args)
        assert code == 1 and err.startswith("error: ") and f"{field}:" in err, (kind, err)
        assert len(err.strip().splitlines()) == 1
        response = httpx.post(f"{server}/v1/{kind}s", json=_body(kind, args),
                              headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert response.status_code == 422 and response.json()["field"] == field, (
            kind, response.text)
    assert cli.json("pod", "list") == [] and cli.json("job", "list") == []


_OPTION_FIELDS = {"--checkpoint-dir": "checkpoint_dir", "--bid": "bid", "--grace": "grace",
                  "--priority-class": "priority_class",
                  "--checkpoint-signal": "checkpoint_signal", "--checkpoint": "checkpoint"}


def _body(kind: str, args: list[str]) -> dict[str, Any]:
    """The same request as JSON (REST)."""
    body: dict[str, Any] = {"name": "bad", "image": "busybox"}
    body.update({"gpus": 0} if kind == "pod" else {"nodes": 1})
    rest = list(args)
    while rest:
        option = rest.pop(0)
        if option == "--spot":
            body["spot"] = True
            continue
        value: Any = rest.pop(0)
        if option in ("--bid", "--grace"):
            value = float(value)
        body[_OPTION_FIELDS[option]] = value
    return body


def test_node_drain_and_undrain_through_the_cli(server: str, cli: Cli,  # noqa: F811
                                                ctx: ServiceContext) -> None:
    token = cli("node", "join-token")[1].strip()
    a, b = _register(server, "a", token), _register(server, "b", token)
    for name in ("p1", "p2"):
        assert cli("pod", "create", name, "--image", "busybox", "--gpus", "8")[0] == 0
    SchedulingController(ctx).tick()
    _run_scheduled(server, a)
    _run_scheduled(server, b)
    on_a = [p["name"] for p in cli.json("pod", "list") if p["node"] == "a"]
    assert len(on_a) == 1

    code, _, err = cli("node", "drain", "a", "--deadline", "soon")
    assert code == 1 and err.startswith("error: deadline:") and len(err.splitlines()) == 1
    code, _, err = cli("node", "drain", "nowhere")
    assert code == 1 and err.strip() == "error: node 'nowhere' not found"
    code, out, err = cli("node", "drain", "a", "--deadline", "10m")
    assert code == 0, err
    assert out.strip().startswith(f"node a Draining: draining: 1 of 1 pods left ({on_a[0]})")
    node = cli.json("node", "get", "a")
    assert (node["status"], node["cordoned"], node["drain"]["pods_left"]) == (
        "Draining", True, 1)
    shown = [line.split(None, 1) for line in cli("node", "get", "a")[1].splitlines()]
    assert ["status:", "Draining"] in shown

    assert _stop_what_is_stopped(server, a) == on_a  # the agent: noticed, stopped
    drain.tick(ctx)
    node = cli.json("node", "get", "a")
    assert (node["status"], node["drain"]["pods_left"]) == ("Drained", 0), node
    assert "drained at" in cli("node", "get", "a")[1]
    moved = cli.json("pod", "get", on_a[0])
    assert (moved["phase"], moved["last_preemption_reason"], moved["preemptions"]) == (
        "Pending", "drain", 1)

    code, out, err = cli("node", "undrain", "a")
    assert code == 0 and out.strip() == "node a undrained (Ready)", err
    node = cli.json("node", "get", "a")
    assert (node["status"], node["cordoned"], node["drain"]) == ("Ready", False, None)
