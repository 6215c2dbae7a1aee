"""`gpucloud job …` against a real server over HTTP: the forms of the issue, exactly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gpucloud.cli import job as job_cli
from gpucloud.cli.common import FOLLOW_POLL_SECONDS
from gpucloud.controllers.loops import JobController
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import h100_gpus
from tests.integration.test_cli import Cli, _register, cli, server  # noqa: F401 - fixtures


def test_job_lifecycle_through_the_cli(server: str, cli: Cli,  # noqa: F811 - fixtures
                                       ctx: ServiceContext) -> None:
    token = cli("node", "join-token")[1].strip()
    for name in ("a", "b", "c"):
        _register(server, name, token)
    code, out, err = cli("job", "create", "train", "--nodes", "2", "--gpus-per-node", "8",
                         "--topology", "same-rack", "--priority-class", "batch",
                         "--max-restarts", "2", "--ready-timeout", "120",
                         "--image", "busybox", "--", "torchrun", "train.py")
    assert code == 0, err
    assert "train" in out and "2 members" in out
    job = cli.json("job", "get", "train")
    assert job["command"] == ["torchrun", "train.py"] and job["topology"] == "same-rack"
    assert (job["priority_class"], job["max_restarts"], job["ready_timeout"]) == (
        "batch", 2, 120)
    JobController(ctx).tick()
    assert cli("job", "why", "train")[1].strip() == (
        "needs 2 nodes with 8 free GPUs each in one rack (same-rack); at most 0 fit in one "
        "rack")
    [listed] = cli.json("job", "list")
    assert listed["name"] == "train" and listed["phase"] == "Pending"
    assert "train-1" in cli("job", "get", "train")[1]
    assert cli.json("job", "logs", "train")["text"] == ""
    assert cli.json("job", "stop", "train")["phase"] == "Stopped"
    code, out, _ = cli("job", "delete", "train")
    assert code == 0 and "deleted" in out
    code, _, err = cli("job", "get", "train")
    assert code == 1 and err.strip() == "error: job 'train' not found"


@pytest.mark.parametrize(("args", "message"), [
    (["--nodes", "0"], "nodes:"),
    (["--topology", "same-room"], "topology:"),
    (["--priority-class", "urgent"], "priority_class:"),
    (["--ready-timeout", "0"], "ready_timeout:"),
])
def test_bad_job_input_is_one_line(server: str, cli: Cli,  # noqa: F811 - fixtures
                                   args: list[str], message: str) -> None:
    code, _, err = cli("job", "create", "ok", "--image", "busybox", *args)
    assert code == 1 and err.startswith("error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_max_duration_through_the_cli(server: str, cli: Cli) -> None:  # noqa: F811 - fixtures
    code, _, err = cli("pod", "create", "web", "--image", "busybox", "--max-duration", "2h")
    assert code == 0, err
    assert cli.json("pod", "get", "web")["max_duration"] == 7200
    code, _, err = cli("job", "create", "train", "--nodes", "2", "--gpus-per-node", "1",
                       "--max-duration", "90", "--image", "busybox")
    assert code == 0, err
    assert cli.json("job", "get", "train")["max_duration"] == 90
    shown = [line.split() for line in cli("job", "get", "train")[1].splitlines()]
    assert ["max", "duration:", "90s"] in shown
    code, _, err = cli("pod", "create", "bad", "--image", "busybox", "--max-duration", "soon")
    assert code == 1 and "max_duration:" in err and len(err.strip().splitlines()) == 1


class _Member:
    """A job member as its node's agent sees it: ships log chunks and reports phases."""

    def __init__(self, url: str, node: dict[str, Any], assignment: dict[str, Any]) -> None:
        self.url, self.node, self.assignment = url, node, assignment
        self.offset = 0

    def _post(self, what: str, body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(
            f"{self.url}/v1/agent/pods/{self.assignment['pod_id']}/{what}",
            headers={"Authorization": f"Bearer {self.node['node_token']}"},
            json={"fencing_token": self.node["fencing_token"],
                  "attempt": self.assignment["attempt"], **body})
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def ship(self, data: str) -> None:
        self.offset = int(self._post("logs", {"offset": self.offset, "data": data})
                          ["next_offset"])

    def ready(self) -> None:
        self._post("ready", {})

    def report(self, phase: str, **extra: Any) -> None:
        self._post("status", {"phase": phase, **extra})


def _running_job(url: str, run: Cli, ctx: ServiceContext) -> list[_Member]:
    """A 2-member job ``train`` placed, past its start barrier, both members Running."""
    token = run("node", "join-token")[1].strip()
    nodes = {}
    for name in ("a", "b"):
        response = httpx.post(f"{url}/v1/agent/register", json={
            "join_token": token, "name": name, "cpu_cores": 64, "memory_bytes": 512 * 1024**3,
            "gpus": h100_gpus(8)})
        response.raise_for_status()
        nodes[name] = response.json()
    code, _, err = run("job", "create", "train", "--nodes", "2", "--gpus-per-node", "8",
                       "--image", "busybox", "--", "torchrun", "train.py")
    assert code == 0, err
    JobController(ctx).tick()
    members = []
    for member in run.json("job", "get", "train")["members"]:
        node = nodes[member["node"]]
        pods = httpx.get(f"{url}/v1/agent/assignments",
                         headers={"Authorization": f"Bearer {node['node_token']}"}).json()
        [assignment] = pods["pods"]
        members.append(_Member(url, node, assignment))
        members[-1].ready()
    JobController(ctx).tick()
    for member in members:
        member.report("Running")
    assert run.json("job", "get", "train")["phase"] == "Running"
    return members


def _script(monkeypatch: pytest.MonkeyPatch,
            steps: list[Callable[[], None]]) -> list[float]:
    """Make follow mode's pause run the next step instead of sleeping; returns the pauses."""
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        assert steps, "follow mode went on polling after the job had ended"
        steps.pop(0)()

    monkeypatch.setattr(job_cli, "pause", pause)
    return pauses


def test_job_logs_follow_prints_whole_new_lines_until_the_job_ends(
        server: str, cli: Cli, ctx: ServiceContext,  # noqa: F811 - fixtures
        monkeypatch: pytest.MonkeyPatch) -> None:
    rank0, rank1 = _running_job(server, cli, ctx)
    rank0.ship("loading\n")
    rank1.ship("warming")

    def more_output() -> None:
        rank1.ship(" up\nstep")
        rank0.ship("epoch 1\n")

    def the_job_ends() -> None:
        for member in (rank0, rank1):
            member.report("Succeeded", exit_code=0)
        JobController(ctx).tick()

    pauses = _script(monkeypatch, [more_output, the_job_ends])
    code, out, err = cli("job", "logs", "train", "--follow")
    assert (code, err) == (0, "")
    assert out == "[0] loading\n" "[0] epoch 1\n[1] warming up\n" "[1] step\n"
    assert pauses == [FOLLOW_POLL_SECONDS] * 2
    assert cli("job", "logs", "train", "-f", "--tail", "1")[1] == "[0] epoch 1\n[1] step\n"


def test_job_logs_follow_stops_quietly_on_ctrl_c(
        server: str, cli: Cli, ctx: ServiceContext,  # noqa: F811 - fixtures
        monkeypatch: pytest.MonkeyPatch) -> None:
    rank0, _ = _running_job(server, cli, ctx)
    rank0.ship("step 1\nstep 2\nstep")

    def interrupt() -> None:
        raise KeyboardInterrupt

    _script(monkeypatch, [interrupt])
    code, out, err = cli("job", "logs", "train", "-f", "--tail", "1")
    assert (code, out, err) == (130, "[0] step 2\n", "")


def test_job_logs_tail_json_and_bad_options(
        server: str, cli: Cli, ctx: ServiceContext) -> None:  # noqa: F811 - fixtures
    rank0, rank1 = _running_job(server, cli, ctx)
    rank0.ship("a\nb\nc")
    rank1.ship("x\n")
    assert cli("job", "logs", "train") == (0, "[0] a\n[0] b\n[0] c\n[1] x\n", "")
    assert cli("job", "logs", "train", "--tail", "1")[1] == "[0] c\n[1] x\n"
    shown = cli.json("job", "logs", "train", "--tail", "2")
    assert (shown["text"], shown["finished"]) == ("[0] b\n[0] c\n[1] x\n", False)
    assert shown["offsets"] == "0:1:5,1:1:2"
    code, _, err = cli("job", "logs", "train", "-f", "--output", "json")
    assert code == 1 and err.startswith("error: --follow") and len(err.splitlines()) == 1
    code, _, err = cli("job", "logs", "train", "--tail", "-1")
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1
    code, _, err = cli("job", "logs", "nope", "-f")
    assert (code, err) == (1, "error: job 'nope' not found\n")


def test_job_events_through_the_cli(server: str, cli: Cli,  # noqa: F811 - fixtures
                                    ctx: ServiceContext) -> None:
    _, rank1 = _running_job(server, cli, ctx)
    rank1.report("Failed", exit_code=3)
    events = cli.json("job", "events", "train")
    assert [(e["rank"], e["reason"]) for e in events if e["to_phase"] == "Failed"] == [
        (1, "Error (exit code 3)")]
    assert {e["pod"] for e in events} == {"train-0", "train-1"}
    code, out, _ = cli("job", "events", "train")
    header, *rows = out.splitlines()
    assert header.split() == ["TIME", "RANK", "FROM", "TO", "REASON", "MESSAGE"]
    assert len(rows) >= len(events)  # long messages may wrap
    wanted = ["1", "Running", "Failed", "Error"]  # rank, from, to, reason (time may wrap)
    assert any(" ".join(wanted) in " ".join(row.split()) for row in rows)
    code, _, err = cli("job", "events", "nope")
    assert (code, err) == (1, "error: job 'nope' not found\n")
