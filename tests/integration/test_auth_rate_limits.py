"""Rate limits on failed authentication: per key prefix and, wider, per client address on
the REST API (429 + Retry-After), a credential that passed from an address exempt there;
per address at the SSH gateway; time from a manual clock."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from gpucloud.api.app import create_app
from gpucloud.core.clock import ManualClock
from gpucloud.core.settings import Settings
from gpucloud.services.ratelimit import AuthFailureLimiter, Policy, api_keys, peer_limits
from tests.conftest import ADMIN_KEY
from tests.fixtures.openssh import OpenSsh
from tests.fixtures.postgres import free_port
from tests.fixtures.server import live_server

BURST, PER_MINUTE = 3, 6.0  # one more failure every 10 s after the burst
FACTOR = 2  # an address: 6 failures, one more every 5 s


def _limited(settings: Settings) -> Settings:
    return dataclasses.replace(settings, auth_failure_burst=BURST,
                               auth_failures_per_minute=PER_MINUTE,
                               auth_failure_address_factor=FACTOR)


@pytest.fixture
def limited_app(settings: Settings, clock: ManualClock) -> Iterator[TestClient]:
    with TestClient(create_app(_limited(settings), clock, run_controllers=False)) as client:
        yield client


def _client(app: TestClient, address: str) -> TestClient:
    """A client whose TCP peer is ``address`` (the ASGI scope's client). No ``with`` (no
    second lifespan): it sends on ``app``'s event loop, as a server's requests share one,
    instead of starting a thread and a loop for each request."""
    client = TestClient(app.app, client=(address, 40000))
    client.portal = app.portal
    return client


def _from(app: TestClient, address: str, key: str) -> httpx.Response:
    response: httpx.Response = _client(app, address).get(
        "/v1/pods", headers={"Authorization": f"Bearer {key}"})
    return response


def _guesses(count: int) -> list[str]:
    """Bad keys of as many prefixes (their first 10 characters differ)."""
    return [f"gpc_{i:06d}-wrong-guess" for i in range(count)]


def test_the_bucket_refills_with_the_clock() -> None:
    limiter, policy = AuthFailureLimiter(), Policy(BURST, PER_MINUTE)
    a, b = peer_limits("a"), peer_limits("b")
    for _ in range(BURST):
        assert limiter.retry_after(a, 100.0, policy) is None
        limiter.failed(a, 100.0, policy)
    assert limiter.retry_after(a, 100.0, policy) == pytest.approx(10.0)
    assert limiter.retry_after(a, 105.0, policy) == pytest.approx(5.0)
    assert limiter.retry_after(a, 110.0, policy) is None
    assert limiter.retry_after(b, 100.0, policy) is None  # buckets are separate


def test_an_address_bucket_is_wider_and_a_success_there_exempts_its_credential() -> None:
    limiter, policy = AuthFailureLimiter(), Policy(BURST, PER_MINUTE, FACTOR)
    good, other = api_keys("10.0.0.1", "gpc_good-key"), api_keys("10.0.0.1", "gpc_other-key")
    limiter.succeeded(good)
    for guess in _guesses(BURST * FACTOR):
        limiter.check(api_keys("10.0.0.1", guess), 100.0, policy)
        limiter.failed(api_keys("10.0.0.1", guess), 100.0, policy)
    assert limiter.retry_after(other, 100.0, policy) == pytest.approx(5.0)
    assert limiter.retry_after(good, 100.0, policy) is None
    assert limiter.retry_after(api_keys("10.0.0.2", "gpc_good-key"), 100.0, policy) is None
    limiter.failed(good, 100.0, policy)  # revoked, say: its failure forgets its success
    assert limiter.retry_after(good, 100.0, policy) is not None


def test_a_key_spinning_on_401_does_not_lock_out_its_neighbours(
        limited_app: TestClient, clock: ManualClock,
        register_node: Callable[..., dict[str, Any]]) -> None:
    """A host-network node: its agent and a pod's worker share an address, and the worker
    retries a dead key in a tight loop. The dead key alone gets 429 after its burst; the
    agent's lease renewals, its other calls and a key never seen from there pass."""
    limited_app.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
    node = register_node("n1")
    fresh = limited_app.post("/v1/keys", json={"name": "fresh"}).json()["key"]
    assert limited_app.portal is not None
    codes = limited_app.portal.call(_spin, limited_app, clock, node)
    assert codes[:BURST] == [401] * BURST and codes[BURST] == 429
    assert codes.count(401) == BURST + 59  # one more every 10 s: its own bucket's rate
    # the address's wider bucket was never emptied: a key new to it is checked as usual
    assert _from(limited_app, "10.0.0.1", fresh).status_code == 200
    assert _from(limited_app, "10.0.0.1", "gpc_a-new-wrong-key").status_code == 401


