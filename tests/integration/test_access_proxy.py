"""The HTTP/WebSocket proxy of the server against a real HTTP server on loopback.

The proxy is tested here, not the SSH upstream: ``app.state.proxy_opener`` connects the
pod stream to a local uvicorn ("the pod's server") over plain TCP instead of through an
agent (tests/e2e/test_access_proxy.py goes through a real agent and runc pod). Both
servers are real (uvicorn, real sockets), the clients are httpx and ``websockets``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import update
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from gpucloud.access.proxy_http import Reader, Writer
from gpucloud.api.app import create_app
from gpucloud.core.settings import Settings
from gpucloud.db.models import PodModel
from gpucloud.services.context import ServiceContext
from tests.fixtures.postgres import free_port

ADMIN = "gpc_proxy-admin-key-0123456789"
IDLE = 1.0
Scope = dict[str, Any]


@dataclass
class PodServer:
    """What the pod's server saw, and gates a test opens to prove streaming."""

    port: int = 0
    peers: list[tuple[str, int]] = field(default_factory=list)
    ws_closes: list[int] = field(default_factory=list)
    first_chunk_sent: threading.Event = field(default_factory=threading.Event)
    send_rest: threading.Event = field(default_factory=threading.Event)
    upload_started: threading.Event = field(default_factory=threading.Event)


async def _wait_thread_event(event: threading.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(0.005)


def pod_app(state: PodServer) -> Any:
    """A small ASGI app: echo, streamed download and upload, silence, WebSocket echo."""

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        elif scope["type"] == "websocket":
            await websocket_echo(scope, receive, send)
        else:
            state.peers.append(tuple(scope["client"]))
            await http(scope, receive, send)

    async def http(scope: Scope, receive: Any, send: Any) -> None:
        path = scope["path"]
        if path == "/stream":
            await start(send, 200, "application/octet-stream")
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            state.first_chunk_sent.set()
            await _wait_thread_event(state.send_rest)
            await send({"type": "http.response.body", "body": b"-rest"})
        elif path == "/upload":
            digest, size = hashlib.sha256(), 0
            while True:
                message = await receive()
                digest.update(message.get("body", b""))
                size += len(message.get("body", b""))
                state.upload_started.set()
                if not message.get("more_body"):
                    break
            await json_response(send, {"sha256": digest.hexdigest(), "size": size})
        elif path == "/silent":
            await asyncio.sleep(30)
        else:
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            await json_response(send, {"method": scope["method"], "path": path,
                                       "query": scope["query_string"].decode(),
                                       "headers": headers})

    async def websocket_echo(scope: Scope, receive: Any, send: Any) -> None:
        await receive()
        protocols = scope.get("subprotocols") or [None]
        await send({"type": "websocket.accept", "subprotocol": protocols[0]})
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                state.ws_closes.append(message.get("code", 1000))
                return
            text = message.get("text")
            if text and text.startswith("close:"):
                await send({"type": "websocket.close", "code": int(text[6:]),
                            "reason": "asked to"})
                return
            if text == "origin":
                text = dict(scope["headers"]).get(b"origin", b"").decode()
            await send({"type": "websocket.send", "text": text, "bytes": message.get("bytes")})

    return app


async def start(send: Any, status: int, content_type: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode())]})


async def json_response(send: Any, body: dict[str, Any]) -> None:
    await start(send, 200, "application/json")
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


@dataclass
class Served:
    url: str
    port: int
    ctx: ServiceContext
    pod: PodServer
    opens: list[tuple[str, int]]


