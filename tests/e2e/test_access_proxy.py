"""The HTTP proxy end to end: server → SSH to the node's agent → the runc pod's port.

The pod is busybox only: ``httpd`` serves a page, an ash script behind ``nc -ll -e`` is a
WebSocket echo server. Requests go to the server on loopback, in the host form
(``Host: {pod}-{port}.localhost``) and the path form (``/proxy/{pod}/{port}/…``).
"""

from __future__ import annotations

import socket
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

from gpucloud.core.models import PodOut
from tests.e2e.cluster import ADMIN_KEY, Cloud, wait_for
from tests.e2e.proxy_image import COMMAND, HTTP_PORT, INDEX, PORTS, WS_PORT, proxy_pod_image
from tests.fixtures.registry import Registry

AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


def start_proxy_pod(cloud: Cloud, registry: Registry, name: str = "web") -> PodOut:
    proxy_pod_image().push(registry.host, "e2e/proxy-pod:1")
    cloud.agent("node-a")
    cloud.create_pod(name, f"{registry.host}/e2e/proxy-pod:1", COMMAND, ports=PORTS)
    return cloud.wait_pod(name, "Running")


def host_get(cloud: Cloud, pod: PodOut, path: str, **kwargs: Any) -> httpx.Response:
    headers = {"Host": f"{pod.id}-{HTTP_PORT}.localhost", **AUTH}
    return httpx.get(f"{cloud.url}{path}", headers=headers, timeout=10, **kwargs)


def _ok(response: httpx.Response) -> httpx.Response | None:
    return response if response.status_code == 200 else None


def ws_connect(cloud: Cloud, pod: PodOut) -> ClientConnection:
    port = cloud.url.rsplit(":", 1)[1]
    sock = socket.create_connection(("127.0.0.1", int(port)))
    connection: ClientConnection = connect(
        f"ws://{pod.id}-{WS_PORT}.localhost:{port}/echo", sock=sock, open_timeout=15,
        additional_headers=AUTH)
    return connection


def test_get_through_the_proxy_reaches_httpd_in_the_pod(cloud: Cloud,
                                                        registry: Registry) -> None:
    pod = start_proxy_pod(cloud, registry)
    # Running is reported when the container starts; httpd binds a moment later.
    first = wait_for(lambda: _ok(host_get(cloud, pod, "/index.html")), 20,
                     "httpd in the pod to answer through the proxy")
    assert first.text == INDEX
    path_form = httpx.get(f"{cloud.url}/proxy/{pod.id}/{HTTP_PORT}/index.html",
                          headers=AUTH, timeout=10)
    assert path_form.status_code == 200 and path_form.text == INDEX
    missing = host_get(cloud, pod, "/nothing-here")
    assert missing.status_code == 404 and "Not Found" in missing.text
    nobody = httpx.get(f"{cloud.url}/index.html", timeout=10, headers={
        "Host": f"{pod.id}-{HTTP_PORT}.localhost"})
    assert nobody.status_code == 401


def test_websocket_echo_through_the_proxy(cloud: Cloud, registry: Registry) -> None:
    pod = start_proxy_pod(cloud, registry, "ws")
    wait_for(lambda: _ok(host_get(cloud, pod, "/index.html")), 20,
             "the pod's servers to listen")
    with ws_connect(cloud, pod) as ws:
        ws.send("hello through the agent")
        assert ws.recv(timeout=15) == "hello through the agent"
        ws.send(b"\x00\x01\xfe\xff" * 40)
        assert ws.recv(timeout=15) == b"\x00\x01\xfe\xff" * 40
        ws.close(code=4003)
    assert ws.close_code == 4003