async def _spin(app: TestClient, clock: ManualClock, node: dict[str, Any]) -> list[int]:
    """Ten minutes of the spinner at 10.0.0.1, at many tries a second, beside its agent's
    calls; the spinner's statuses. Sent on the app's own event loop (2,640 requests: a
    TestClient request from the test's thread costs several thread hand-offs each)."""
    transport = httpx.ASGITransport(app.app, client=("10.0.0.1", 40000))
    spinner = {"Authorization": "Bearer gpc_revoked-key-spins"}
    agent = {"Authorization": f"Bearer {node['node_token']}"}
    renewal = {"fencing_token": node["fencing_token"]}
    codes: list[int] = []
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as host:
        assert (await host.post("/v1/agent/lease", headers=agent,
                                json=renewal)).status_code == 200
        for _ in range(120):
            codes += [(await host.get("/v1/pods", headers=spinner)).status_code
                      for _ in range(20)]
            assert (await host.post("/v1/agent/lease", headers=agent,
                                    json=renewal)).status_code == 200
            assert (await host.get("/v1/agent/assignments", headers=agent)).status_code == 200
            clock.advance(5)  # the agent renews within its 10 s lease
    return codes


def test_many_keys_from_one_address_are_still_limited(
        limited_app: TestClient, clock: ManualClock) -> None:
    """Brute force: other keys each time. The address's bucket (FACTOR times a key's)
    empties, and then every key is refused unchecked, a right one too (no oracle), except
    one that had authenticated from this address before: its caller knows it already."""
    limited_app.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
    known = limited_app.post("/v1/keys", json={"name": "known"}).json()
    unseen = limited_app.post("/v1/keys", json={"name": "unseen"}).json()["key"]
    assert _from(limited_app, "10.0.0.1", known["key"]).status_code == 200
    guesses = iter(_guesses(100))
    for _ in range(BURST * FACTOR):
        assert _from(limited_app, "10.0.0.1", next(guesses)).status_code == 401
    blocked = _from(limited_app, "10.0.0.1", next(guesses))
    assert blocked.status_code == 429 and blocked.headers["Retry-After"] == "5"
    assert "too many failed authentications" in blocked.json()["detail"]
    assert _from(limited_app, "10.0.0.1", unseen).status_code == 429
    assert _from(limited_app, "10.0.0.1", ADMIN_KEY).status_code == 429
    assert _from(limited_app, "10.0.0.1", known["key"]).status_code == 200
    assert _from(limited_app, "10.0.0.2", unseen).status_code == 200  # another address
    clock.advance(5)
    assert _from(limited_app, "10.0.0.1", unseen).status_code == 200
    assert _from(limited_app, "10.0.0.1", next(guesses)).status_code == 401
    assert _from(limited_app, "10.0.0.1", ADMIN_KEY).status_code == 429
    # a known key revoked meanwhile: checked once (401, it counts), then refused unchecked
    limited_app.post(f"/v1/keys/{known['id']}/revoke").raise_for_status()
    clock.advance(60)  # past the auth cache
    for guess in _guesses(200)[100:100 + BURST * FACTOR]:
        _from(limited_app, "10.0.0.1", guess)
    assert _from(limited_app, "10.0.0.1", known["key"]).status_code == 401
    assert _from(limited_app, "10.0.0.1", known["key"]).status_code == 429


def test_failures_for_one_key_prefix_are_limited_across_addresses(
        limited_app: TestClient) -> None:
    for i in range(BURST):
        assert _from(limited_app, f"10.1.0.{i}", f"gpc_samepfx-guess-{i}").status_code == 401
    assert _from(limited_app, "10.1.0.9", "gpc_samepfx-guess-9").status_code == 429
    assert _from(limited_app, "10.1.0.9", "gpc_otherpf-guess-9").status_code == 401


def test_node_tokens_and_join_tokens_count_too(limited_app: TestClient) -> None:
    for _ in range(BURST):
        assert limited_app.get("/v1/agent/assignments",
                               headers={"Authorization": "Bearer gpn_nope"}).status_code == 401
    assert limited_app.get("/v1/agent/assignments",
                           headers={"Authorization": "Bearer gpn_nope"}).status_code == 429
    body = {"join_token": "gpj_nope", "name": "n1", "cpu_cores": 8, "memory_bytes": 1 << 34}
    for _ in range(BURST * FACTOR - BURST):  # the address's bucket: 6 in all
        assert limited_app.post("/v1/agent/register", json=body).status_code == 401
    body["join_token"] = "gpj_other"
    refused = limited_app.post("/v1/agent/register", json=body)
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1


def test_successes_take_nothing(limited_app: TestClient) -> None:
    for _ in range(BURST * FACTOR * 5):
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
