"""An OCI distribution API client over synchronous httpx: pull, verify, and push.

Every byte that comes from a registry is checked against the digest it was asked for: the
registry's ``Docker-Content-Digest`` header must agree, and the content is hashed while it
streams to disk (a blob is never held in memory whole). Plain HTTP is used only for
loopback registries and the ones listed as insecure; everything else is HTTPS. The client
is thread-safe: the puller shares one between its download threads.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import httpx

from gpucloud.images.auth import Credentials, RegistryAuth
from gpucloud.images.errors import (
    DigestMismatch,
    ImageNotFound,
    RegistryUnauthorized,
    RegistryUnavailable,
)
from gpucloud.images.manifest import ACCEPT, Descriptor
from gpucloud.images.reference import DOCKER_HUB, DOCKER_HUB_API, ImageReference

CHUNK_SIZE = 1 << 20
MAX_MANIFEST_BYTES = 4 << 20
_NOT_FOUND_CODES = frozenset({"MANIFEST_UNKNOWN", "NAME_UNKNOWN", "BLOB_UNKNOWN"})
_DOWNLOAD_ATTEMPTS = 3


@dataclass(frozen=True)
class FetchedManifest:
    """Manifest bytes with the media type the registry declared and their digest."""

    data: bytes
    media_type: str
    digest: str


def sha256_digest(data: bytes) -> str:
    """``sha256:<hex>`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def is_loopback(registry: str) -> bool:
    """True for ``localhost``, ``127.x.y.z`` and ``[::1]``, with or without a port."""
    host = registry.rsplit(":", 1)[0] if not registry.endswith("]") else registry
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RegistryClient:
    """Talks the distribution API to any number of registries.

    ``credentials`` maps a registry (``docker.io``, ``ghcr.io``, ``127.0.0.1:5000``) to its
    username and password; ``insecure`` lists non-loopback registries to reach over plain
    HTTP; ``transport`` replaces the network (``httpx.MockTransport`` in unit tests).
    """

    def __init__(
        self,
        *,
        credentials: Mapping[str, Credentials] | None = None,
        insecure: Iterable[str] = (),
        transport: httpx.BaseTransport | None = None,
        timeout: float = 60.0,
    ) -> None:
        by_host = {_api_host(name): creds for name, creds in (credentials or {}).items()}
        self._insecure = frozenset(_api_host(name) for name in insecure)
        self._http = httpx.Client(
            auth=RegistryAuth(by_host),
            transport=transport,
            timeout=httpx.Timeout(timeout, connect=10.0),
            follow_redirects=True,
            headers={"User-Agent": "gpucloud-agent"},
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=16),
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def base_url(self, registry: str) -> str:
        """``http://`` for loopback and insecure registries, ``https://`` otherwise."""
        host = _api_host(registry)
        scheme = "http" if is_loopback(host) or host in self._insecure else "https"
        return f"{scheme}://{host}"

    # -- pulling -----------------------------------------------------------------------

    def get_manifest(self, image: ImageReference, reference: str | None = None) -> FetchedManifest:
        """Fetch a manifest or index by tag or digest and verify its digest."""
        ref = reference or image.reference
        url = self._url(image.registry, image.repository, "manifests", ref)
        with self._stream("GET", url, str(image), headers={"Accept": ACCEPT}) as response:
            self._raise_for_status(response, f"image {image}")
            data = _read_limited(response, MAX_MANIFEST_BYTES, f"manifest of {image}")
        digest = sha256_digest(data)
        claimed = response.headers.get("Docker-Content-Digest")
        expected = ref if ref.startswith("sha256:") else claimed
        if expected and expected != digest:
            raise DigestMismatch(expected, f"the manifest hashed to {digest}", "manifest")
        media_type = response.headers.get("Content-Type", "").split(";")[0].strip()
        return FetchedManifest(data, media_type, digest)

    def fetch_blob(
        self,
        image: ImageReference,
        descriptor: Descriptor,
        sink: BinaryIO,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """Stream one blob into ``sink`` (from its start), verifying size and digest.

        Connection failures are retried a few times from the beginning; a digest mismatch
        is not (a registry that serves corrupted data will do it again).
        """
        for attempt in range(1, _DOWNLOAD_ATTEMPTS + 1):
            sink.seek(0)
            sink.truncate()
            try:
                self._fetch_blob_once(image, descriptor, sink, on_bytes)
                return
            except RegistryUnavailable:
                if attempt == _DOWNLOAD_ATTEMPTS:
                    raise

    def _fetch_blob_once(
        self,
        image: ImageReference,
        descriptor: Descriptor,
        sink: BinaryIO,
        on_bytes: Callable[[int], None] | None,
    ) -> None:
        url = self._url(image.registry, image.repository, "blobs", descriptor.digest)
        with self._stream("GET", url, str(image)) as response:
            self._raise_for_status(response, f"blob {descriptor.digest} of image {image}")
            claimed = response.headers.get("Docker-Content-Digest")
            if claimed and claimed != descriptor.digest:
                raise DigestMismatch(descriptor.digest, f"the registry labelled it {claimed}")
            _copy_verified(_iter_body(response, str(image)), descriptor, sink, on_bytes)

    # -- pushing (test images, `make up`) -------------------------------------------------

    def blob_exists(self, registry: str, repository: str, digest: str) -> bool:
        """True when the registry already has the blob in ``repository``."""
        url = self._url(registry, repository, "blobs", digest)
        with self._stream("HEAD", url, f"{registry}/{repository}") as response:
            if response.status_code == 404:
                return False
            self._raise_for_status(response, f"blob {digest}")
            return True

    def upload_blob(
        self,
        registry: str,
        repository: str,
        source: Path | bytes,
        digest: str,
        chunk_size: int | None = None,
    ) -> None:
        """Upload a blob: monolithic (POST + PUT) or, with ``chunk_size``, in PATCH chunks."""
        what = f"{registry}/{repository}"
        start = self._url(registry, repository, "blobs", "uploads/")
        with self._stream("POST", start, what) as response:
            location = self._upload_location(response, what)
        if chunk_size is None:
            body = source if isinstance(source, bytes) else _chunks(source, CHUNK_SIZE)
            self._finish_upload(location, digest, what, body)
            return
        offset = 0
        for chunk in _chunks(source, chunk_size):
            headers = {
                "Content-Type": "application/octet-stream",
                "Content-Range": f"{offset}-{offset + len(chunk) - 1}",
            }
            with self._stream("PATCH", location, what, content=chunk, headers=headers) as resp:
                location = self._upload_location(resp, what)
            offset += len(chunk)
        self._finish_upload(location, digest, what, b"")

    def put_manifest(
        self, registry: str, repository: str, reference: str, data: bytes, media_type: str
    ) -> str:
        """PUT a manifest under a tag (or its digest); return its digest."""
        url = self._url(registry, repository, "manifests", reference)
        headers = {"Content-Type": media_type}
        with self._stream(
            "PUT", url, f"{registry}/{repository}", content=data, headers=headers
        ) as r:
            self._raise_for_status(r, f"manifest {registry}/{repository}:{reference}")
        return sha256_digest(data)

    def _finish_upload(
        self, location: str, digest: str, what: str, body: bytes | Iterator[bytes]
    ) -> None:
        url = httpx.URL(location).copy_merge_params({"digest": digest})
        headers = {"Content-Type": "application/octet-stream"}
        with self._stream("PUT", str(url), what, content=body, headers=headers) as response:
            self._raise_for_status(response, f"upload of {digest} to {what}")

    def _upload_location(self, response: httpx.Response, what: str) -> str:
        self._raise_for_status(response, f"upload to {what}")
        location = response.headers.get("Location")
        if not location:
            raise RegistryUnavailable(f"registry gave no upload location for {what}")
        return str(response.request.url.join(location))

    # -- plumbing ----------------------------------------------------------------------

    def _url(self, registry: str, repository: str, kind: str, ref: str) -> str:
        return f"{self.base_url(registry)}/v2/{repository}/{kind}/{ref}"

    @contextmanager
    def _stream(
        self,
        method: str,
        url: str,
        what: str,
        *,
        content: bytes | Iterator[bytes] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Iterator[httpx.Response]:
        """A streamed request whose network failures become ``RegistryUnavailable``."""
        try:
            with self._http.stream(method, url, content=content, headers=headers) as response:
                yield response
        except httpx.TransportError as exc:
            host = httpx.URL(url).netloc.decode("ascii")
            raise RegistryUnavailable(f"cannot reach registry {host} for {what}: {exc}") from exc

    @staticmethod
    def _raise_for_status(response: httpx.Response, what: str) -> None:
        status = response.status_code
        if status < 400:
            return
        codes = _error_codes(response)
        if status == 404 or codes & _NOT_FOUND_CODES:
            raise ImageNotFound(f"{what} not found in the registry")
        if status in (401, 403):
            raise RegistryUnauthorized(
                f"registry {response.url.netloc.decode('ascii')} refused access to {what} "
                f"(HTTP {status}): check the credentials"
            )
        raise RegistryUnavailable(f"registry answered HTTP {status} for {what}")


def _api_host(registry: str) -> str:
    return DOCKER_HUB_API if registry in (DOCKER_HUB, "index.docker.io") else registry


def _error_codes(response: httpx.Response) -> set[str]:
    """The ``errors[].code`` values of a distribution API error body, if any."""
    try:
        response.read()
        body = response.json()
    except (ValueError, httpx.HTTPError):
        return set()
    errors = body.get("errors") if isinstance(body, dict) else None
    if not isinstance(errors, list):
        return set()
    return {str(e.get("code")) for e in errors if isinstance(e, dict)}


def _iter_body(response: httpx.Response, what: str) -> Iterator[bytes]:
    try:
        yield from response.iter_bytes()
    except httpx.TransportError as exc:
        raise RegistryUnavailable(f"download of {what} broke off: {exc}") from exc


def _read_limited(response: httpx.Response, limit: int, what: str) -> bytes:
    parts: list[bytes] = []
    total = 0
    for chunk in _iter_body(response, what):
        total += len(chunk)
        if total > limit:
            raise RegistryUnavailable(f"{what} is larger than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


def _copy_verified(
    chunks: Iterable[bytes],
    descriptor: Descriptor,
    sink: BinaryIO,
    on_bytes: Callable[[int], None] | None,
) -> None:
    """Write ``chunks`` to ``sink`` while hashing; refuse content of the wrong size or hash."""
    hasher = hashlib.sha256()
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > descriptor.size:
            raise DigestMismatch(descriptor.digest, f"it is longer than {descriptor.size} bytes")
        hasher.update(chunk)
        sink.write(chunk)
        if on_bytes is not None:
            on_bytes(len(chunk))
    actual = "sha256:" + hasher.hexdigest()
    if actual != descriptor.digest:
        raise DigestMismatch(descriptor.digest, f"its content hashed to {actual}")


def _chunks(source: Path | bytes, size: int) -> Iterator[bytes]:
    if isinstance(source, bytes):
        for start in range(0, len(source), size):
            yield source[start : start + size]
        return
    with source.open("rb") as stream:
        while chunk := stream.read(size):
            yield chunk
