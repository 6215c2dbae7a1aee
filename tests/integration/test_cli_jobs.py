"""`gpucloud job …` against a real server over HTTP: the forms of the issue, exactly."""

from __future__ import annotations

import pytest

from gpucloud.controllers.loops import JobController
from gpucloud.services.context import ServiceContext
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
