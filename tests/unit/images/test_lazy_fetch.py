"""``RangeFetcher`` against real loopback HTTP servers: a registry and a blob store.

The registry redirects blob GETs to the store under a "presigned" URL (``?sig=N``) and may
demand a bearer token from its own token endpoint; the store serves Range requests and can
expire signatures or fail with 503. Nothing is mocked: httpx talks HTTP to both servers.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from gpucloud.images.auth import Credentials, RegistryAuth
from gpucloud.images.errors import RegistryUnavailable
from gpucloud.images.lazy.fetch import RangeFetcher

BLOB = os.urandom(64 << 10)
DIGEST = "sha256:" + "ab" * 32
PATH = f"/v2/app/blobs/{DIGEST}"


@dataclass
class World:
    """What the servers do and what they saw."""

    store_port: int = 0
    registry_port: int = 0
    require_token: bool = False
    token_serial: int = 0
    expired_tokens: set[str] = field(default_factory=set)
    signature: int = 1
    expired_signatures: set[int] = field(default_factory=set)
    failures_left: int = 0
    retry_after: str | None = None
    registry_log: list[tuple[str, str, str]] = field(default_factory=list)
    store_log: list[tuple[str, str, str]] = field(default_factory=list)
    token_requests: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Base(BaseHTTPRequestHandler):
    world: World

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class Registry(_Base):
    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        world = self.world
        auth = self.headers.get("Authorization", "")
        with world.lock:
            world.registry_log.append((self.command, self.path, auth))
        if self.path.startswith("/token"):
            with world.lock:
                world.token_serial += 1
                token = f"t{world.token_serial}"
                world.token_requests.append(token)
            self._send(200, b'{"token": "%s", "expires_in": 300}' % token.encode(),
                       {"Content-Type": "application/json"})
            return
        if world.require_token and (not auth.startswith("Bearer ")
                                    or auth[7:] in world.expired_tokens):
            realm = f"http://127.0.0.1:{self.world.registry_port}/token"
            challenge = f'Bearer realm="{realm}",service="reg",scope="repository:app:pull"'
            self._send(401, b"", {"WWW-Authenticate": challenge})
            return
        with world.lock:
            sig = world.signature
            world.signature += 1
        self._send(307, b"", {"Location": f"http://127.0.0.1:{world.store_port}/blob?sig={sig}"})


class Store(_Base):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        world = self.world
        with world.lock:
            world.store_log.append((self.command, self.path,
                                    self.headers.get("Authorization", "")))
            failing = world.failures_left > 0
            world.failures_left -= 1 if failing else 0
        sig = int(parse_qs(urlsplit(self.path).query)["sig"][0])
        if sig in world.expired_signatures:
            self._send(403, b"expired")
            return
        if failing:
            headers = {"Retry-After": world.retry_after} if world.retry_after else {}
            self._send(503, b"busy", headers)
            return
        start, end = (int(x) for x in self.headers["Range"].split("=")[1].split("-"))
        self._send(206, BLOB[start : end + 1],
                   {"Content-Range": f"bytes {start}-{end}/{len(BLOB)}"})


def _serve(handler: type[_Base], world: World) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (handler,), {"world": world}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def world() -> Iterator[tuple[World, str]]:
    state = World()
    store = _serve(Store, state)
    state.store_port = store.server_address[1]
    registry = _serve(Registry, state)
    state.registry_port = registry.server_address[1]
    yield state, f"http://127.0.0.1:{registry.server_address[1]}{PATH}"
    for server in (registry, store):
        server.shutdown()
        server.server_close()


def _fetcher(url: str, sleeps: list[float] | None = None,
             creds: Credentials | None = None) -> RangeFetcher:
    host = urlsplit(url).netloc
    registry = httpx.Client(auth=RegistryAuth({host: creds} if creds else {}),
                            follow_redirects=False)
    return RangeFetcher(registry, httpx.Client(), url, len(BLOB), attempts=4, backoff=0.5,
                        deadline=10.0, sleep=(sleeps.append if sleeps is not None else None)
                        or (lambda _s: None))


def test_redirect_is_followed_without_registry_auth_and_reused(
        world: tuple[World, str]) -> None:
    state, url = world
    state.require_token = True
    fetcher = _fetcher(url, creds=Credentials("alice", "secret"))
    assert fetcher.fetch(100, 5000) == BLOB[100:5000]
    assert fetcher.fetch(9000, 9100) == BLOB[9000:9100]
    # The registry saw the token; the store never saw any Authorization header.
    assert any(auth.startswith("Bearer ") for _, _, auth in state.registry_log)
    assert state.store_log and all(auth == "" for _, _, auth in state.store_log)
    # Resolved once: both ranges went to the same presigned URL.
    assert {path for _, path, _ in state.store_log} == {"/blob?sig=1"}


def test_expired_presigned_url_is_resolved_again_on_403(world: tuple[World, str]) -> None:
    state, url = world
    fetcher = _fetcher(url)
    assert fetcher.fetch(0, 10) == BLOB[:10]
    state.expired_signatures.add(1)
    assert fetcher.fetch(10, 20) == BLOB[10:20]
    assert [path for _, path, _ in state.store_log] == [
        "/blob?sig=1", "/blob?sig=1", "/blob?sig=2"]


def test_bearer_token_is_refreshed_on_401_mid_run(world: tuple[World, str]) -> None:
    state, url = world
    state.require_token = True
    fetcher = _fetcher(url)
    assert fetcher.fetch(0, 10) == BLOB[:10]
    assert state.token_requests == ["t1"]
    state.expired_tokens.add("t1")  # the token service revoked it before its expiry
    state.expired_signatures.add(1)  # and the presigned URL expired: back to the registry
    assert fetcher.fetch(10, 20) == BLOB[10:20]
    assert state.token_requests == ["t1", "t2"]
    assert state.registry_log[-1][2] == "Bearer t2"


def test_503_is_retried_with_exponential_backoff_and_retry_after(
        world: tuple[World, str]) -> None:
    state, url = world
    sleeps: list[float] = []
    state.failures_left = 2
    fetcher = _fetcher(url, sleeps)
    assert fetcher.fetch(0, 100) == BLOB[:100]
    assert sleeps == [0.5, 1.0] and fetcher.stats.retries == 2

    sleeps.clear()
    state.failures_left, state.retry_after = 1, "3"
    assert fetcher.fetch(0, 100) == BLOB[:100]
    assert sleeps == [3.0]


def test_backoff_gives_up_after_its_attempts(world: tuple[World, str]) -> None:
    state, url = world
    sleeps: list[float] = []
    state.failures_left = 100
    fetcher = _fetcher(url, sleeps)
    with pytest.raises(RegistryUnavailable, match="HTTP 503"):
        fetcher.fetch(0, 100)
    assert sleeps == [0.5, 1.0, 2.0]  # 4 attempts, 3 waits


class _KeepAliveBlob(BaseHTTPRequestHandler):
    """Serves BLOB's ranges over HTTP/1.1 keep-alive and counts the TCP connections."""

    protocol_version = "HTTP/1.1"
    connections: list[int]
    long_body: bool = False

    def setup(self) -> None:
        super().setup()
        self.connections.append(1)

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        start, end = (int(x) for x in self.headers["Range"].split("=")[1].split("-"))
        body = BLOB[start : end + 1 + (10 if self.long_body else 0)]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(BLOB)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", str(len(BLOB)))
        self.end_headers()