def _serve(app: Any, port: int) -> uvicorn.Server:
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            lifespan="on", ws="wsproto")
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "a test server did not start"
        time.sleep(0.02)
    return server


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The gpucloud server (proxy in front) and the pod's server, for the whole module.
    Port 8080 of every pod reaches the pod server; 9090 reaches a port nobody listens on."""
    workdir: Path = tmp_path_factory.mktemp("proxy")
    pod = PodServer(port=free_port())
    dead_port = free_port()
    opens: list[tuple[str, int]] = []

    async def opener(_ctx: ServiceContext, pod_id: str, port: int) -> tuple[Reader, Writer]:
        opens.append((pod_id, port))
        return await asyncio.open_connection("127.0.0.1",
                                             pod.port if port == 8080 else dead_port)

    settings = Settings(home=workdir / "home", database_url=f"sqlite:///{workdir / 'db'}",
                        admin_key=ADMIN, proxy_idle_timeout_seconds=IDLE)
    app = create_app(settings, run_controllers=False)
    app.state.proxy_opener = opener
    pod_server = _serve(pod_app(pod), pod.port)
    port = free_port()
    server = _serve(app, port)
    try:
        yield Served(f"http://127.0.0.1:{port}", port, app.state.ctx, pod, opens)
    finally:
        server.should_exit = pod_server.should_exit = True


@dataclass(frozen=True)
class Pod:
    id: str
    token: str


def make_pod(served: Served, name: str, key: str = ADMIN, phase: str = "Running",
             ports: tuple[str, ...] = ("8080/http", "9090/http", "22/tcp")) -> Pod:
    response = httpx.post(f"{served.url}/v1/pods", headers=auth(key), json={
        "name": name, "image": "busybox", "command": ["sleep", "1"], "ports": list(ports)})
    assert response.status_code == 201, response.text
    pod_id = response.json()["id"]
    # The pod's lifecycle is not under test here: its phase is set as an agent would.
    with served.ctx.db.transaction() as session:
        session.execute(update(PodModel).where(PodModel.id == pod_id).values(phase=phase))
        token = session.get_one(PodModel, pod_id).proxy_token
    assert token
    return Pod(pod_id, token)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def host_get(served: Served, pod: Pod, path: str = "/echo", port: int = 8080,
             **kwargs: Any) -> httpx.Response:
    headers = {"Host": f"{pod.id}-{port}.localhost:{served.port}", **kwargs.pop("headers", {})}
    return httpx.get(f"{served.url}{path}", headers=headers, **kwargs)


def other_project_key(served: Served) -> str:
    name = f"other{time.monotonic_ns()}"
    created = httpx.post(f"{served.url}/v1/projects", headers=auth(ADMIN),
                         json={"name": name})
    assert created.status_code == 201, created.text
    key: str = created.json()["key"]["key"]
    return key


def test_host_form_forwards_with_forwarded_headers_and_without_the_api_key(
        served: Served) -> None:
    pod = make_pod(served, "host-form")
    response = host_get(served, pod, "/echo?a=1&b=2", headers={
        **auth(ADMIN), "X-Forwarded-Host": "spoofed", "Cookie": "theirs=1"})
    assert response.status_code == 200, response.text
    seen = response.json()
    assert (seen["path"], seen["query"]) == ("/echo", "a=1&b=2")
    headers = seen["headers"]
    assert headers["host"] == f"{pod.id}-8080.localhost:{served.port}"
    assert headers["x-forwarded-host"] == headers["host"]
    assert headers["x-forwarded-proto"] == "http"
    assert headers["x-forwarded-for"] == "127.0.0.1"
    assert headers["cookie"] == "theirs=1"
    assert "authorization" not in headers and "x-forwarded-prefix" not in headers


def test_path_form_strips_the_prefix_and_says_it(served: Served) -> None:
    pod = make_pod(served, "path-form")
    response = httpx.get(f"{served.url}/proxy/{pod.id}/8080/lab/tree?x=%20y",
                         headers=auth(ADMIN))
    assert response.status_code == 200, response.text
    seen = response.json()
    assert (seen["path"], seen["query"]) == ("/lab/tree", "x=%20y")
    assert seen["headers"]["x-forwarded-prefix"] == f"/proxy/{pod.id}/8080"
    bare = httpx.get(f"{served.url}/proxy/{pod.id}/8080", headers=auth(ADMIN))
    assert bare.status_code == 307
    assert bare.headers["location"] == f"/proxy/{pod.id}/8080/"


def test_other_routes_reach_the_api(served: Served) -> None:
    assert httpx.get(f"{served.url}/healthz").json()["status"] == "ok"
    listed = httpx.get(f"{served.url}/v1/pods", headers=auth(ADMIN))
    assert listed.status_code == 200
    not_a_pod = httpx.get(f"{served.url}/proxy/nothex/8080/", headers=auth(ADMIN))
    assert not_a_pod.status_code == 404 and not_a_pod.json()["detail"]


def test_refusals_are_one_line_and_hide_other_projects(served: Served) -> None:
    pod = make_pod(served, "refusals")
    other = other_project_key(served)
    cases = [
        (host_get(served, pod), 401),
        (host_get(served, pod, headers=auth("gpc_wrong")), 401),
        (host_get(served, pod, headers=auth(other)), 404),
        (host_get(served, Pod("0" * 32, ""), headers=auth(ADMIN)), 404),
        (host_get(served, pod, port=22, headers=auth(ADMIN)), 404),
        (host_get(served, pod, port=7777, headers=auth(ADMIN)), 404),
        (host_get(served, pod, f"/x?gpucloud_token={'z' * 43}"), 404),
    ]
    for response, status in cases:
        assert response.status_code == status, (status, response.text)
        assert response.text.count("\n") == 1 and "Traceback" not in response.text
    # Another project's pod reads exactly like a pod that does not exist.
    assert cases[2][0].text == f"pod {pod.id} not found\n"


def test_a_pod_not_running_is_503_with_its_state(served: Served) -> None:
    pod = make_pod(served, "stopped-one", phase="Stopped")
    response = host_get(served, pod, headers=auth(ADMIN))
    assert response.status_code == 503
    assert response.text == ("pod stopped-one is Stopped; start it with "
                             "`gpucloud pod start stopped-one`\n")


def test_token_becomes_a_cookie_and_the_cookie_lets_a_browser_in(served: Served) -> None:
    pod = make_pod(served, "browser")
    first = host_get(served, pod, f"/tree?gpucloud_token={pod.token}&dir=a")
    assert first.status_code == 307
    assert first.headers["location"] == "/tree?dir=a"
    cookie = first.headers["set-cookie"]
    name = f"gpucloud_proxy_{pod.id}"
    assert cookie.startswith(f"{name}={pod.token}; Path=/;")
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie
    second = host_get(served, pod, "/tree?dir=a",
                      headers={"Cookie": f"a=1; {name}={pod.token}; b=2"})
    assert second.status_code == 200, second.text
    assert second.json()["headers"]["cookie"] == "a=1; b=2"
    path_form = httpx.get(f"{served.url}/proxy/{pod.id}/8080/?gpucloud_token={pod.token}")
    assert path_form.status_code == 307
    assert f"Path=/proxy/{pod.id}/;" in path_form.headers["set-cookie"]
    other_pod = make_pod(served, "browser-2")
    wrong = host_get(served, other_pod, headers={"Cookie": f"{name}={pod.token}"})
    assert wrong.status_code == 401


def test_bodies_stream_both_ways(served: Served) -> None:
    pod = make_pod(served, "streams")
    served.pod.first_chunk_sent.clear()
    served.pod.send_rest.clear()
    headers = {"Host": f"{pod.id}-8080.localhost", **auth(ADMIN)}
    with httpx.stream("GET", f"{served.url}/stream", headers=headers, timeout=10) as response:
        chunks = response.iter_raw()
        # The pod's server holds back the rest until the first chunk reached the client.
        assert next(chunks) == b"first"
        served.pod.send_rest.set()
        assert b"".join(chunks) == b"-rest"

    served.pod.upload_started.clear()

    def body() -> Iterator[bytes]:
        yield b"x" * 100_000
        assert served.pod.upload_started.wait(10), "the first chunk did not arrive"
        yield b"y" * 1_000_000

    upload = httpx.post(f"{served.url}/upload", headers=headers, content=body(), timeout=10)
    assert upload.status_code == 200, upload.text
    expected = hashlib.sha256(b"x" * 100_000 + b"y" * 1_000_000).hexdigest()
    assert upload.json() == {"sha256": expected, "size": 1_100_000}


def test_keep_alive_reuses_the_pod_stream(served: Served) -> None:
    pod = make_pod(served, "keepalive")
    served.opens.clear()
    with httpx.Client(headers={"Host": f"{pod.id}-8080.localhost", **auth(ADMIN)}) as client:
        for _ in range(5):
            assert client.get(f"{served.url}/echo").status_code == 200
    assert served.opens == [(pod.id, 8080)]


def test_upstream_failures_are_502_and_silence_is_504(served: Served) -> None:
    pod = make_pod(served, "failing")
    refused = host_get(served, pod, port=9090, headers=auth(ADMIN))
    assert refused.status_code == 502
    assert refused.text.startswith(f"cannot reach port 9090 of pod {pod.id}: ")
    assert refused.text.count("\n") == 1
    started = time.monotonic()
    silent = host_get(served, pod, "/silent", headers=auth(ADMIN), timeout=10)
    assert silent.status_code == 504
    assert silent.text == f"pod failing port 8080: no data for {IDLE:g} s\n"
    assert IDLE <= time.monotonic() - started < IDLE + 5


def ws_connect(served: Served, pod: Pod, path: str = "/ws",
               **kwargs: Any) -> ClientConnection:
    """A WebSocket to the proxy with the host form's Host (the socket goes to loopback)."""
    sock = socket.create_connection(("127.0.0.1", served.port))
    connection: ClientConnection = connect(
        f"ws://{pod.id}-8080.localhost:{served.port}{path}", sock=sock, open_timeout=10,
        **kwargs)
    return connection


