"""Prices, usage, invoices and spend limits over the API, on both databases.

Pods go through their real phase transitions (agent status reports), which write the
meter's rows (``services.meter``); samples go through ``POST /v1/agent/usage``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select

from gpucloud.core.clock import ManualClock
from gpucloud.db.models import PodModel
from gpucloud.services import meter
from gpucloud.services.context import ServiceContext
from gpucloud.services.spend import enforce_credit
from tests.conftest import ADMIN_KEY
from tests.integration.conftest import agent_headers, h100_gpus

Register = Callable[..., dict[str, Any]]


def _status(api: TestClient, reg: dict[str, Any], pod_id: str, phase: str,
            **extra: Any) -> None:
    response = api.post(f"/v1/agent/pods/{pod_id}/status", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "phase": phase, **extra})
    assert response.status_code == 200, response.text


def _create(api: TestClient, name: str, gpus: float = 2, **extra: Any) -> Any:
    return api.post("/v1/pods", json={"name": name, "image": "busybox", "gpus": gpus,
                                      "gpu_type": "H100-80GB", **extra})


def _run(api: TestClient, reg: dict[str, Any], schedule: Callable[[], Any], clock: ManualClock,
         name: str, seconds: float, util: float | None = 50.0) -> str:
    """A pod created, placed, Pulling 5 s (not billed), Running ``seconds`` with samples
    at ``util`` % on each GPU, then Succeeded; returns its id."""
    created = _create(api, name)
    assert created.status_code == 201, created.text
    pod_id = str(created.json()["id"])
    schedule()
    _status(api, reg, pod_id, "Pulling")
    clock.advance(5)
    _status(api, reg, pod_id, "Running")
    uuids = api.get(f"/v1/pods/{pod_id}").json()["gpu_uuids"]
    pods = api.get("/v1/agent/assignments", headers=agent_headers(reg)).json()["pods"]
    attempt = next(int(a["attempt"]) for a in pods if a["pod_id"] == pod_id)
    samples = []
    for seq in range(1, 3):
        clock.advance(seconds / 2)
        samples.append({"pod_id": pod_id, "attempt": attempt, "seq": seq,
                        "time": clock.now().isoformat(), "cpu_seconds": 1.5 * seq,
                        "memory_bytes": 1 << 30, "memory_peak_bytes": 1 << 30,
                        "gpus": [{"uuid": u, "util_percent": util,
                                  "memory_used_bytes": 1 << 30} for u in uuids]})
    response = api.post("/v1/agent/usage", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "samples": samples})
    assert response.status_code == 200, response.text
    _status(api, reg, pod_id, "Succeeded", exit_code=0)
    return pod_id


def test_a_pod_is_billed_per_second_at_the_catalog_price(
        api: TestClient, register_node: Register, schedule: Callable[[], Any],
        clock: ManualClock) -> None:
    reg = register_node("gpu-1")
    price = api.post("/v1/prices", json={"model": "h100", "price_class": "on-demand",
                                         "price": "3.60"})
    assert price.status_code == 201, price.text
    assert price.json()["model"] == "H100-80GB" and price.json()["price"] == "3.600000"
    pod_id = _run(api, reg, schedule, clock, "train", 10)

    usage = api.get("/v1/usage", params={"by": "pod"}).json()
    [row] = usage["rows"]
    assert row["pod"] == "train" and row["pod_id"] == pod_id
    assert row["seconds"] == 10.0 and row["gpu_seconds"] == 20.0  # pulling not billed
    assert Decimal(row["cost"]) == Decimal("0.02")  # 20 GPU-s × $3.60 / 3600 s
    assert row["gpu_util_avg"] == 50.0 and row["cpu_seconds"] == 3.0
    assert "gpu_util_avg" in row["measured"] and "gpu_seconds" in row["allocated"]

    by_type = api.get("/v1/usage", params={"by": "gpu-type"}).json()["rows"]
    assert [(r["key"], r["gpu_seconds"]) for r in by_type] == [("H100-80GB", 20.0)]
    [day] = api.get("/v1/usage", params={"by": "day"}).json()["rows"]
    assert day["key"] == "2026-01-01"

    invoice = api.get("/v1/invoices/admin", params={"month": "2026-01"}).json()
    [line] = invoice["lines"]
    assert line["description"] == "GPU H100-80GB, on-demand" and line["unit"] == "gpu-hour"
    assert Decimal(line["unit_price"]) == Decimal("3.60")
    assert Decimal(line["amount"]) == Decimal("0.02")
    assert Decimal(invoice["total"]) == Decimal("0.02") == Decimal(invoice["charges"])
    empty = api.get("/v1/invoices/admin", params={"month": "2025-12"}).json()
    assert empty["lines"] == [] and Decimal(empty["total"]) == 0


def test_a_run_is_priced_at_the_gpus_it_was_given(
        api: TestClient, register_node: Register, schedule: Callable[[], Any],
        clock: ManualClock) -> None:
    """A pod that names no model pays for the node's (not $0: no model); a MIG pod pays
    its profile's price, not a whole GPU's."""
    gpus = h100_gpus(2)
    gpus[1].update(mig_capable=True, mig_mode=True)
    reg = register_node("gpu-1", gpus=gpus)
    api.post("/v1/prices", json={"model": "H100-80GB", "price": "3.60"})
    assert api.post("/v1/prices", json={"model": "H100-80GB", "mig_profile": "1g.10gb",
                                        "price": "0.72"}).status_code == 201
    ids = []
    for name, spec in (("any", {"gpus": 1}), ("slice", {"mig": "1g.10gb"})):
        created = api.post("/v1/pods", json={"name": name, "image": "busybox", **spec})
        assert created.status_code == 201, created.text
        ids.append(created.json()["id"])
    schedule()
    for pod_id in ids:
        _status(api, reg, pod_id, "Running")
    clock.advance(100)
    for pod_id in ids:
        _status(api, reg, pod_id, "Succeeded", exit_code=0)
    rows = {r["pod"]: r for r in api.get("/v1/usage", params={"by": "pod"}).json()["rows"]}
    assert Decimal(rows["any"]["cost"]) == Decimal("0.1")  # 100 s × $3.60/h
    assert Decimal(rows["slice"]["cost"]) == Decimal("0.02")  # 100 s × $0.72/h
    by_type = api.get("/v1/usage", params={"by": "gpu-type"}).json()["rows"]
    assert [r["key"] for r in by_type] == ["H100-80GB"]
    lines = api.get("/v1/invoices/admin", params={"month": "2026-01"}).json()["lines"]
    assert sorted(line["description"] for line in lines) == [
        "GPU H100-80GB MIG 1g.10gb, on-demand", "GPU H100-80GB, on-demand"]


def test_price_versions_split_a_run_and_invoices_total_exactly(
        api: TestClient, register_node: Register, schedule: Callable[[], Any],
        clock: ManualClock) -> None:
    reg = register_node("gpu-1")
    api.post("/v1/prices", json={"model": "H100-80GB", "price": "3.60"})
    # From 8 s after the pod starts running (5 s of pulling first), the price is $7.20.
    change = clock.now() + timedelta(seconds=13)
    assert api.post("/v1/prices", json={"model": "H100-80GB", "price": "7.20",
                                        "effective_at": change.isoformat()}).status_code == 201
    _run(api, reg, schedule, clock, "a", 10)  # 8 s at 3.60, 2 s at 7.20, × 2 GPUs
    invoice = api.get("/v1/invoices/admin", params={"month": "2026-01"}).json()
    amounts = sorted(Decimal(line["amount"]) for line in invoice["lines"])
    assert amounts == [Decimal("0.008"), Decimal("0.016")]
    assert Decimal(invoice["total"]) == sum(amounts) == Decimal("0.024")
    listed = api.get("/v1/prices").json()
    h100 = [p for p in listed if p["model"] == "H100-80GB" and p["price_class"] == "on-demand"]
    assert [(p["price"], p["source"]) for p in h100] == [("3.600000", "set"),
                                                           ("7.200000", "set")]
    spot = [p for p in listed if p["model"] == "H100-80GB" and p["price_class"] == "spot"]
    assert spot[0]["source"] == "default" and spot[0]["price"] == "1.79"


def test_an_attempt_ended_by_a_gpu_fault_is_credited(
        api: TestClient, app_ctx: ServiceContext, register_node: Register,
        schedule: Callable[[], Any], clock: ManualClock) -> None:
    reg = register_node("gpu-1")
    api.post("/v1/prices", json={"model": "H100-80GB", "price": "3.60"})
    created = _create(api, "faulty").json()
    schedule()
    _status(api, reg, created["id"], "Running")
    clock.advance(100)
    with app_ctx.db.transaction() as session:  # the meter's own close, as for an XID fault
        pod = session.scalars(select(PodModel).where(PodModel.id == created["id"])).one()
        meter.close_run(session, pod, clock.now(), "GpuFault")
    [row] = api.get("/v1/usage").json()["rows"]
    assert row["gpu_seconds"] == 200.0 and Decimal(row["cost"]) == 0
    assert Decimal(row["credited"]) == Decimal("0.2")
    invoice = api.get("/v1/invoices/admin", params={"month": "2026-01"}).json()
    charge, credit = invoice["lines"]
    assert charge["description"] == "GPU H100-80GB, on-demand"
    assert credit["description"].startswith("credit: GPU H100-80GB")
    assert (Decimal(charge["amount"]), Decimal(credit["amount"])) == (Decimal("0.2"),
                                                                      Decimal("-0.2"))
    assert (Decimal(invoice["charges"]), Decimal(invoice["credits"]),
            Decimal(invoice["total"])) == (Decimal("0.2"), Decimal("-0.2"), Decimal(0))


def test_a_spend_limit_refuses_a_pod_over_it(api: TestClient, app_client: TestClient,
                                             register_node: Register) -> None:
    register_node("gpu-1")
    api.post("/v1/prices", json={"model": "H100-80GB", "price": "3.60"})
    team = api.post("/v1/projects", json={"name": "team"}).json()
    limit = api.put("/v1/projects/team/spend-limit", json={"per_hour": "10"})
    assert limit.status_code == 200, limit.text
    assert limit.json()["per_hour"] == "10.000000"
    user = TestClient(app_client.app, headers={"Authorization": f"Bearer {team['key']['key']}"})
    assert _create(user, "two", gpus=2).status_code == 201  # $7.20/h reserved
    refused = _create(user, "one-more", gpus=1)  # 7.20 + 3.60 > 10
    assert refused.status_code == 409
    detail = refused.json()["detail"]
    assert "spend limit" in detail and "$10.00/h" in detail and "$7.20/h" in detail
    assert "$3.60/h" in detail
    assert [p["name"] for p in user.get("/v1/pods").json()] == ["two"]  # nothing half-written
    assert user.get("/v1/projects/team/spend-limit").json()["reserved_per_hour"] == "7.200000"
    # Not the user's to change; cleared by the admin, the pod is admitted.
    assert user.put("/v1/projects/team/spend-limit", json={"per_hour": None}).status_code == 403
    assert api.put("/v1/projects/team/spend-limit", json={"per_hour": None}).status_code == 200
    assert _create(user, "one-more", gpus=1).status_code == 201


def test_prepaid_credit_runs_out_and_its_pods_are_stopped_with_notice(
        api: TestClient, app_client: TestClient, app_ctx: ServiceContext,
        register_node: Register, schedule: Callable[[], Any], clock: ManualClock) -> None:
    reg = register_node("gpu-1")
    api.post("/v1/prices", json={"model": "H100-80GB", "price": "3.60"})
    team = api.post("/v1/projects", json={"name": "team"}).json()
    user = TestClient(app_client.app, headers={"Authorization": f"Bearer {team['key']['key']}"})
    assert api.put("/v1/projects/team/spend-limit", json={"credit": "0.01"}).status_code == 200
    pod = _create(user, "burn", gpus=1).json()
    schedule()
    _status(api, reg, pod["id"], "Running")
    clock.advance(5)  # $0.005 of $0.01
    assert enforce_credit(app_ctx) == []
    clock.advance(5)  # $0.01: spent
    assert enforce_credit(app_ctx) == ["burn"]
    stopped = user.get("/v1/pods/burn").json()
    assert stopped["desired_state"] == "stopped"
    events = [e["reason"] for e in user.get("/v1/pods/burn/events").json()]
    assert "CreditExhausted" in events and "PreemptionNotice" in events
    assignment = api.get("/v1/agent/assignments", headers=agent_headers(reg)).json()["pods"]
    [notice] = [a["stop_notice"] for a in assignment if a["pod_id"] == pod["id"]]
    assert notice["reason"] == "credit"
    refused = _create(user, "again", gpus=1)
    assert refused.status_code == 409 and "prepaid credit exhausted" in refused.json()["detail"]
    shown = user.get("/v1/projects/team/spend-limit").json()
    assert Decimal(shown["balance"]) == 0 and Decimal(shown["spent_since_credit"]) == Decimal(
        "0.01")


def test_bad_prices_months_and_times_are_refused_naming_the_field(
        api: TestClient, app_client: TestClient) -> None:
    for body, field in [
        ({"model": "H100-80GB", "price": "-1"}, "price"),
        ({"model": "H100-80GB", "price": "abc"}, "price"),
        ({"model": "H100-80GB", "price": "1.0000001"}, "price"),
        ({"model": "Z9000", "price": "1"}, "model"),
        ({"price": "1"}, "model"),
        ({"model": "T4", "mig_profile": "1g.5gb", "price": "1"}, "mig_profile"),
        ({"model": "H100-80GB", "mig_profile": "big", "price": "1"}, "mig_profile"),
        ({"model": "H100-80GB", "price_class": "cheap", "price": "1"}, "price_class"),
        ({"resource": "cpu", "model": "H100-80GB", "price": "1"}, "model"),
    ]:
        response = api.post("/v1/prices", json=body)
        assert response.status_code == 422, (body, response.text)
        assert response.json()["field"] == field, (body, response.json())
    assert api.get("/v1/prices").json() == [p for p in api.get("/v1/prices").json()
                                            if p["source"] == "default"]
    for month in ("2026-13", "2026/01", "dec", "1969-12"):
        response = api.get("/v1/invoices/admin", params={"month": month})
        assert response.status_code == 422 and response.json()["field"] == "month", month
    assert api.get("/v1/usage", params={"since": "yesterday"}).json()["field"] == "since"
    assert api.get("/v1/usage", params={"by": "node"}).json()["field"] == "by"
    response = api.put("/v1/projects/admin/spend-limit", json={"per_hour": "-5"})
    assert response.status_code == 422 and response.json()["field"] == "per_hour"
    anonymous = app_client.get("/v1/prices", headers={"Authorization": f"Bearer x{ADMIN_KEY}"})
    assert anonymous.status_code == 401