@pytest.mark.parametrize("long_body", [False, True])
def test_range_responses_reuse_one_connection(long_body: bool) -> None:
    """A 206 is read to its end so its connection goes back to the pool: a chunk fetch
    must not pay a new TCP (TLS, at a real registry) handshake. A body longer than the
    range asked for is cut to the range, and its connection is not reused."""
    connections: list[int] = []
    handler = type("H", (_KeepAliveBlob,), {"connections": connections, "long_body": long_body})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}{PATH}"
        with httpx.Client() as registry, httpx.Client() as storage:
            fetcher = RangeFetcher(registry, storage, url, len(BLOB))
            for start in range(0, 40000, 8000):
                assert fetcher.fetch(start, start + 8000) == BLOB[start : start + 8000]
        # One for the HEAD and every range; a longer body: the HEAD's connection serves
        # the first range and is closed after it, then one connection per range.
        assert len(connections) == (5 if long_body else 1)
    finally:
        server.shutdown()
        server.server_close()


class _SlowBlob(BaseHTTPRequestHandler):
    """Answers a Range request with its ``206`` headers, then either trickles the body
    (a byte every 20 ms: every read well within its timeout, the body in seconds) or sends
    nothing more (``silent``) until the client hangs up."""

    protocol_version = "HTTP/1.1"
    silent = False

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", str(len(BLOB)))
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        start, end = (int(x) for x in self.headers["Range"].split("=")[1].split("-"))
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(BLOB)}")
        self.send_header("Content-Length", str(end + 1 - start))
        self.end_headers()
        try:
            for byte in BLOB[start : end + 1]:
                if self.silent:
                    self.rfile.read(1)  # until the client closes the connection
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.02)
        except (BrokenPipeError, ConnectionResetError):
            return


@pytest.mark.parametrize("silent", [False, True])
def test_the_read_deadline_bounds_the_whole_download(silent: bool) -> None:
    """Not only the retries: a body still arriving at the deadline (trickled: each read
    in time, the whole 4 s) or not arriving (the client's own read timeout is 5 s) is
    given up at the deadline, so a reader waiting on it gets its ``EIO`` then."""
    handler = type("H", (_SlowBlob,), {"silent": silent})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}{PATH}"
        with httpx.Client() as registry, httpx.Client() as storage:
            fetcher = RangeFetcher(registry, storage, url, len(BLOB), attempts=3,
                                   backoff=0.01, deadline=0.3)
            started = time.monotonic()
            with pytest.raises(RegistryUnavailable):
                fetcher.fetch(0, 200)
            assert time.monotonic() - started < 2
    finally:
        server.shutdown()
        server.server_close()
