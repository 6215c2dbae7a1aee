"""The serverless queue on both databases (manual clock): leases, one worker per
request under concurrent takes, lapsed leases retried up to max-retries, execution
timeouts and the stop channel, cancel, purge, retention, worker idle marks, stream
chunks, queue stats, and webhooks POSTed to a local HTTP server with retries."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest
from sqlalchemy import select, update

from gpucloud.core.clock import ManualClock
from gpucloud.core.egress import EgressPolicy, parse_networks
from gpucloud.core.errors import InvalidInput, NotFound
from gpucloud.core.models import PodCreateRequest
from gpucloud.core.serverless import EndpointCreateRequest
from gpucloud.db.models import EndpointRequestModel, PodEventModel, PodModel
from gpucloud.services import endpoints, pods
from gpucloud.services import serverless_queue as q
from gpucloud.services.context import ServiceContext
from gpucloud.services.projects import Principal, authenticate
from tests.conftest import ADMIN_KEY


@pytest.fixture
def admin(app_ctx: ServiceContext) -> Principal:
    return authenticate(app_ctx, ADMIN_KEY)


@pytest.fixture
def endpoint(app_ctx: ServiceContext, admin: Principal) -> str:
    return endpoints.create_endpoint(app_ctx, admin, EndpointCreateRequest(
        name="echo", image="registry.local/echo:1", max_retries=1,
        execution_timeout="120s")).id


def worker(ctx: ServiceContext, caller: Principal, endpoint_id: str, name: str) -> str:
    """A running worker pod of the endpoint (as the autoscaler makes them)."""
    pod = pods.create_pod(ctx, caller, PodCreateRequest(name=name, image="registry.local/e:1"))
    with ctx.db.transaction() as session:
        session.execute(update(PodModel).where(PodModel.id == pod.id).values(
            endpoint_id=endpoint_id, phase="Running"))
    return pod.id


def submit(ctx: ServiceContext, caller: Principal, endpoint_id: str, n: int,
           **body: Any) -> list[str]:
    return [q.submit(ctx, caller, endpoint_id, {"input": {"n": i}, **body}, sync=False)["id"]
            for i in range(n)]


def row(ctx: ServiceContext, request_id: str) -> EndpointRequestModel:
    with ctx.db.read() as session:
        found = session.get(EndpointRequestModel, request_id)
        assert found is not None
        session.expunge(found)
        return found


def idle_since(ctx: ServiceContext, pod_id: str) -> Any:
    with ctx.db.read() as session:
        return session.scalar(select(PodModel.worker_idle_since).where(PodModel.id == pod_id))


def test_take_leases_the_oldest_to_one_worker(app_ctx: ServiceContext, admin: Principal,
                                              endpoint: str) -> None:
    ids = submit(app_ctx, admin, endpoint, 3)
    w1, w2 = (worker(app_ctx, admin, endpoint, name) for name in ("w1", "w2"))
    first = q.take(app_ctx, endpoint, w1, batch_size=2)
    assert [job["id"] for job in first] == ids[:2]
    assert first[0]["input"] == {"n": 0}
    assert [job["id"] for job in q.take(app_ctx, endpoint, w2, 5)] == ids[2:]
    assert q.take(app_ctx, endpoint, w2) == []
    taken = row(app_ctx, ids[0])
    assert (taken.status, taken.worker_pod_id) == ("IN_PROGRESS", w1)
    assert taken.lease_expires_at == app_ctx.clock.now() + timedelta(seconds=q.LEASE_SECONDS)
    stats = q.queue_stats(app_ctx)[endpoint]
    assert (stats.in_queue, stats.in_progress, stats.in_flight) == (0, 3, {w1: 2, w2: 1})


def test_concurrent_takes_never_share_a_request(app_ctx: ServiceContext, admin: Principal,
                                                endpoint: str) -> None:
    ids = submit(app_ctx, admin, endpoint, 12)
    names = [worker(app_ctx, admin, endpoint, f"w{i}") for i in range(6)]
    barrier = threading.Barrier(len(names))

    def drain(pod_id: str) -> list[str]:
        barrier.wait()
        got: list[str] = []
        while jobs := q.take(app_ctx, endpoint, pod_id, 2):
            got += [job["id"] for job in jobs]
        return got

    with ThreadPoolExecutor(len(names)) as pool:
        results = list(pool.map(drain, names))
    flat = [request_id for got in results for request_id in got]
    assert sorted(flat) == sorted(ids)  # every request once, none twice


def test_lapsed_lease_is_retried_then_fails(app_ctx: ServiceContext, clock: ManualClock,
                                            admin: Principal, endpoint: str) -> None:
    (request_id,) = submit(app_ctx, admin, endpoint, 1)
    w1 = worker(app_ctx, admin, endpoint, "w1")
    q.take(app_ctx, endpoint, w1)
    clock.advance(q.LEASE_SECONDS - 1)
    assert q.renew(app_ctx, w1, [request_id]) == 1  # a ping keeps it
    clock.advance(q.LEASE_SECONDS - 1)
    assert q.expire(app_ctx) == 0
    clock.advance(2)
    assert q.expire(app_ctx) == 1
    again = row(app_ctx, request_id)
    assert (again.status, again.retries, again.worker_pod_id) == ("IN_QUEUE", 1, None)
    assert q.finish(app_ctx, w1, request_id, {"output": "late"}) is False  # not its any more
    q.take(app_ctx, endpoint, w1)
    clock.advance(q.LEASE_SECONDS + 1)
    q.expire(app_ctx)  # max_retries is 1: the second loss fails it
    failed = row(app_ctx, request_id)
    assert failed.status == "FAILED" and "max retries 1" in (failed.error or "")
    assert q.status(app_ctx, admin, endpoint, request_id)["retries"] == 1


def test_a_gone_worker_requeues_at_once(app_ctx: ServiceContext, admin: Principal,
                                        endpoint: str) -> None:
    ids = submit(app_ctx, admin, endpoint, 2)
    w1 = worker(app_ctx, admin, endpoint, "w1")
    q.take(app_ctx, endpoint, w1, 2)
    pods.delete_pod(app_ctx, admin, w1)
    assert q.expire(app_ctx) == 2
    assert {row(app_ctx, i).status for i in ids} == {"IN_QUEUE"}
    assert q.take(app_ctx, endpoint, w1) == []  # a deleted worker takes nothing more


def test_execution_timeout_and_the_stop_channel(app_ctx: ServiceContext, clock: ManualClock,
                                                admin: Principal, endpoint: str) -> None:
    (slow,) = submit(app_ctx, admin, endpoint, 1)
    (short,) = submit(app_ctx, admin, endpoint, 1, policy={"executionTimeout": 5000})
    w1 = worker(app_ctx, admin, endpoint, "w1")
    q.take(app_ctx, endpoint, w1, 2)
    clock.advance(6)
    q.renew(app_ctx, w1, [slow, short])
    assert q.expire(app_ctx) == 1
    assert row(app_ctx, short).status == "TIMED_OUT"
    assert q.stop_signals(app_ctx, w1) == [short]
    assert q.stop_signals(app_ctx, w1) == []  # told once
    q.renew(app_ctx, w1, [short])  # ... yet its ping says it still runs it: told again
    assert q.stop_signals(app_ctx, w1) == [short]
    for _ in range(5):
        clock.advance(25)
        q.renew(app_ctx, w1, [slow])
    q.expire(app_ctx)
    assert row(app_ctx, slow).status == "TIMED_OUT"  # the endpoint's 120 s
    assert q.finish(app_ctx, w1, slow, {"output": 1}) is False


def test_cancel_purge_and_finish(app_ctx: ServiceContext, admin: Principal,
                                 endpoint: str) -> None:
    ids = submit(app_ctx, admin, endpoint, 4)
    w1 = worker(app_ctx, admin, endpoint, "w1")
    q.take(app_ctx, endpoint, w1, 2)
    assert idle_since(app_ctx, w1) is None
    assert q.cancel(app_ctx, admin, endpoint, ids[1])["status"] == "CANCELLED"
    assert q.stop_signals(app_ctx, w1) == [ids[1]]
    assert q.cancel(app_ctx, admin, endpoint, ids[2])["status"] == "CANCELLED"
    assert q.purge(app_ctx, admin, endpoint) == 1  # ids[3]; ids[0] runs on
    assert q.finish(app_ctx, w1, ids[0], {"output": {"echo": 0}}) is True
    assert idle_since(app_ctx, w1) == app_ctx.clock.now()
    done = q.status(app_ctx, admin, endpoint, ids[0])
    assert done["status"] == "COMPLETED" and done["output"] == {"echo": 0}
    assert done["delayTime"] == 0 and done["executionTime"] == 0
    assert q.cancel(app_ctx, admin, endpoint, ids[0])["status"] == "COMPLETED"
    health = q.health(app_ctx, admin, endpoint)
    assert health["jobs"] == {"completed": 1, "failed": 0, "inProgress": 0, "inQueue": 0,
                              "retried": 0}
    assert health["workers"] == {"idle": 1, "running": 1}
    with pytest.raises(NotFound):
        q.status(app_ctx, admin, endpoint, "nope")


def test_error_results_fail_and_progress_is_not_a_result(
        app_ctx: ServiceContext, admin: Principal, endpoint: str) -> None:
    ids = submit(app_ctx, admin, endpoint, 1)
    w1 = worker(app_ctx, admin, endpoint, "w1")
    q.take(app_ctx, endpoint, w1)
    assert q.progress(app_ctx, w1, ids[0], "50%")
    assert q.status(app_ctx, admin, endpoint, ids[0])["status"] == "IN_PROGRESS"
    q.finish(app_ctx, w1, ids[0], {"output": None, "error": "boom"})
    failed = q.status(app_ctx, admin, endpoint, ids[0])
    assert (failed["status"], failed["error"]) == ("FAILED", "boom")


def test_stream_chunks_are_returned_once(app_ctx: ServiceContext, admin: Principal,
                                         endpoint: str) -> None:
    (request_id,) = submit(app_ctx, admin, endpoint, 1)
    w1 = worker(app_ctx, admin, endpoint, "w1")
    q.take(app_ctx, endpoint, w1)
    assert q.add_stream_chunks(app_ctx, w1, request_id, [{"output": 1}])
    assert q.add_stream_chunks(app_ctx, w1, request_id, [{"output": 2}])
    assert q.stream(app_ctx, admin, endpoint, request_id)["stream"] == [
        {"output": 1}, {"output": 2}]
    assert q.stream(app_ctx, admin, endpoint, request_id)["stream"] == []
    q.finish(app_ctx, w1, request_id, {"output": []}, stream_done=True)
    final = q.stream(app_ctx, admin, endpoint, request_id)
    assert (final["status"], final["stream"]) == ("COMPLETED", [])


def test_retention_and_ttl(app_ctx: ServiceContext, clock: ManualClock, admin: Principal,
                           endpoint: str) -> None:
    w1 = worker(app_ctx, admin, endpoint, "w1")
    synced = q.submit(app_ctx, admin, endpoint, {"input": 1}, sync=True)["id"]
    (queued,) = submit(app_ctx, admin, endpoint, 1, policy={"ttl": 10_000})
    kept = submit(app_ctx, admin, endpoint, 1)[0]
    q.take(app_ctx, endpoint, w1, 1)
    q.finish(app_ctx, w1, synced, {"output": 1})
    q.take(app_ctx, endpoint, w1, 2)  # queued (ttl 10 s) is taken here too
    q.finish(app_ctx, w1, kept, {"output": 2})
    q.cancel(app_ctx, admin, endpoint, queued)
    clock.advance(q.SYNC_RETENTION_SECONDS + 1)
    q.expire(app_ctx)
    with pytest.raises(NotFound):
        q.status(app_ctx, admin, endpoint, synced)
    assert q.status(app_ctx, admin, endpoint, kept)["status"] == "COMPLETED"
    clock.advance(q.ASYNC_RETENTION_SECONDS)
    q.expire(app_ctx)
    with pytest.raises(NotFound):
        q.status(app_ctx, admin, endpoint, kept)
    (dropped,) = submit(app_ctx, admin, endpoint, 1, policy={"ttl": 10_000})
    clock.advance(11)
    q.expire(app_ctx)
    with pytest.raises(NotFound):
        q.status(app_ctx, admin, endpoint, dropped)  # never started within its ttl


@pytest.mark.parametrize(("body", "field"), [
    ({"inputs": 1}, "input"), ({"input": 1, "webhook": "ftp://x"}, "webhook"),
    ({"input": 1, "policy": {"executionTimeout": 5}}, "policy.executionTimeout"),
    ({"input": 1, "policy": []}, "policy")])
def test_submit_refuses_bad_bodies(app_ctx: ServiceContext, admin: Principal, endpoint: str,
                                   body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput) as error:
        q.submit(app_ctx, admin, endpoint, body, sync=False)
    assert error.value.field == field
    assert q.queue_stats(app_ctx)[endpoint].in_queue == 0


class _Hook(BaseHTTPRequestHandler):
    answers: list[int] = []
    bodies: list[dict[str, Any]] = []
    hosts: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).bodies.append(json.loads(body))
        type(self).hosts.append(self.headers["Host"])
        self.send_response(type(self).answers.pop(0) if type(self).answers else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def hook_url() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    _Hook.answers, _Hook.bodies, _Hook.hosts = [500], [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/hook"
    server.shutdown()
    server.server_close()


@pytest.fixture
def loopback_hooks(app_ctx: ServiceContext) -> ServiceContext:
    """The context with loopback webhooks allowed (denied by default: the server's host)."""
    egress = EgressPolicy(app_ctx.settings.webhook_egress.denied,
                          allowed=parse_networks("127.0.0.0/8,::1", "allow"))
    return dataclasses.replace(app_ctx, settings=dataclasses.replace(
        app_ctx.settings, webhook_egress=egress))


def test_webhooks_are_posted_with_retries(loopback_hooks: ServiceContext,
                                          clock: ManualClock, admin: Principal,
                                          endpoint: str, hook_url: str) -> None:
    app_ctx = loopback_hooks
    (request_id,) = submit(app_ctx, admin, endpoint, 1, webhook=hook_url)
    (lost,) = submit(app_ctx, admin, endpoint, 1, webhook="http://127.0.0.1:9/none")
    w1 = worker(app_ctx, admin, endpoint, "w1")
    q.take(app_ctx, endpoint, w1, 2)
    q.finish(app_ctx, w1, request_id, {"output": "hi"})
    q.finish(app_ctx, w1, lost, {"output": "x"})
    assert q.deliver_webhooks(app_ctx) == 0  # the hook answers 500 first; port 9 refuses
    assert q.deliver_webhooks(app_ctx) == 0  # not due again yet
    clock.advance(q.WEBHOOK_BACKOFF_SECONDS)
    assert q.deliver_webhooks(app_ctx) == 1
    assert [b["id"] for b in _Hook.bodies] == [request_id, request_id]
    assert _Hook.bodies[-1]["status"] == "COMPLETED" and _Hook.bodies[-1]["output"] == "hi"
    clock.advance(2 * q.WEBHOOK_BACKOFF_SECONDS)
    q.deliver_webhooks(app_ctx)
    assert (row(app_ctx, request_id).webhook_state, row(app_ctx, lost).webhook_state) == (
        "done", "failed")


def _finished_with_webhook(ctx: ServiceContext, admin: Principal, endpoint: str,
                           url: str) -> str:
    """A request with a webhook, taken and finished by a worker: its webhook is due."""
    (request_id,) = submit(ctx, admin, endpoint, 1, webhook=url)
    w1 = worker(ctx, admin, endpoint, "w1")
    q.take(ctx, endpoint, w1, 1)
    q.finish(ctx, w1, request_id, {"output": "x"})
    return request_id


def test_webhooks_to_the_servers_own_host_are_refused(app_ctx: ServiceContext,
                                                       admin: Principal, endpoint: str,
                                                       hook_url: str) -> None:
    """Loopback and the metadata address are denied by default: a literal at submit (422
    naming the field), a name that resolves there when delivering (failed, not retried)."""
    for url in (hook_url, "http://169.254.169.254/latest/meta-data/",
                "http://[::ffff:127.0.0.1]:80/"):
        with pytest.raises(InvalidInput) as refused:
            submit(app_ctx, admin, endpoint, 1, webhook=url)
        assert refused.value.field == "webhook"
    request_id = _finished_with_webhook(app_ctx, admin, endpoint,
                                        hook_url.replace("127.0.0.1", "localhost"))
    assert q.deliver_webhooks(app_ctx) == 0
    assert row(app_ctx, request_id).webhook_state == "failed" and _Hook.bodies == []


def test_a_webhook_is_sent_to_the_address_checked(loopback_hooks: ServiceContext,
                                                  admin: Principal, endpoint: str,
                                                  hook_url: str) -> None:
    """Delivered to the resolved, checked address with the URL's own Host header (no
    second lookup that DNS rebinding could move)."""
    _Hook.answers = []
    _finished_with_webhook(loopback_hooks, admin, endpoint,
                           hook_url.replace("127.0.0.1", "localhost"))
    assert q.deliver_webhooks(loopback_hooks) == 1
    port = hook_url.split(":")[2].split("/")[0]
    assert _Hook.hosts == [f"localhost:{port}"]


def test_stop_pod_in_a_result_refreshes_the_worker(app_ctx: ServiceContext, admin: Principal,
                                                    endpoint: str) -> None:
    """A handler that returned ``refresh_worker`` (the SDK sends ``stopPod: true``): the
    worker is stopped and takes nothing more (the autoscaler replaces it)."""
    first, second = submit(app_ctx, admin, endpoint, 2)
    w1 = worker(app_ctx, admin, endpoint, "w1")
    assert [j["id"] for j in q.take(app_ctx, endpoint, w1, 1)] == [first]
    assert q.finish(app_ctx, w1, first, {"output": 1, "stopPod": True})
    with app_ctx.db.read() as session:
        pod = session.get_one(PodModel, w1)
        assert pod.desired_state == "stopped"
        reasons = [e.reason for e in session.scalars(
            select(PodEventModel).where(PodEventModel.pod_id == w1))]
    assert "WorkerRefresh" in reasons
    assert q.take(app_ctx, endpoint, w1, 1) == []
    w2 = worker(app_ctx, admin, endpoint, "w2")
    assert [j["id"] for j in q.take(app_ctx, endpoint, w2, 1)] == [second]
    assert q.finish(app_ctx, w2, second, {"output": 2, "stopPod": False})
    with app_ctx.db.read() as session:
        assert session.get_one(PodModel, w2).desired_state == "running"
