"""Rate limits on failed authentication: per client address and per key prefix on the
REST API (429 + Retry-After), per address at the SSH gateway; time from a manual clock."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from gpucloud.api.app import create_app
from gpucloud.core.clock import ManualClock
from gpucloud.core.settings import Settings
from gpucloud.services.ratelimit import AuthFailureLimiter, Policy
from tests.conftest import ADMIN_KEY
from tests.fixtures.openssh import OpenSsh
from tests.fixtures.postgres import free_port
from tests.fixtures.server import live_server

BURST, PER_MINUTE = 3, 6.0  # one more failure every 10 s after the burst


def _limited(settings: Settings) -> Settings:
    return dataclasses.replace(settings, auth_failure_burst=BURST,
                               auth_failures_per_minute=PER_MINUTE)


@pytest.fixture
def limited_app(settings: Settings, clock: ManualClock) -> Iterator[TestClient]:
    with TestClient(create_app(_limited(settings), clock, run_controllers=False)) as client:
        yield client


def _from(app: TestClient, address: str, key: str) -> httpx.Response:
    """A request whose TCP peer is ``address`` (the ASGI scope's client)."""
    other = TestClient(app.app, client=(address, 40000))  # no `with`: no second lifespan
    response: httpx.Response = other.get("/v1/pods",
                                         headers={"Authorization": f"Bearer {key}"})
    return response


def test_the_bucket_refills_with_the_clock() -> None:
    limiter, policy = AuthFailureLimiter(), Policy(BURST, PER_MINUTE)
    for _ in range(BURST):
        assert limiter.retry_after(["a"], 100.0, policy) is None
        limiter.failed(["a"], 100.0, policy)
    assert limiter.retry_after(["a"], 100.0, policy) == pytest.approx(10.0)
    assert limiter.retry_after(["a"], 105.0, policy) == pytest.approx(5.0)
    assert limiter.retry_after(["a"], 110.0, policy) is None
    assert limiter.retry_after(["b"], 100.0, policy) is None  # buckets are separate


def test_failures_from_one_address_get_429_with_retry_after(
        limited_app: TestClient, clock: ManualClock) -> None:
    for _ in range(BURST):
        assert _from(limited_app, "10.0.0.1", "gpc_wrongwrongwrong").status_code == 401
    blocked = _from(limited_app, "10.0.0.1", "gpc_otherotherother")
    assert blocked.status_code == 429 and blocked.headers["Retry-After"] == "10"
    assert "too many failed authentications" in blocked.json()["detail"]
    # while blocked even the right key is refused (no oracle); another address is fine
    assert _from(limited_app, "10.0.0.1", ADMIN_KEY).status_code == 429
    assert _from(limited_app, "10.0.0.2", ADMIN_KEY).status_code == 200
    clock.advance(10)
    assert _from(limited_app, "10.0.0.1", ADMIN_KEY).status_code == 200
    assert _from(limited_app, "10.0.0.1", "gpc_wrongwrongwrong").status_code == 401
    assert _from(limited_app, "10.0.0.1", ADMIN_KEY).status_code == 429


def test_failures_for_one_key_prefix_are_limited_across_addresses(
        limited_app: TestClient) -> None:
    for i in range(BURST):
        assert _from(limited_app, f"10.1.0.{i}", f"gpc_samepfx-guess-{i}").status_code == 401
    assert _from(limited_app, "10.1.0.9", "gpc_samepfx-guess-9").status_code == 429
    assert _from(limited_app, "10.1.0.9", "gpc_otherpf-guess-9").status_code == 401


def test_node_tokens_and_join_tokens_count_too(limited_app: TestClient) -> None:
    for _ in range(2):
        assert limited_app.get("/v1/agent/assignments",
                               headers={"Authorization": "Bearer gpn_nope"}).status_code == 401
    body = {"join_token": "gpj_nope", "name": "n1", "cpu_cores": 8, "memory_bytes": 1 << 34}
    assert limited_app.post("/v1/agent/register", json=body).status_code == 401
    refused = limited_app.post("/v1/agent/register", json=body)
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1


def test_successes_take_nothing(limited_app: TestClient) -> None:
    for _ in range(BURST * 5):
        assert _from(limited_app, "10.2.0.1", ADMIN_KEY).status_code == 200


def test_the_ssh_gateway_limits_refused_keys_per_address(
        settings: Settings, tmp_path: Path) -> None:
    clock = ManualClock()
    port = free_port()
    with live_server(dataclasses.replace(_limited(settings), ssh_port=port), clock,
                     run_controllers=False) as url:
        admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        user = OpenSsh.for_gateway(settings.home, tmp_path, port, "user")
        stranger = OpenSsh.for_gateway(settings.home, tmp_path, port, "stranger")
        admin.post("/v1/ssh-keys", json={"public_key": user.public_key}).raise_for_status()
        admin.post("/v1/pods", json={"name": "dev", "image": "busybox",
                                     "command": ["true"]}).raise_for_status()
        # the pod is Pending: a login that passes auth gets one line and exit status 1
        assert user.run(user.ssh("dev", "true")).returncode == 1
        for _ in range(BURST):
            assert stranger.run(stranger.ssh("dev", "true")).returncode == 255
        denied = user.run(user.ssh("dev", "true"))
        assert denied.returncode == 255 and b"Permission denied" in denied.stderr
        clock.advance(10)
        assert user.run(user.ssh("dev", "true")).returncode == 1
        admin.close()
