"""The registry client against an in-process fake transport: auth handshakes, error
mapping and digest checks. (The real registry is exercised in tests/integration/images.)"""

from __future__ import annotations

import base64
import hashlib
import io
import json

import httpx
import pytest

from gpucloud.images.auth import Credentials, parse_challenge
from gpucloud.images.client import RegistryClient, is_loopback
from gpucloud.images.errors import (
    DigestMismatch,
    ImageNotFound,
    RegistryUnauthorized,
    RegistryUnavailable,
)
from gpucloud.images.manifest import OCI_LAYER, Descriptor
from gpucloud.images.reference import parse_reference

BLOB = b"layer bytes" * 100
BLOB_DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()
MANIFEST = json.dumps({"schemaVersion": 2, "layers": [], "config": {}}).encode()
MANIFEST_DIGEST = "sha256:" + hashlib.sha256(MANIFEST).hexdigest()


class FakeRegistry:
    """A registry on ghcr.io behind bearer auth, with its token service on another host."""

    def __init__(self, users: dict[str, str] | None = None) -> None:
        self.users = users or {}
        self.token_requests: list[httpx.Request] = []
        self.served_digest_header: str | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "auth.example":
            return self._token(request)
        if request.headers.get("Authorization") != "Bearer good-token":
            challenge = (
                'Bearer realm="https://auth.example/token",service="ghcr.io",'
                'scope="repository:org/app:pull"'
            )
            return httpx.Response(401, headers={"WWW-Authenticate": challenge})
        if request.url.path.endswith("/manifests/missing"):
            body = {"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]}
            return httpx.Response(404, json=body)
        if "/manifests/" in request.url.path:
            digest = self.served_digest_header or MANIFEST_DIGEST
            return httpx.Response(200, content=MANIFEST, headers={"Docker-Content-Digest": digest})
        return httpx.Response(200, content=BLOB)

    def _token(self, request: httpx.Request) -> httpx.Response:
        self.token_requests.append(request)
        header = request.headers.get("Authorization")
        if header is not None:
            user, _, password = base64.b64decode(header.split()[1]).decode().partition(":")
            if self.users.get(user) != password:
                return httpx.Response(401, json={"details": "bad credentials"})
        return httpx.Response(200, json={"token": "good-token", "expires_in": 300})


def make_client(fake: FakeRegistry, creds: Credentials | None = None) -> RegistryClient:
    credentials = {"ghcr.io": creds} if creds else None
    return RegistryClient(credentials=credentials, transport=httpx.MockTransport(fake))


def test_parse_challenge_reads_quoted_and_bare_parameters() -> None:
    challenge = parse_challenge(
        'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
        'scope="repository:samalba/my-app:pull,push",error=insufficient_scope'
    )
    assert challenge is not None and challenge.scheme == "bearer"
    assert challenge.params == {
        "realm": "https://auth.docker.io/token",
        "service": "registry.docker.io",
        "scope": "repository:samalba/my-app:pull,push",
        "error": "insufficient_scope",
    }
    basic = parse_challenge('Basic realm="Registry Realm"')
    assert basic is not None and basic.scheme == "basic"


def test_anonymous_bearer_token_is_fetched_once_and_reused() -> None:
    fake = FakeRegistry()
    image = parse_reference("ghcr.io/org/app:v1")
    with make_client(fake) as client:
        assert client.get_manifest(image).digest == MANIFEST_DIGEST
        sink = io.BytesIO()
        client.fetch_blob(image, Descriptor(OCI_LAYER, BLOB_DIGEST, len(BLOB)), sink)
    assert sink.getvalue() == BLOB
    assert len(fake.token_requests) == 1
    token_request = fake.token_requests[0]
    assert token_request.url.params["scope"] == "repository:org/app:pull"
    assert token_request.url.params["service"] == "ghcr.io"
    assert "Authorization" not in token_request.headers


def test_credentials_go_to_the_token_service_and_refusal_is_typed() -> None:
    fake = FakeRegistry(users={"alice": "secret"})
    image = parse_reference("ghcr.io/org/app:v1")
    with make_client(fake, Credentials("alice", "secret")) as client:
        client.get_manifest(image)
    assert fake.token_requests[0].url.params["account"] == "alice"
    with make_client(fake, Credentials("alice", "wrong")) as client:
        with pytest.raises(RegistryUnauthorized, match="refused user 'alice'"):
            client.get_manifest(image)


def test_missing_manifest_is_image_not_found() -> None:
    with make_client(FakeRegistry()) as client:
        with pytest.raises(ImageNotFound, match="ghcr.io/org/app:missing"):
            client.get_manifest(parse_reference("ghcr.io/org/app:missing"))


def test_manifest_whose_digest_header_disagrees_is_refused() -> None:
    fake = FakeRegistry()
    fake.served_digest_header = "sha256:" + "0" * 64
    with make_client(fake) as client:
        with pytest.raises(DigestMismatch, match="sha256:0000"):
            client.get_manifest(parse_reference("ghcr.io/org/app:v1"))


def test_manifest_pinned_by_digest_must_hash_to_it() -> None:
    wrong = "sha256:" + "1" * 64
    with make_client(FakeRegistry()) as client:
        with pytest.raises(DigestMismatch, match=wrong):
            client.get_manifest(parse_reference(f"ghcr.io/org/app@{wrong}"))


@pytest.mark.parametrize(
    ("descriptor", "message"),
    [
        (Descriptor(OCI_LAYER, "sha256:" + "2" * 64, len(BLOB)), "hashed to " + BLOB_DIGEST),
        (Descriptor(OCI_LAYER, BLOB_DIGEST, len(BLOB) - 1), "longer than"),
    ],
)
def test_blob_with_wrong_content_or_size_is_refused(descriptor: Descriptor, message: str) -> None:
    with make_client(FakeRegistry()) as client:
        with pytest.raises(DigestMismatch, match=message) as caught:
            client.fetch_blob(parse_reference("ghcr.io/org/app:v1"), descriptor, io.BytesIO())
    assert caught.value.expected == descriptor.digest


def test_unreachable_registry_is_unavailable_after_retries() -> None:
    attempts: list[httpx.Request] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        attempts.append(request)
        raise httpx.ConnectError("connection refused", request=request)

    client = RegistryClient(transport=httpx.MockTransport(refuse))
    descriptor = Descriptor(OCI_LAYER, BLOB_DIGEST, len(BLOB))
    with pytest.raises(RegistryUnavailable, match="cannot reach registry ghcr.io"):
        client.fetch_blob(parse_reference("ghcr.io/org/app"), descriptor, io.BytesIO())
    assert len(attempts) == 3


def test_basic_auth_challenge_is_answered_with_credentials() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") is None:
            return httpx.Response(401, headers={"WWW-Authenticate": 'Basic realm="r"'})
        return httpx.Response(200, content=MANIFEST)

    creds = {"reg.example:5000": Credentials("bob", "pw")}
    with RegistryClient(credentials=creds, transport=httpx.MockTransport(handler)) as client:
        client.get_manifest(parse_reference("reg.example:5000/app"))
        client.get_manifest(parse_reference("reg.example:5000/app"))
    expected = "Basic " + base64.b64encode(b"bob:pw").decode()
    assert seen == [None, expected, expected]


def test_plain_http_only_for_loopback_and_listed_registries() -> None:
    client = RegistryClient(insecure=["registry.lan:5000"])
    assert client.base_url("127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert client.base_url("localhost:5000") == "http://localhost:5000"
    assert client.base_url("[::1]:5000") == "http://[::1]:5000"
    assert client.base_url("registry.lan:5000") == "http://registry.lan:5000"
    assert client.base_url("ghcr.io") == "https://ghcr.io"
    assert client.base_url("docker.io") == "https://registry-1.docker.io"
    assert not is_loopback("10.0.0.1:5000")
    client.close()
