"""`gpucloud price …`, `usage`, `invoice` and `project limit …` against a real server over
HTTP: the forms of the issue, exactly."""

from __future__ import annotations

import csv
import io

from sqlalchemy import select

from gpucloud.controllers.loops import SchedulingController
from gpucloud.core.clock import ManualClock
from gpucloud.core.models import AgentPodStatusRequest
from gpucloud.core.phases import PodPhase
from gpucloud.db.models import NodeModel
from gpucloud.services import agent
from gpucloud.services.context import ServiceContext
from tests.integration.test_cli import Cli, _register, cli, server  # noqa: F401 - fixtures


def test_prices_through_the_cli(server: str, cli: Cli) -> None:  # noqa: F811 - fixtures
    code, out, err = cli("price", "set", "H100-80GB", "--class", "on-demand",
                         "--per-gpu-hour", "3.60")
    assert code == 0, err
    assert "H100-80GB on-demand: $3.600000 per gpu-hour" in out
    assert cli.json("price", "set", "a100", "--class", "spot", "--per-gpu-hour",
                    "1.10")["model"] == "A100-40GB"
    assert cli("price", "set", "cpu", "--per-core-hour", "0.05")[0] == 0
    assert cli("price", "set", "volume", "--per-gib-month", "0.1")[0] == 0
    listed = cli.json("price", "list")
    mine = {(p["resource"], p["model"], p["price_class"]): p["price"] for p in listed
            if p["source"] == "set"}
    assert mine == {("gpu", "H100-80GB", "on-demand"): "3.600000",
                    ("gpu", "A100-40GB", "spot"): "1.100000",
                    ("cpu", None, "on-demand"): "0.050000",
                    ("volume", None, "on-demand"): "0.100000"}
    code, out, _ = cli("price", "list")
    assert code == 0 and "H100-80GB" in out and "default" in out
    for args, message in [
        (("H100-80GB", "--per-gpu-hour", "-1"), "price:"),
        (("H100-80GB", "--per-gpu-hour", "cheap"), "price:"),
        (("Z9000", "--per-gpu-hour", "1"), "model: unknown GPU model 'Z9000'"),
        (("H100-80GB", "--class", "reserved", "--per-gpu-hour", "1"), "--class"),
        (("cpu", "--per-gpu-hour", "1"), "--per-gpu-hour does not fit 'cpu'"),
        (("H100-80GB",), "missing --per-gpu-hour"),
    ]:
        code, out, err = cli("price", "set", *args)
        assert code != 0 and message in err and len(err.strip().splitlines()) == 1, (args, err)


def test_usage_invoice_and_limits_through_the_cli(  # noqa: PLR0915 - one story
        server: str, cli: Cli, ctx: ServiceContext,  # noqa: F811 - fixtures
        clock: ManualClock) -> None:
    code, token, _ = cli("node", "join-token")
    _register(server, "gpu-1", token.strip())
    # The server runs on the real clock, the pod's transitions on the test's (2026-01-01):
    # the price must be in effect from before then.
    assert cli("price", "set", "H100-80GB", "--class", "on-demand", "--per-gpu-hour",
               "3.60", "--effective", "2025-12-01")[0] == 0
    code, _, err = cli("pod", "create", "train", "--image", "busybox", "--gpus", "2",
                       "--gpu-type", "H100-80GB")
    assert code == 0, err
    SchedulingController(ctx).tick()
    pod = cli.json("pod", "get", "train")
    _report(ctx, pod["id"], "Running")
    clock.advance(10)
    _report(ctx, pod["id"], "Succeeded")

    [row] = cli.json("usage", "--by", "pod", "--since", "2025-12-31")
    assert row["pod"] == "train" and row["gpu_seconds"] == 20.0 and row["cost"] == "0.020000"
    assert "gpu_util_avg" in row and row["measured"] == ["gpu_util_avg", "cpu_seconds"]
    code, out, _ = cli("usage", "--by", "gpu-type", "--output", "csv", "--since", "2025-12-31")
    [parsed] = list(csv.DictReader(io.StringIO(out)))
    assert parsed["key"] == "H100-80GB" and parsed["cost"] == "0.020000"
    code, out, _ = cli("usage", "--since", "2025-12-31")
    assert code == 0 and "train" in out and "measured: gpu_util_avg" in out
    code, _, err = cli("usage", "--since", "last tuesday")
    assert code == 1 and err.startswith("error: --since: 'last tuesday'")
    code, _, err = cli("usage", "--by", "node")
    assert code != 0 and "--by" in err

    invoice = cli.json("invoice", "admin", "--month", "2026-01")
    assert invoice["total"] == "0.020000" and len(invoice["lines"]) == 1
    code, out, _ = cli("invoice", "admin", "--month", "2026-01")
    assert code == 0 and "GPU H100-80GB, on-demand" in out and "total $0.020000" in out
    code, _, err = cli("invoice", "admin", "--month", "2026-1x")
    assert code == 1 and err.startswith("error: month: '2026-1x' is not a month")

    assert cli("project", "create", "team")[0] == 0
    shown = cli.json("project", "limit", "set", "team", "--per-hour", "80")
    assert shown["per_hour"] == "80.000000" and shown["reserved_per_hour"] == "0.000000"
    code, out, _ = cli("project", "limit", "get", "team")
    assert code == 0 and "$80.000000" in out
    assert cli.json("project", "limit", "set", "team", "--per-hour", "none")["per_hour"] is None
    code, _, err = cli("project", "limit", "set", "team", "--per-hour", "lots")
    assert code == 1 and err.startswith("error: per_hour:")


def _report(ctx: ServiceContext, pod_id: str, phase: str) -> None:
    """The pod's agent reports a phase, as ``POST /v1/agent/pods/ID/status`` does."""
    with ctx.db.read() as session:
        node = session.scalars(select(NodeModel)).one()
        node_id, token = node.id, node.fencing_token
    agent.report_status(ctx, node_id, pod_id,
                        AgentPodStatusRequest(fencing_token=token, phase=PodPhase(phase)))
