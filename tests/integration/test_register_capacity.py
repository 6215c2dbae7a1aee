"""Registrations hold under a storm (api/register_capacity.py, issue 16): their own few
threads and a bounded queue, excess refused at once (503 + Retry-After); one that waited
longer than its agent waits is refused, or rolled back before its commit, with nothing
written; a re-registration forgets that node's cached token only, on every replica."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, select

from gpucloud.api import register_capacity
from gpucloud.api.app import create_app
from gpucloud.core.clock import ManualClock
from gpucloud.core.settings import Settings
from gpucloud.db.models import NodeModel
from gpucloud.services import nodes, notify
from gpucloud.services.context import ServiceContext, TtlCache
from tests.conftest import ADMIN_KEY
from tests.integration.conftest import agent_headers, h100_gpus


def _body(token: str, name: str) -> dict[str, Any]:
    return {"join_token": token, "name": name, "cpu_cores": 64,
            "memory_bytes": 512 * 1024**3, "gpus": h100_gpus()}


def _uses(api: TestClient, token_id: str) -> int:
    listed = {t["id"]: t for t in api.get("/v1/nodes/join-tokens").json()}
    return int(listed[token_id]["uses"])


def _node(ctx: ServiceContext, name: str) -> NodeModel | None:
    with ctx.db.read() as session:
        return session.scalar(select(NodeModel).where(NodeModel.name == name))


def _refused_busy(response: Any) -> bool:
    return bool(response.status_code == 503 and response.headers.get("Retry-After") == str(
        register_capacity.RETRY_AFTER_S))


@contextmanager
def _registration_held(api: TestClient, ctx: ServiceContext, token: str,
                       name: str) -> Iterator[register_capacity._Admission]:
    """A registration in flight on the one registration thread, held at its first
    statement (as by a slow database) until the block ends; then it completes."""
    reached, release = threading.Event(), threading.Event()

    def hold(*_args: Any) -> None:
        if not reached.is_set():  # its first statement only
            reached.set()
            release.wait(timeout=30)

    event.listen(ctx.db.engine, "before_cursor_execute", hold)
    held, answers = _in_background(
        lambda: api.post("/v1/agent/register", json=_body(token, name)))
    try:
        assert reached.wait(timeout=20), "the registration never reached the database"
        portal = api.portal
        assert portal is not None
        yield portal.call(register_capacity.admission)
    finally:
        release.set()
        held.join(timeout=20)
        event.remove(ctx.db.engine, "before_cursor_execute", hold)
    assert answers and answers[0].status_code == 201, answers[0].text


def _in_background(call: Callable[[], Any]) -> tuple[threading.Thread,
                                                                 list[Any]]:
    answers: list[Any] = []
    thread = threading.Thread(target=lambda: answers.append(call()), daemon=True)
    thread.start()
    return thread, answers


def _until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def small_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    """One registration thread and one waiting place (read when the app's loop first
    registers)."""
    monkeypatch.setattr(register_capacity, "REGISTER_THREADS", 1)
    monkeypatch.setattr(register_capacity, "REGISTER_QUEUE", 1)


@pytest.mark.usefixtures("small_capacity")
def test_registrations_beyond_the_bound_are_refused_at_once_with_retry_after(
        api: TestClient, app_ctx: ServiceContext) -> None:
    token = api.post("/v1/nodes/join-tokens", json={"uses": 5}).json()
    with _registration_held(api, app_ctx, token["token"], "q-0") as state:
        queued, answers = _in_background(
            lambda: api.post("/v1/agent/register", json=_body(token["token"], "q-1")))
        _until(lambda: state.admitted == 2, "the registration queued")
        refused = api.post("/v1/agent/register", json=_body(token["token"], "q-2"))
        assert _refused_busy(refused), refused.text  # answered while the thread is held
        assert "register again" in refused.json()["detail"]
        assert not answers  # the queued one waits for its thread
    queued.join(timeout=20)
    assert answers and answers[0].status_code == 201, answers[0].text
    assert _node(app_ctx, "q-2") is None and _uses(api, token["id"]) == 2
    assert api.post("/v1/agent/register",
                    json=_body(token["token"], "q-2")).status_code == 201
    assert state.admitted == 0


def test_slow_registrations_shorten_the_queue(
        api: TestClient, app_ctx: ServiceContext, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a registration takes long (a starved replica), no more wait than the threads
    start in time: the next is refused at once instead of left to go stale."""
    monkeypatch.setattr(register_capacity, "REGISTER_THREADS", 1)
    token = api.post("/v1/nodes/join-tokens", json={"uses": 5}).json()["token"]
    with _registration_held(api, app_ctx, token, "s-0") as state:
        assert state.queue == register_capacity.REGISTER_QUEUE > 1
        state.pace_s = register_capacity.START_WITHIN_S  # each one takes 20 s here lately
        assert state.bound() == 2  # the one running and one waiting
        queued, answers = _in_background(
            lambda: api.post("/v1/agent/register", json=_body(token, "s-1")))
        _until(lambda: state.admitted == 2, "the registration queued")
        assert _refused_busy(api.post("/v1/agent/register", json=_body(token, "s-2")))
        state.pace_s = 0.01  # fast again: many may wait
        assert state.bound() == 1 + register_capacity.REGISTER_QUEUE
    queued.join(timeout=20)
    assert answers and answers[0].status_code == 201, answers[0].text


