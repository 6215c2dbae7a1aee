"""A pod server bound only to the pod's own 127.0.0.1 (Jupyter's default) is reached
through the HTTP proxy: the agent opens the stream inside the pod's network namespace."""

from __future__ import annotations

import socket

import httpx

from tests.e2e.cluster import ADMIN_KEY, Cloud, wait_for
from tests.e2e.conftest import PushedImages

AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
SERVE = ("mkdir -p /w && echo loopback-only > /w/index.html && "
         "exec httpd -f -p 127.0.0.1:8000 -h /w")


def test_the_proxy_reaches_a_server_on_the_pods_loopback(cloud: Cloud,
                                                         images: PushedImages) -> None:
    cloud.agent("node-a")
    cloud.create_pod("lo", images.busybox, ["sh", "-c", SERVE], ports=["8000/http"])
    pod = cloud.wait_pod("lo", "Running")

    def get() -> httpx.Response | None:
        response = httpx.get(f"{cloud.url}/proxy/{pod.id}/8000/index.html", headers=AUTH,
                             timeout=10)
        return response if response.status_code == 200 else None

    assert wait_for(get, 20, "httpd on the pod's loopback via the proxy").text == \
        "loopback-only\n"
    assert pod.ip and not pod.ip.startswith("127.")  # its own namespace, its own address
    with socket.socket() as sock:
        sock.settimeout(5)
        assert sock.connect_ex((pod.ip, 8000)) != 0  # not listening there: loopback only