def test_websocket_echo_and_close_codes_both_ways(served: Served) -> None:
    pod = make_pod(served, "websockets")
    with ws_connect(served, pod, additional_headers=auth(ADMIN),
                    subprotocols=["chat"],
                    origin=f"http://{pod.id}-8080.localhost") as ws:
        assert ws.subprotocol == "chat"
        ws.send("hello")
        assert ws.recv(timeout=10) == "hello"
        ws.send(b"\x00\x01" * 70_000)
        assert ws.recv(timeout=10) == b"\x00\x01" * 70_000
        ws.send("origin")
        assert ws.recv(timeout=10) == f"http://{pod.id}-8080.localhost"
        ws.send("close:4001")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4001
    served.pod.ws_closes.clear()
    with ws_connect(served, pod, f"/ws?gpucloud_token={pod.token}") as ws:
        ws.send("via token")
        assert ws.recv(timeout=10) == "via token"
        ws.close(code=4002)
    deadline = time.monotonic() + 10
    while not served.pod.ws_closes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.pod.ws_closes == [4002]


def test_websocket_refusals_are_http_answers(served: Served) -> None:
    pod = make_pod(served, "ws-refusals")
    other = other_project_key(served)
    for headers, status in (({}, 401), (auth(other), 404)):
        with pytest.raises(InvalidStatus) as refused:
            ws_connect(served, pod, additional_headers=headers)
        assert refused.value.response.status_code == status