@pytest.mark.usefixtures("small_capacity")
def test_a_registration_that_waited_past_the_agents_timeout_is_refused_writing_nothing(
        api: TestClient, app_ctx: ServiceContext, clock: ManualClock) -> None:
    token = api.post("/v1/nodes/join-tokens", json={"uses": 2}).json()
    with _registration_held(api, app_ctx, token["token"], "on-time") as state:
        queued, answers = _in_background(
            lambda: api.post("/v1/agent/register", json=_body(token["token"], "late")))
        _until(lambda: state.admitted == 2, "the registration queued")
        clock.advance(register_capacity.START_WITHIN_S + 1)  # it waits meanwhile
    queued.join(timeout=20)
    assert answers and _refused_busy(answers[0]), answers[0].text
    assert "waited" in answers[0].json()["detail"]
    assert _node(app_ctx, "late") is None  # nothing written
    assert _uses(api, token["id"]) == 1  # nor a use of the join token spent
    again = api.post("/v1/agent/register", json=_body(token["token"], "late"))
    assert again.status_code == 201, again.text


async def _register_gone(app: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A registration over raw ASGI whose client has closed its connection by the time
    the route runs (it waited past its timeout in a starved replica's accept queue):
    after the body, the server's next message is the disconnect. The messages sent."""
    payload = json.dumps(body).encode()
    messages = [{"type": "http.request", "body": payload, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/agent/register",
             "raw_path": b"/v1/agent/register", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.9", 40000), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    return sent


def test_a_registration_its_agent_gave_up_before_its_turn_writes_nothing(
        api: TestClient, app_ctx: ServiceContext) -> None:
    """Its agent gave it up and sent it again: done, it would replace the node token of
    the retry (or spend a use) for an answer nobody reads."""
    token = api.post("/v1/nodes/join-tokens", json={"uses": 5}).json()
    portal = api.portal
    assert portal is not None
    sent = portal.call(_register_gone, api.app, _body(token["token"], "gone-0"))
    start = sent[0]
    assert start["status"] == 503
    assert (b"retry-after", str(register_capacity.RETRY_AFTER_S).encode()) in start["headers"]
    assert _node(app_ctx, "gone-0") is None and _uses(api, token["id"]) == 0
    assert api.post("/v1/agent/register",
                    json=_body(token["token"], "gone-0")).status_code == 201


def test_a_re_registration_done_too_late_is_rolled_back_and_the_old_token_kept(
        api: TestClient, app_ctx: ServiceContext, clock: ManualClock) -> None:
    """Its work outlasted the agent's timeout (a slow statement): not committed, so the
    agent's retry does not find the node's token and grant replaced by a registration
    that nobody received."""
    token = api.post("/v1/nodes/join-tokens").json()["token"]
    first = api.post("/v1/agent/register", json=_body(token, "slow")).json()
    before = _node(app_ctx, "slow")
    assert before is not None

    slowed: list[bool] = []

    def slow_statement(*_args: Any) -> None:  # the first statement of the registration
        if not slowed:
            slowed.append(True)
            clock.advance(register_capacity.COMMIT_WITHIN_S + 1)

    event.listen(app_ctx.db.engine, "before_cursor_execute", slow_statement)
    try:
        late = api.post("/v1/agent/register", json=_body(token, "slow"))
    finally:
        event.remove(app_ctx.db.engine, "before_cursor_execute", slow_statement)
    assert _refused_busy(late), late.text
    after = _node(app_ctx, "slow")
    assert after is not None
    assert (after.token_hash, after.fencing_token, after.lease_expires_at) == (
        before.token_hash, before.fencing_token, before.lease_expires_at)
    renewed = api.post("/v1/agent/lease", headers=agent_headers(first),
                       json={"fencing_token": first["fencing_token"]})
    assert renewed.status_code == 200, renewed.text  # the old token and grant hold


@pytest.fixture
def postgres_only(database_url: str) -> None:
    if database_url.startswith("sqlite"):
        pytest.skip("replicas share PostgreSQL (LISTEN/NOTIFY)")


@contextmanager
def _replica(settings: Settings, clock: ManualClock, name: str) -> Iterator[TestClient]:
    """A server replica on the shared database: its own app, cache and notify bridge."""
    own = replace(settings, home=settings.home.parent / name, auth_cache_ttl_seconds=30.0)
    with TestClient(create_app(own, clock, run_controllers=False)) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        yield client


def _ctx(client: TestClient) -> ServiceContext:
    ctx: ServiceContext = client.app.state.ctx  # type: ignore[attr-defined]
    return ctx


def _listening(one: ServiceContext, other: ServiceContext) -> None:
    """Until ``other``'s bridge LISTENs (a hint sent before is lost)."""
    deadline = time.monotonic() + 20
    while True:
        other.cache.put("probe", True)
        one.cache.forget("probe")
        for _ in range(20):
            if other.cache.get("probe") is None:
                return
            time.sleep(0.01)
        assert time.monotonic() < deadline, "the other replica's bridge never listened"


def _uses_node_token(client: TestClient, registration: dict[str, Any]) -> int:
    """A route that takes the node from its token (cached): 401 once the token is not
    valid, another answer (the pod is unknown) while it is."""
    return client.post("/v1/agent/pods/no-such-pod/logs", headers=agent_headers(registration),
                       json={"fencing_token": registration["fencing_token"], "offset": 0,
                             "data": ""}).status_code


@pytest.mark.usefixtures("postgres_only")
def test_a_re_registration_forgets_only_that_nodes_token_on_every_replica(
        settings: Settings, clock: ManualClock) -> None:
    with _replica(settings, clock, "one") as one, _replica(settings, clock, "two") as two:
        ctx_one, ctx_two = _ctx(one), _ctx(two)
        _listening(ctx_one, ctx_two)
        _listening(ctx_two, ctx_one)
        token = one.post("/v1/nodes/join-tokens").json()["token"]
        restarting = one.post("/v1/agent/register", json=_body(token, "restarts")).json()
        others = [one.post("/v1/agent/register", json=_body(token, f"steady-{i}")).json()
                  for i in range(3)]
        for replica in (one, two):  # every token authenticated, so cached, on both
            for registration in [restarting, *others]:
                assert _uses_node_token(replica, registration) != 401
        for ctx in (ctx_one, ctx_two):
            assert nodes.cached_node(ctx, restarting["node_token"]) == restarting["node_id"]

        again = one.post("/v1/agent/register", json=_body(token, "restarts"))
        assert again.status_code == 201, again.text
        assert again.json()["node_id"] == restarting["node_id"]
        assert _uses_node_token(one, restarting) == 401  # at once where it registered
        _until(lambda: nodes.cached_node(ctx_two, restarting["node_token"]) is None,
               "the other replica forgetting the old token", timeout=10)
        assert _uses_node_token(two, restarting) == 401  # well inside its 30 s cache TTL
        for ctx in (ctx_one, ctx_two):  # the rest of the fleet's tokens stay cached
            for registration in others:
                assert nodes.cached_node(ctx, registration["node_token"]) == \
                    registration["node_id"]
        for replica in (one, two):
            assert _uses_node_token(replica, again.json()) != 401


@pytest.mark.usefixtures("postgres_only")
def test_forgotten_keys_cross_replicas_in_payloads_postgres_accepts(
        postgres_url: str) -> None:
    """A fleet re-registering publishes one 71-byte key per node: batched within
    NOTIFY's 8000-byte payload, none lost (200 of them are 14 KB)."""
    sent = [nodes._NODE_TOKEN + f"{i:064x}" for i in range(450)]
    publisher = notify.NotifyBridge(postgres_url, TtlCache())
    with psycopg.connect(notify._dsn(postgres_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {notify.CHANNEL}")
        publisher.start()
        try:
            for key in sent:
                publisher.cache.forget(key)
            payloads: list[str] = []
            received: set[str] = set()
            for note in listener.notifies(timeout=10.0):
                payloads.append(note.payload)
                # the bridge's own hello (HELLO, asking for follows) is not a key
                received.update(item for item in note.payload.split()
                                if item.startswith(notify.CACHE_KEY))
                if len(received) >= len(sent):
                    break
        finally:
            publisher.stop()
    assert received == {notify.CACHE_KEY + key for key in sent}
    assert max(len(p.encode()) for p in payloads) <= notify.PAYLOAD_BYTES
    receiver = TtlCache()  # a replica receiving one: that key forgotten, nothing else
    receiver.put(sent[0], "n0")
    receiver.put(sent[1], "n1")
    notify.NotifyBridge(postgres_url, receiver)._receive(notify.CACHE_KEY + sent[0])
    assert receiver.get(sent[0]) is None and receiver.get(sent[1]) == "n1"
