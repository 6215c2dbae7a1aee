"""The proxy's pure parts: which requests are for a pod, tokens, cookies, headers."""

from __future__ import annotations

from typing import Any

import pytest

from gpucloud.access.proxy import (
    Route,
    forwarded_headers,
    http_request,
    route_of,
    split_token,
    without_own_cookies,
)
from gpucloud.access.proxy_http import drop_hop_by_hop

POD = "0123456789abcdef0123456789abcdef"


def scope(host: str = "127.0.0.1:8080", path: str = "/", query: bytes = b"",
          headers: list[tuple[bytes, bytes]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(),
            "query_string": query, "client": ("10.1.2.3", 5555), "scheme": "http",
            "headers": [(b"host", host.encode()), *(headers or [])], **extra}


@pytest.mark.parametrize(("host", "path", "expected"), [
    (f"{POD}-8888.localhost", "/lab", Route(POD, 8888, b"/lab", None)),
    (f"{POD}-8888.localhost:8080", "/", Route(POD, 8888, b"/", None)),
    (f"{POD.upper()}-80.LOCALHOST", "/", Route(POD, 80, b"/", None)),
    ("127.0.0.1:8080", f"/proxy/{POD}/8888/lab/x",
     Route(POD, 8888, b"/lab/x", f"/proxy/{POD}/8888")),
    ("127.0.0.1:8080", f"/proxy/{POD}/8888", Route(POD, 8888, b"", f"/proxy/{POD}/8888")),
    ("localhost:8080", "/v1/pods", None),
    (f"{POD}-8888.example.com", "/", None),
    (f"{POD}-8888.localhost.evil", "/", None),
    (f"x{POD}-8888.localhost", "/", None),
    ("127.0.0.1", "/proxy/notapodid/8888/", None),
    ("127.0.0.1", f"/proxyx/{POD}/8888/", None),
])
def test_route_of(host: str, path: str, expected: Route | None) -> None:
    assert route_of(scope(host, path), "localhost") == expected


def test_route_of_another_domain() -> None:
    assert route_of(scope(f"{POD}-1.pods.example.com"), "pods.example.com") == Route(
        POD, 1, b"/", None)


@pytest.mark.parametrize(("query", "token", "rest"), [
    (b"", None, b""),
    (b"a=1", None, b"a=1"),
    (b"gpucloud_token=abc", "abc", b""),
    (b"a=1&gpucloud_token=a%2Db&b=2", "a-b", b"a=1&b=2"),
])
def test_split_token(query: bytes, token: str | None, rest: bytes) -> None:
    assert split_token(query) == (token, rest)


def test_own_cookies_are_not_forwarded() -> None:
    assert without_own_cookies(b"a=1; gpucloud_proxy_x=t; b=2") == b"a=1; b=2"
    assert without_own_cookies(f"gpucloud_proxy_{POD}=t".encode()) == b""


def test_hop_by_hop_headers_and_those_connection_names_are_dropped() -> None:
    headers = [(b"Connection", b"keep-alive, X-Secret"), (b"X-Secret", b"1"),
               (b"Keep-Alive", b"5"), (b"Upgrade", b"h2c"), (b"Accept", b"*/*")]
    assert drop_hop_by_hop(headers) == [(b"accept", b"*/*")]


def test_forwarded_headers_replace_the_clients_own_and_keep_the_chain() -> None:
    request = scope(f"{POD}-80.localhost", headers=[
        (b"x-forwarded-for", b"192.0.2.1"), (b"x-forwarded-host", b"spoof"),
        (b"authorization", b"Bearer gpc_key"), (b"expect", b"100-continue")])
    route = Route(POD, 80, b"/", f"/proxy/{POD}/80")
    headers = dict(forwarded_headers(request, route, strip_auth=True))
    assert headers == {b"x-forwarded-proto": b"http",
                       b"x-forwarded-host": f"{POD}-80.localhost".encode(),
                       b"x-forwarded-for": b"192.0.2.1, 10.1.2.3",
                       b"x-forwarded-prefix": f"/proxy/{POD}/80".encode()}
    kept = dict(forwarded_headers(request, route, strip_auth=False))
    assert kept[b"authorization"] == b"Bearer gpc_key"


def test_a_chunked_upload_stays_chunked_and_the_token_leaves_the_target() -> None:
    request = scope(f"{POD}-80.localhost", "/up", b"gpucloud_token=t&x=1",
                    headers=[(b"transfer-encoding", b"chunked")], method="POST")
    built = http_request(request, Route(POD, 80, b"/up", None), strip_auth=False)
    assert built.target == b"/up?x=1" and built.has_body
    assert (b"transfer-encoding", b"chunked") in built.headers
    assert built.headers[0] == (b"host", f"{POD}-80.localhost".encode())
